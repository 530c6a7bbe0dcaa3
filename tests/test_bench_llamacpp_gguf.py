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


def test_compare_report_pairs_our_numbers_with_llama_bench_at_the_same_depth():
    from bench.compare_llamacpp import markdown, summarize

    rows = [dict(n_prompt=512, n_gen=0, n_depth=0, flash_attn=fa, avg_ts=100.0 + fa) for fa in (0, 1)]
    rows += [dict(n_prompt=0, n_gen=128, n_depth=512, flash_attn=fa, avg_ts=50.0 + fa) for fa in (0, 1)]
    peer = summarize(rows)
    assert peer == {"pp512_fa0": 100.0, "pp512_fa1": 101.0, "tg128_d512_fa0": 50.0, "tg128_d512_fa1": 51.0}
    report = {"depth": 512, "shapes": {"qwen3.6-35b-a3b-4bit": {
        "arch": "qwen35moe", "llama_cpp": peer, "ours": {"decode_tok_s": 102.0, "prefill_tok_s": 50.5},
        "ours_beside": {"decode_tok_s": 25.5}, "ours_beside_shape": "qwen3.6-35b-a3b-3bit"}}}
    md = markdown(report)
    assert "| qwen3.6-35b-a3b-4bit decode tg128 @ 512 tok/s | 102.0 | 50.0 | 51.0 | 2.00× |" in md
    assert "| qwen3.6-35b-a3b-4bit prefill pp512 tok/s | 50.5 | 100.0 | 101.0 | 0.50× |" in md
    assert "| qwen3.6-35b-a3b-3bit decode tg128 @ 512 tok/s | 25.5 | 50.0 | 51.0 | 0.50× |" in md
    assert "qwen35moe" in md
