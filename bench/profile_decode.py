"""Per-kernel GPU time of one decode token's dispatches (a bench shape, default phi3-mini; random weights).

Each kernel is dispatched N times in one compute pass and timed with a sync, so a figure includes the
barrier between dependent dispatches. Run from the repo root: `python bench/profile_decode.py`.
"""

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import dispatch_seconds, random_weights, shape_spec  # noqa: E402
from engine.gpu import Gpu, Recorder  # noqa: E402
from engine.transformer import DenseTransformer  # noqa: E402

N = 200
CONTEXT = 600


def main() -> None:
    g = Gpu()
    spec = shape_spec(sys.argv[1] if len(sys.argv) > 1 else "phi3-mini")
    rt = DenseTransformer(g, spec, random_weights(spec), max_context=1024, prefill_chunk=64)
    rt.reset()
    rt.prefill(np.arange(CONTEXT, dtype=np.uint32) % 1000)
    rt.read_sampled(0)
    splits = rt._splits(CONTEXT + 1)
    rt._write_step(1, CONTEXT, 1, splits)
    b, p, s = rt.layer_bg[0], rt.p, spec
    items = {
        "qkv_fused": (p["qkv_fused"], b["qkv_fused"], rt.qkv_fused_grid) if "qkv_fused" in b else None,
        f"attn_split{splits}": (p["attn_split"], b["attn_split"], (s.n_heads, 1, splits)),
        "combine": (p["combine"], rt.bg["combine"], (s.n_heads, 1)),
        **{f"{kind}_{m}": (*b[f"{kind}_{m}"][:2], b[f"q8_{m}"][2] if kind == "q8" else b[f"grid_{m}"])
           for m in ("qkv", "o", "gate_up", "down") for kind in ("q8", "mv") if f"{kind}_{m}" in b},
        "rope_append": (p["rope_append"], b["rope_append"], (1, s.n_heads + 2 * s.n_kv_heads)),
        "add_norm": (p["add_norm"], b["add_norm1"], (1,)),
        "lm_head": rt.lm_parts["mv"][0],
        "argmax": (p["argmax"], rt.bg["argmax"], (1,)),
        "embed": (*rt.embed_parts[0][:2], (rt.embed_parts[0][2], 1)),
    }
    for name, item in items.items():
        if item is None:
            continue
        pipe, bg, grid = item
        print(f"{name:14s} {dispatch_seconds(g, pipe, bg, grid, N) * 1e6:8.1f} us/dispatch  grid={grid}")

    host = []
    g.sync()
    t0 = time.perf_counter()
    for _ in range(20):
        t = time.perf_counter()
        rec = Recorder(g, "token")
        rt._record_body(rec, 1, 1)
        rec.submit()
        host.append(time.perf_counter() - t)
    t1 = time.perf_counter()
    g.sync()
    t2 = time.perf_counter()
    print(f"host record+submit per token {np.median(host) * 1e3:.2f} ms; 20 queued tokens {(t2 - t0) * 1e3:.1f} ms "
          f"wall, {(t2 - t1) * 1e3:.1f} ms waited after the last submit")


if __name__ == "__main__":
    main()
