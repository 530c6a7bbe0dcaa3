"""Prefill attention, per-(head, token) workgroups (attention.wgsl) vs query blocks (attention_prefill.wgsl), on
one layer of a 512-token chunk from an empty cache and of a chunk after 1,536 cached tokens (pp2048's last).

    python3 bench/attention_probe.py [--quick]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.attention import attention_consts, attention_prefill_consts, attention_prefill_grid  # noqa: E402
from engine.bench import dispatch_seconds  # noqa: E402
from engine.gpu import UNIFORM, Gpu  # noqa: E402

PAGE = 16
SHAPES = {"phi3-mini": (32, 32, 96), "qwen3-4b": (32, 8, 128), "qwen3.5-4b (full layers)": (16, 4, 256)}


def main(quick: bool) -> None:
    g = Gpu()
    rng = np.random.default_rng(0)
    cases = [(16, 0), (16, 48)] if quick else [(512, 0), (512, 1536)]
    for name, (H, KVH, HD) in SHAPES.items():
        for T, pos0 in cases:
            n = pos0 + T
            pages = -(-n // PAGE)
            k = g.upload("k", rng.standard_normal((pages, KVH, PAGE, HD)).astype(np.float16))
            v = g.upload("v", rng.standard_normal((pages, KVH, PAGE, HD)).astype(np.float16))
            pt = g.upload("pt", rng.permutation(pages).astype(np.uint32))
            q = g.upload("q", rng.standard_normal((T, H * HD)).astype(np.float32))
            step = g.upload("step", np.array([T, pos0, 0, 1], np.uint32), UNIFORM)
            outs, times = [], []
            for shader, consts, grid in (
                ("attention", dict(attention_consts(H, KVH, HD, PAGE), SPLIT=False), (H, T, 1)),
                ("attention_prefill", attention_prefill_consts(H, KVH, HD, PAGE),
                 attention_prefill_grid(attention_prefill_consts(H, KVH, HD, PAGE), T)),
            ):
                out = g.buffer("out", T * H * HD * 4)
                pipe = g.pipeline(shader, consts)
                extra = [g.buffer("ml", 16)] if shader == "attention" else []
                bg = g.bind(pipe, [q, k, v, pt, out, *extra, step], shader)
                times.append(dispatch_seconds(g, pipe, bg, grid, reps=3 if quick else 10))
                outs.append(g.read(out))
            err = np.abs(outs[0] - outs[1]).max() / np.abs(outs[0]).max()
            print(f"{name:26s} T={T} after {pos0:5d}: attention {times[0] * 1e6:8.1f} µs, attention_prefill "
                  f"{times[1] * 1e6:8.1f} µs ({times[0] / times[1]:.1f}×), max rel diff {err:.1e}", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="tiny sizes (a correctness run on a software GPU)")
    main(ap.parse_args().quick)
