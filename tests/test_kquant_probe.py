"""bench/kquant_probe.py, the K-quant bandwidth probe the H200 runs in one call: on this GPU's smallest setting its
kernel checks pass (every timed kernel agrees with float64 numpy or its f32 twin), and it reports each type's GB/s
and ratio to Q4_0 in its closing table and --json, with weight copies past --weight-mib."""

import json
import subprocess
import sys

import pytest

from engine.resources import root

pytestmark = [pytest.mark.gpu, pytest.mark.slow]


def test_probe_checks_and_reports_every_type(tmp_path):
    out = tmp_path / "kq.json"
    types = ["q4_0", "q2_k", "q6_k"]
    run = subprocess.run([sys.executable, str(root() / "bench" / "kquant_probe.py"), "--quick", "--kinds",
                          "matvec int8", "--types", ",".join(types), "--weight-mib", "0.5", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    assert report["failures"] == 0 and report["kinds"] == ["matvec int8"]
    for name, entry in report["matrices"].items():
        assert list(entry["types"]) == types
        for tag, row in entry["types"].items():
            cell = row["matvec int8"]
            # × Q4_0 is the median of the rounds' ratios to Q4_0's pass in the same round: within their range
            assert cell["gbs"] > 0 and cell["x_min"] <= cell["x_q4_0"] <= cell["x_max"]
            assert len(cell["us_rounds"]) == report["rounds"] and min(cell["us_rounds"]) > 0
            if tag == "q4_0":
                assert cell["x_q4_0"] == cell["x_min"] == cell["x_max"] == 1.0
            assert row["copies"] * row["bits_per_weight"] * entry["N"] * entry["K"] / 8 >= 0.5 * 2**20, (name, tag)
            assert "matvec f32" not in row  # only the asked kinds are timed
    table = run.stdout[run.stdout.index("| type |"):].splitlines()
    assert [line.split("|")[1].strip() for line in table[2:]] == [t.upper() for t in types]


def test_probe_times_the_element_order_variants_on_their_own_rows(tmp_path):
    # The natural variants read rows quantize_q8 wrote in element order (Q8_NATURAL): the default kernel on them
    # gives the default's outputs bit for bit (the same integer sums), for the decode matvec and the prefill GEMM;
    # with other knobs too (rows, wide: another kernel or grouping of the f32 sums) within the probe's own check.
    out = tmp_path / "kq.json"
    run = subprocess.run([sys.executable, str(root() / "bench" / "kquant_probe.py"), "--quick", "--kinds",
                          "matvec int8,gemm int8", "--types", "q4_0,q4_k,q3_k", "--variants", "--variant-keys",
                          "natural,rows,wide", "--rounds", "1", "--warmup", "0", "--json", str(out)],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    report = json.loads(out.read_text())
    for entry in report["matrices"].values():
        for tag in ("q4_k", "q3_k"):
            natural = [v for v in entry["types"][tag]["variants"] if v["plan"].get("natural")]
            assert {v["kind"] for v in natural} == {"matvec int8", "gemm int8"}, (tag, natural)
            assert all(v["ok"] for v in natural), (tag, natural)
            assert all(v["err"] == 0.0 for v in natural if v["plan"] == {"natural": True}), (tag, natural)
