"""bench/llamacpp_ncmoe.py: which weights llama.cpp keeps on the GPU at `-ngl 99 -ncmoe N` (every tensor but
token_embd and the first N layers' routed expert stacks), the N each of our weights budgets gets, and the report."""

import pytest

from bench import llamacpp_gguf as g
from bench import llamacpp_ncmoe as nc

Q4_0 = 18 / 32  # bytes per weight: an f16 scale and 32 nibbles per block


def test_tiny_byte_table_from_the_file_matches_the_arithmetic(tmp_path):
    cfg = g.TINY["qwen35moe"]
    path = g.write(cfg, tmp_path / "moe.gguf")
    tensors = nc.gguf_tensor_bytes(path)
    assert tensors == nc.layout_tensor_bytes(cfg)
    total = sum(tensors.values())
    embd = cfg["vocab"] * cfg["d"] * Q4_0
    layer_experts = 3 * cfg["experts"] * cfg["expert_ffn"] * cfg["d"] * Q4_0  # gate, up and down stacks
    table = nc.byte_table(tensors, cfg["layers"])
    assert [r["n_cpu_moe"] for r in table] == list(range(cfg["layers"] + 1))
    for r in table:
        assert r["gpu_bytes"] == total - embd - r["n_cpu_moe"] * layer_experts
        assert r["cpu_bytes"] == total - r["gpu_bytes"]


@pytest.mark.parametrize("name, n, cpu", [
    ("token_embd.weight", 0, True), ("output.weight", 40, False), ("blk.0.ffn_up_exps.weight", 0, False),
    ("blk.0.ffn_up_exps.weight", 1, True), ("blk.1.ffn_down_exps.weight", 2, True),
    ("blk.2.ffn_gate_exps.weight", 2, False), ("blk.11.ffn_up_exps.weight", 2, False),
    ("blk.0.ffn_gate_up_exps.weight", 1, True), ("blk.0.ffn_up_shexp.weight", 40, False),
    ("blk.0.ffn_gate_inp.weight", 40, False), ("blk.0.attn_qkv.weight", 40, False)])
def test_tensors_on_the_cpu_follow_llama_cpps_pattern(name, n, cpu):
    assert nc.on_cpu(name, n) == cpu


def test_a_budget_gets_the_fewest_layers_whose_gpu_weights_fit():
    table = [{"n_cpu_moe": n, "gpu_bytes": 1000 - 100 * n, "cpu_bytes": 100 * n} for n in range(5)]
    assert nc.n_for_budget(table, 700) == 3 and nc.n_for_budget(table, 699) == 4
    assert nc.n_for_budget(table, 10**6) == 0 and nc.n_for_budget(table, 599) is None
    rows = nc.runs(table, {"A": 800, "B": 799, "C": 10})
    assert [(r["n_cpu_moe"], r["budgets"]) for r in rows] == [(0, []), (2, ["A"]), (3, ["B"]), (4, [])]
    assert [(r["n_cpu_moe"], r["budgets"]) for r in nc.runs(table, {"A": 800}, [4, 2])] == [(2, ["A"]), (4, [])]


def test_the_real_shape_lines_up_with_our_budgets():
    cfg = g.shape_config(nc.SHAPE)
    table = nc.byte_table(nc.layout_tensor_bytes(cfg), cfg["layers"])
    per_layer = 3 * 256 * 512 * 2048 * Q4_0  # Qwen3.6-35B-A3B: 256 experts of 512 x 2048 a layer
    assert all(a["gpu_bytes"] - b["gpu_bytes"] == per_layer for a, b in zip(table[:-1], table[1:], strict=True))
    for gib in (8, 12, 16):
        n = nc.n_for_budget(table, gib * 2**30)
        assert 0 < n < cfg["layers"] and table[n]["gpu_bytes"] <= gib * 2**30 < table[n - 1]["gpu_bytes"]


def test_build_only_prints_the_table_and_the_commands(tmp_path, capsys):
    assert nc.main(["--build-only", "--work", str(tmp_path), "--threads", "16"]) == 0
    out = capsys.readouterr().out
    cfg = g.shape_config(nc.SHAPE)
    n8 = nc.n_for_budget(nc.byte_table(nc.layout_tensor_bytes(cfg), cfg["layers"]), 8 * 2**30)
    assert "layout and tensor sizes as expected" in out
    assert f"-ngl 99 -fa 1 -ncmoe {n8} -t 16 -r 3 -o json" in out and "<= 8G" in out
    assert f"-ncmoe {cfg['layers']} -t 16" in out and "-p 0 -n 128 -d 512" in out and "-p 512 -n 0 -d 0" in out
    assert nc.main(["--build-only", "--work", str(tmp_path), "--ns", "3"]) == 0
    assert "-ncmoe  3:" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        nc.main(["--build-only", "--work", str(tmp_path), "--ns", "41"])


def test_the_report_puts_our_numbers_beside_llama_cpps_at_the_same_budget():
    rows = [dict(n_prompt=512, n_gen=0, n_depth=0, avg_ts=900.0), dict(n_prompt=0, n_gen=128, n_depth=512,
                                                                       avg_ts=40.25)]
    peer = nc.summarize(rows)
    assert peer == {"pp512": 900.0, "tg128_d512": 40.25}
    ours = {"results": [
        {"shape": nc.SHAPE, "budget_gib": 8.0, "routing": "random", "slots": 80, "decode_tok_s": 30.5,
         "prefill_tok_s": 700.0, "prefill_tokens": 512},
        {"shape": nc.SHAPE, "budget_gib": 8.0, "routing": "skewed", "slots": 80, "decode_tok_s": 45.0},
        {"shape": nc.SHAPE, "budget_gib": None, "routing": "router", "decode_tok_s": 120.0},
        {"shape": "qwen3.6-35b-a3b-3bit", "budget_gib": 8.0, "routing": "random", "decode_tok_s": 1.0}]}
    report = {"threads": 16, "fa": "1", "depth": 512, "ours": ours, "runs": [
        {"n_cpu_moe": 0, "gpu_bytes": 18 * 2**30, "cpu_bytes": 2**29, "budgets": [], "llama_cpp": peer},
        {"n_cpu_moe": 24, "gpu_bytes": 7.5 * 2**30, "cpu_bytes": 11 * 2**30, "budgets": ["8G"], "llama_cpp": peer},
        {"n_cpu_moe": 40, "gpu_bytes": 2**30, "cpu_bytes": 17 * 2**30, "budgets": [], "skipped": "past --time-limit"}]}
    md = nc.markdown(report)
    assert "-t 16, -fa 1" in md
    assert "| all | 0 | 18.00 GiB | 0.50 GiB | 40.25 | 900.0 | all | 120.0 | — |" in md
    assert "| 8G | 24 | 7.50 GiB | 11.00 GiB | 40.25 | 900.0 | 80 | 30.5 / 45.0 | 700.0 (pp512) |" in md
    assert "| — | 40 | 1.00 GiB | 17.00 GiB | past --time-limit | — | — | — | — |" in md


def test_a_run_benches_each_n_with_its_threads_and_writes_the_report(tmp_path, monkeypatch):
    """The run's steps on the tiny file, llama-bench stood in for: each N's flags, the JSON and the markdown."""
    import json

    tiny = g.TINY["qwen35moe"]
    calls = []

    def bench(exe, model, **kw):
        calls.append(kw["extra"])
        n, used = int(kw["extra"][1]), dict(n_cpu_moe=int(kw["extra"][1]), n_threads=int(kw["extra"][3]))
        return [dict(n_prompt=512, n_gen=0, n_depth=0, avg_ts=1000.0 - n, **used),
                dict(n_prompt=0, n_gen=128, n_depth=512, avg_ts=50.0 - n, **used)]

    monkeypatch.setattr(nc, "build_llama", lambda src, work: (work / "llama-bench", 0.0))
    monkeypatch.setattr(nc, "llama_bench", bench)
    monkeypatch.setattr(nc.llamacpp_gguf, "shape_config", lambda shape: tiny)
    (src := tmp_path / "llama.tar.xz").write_bytes(b"")
    out = tmp_path / "out"
    assert nc.main(["--llama-src", str(src), "--out", str(out), "--work", str(tmp_path), "--threads", "16",
                    "--budgets", "600000"]) == 0
    report = json.loads((out / "ncmoe.json").read_text())
    assert calls == [("-ncmoe", "0", "-t", "16"), ("-ncmoe", "2", "-t", "16"), ("-ncmoe", "4", "-t", "16")]
    assert [(r["n_cpu_moe"], r["budgets"], r["llama_cpp"]["tg128_d512"]) for r in report["runs"]] == [
        (0, [], 50.0), (2, ["600000"], 48.0), (4, [], 46.0)]
    assert report["threads"] == 16 and "| 600000 | 2 |" in (out / "ncmoe.md").read_text()
    monkeypatch.setattr(nc, "llama_bench", lambda exe, model, **kw: [dict(n_cpu_moe=0, n_threads=8)])
    with pytest.raises(SystemExit, match="n_threads"):  # llama-bench's own record of its runs is checked
        nc.main(["--llama-src", str(src), "--out", str(out), "--work", str(tmp_path), "--threads", "16"])
