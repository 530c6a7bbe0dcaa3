"""A/B in one run: decode with the residual add + RMSNorm folded into the next matvec (fuse_norm) or not.

    python3 bench/ab_fuse_norm.py [shape ...]
"""

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import run_bench  # noqa: E402
from engine.gpu import Gpu  # noqa: E402

KEYS = ("decode_tok_s", "dispatches_per_token", "gpu_ms_per_token", "wall_ms_per_token", "gpu_busy",
        "host_ms_per_token", "prefill_tok_s", "ttft_35_ms", "pct_of_ceiling")

if __name__ == "__main__":
    gpu = Gpu()
    for shape in sys.argv[1:] or ["phi3-mini", "qwen3-4b"]:
        for fuse in (False, True):
            r = run_bench(shape, runs=3, long_prompt=0, timestamps=True, gpu=gpu, fuse_norm=fuse)
            print(json.dumps({"shape": shape, "fuse_norm": fuse, **{k: r.get(k) for k in KEYS}}), flush=True)
