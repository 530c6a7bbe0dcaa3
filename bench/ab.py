"""A/B runs of runtime options in one process, one GPU, one run (absolute times drift between runs).

    python3 bench/ab.py phi3-mini qwen3-4b --variants '{"q8_prefill": false}' '{}'

A variant is a JSON object of RuntimeOptions fields (engine/runtime_options.py); its "env" object sets environment
variables for its run only, "moe_fused": false runs the MoE decode unfused (bench/moe_unfused.py) and
"gdn_subgroups": true the delta-rule recurrence on its subgroup-shuffle kernel (bench/gdn_subgroups.py):

    python3 bench/ab.py qwen3.6-35b-a3b-4bit qwen3.6-35b-a3b-3bit --variants '{"moe_fused": false}' '{}'
    python3 bench/ab.py qwen3.5-4b --variants '{"gdn_subgroups": true}' '{}'

Its "matmul_consts" object sets tuning constants of engine/kernels/matmul.py for its run only:

    python3 bench/ab.py phi3-mini --variants '{"gate_up_q8": true}' '{}' \
        '{"gate_up_q8": true, "matmul_consts": {"MATVEC_Q8_RMS_Q8_MAX_WG": 512}}'
"""

import argparse
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import engine.kernels.matmul as matmul  # noqa: E402
from bench.gdn_subgroups import subgroup_recurrence  # noqa: E402
from bench.moe_unfused import unfused_moe  # noqa: E402
from engine.bench import run_bench  # noqa: E402
from engine.gpu import Gpu  # noqa: E402

KEYS = ("decode_tok_s", "dispatches_per_token", "gpu_ms_per_token", "wall_ms_per_token", "gpu_busy",
        "host_ms_per_token", "prefill_tok_s", "ttft_35_ms", "achieved_gb_s", "pct_of_ceiling")

if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="+")
    p.add_argument("--variants", nargs="+", default=["{}"], help="JSON objects of RuntimeOptions fields")
    args = p.parse_args()
    gpu = Gpu()
    for shape in args.shapes:
        for variant in args.variants:
            opts = json.loads(variant)
            env = opts.pop("env", {})
            fused = opts.pop("moe_fused", True)
            consts = opts.pop("matmul_consts", {})
            gdn_sg = opts.pop("gdn_subgroups", False)
            saved = {k: os.environ.get(k) for k in env}
            saved_consts = {k: getattr(matmul, k) for k in consts}  # an unknown name fails here, before the run
            os.environ.update(env)
            for k, v in consts.items():
                setattr(matmul, k, v)
            try:
                with unfused_moe(not fused), subgroup_recurrence(gdn_sg):
                    r = run_bench(shape, runs=3, long_prompt=0, timestamps=True, gpu=gpu, **opts)
            finally:
                for k, v in saved.items():
                    os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)
                for k, v in saved_consts.items():
                    setattr(matmul, k, v)
            opts = {**opts, **({"env": env} if env else {}), **({} if fused else {"moe_fused": False}),
                    **({"matmul_consts": consts} if consts else {}), **({"gdn_subgroups": True} if gdn_sg else {})}
            print(json.dumps({"shape": shape, "options": opts, **{k: r.get(k) for k in KEYS}}), flush=True)
