"""Decode matvec variants on this GPU: rows per workgroup × threads per workgroup, per real matrix shape.

Each variant is dispatched N times in one pass (engine.bench.dispatch_seconds, as bench/profile_token.py does) and
reported as µs per dispatch and GB/s of weight bytes read.
Run from the repo root: `python3 bench/tune_matvec.py [shape]`.
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import SHAPES, dispatch_seconds  # noqa: E402
from engine.gpu import UNIFORM, Gpu  # noqa: E402
from engine.kernels.matmul import matvec_plan  # noqa: E402

N_REPS = 100
VARIANTS = [(4, 64), (2, 64), (8, 64), (4, 128), (2, 128), (8, 32), (4, 32), (2, 32), (1, 32), (16, 32), (4, 16),
            (2, 16), (8, 16)]


def main(shape: str) -> None:
    g = Gpu()
    d, _, h, kvh, hd, ffn, vocab = SHAPES[shape][:7]
    mats = {"qkv": (d, (h + 2 * kvh) * hd, False), "o": (h * hd, d, False), "gate_up": (d, ffn, True),
            "down": (ffn, d, False), "lm": (d, vocab, False)}
    rng = np.random.default_rng(0)
    step = g.upload("step", np.array([1, 0, 0, 1], np.uint32), usage=UNIFORM)
    for name, (k, n, gu) in mats.items():
        rows = 2 * n if gu else n
        w = g.upload("w", rng.integers(0, 2**32, (rows, k // 8), dtype=np.uint32))
        s = g.upload("s", rng.uniform(0.001, 0.01, (rows, k // 32)).astype(np.float16))
        x, y = g.upload("x", rng.standard_normal(k).astype(np.float32)), g.buffer("y", 4 * n)
        nbytes = rows * k // 2 + rows * k // 32 * 2
        line = []
        for r, wg in VARIANTS:
            consts, grid = matvec_plan(k, n, gate_up=gu, rows=r, wg=wg)
            pipe = g.pipeline("matvec_int4", consts)
            bg = g.bind(pipe, [x, w, s, y, step], "tune")
            best = dispatch_seconds(g, pipe, bg, grid, N_REPS)
            line.append(f"{r}x{wg}: {best * 1e6:6.1f} us {nbytes / best / 1e9:6.0f} GB/s")
        print(f"{name:8s} {n}x{k}{' gate_up' if gu else ''}\n    " + "\n    ".join(line), flush=True)


if __name__ == "__main__":
    for shape in sys.argv[1:] or ["phi3-mini"]:
        main(shape)
