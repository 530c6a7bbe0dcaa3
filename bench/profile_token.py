"""Where one decode token's GPU time goes, for any bench shape (dense, hybrid or MoE), grouped by kernel.

After a 600-token prefill (the benchmark's context: one-dispatch decode attention up to single_pass_keys, split-K
past it, `--options '{"single_pass_keys": 64}'`) one decode token's dispatches
are recorded into a list instead of a pass; then each is timed alone: N_REPS back-to-back copies in one pass,
best of 3, so a figure includes the barrier to the next dispatch. Totals per kernel are summed over the token.
Then the host side: one token's dispatches recorded and submitted 20 times (median), and how long the GPU still
worked after the last submit. (This replaced bench/profile_decode.py, the same for the dense shapes only.)
With --prefill T: the dispatches of one T-token prefill chunk from an empty cache instead (N_REPS 5).

    python3 bench/profile_token.py qwen3.6-35b-a3b-4bit [phi3-mini ...] [--prefill 512] [--options JSON] [--moe-unfused]

`--moe-unfused`: the MoE decode before its fused passes (bench/moe_unfused.py), for an A/B. `--gdn-subgroups`: the
delta-rule recurrence on its subgroup-shuffle kernel instead of the workgroup-memory one (bench/gdn_subgroups.py).
"""

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.gdn_subgroups import subgroup_recurrence  # noqa: E402
from bench.moe_unfused import unfused_moe  # noqa: E402
from engine import bench  # noqa: E402
from engine.bench_hybrid import HYBRID_SHAPES, hybrid_spec  # noqa: E402
from engine.bench_hybrid import random_weights as hybrid_weights  # noqa: E402
from engine.gpu import Gpu, Recorder  # noqa: E402
from engine.runtime_options import RuntimeOptions  # noqa: E402
from engine.transformer import Transformer  # noqa: E402

N_REPS = 50
CONTEXT = 600


def runtime(shape: str, gpu: Gpu, **options):
    opts = RuntimeOptions.of(max_context=1024, prefill_chunk=512, **options)
    if shape in HYBRID_SHAPES:
        spec, formats = hybrid_spec(shape)
        return Transformer(gpu, spec, hybrid_weights(spec, formats), formats=formats, options=opts)
    spec = bench.shape_spec(shape)
    return Transformer(gpu, spec, bench.random_weights(spec), options=opts)


def main(shape: str, gpu: Gpu, prefill: int = 0, options: dict | None = None) -> None:
    rt = runtime(shape, gpu, **(options or {}))
    rt.reset()
    if prefill:
        rt.ws.write_step(prefill, 0, 0, 1)
        gpu.write(rt.ws.tokens, np.random.default_rng(1).integers(0, rt.spec.vocab, prefill).astype(np.uint32))
        plan = rt.forward_plan(prefill)
    else:
        rt.prefill(np.random.default_rng(1).integers(0, rt.spec.vocab, CONTEXT).astype(np.uint32))
        rt.read_sampled(0)
        splits = rt.splits(CONTEXT + 1)
        rt.ws.write_step(1, CONTEXT, 1, splits)
        plan = rt.decode_plan(splits)  # what decode replays (a hybrid's state snapshot aside)
    per_kernel: dict[str, list[float]] = defaultdict(list)
    for pipe, bg, *grid in plan.items:
        per_kernel[pipe.label].append(bench.dispatch_seconds(gpu, pipe, bg, tuple(grid), 5 if prefill else N_REPS))
    total = sum(sum(v) for v in per_kernel.values())
    what = f"{prefill}-token prefill chunk" if prefill else "decode token"
    print(f"{shape} {what} {options or ''}: {len(plan.items)} dispatches, sum of their times {total * 1e3:.2f} ms"
          + (f" ({prefill / total:,.0f} tok/s)" if prefill else ""), flush=True)
    for name, times in sorted(per_kernel.items(), key=lambda kv: -sum(kv[1])):
        print(f"  {name:22s} ×{len(times):4d}  {np.median(times) * 1e6:7.1f} µs each  "
              f"{sum(times) * 1e3:6.2f} ms  {100 * sum(times) / total:5.1f}%", flush=True)
    if prefill:
        return
    host = []
    gpu.sync()
    t0 = time.perf_counter()
    for _ in range(20):
        t = time.perf_counter()
        rec = Recorder(gpu, "token")
        rec.replay(plan)
        rec.submit()
        host.append(time.perf_counter() - t)
    t1 = time.perf_counter()
    gpu.sync()
    t2 = time.perf_counter()
    print(f"  host record+submit per token {np.median(host) * 1e3:.2f} ms; 20 queued tokens "
          f"{(t2 - t0) * 1e3:.1f} ms wall, {(t2 - t1) * 1e3:.1f} ms waited after the last submit", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["phi3-mini"])
    ap.add_argument("--prefill", type=int, default=0, help="profile a prefill chunk of this many tokens")
    ap.add_argument("--options", default="{}", help="JSON runtime options, e.g. '{\"q8_prefill\": false}'")
    ap.add_argument("--moe-unfused", action="store_true", help="the MoE decode before its fused passes")
    ap.add_argument("--gdn-subgroups", action="store_true", help="the recurrence's subgroup-shuffle kernel")
    args = ap.parse_args()
    g = Gpu()
    for s in args.shapes:
        with unfused_moe(args.moe_unfused), subgroup_recurrence(args.gdn_subgroups):
            main(s, g, args.prefill, json.loads(args.options))
