"""Host-side copy rates that bound streamed experts (issue 20), on this machine: gathering expert-sized runs from a
host stack (numpy, anonymous memory) into (a) host memory and (b) a mapped MAP_WRITE staging buffer, over 1..N
threads; then the GPU copy from staging into a storage buffer, queue.write_buffer, and one map round trip.

    python3 bench/host_copy_probe.py [--mib 8] [--experts-mib 1.77] [--reps 20] [--json OUT]

Each rate is the best of `--reps` rounds (GB/s = bytes / seconds); the gathered runs are random experts of a
512-expert stack, as a layer's misses are.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    import numpy as np
    import wgpu

    from engine.blocks.expert_cache import STAGING
    from engine.gpu import Gpu
    from engine.mapping import ThreadMap

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mib", type=float, default=8.0, help="bytes a round moves (a layer's misses)")
    p.add_argument("--experts-mib", type=float, default=1.77, help="one expert's bytes")
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--threads", default="1,2,4,8,16")
    p.add_argument("--json", type=Path)
    a = p.parse_args(argv)

    exp = int(a.experts_mib * 2**20) // 256 * 256
    n = max(1, int(a.mib * 2**20) // exp)
    total = n * exp
    rng = np.random.default_rng(0)
    stack = np.empty((512, exp), np.uint8)
    for row in stack:  # random bytes (ones and zeros alike would let pages share)
        row[:] = rng.integers(0, 255, exp, dtype=np.uint8)
    ids = rng.choice(512, n, replace=False)
    host_out = np.empty(total, np.uint8)
    gpu = Gpu()
    staging = gpu.device.create_buffer(size=total, usage=STAGING)
    target = gpu.buffer("probe-target", total, wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_DST)
    results: dict = {"bytes": total, "experts": n, "expert_bytes": exp, "adapter": str(gpu.info)[:80]}

    def gather(out, threads, pool):
        ids[:] = rng.choice(len(stack), n, replace=False)  # fresh experts each round: read from DRAM, not cache
        pieces = [(stack[e], out[i * exp:(i + 1) * exp]) for i, e in enumerate(ids)]
        share = [pieces[i::threads] for i in range(threads)]
        if threads == 1:
            for s, d in pieces:
                np.copyto(d, s)
            return
        list(pool.map(lambda job: [np.copyto(d, s) for s, d in job], share))

    def best(fn) -> float:
        times = []
        for _ in range(a.reps):
            t = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t)
        return total / min(times) / 1e9

    for th in [int(x) for x in a.threads.split(",")]:
        with ThreadPoolExecutor(th) as pool:
            results[f"gather_host_t{th}"] = best(lambda th=th, pool=pool: gather(host_out, th, pool))

            def into_staging(th=th, pool=pool):
                staging.map_sync(wgpu.MapMode.WRITE)
                view = ThreadMap(None, staging).view(0, (total + 3) // 4 * 4, True)
                gather(view, th, pool)
                del view
                staging.unmap()

            results[f"gather_staging_t{th}"] = best(into_staging)

    def map_round():
        staging.map_sync(wgpu.MapMode.WRITE)
        staging.unmap()
    results["map_roundtrips_per_s"] = best(map_round) * 1e9 / total

    def gpu_copy():
        enc = gpu.device.create_command_encoder()
        enc.copy_buffer_to_buffer(staging, 0, target, 0, total)
        gpu.queue.submit([enc.finish()])
        gpu.sync()
    results["staging_to_gpu"] = best(gpu_copy)

    def write_buffer():
        gpu.queue.write_buffer(target, 0, host_out)
        gpu.sync()
    results["queue_write_buffer"] = best(write_buffer)

    for k, v in results.items():
        print(f"{k:24s} {v:.3f}" if isinstance(v, float) else f"{k:24s} {v}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
