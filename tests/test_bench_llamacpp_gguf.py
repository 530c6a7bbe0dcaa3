"""bench/llamacpp_gguf.py: the random-weight GGUFs compare_llamacpp.py hands llama.cpp, written for each of the four
architectures and read back with the gguf package against llama.cpp's layout table."""

import numpy as np
import pytest

from bench import llamacpp_gguf as g


@pytest.mark.parametrize("arch", sorted(g.TINY))
def test_tiny_gguf_reads_back_as_llama_cpp_expects(tmp_path, arch):
    cfg = g.TINY[arch]
    path = g.write(cfg, tmp_path / f"{arch}.gguf")
    assert g.check(cfg, path) == []


def test_check_names_a_wrong_layout(tmp_path):
    cfg = g.TINY["qwen35moe"]
    path = g.write(cfg, tmp_path / "moe.gguf")
    other = dict(cfg, experts=4)  # the file holds 8 experts per stack
    problems = g.check(other, path)
    assert any("blk.0.ffn_gate_exps.weight" in p for p in problems)
    assert g.check(dict(cfg, arch="qwen35", ffn=64), path)[0].startswith("general.architecture is 'qwen35moe'")


@pytest.mark.parametrize("shape,arch,params", [
    ("phi3-mini", "phi3", 3.82e9), ("qwen3-4b", "qwen3", 4.02e9), ("qwen3.5-4b", "qwen35", 4.21e9),
    ("qwen3.6-35b-a3b-4bit", "qwen35moe", 34.66e9)])
def test_catalog_shapes_map_to_llama_cpp_archs(shape, arch, params):
    cfg = g.shape_config(shape)
    total = sum(int(np.prod(s)) for s, _ in g.expected(cfg).values())
    assert cfg["arch"] == arch and abs(total - params) < 0.01e9
    if arch in ("qwen35", "qwen35moe"):  # 3 GDN layers for each full-attention one, as llama.cpp's default
        n_gdn = sum(f"blk.{i}.ssm_a" in g.expected(cfg) for i in range(cfg["layers"]))
        assert n_gdn == cfg["layers"] * 3 // 4
