"""What each kernel costs inside a decode token's dependent chain, by ablation, and the chain's floor.

bench/profile_token.py times each dispatch alone (N back to back, wall clock with a readback), which adds the
submit and sync to every figure. Here one token's captured plan is replayed in one pass with pass timestamps
(GPU time only): the whole token, then the token without every dispatch of one kernel (its cost in the chain: the
kernel's own time plus the barrier it brings), for each kernel. The floor: as many dispatches of a one-workgroup
kernel as the token has, each reading and writing one buffer (a barrier between each), and the same number reading
only (no barrier needed), in one pass. Results of ablated tokens are wrong; only their times count.

    python3 bench/chain_profile.py phi3-mini qwen3-4b qwen3.6-35b-a3b-4bit [--tokens 20] [--options JSON ...]

Several --options: each shape is profiled under each in turn (an A/B in one job).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.profile_token import CONTEXT, runtime  # noqa: E402
from engine.gpu import READBACK, DispatchPlan, Gpu, Recorder  # noqa: E402

FLOOR_WGSL = """
@group(0) @binding(0) var<storage, read_write> a: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) { a[i] = a[i] + 1u; }
"""
FLOOR_READ_WGSL = """
@group(0) @binding(0) var<storage, read> a: array<u32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) i: u32) { if (a[i] == 12345u) { workgroupBarrier(); } }
"""


class Stamps:
    """GPU nanoseconds of whole passes, through pass timestamps."""

    def __init__(self, gpu: Gpu, n: int):
        import wgpu

        self.gpu, self.n = gpu, n
        self.qs = gpu.device.create_query_set(label="chain", type=wgpu.QueryType.timestamp, count=2 * n)
        self.resolved = gpu.device.create_buffer(label="chain-ts", size=16 * n,
                                                 usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
        self.out = gpu.buffer("chain-ts-read", 16 * n, READBACK)

    def median_ms(self, record) -> float:
        """Median GPU ms of `record(rec)` over n passes."""
        import wgpu

        for j in range(self.n):
            rec = Recorder(self.gpu, "chain", {"query_set": self.qs, "beginning_of_pass_write_index": 2 * j,
                                               "end_of_pass_write_index": 2 * j + 1})
            record(rec)
            rec.submit()
        enc = self.gpu.device.create_command_encoder(label="resolve")
        enc.resolve_query_set(self.qs, 0, 2 * self.n, self.resolved, 0)
        enc.copy_buffer_to_buffer(self.resolved, 0, self.out, 0, 16 * self.n)
        self.gpu.queue.submit([enc.finish()])
        self.out.map_sync(mode=wgpu.MapMode.READ)
        t = np.frombuffer(self.out.read_mapped(0, 16 * self.n), np.uint64).reshape(self.n, 2).astype(np.float64)
        self.out.unmap()
        return float(np.median(t[:, 1] - t[:, 0])) / 1e6


def floor_ms(gpu: Gpu, stamps: Stamps, count: int) -> tuple[float, float]:
    buf = gpu.buffer("floor", 256)
    out = []
    for code in (FLOOR_WGSL, FLOOR_READ_WGSL):
        pipe = gpu.pipeline_from_source("floor", code)
        bg = gpu.bind(pipe, {"a": buf}, "floor")
        out.append(stamps.median_ms(lambda rec, p=pipe, b=bg: [rec.dispatch(p, b, 1) for _ in range(count)]))
    return out[0], out[1]


def main(shape: str, gpu: Gpu, tokens: int, options: dict) -> dict:
    rt = runtime(shape, gpu, **options)
    rt.reset()
    rt.prefill(np.random.default_rng(1).integers(0, rt.spec.vocab, CONTEXT).astype(np.uint32))
    rt.read_sampled(0)
    splits = rt.splits(CONTEXT + 1)
    rt.ws.write_step(1, CONTEXT, 1, splits)
    plan = rt.decode_plan(splits)
    stamps = Stamps(gpu, tokens)
    whole = stamps.median_ms(lambda rec: rec.replay(plan))
    by_kernel: dict[str, list] = defaultdict(list)
    for item in plan.items:
        by_kernel[item[0].label].append(item)
    rows = []
    for name, items in by_kernel.items():
        rest = DispatchPlan([it for it in plan.items if it[0].label != name])
        ms = stamps.median_ms(lambda rec, p=rest: rec.replay(p))
        rows.append((name, len(items), whole - ms))
    rows.sort(key=lambda r: -r[2])
    barrier, free = floor_ms(gpu, stamps, len(plan.items))
    n = len(plan.items)
    print(f"{shape} decode token {options or ''}: {n} dispatches, {whole:.3f} GPU ms "
          f"({whole / n * 1e3:.1f} µs a dispatch); floor of {n} one-workgroup dispatches: {barrier:.3f} ms with a "
          f"barrier each ({barrier / n * 1e3:.2f} µs), {free:.3f} ms read-only ({free / n * 1e3:.2f} µs)", flush=True)
    for name, count, ms in rows:
        print(f"  {name:24s} ×{count:4d}  {ms / count * 1e3:7.2f} µs each in the chain  {ms:6.3f} ms  "
              f"{100 * ms / whole:5.1f}%", flush=True)
    return {"shape": shape, "options": options, "dispatches": n, "gpu_ms": whole, "floor_barrier_ms": barrier,
            "floor_read_ms": free, "kernels": [{"kernel": k, "count": c, "ms": m} for k, c, m in rows]}


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["phi3-mini"])
    ap.add_argument("--tokens", type=int, default=20, help="passes timed per variant (median)")
    ap.add_argument("--options", action="append", help="JSON runtime options (repeat: each in turn, per shape)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args()
    g = Gpu()
    results = []
    for s in args.shapes:
        for o in args.options or ["{}"]:
            results.append(main(s, g, args.tokens, json.loads(o)))
            if args.json:  # after each: a job cut short keeps what it measured
                Path(args.json).write_text(json.dumps(results, indent=1))
