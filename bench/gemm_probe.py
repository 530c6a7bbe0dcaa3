"""Prefill GEMM probe: the f32-activation matmul_int4 against quantize_q8 + matmul_q8 (int8 activations,
dot4I8Packed) on one model's four layer matrices at one chunk length, random q4f16_1 weights.

Each matrix is first run once by both paths and the int8 result checked against the f32 one (int8 rounding of x:
a few % of max|y|); then every kernel is dispatched `--reps` times in one pass, best of 3 submissions
(engine.bench.dispatch_seconds), reported as µs per dispatch. The ratio is matmul_int4 / (quantize_q8 + matmul_q8).
`--tiles` adds matmul_q8 tile variants (TM×TN, KC) for tuning.

    python3 bench/gemm_probe.py [phi3-mini|qwen3-4b] [--tokens 512] [--reps 20] [--tiles] [--quick]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import SHAPES, dispatch_seconds  # noqa: E402
from engine.gpu import UNIFORM, Gpu, Recorder  # noqa: E402
from engine.kernels.matmul import gemm_plan, gemm_q8_plan, quantize_q8_plan  # noqa: E402

TOLERANCE = 5e-2  # int8 x vs f32 x, relative to max|y|
TILES = [dict(tm=32, tn=128), dict(tm=128, tn=32), dict(kc=1), dict(kc=3)]  # with --tiles


def matrices(shape: str, quick: bool) -> dict[str, tuple[int, int, bool]]:
    """name -> (K, N outputs, gate_up) of one layer's matrices."""
    if quick:  # small enough for a software GPU; still partial tiles and several steps of K
        return {"small": (256, 200, False), "gate_up": (192, 70, True)}
    d, _, h, kvh, hd, ffn = SHAPES[shape][:6]
    return {"qkv": (d, (h + 2 * kvh) * hd, False), "o": (h * hd, d, False), "gate_up": (d, ffn, True),
            "down": (ffn, d, False)}


def once(g: Gpu, steps) -> None:
    rec = Recorder(g, "check")
    for pipe, bg, grid in steps:
        rec.dispatch(pipe, bg, *grid)
    rec.submit()
    g.sync()


def probe(g: Gpu, name: str, K: int, N: int, gate_up: bool, T: int, reps: int, tiles: bool) -> tuple[float, float]:
    """Check, time and print one matrix; returns (µs matmul_int4, µs quantize_q8 + matmul_q8)."""
    rng = np.random.default_rng(0)
    rows = 2 * N if gate_up else N
    w = g.upload("w", rng.integers(0, 2**32, (rows, K // 8), dtype=np.uint32))
    s = g.upload("s", rng.uniform(0.002, 0.02, (rows, K // 32)).astype(np.float16))
    x = g.upload("x", rng.standard_normal((T, K)).astype(np.float32))
    step = g.upload("step", np.array([T, 0, 0, 1], np.uint32), usage=UNIFORM)
    xq, xm = g.buffer("xq", T * K), g.buffer("xm", T * K // 32 * 8)
    y_f32, y_q8 = g.buffer("y-f32", T * N * 4), g.buffer("y-q8", T * N * 4)

    consts, grid = gemm_plan(K, N, T, gate_up=gate_up)
    pipe = g.pipeline("matmul_int4", consts)
    f32 = (pipe, g.bind(pipe, [x, w, s, y_f32, step], "probe-int4"), grid)
    consts, grid = quantize_q8_plan(K, rows=T)
    pipe = g.pipeline("quantize_q8", consts)
    quantize = (pipe, g.bind(pipe, [x, xq, xm, step], "probe-quantize"), grid)

    def q8_gemm(**tile):
        if gate_up and "tn" in tile:  # the same staged weight rows: half as many outputs
            tile = dict(tile, tn=tile["tn"] // 2)
        consts, grid = gemm_q8_plan(K, N, T, gate_up=gate_up, **tile)
        pipe = g.pipeline("matmul_q8", consts)
        return pipe, g.bind(pipe, [xq, w, s, y_q8, xm, step], "probe-q8"), grid, consts

    print(f"{name} K={K} N={N}{' gate_up' if gate_up else ''} T={T}", flush=True)
    variants = [("matmul_q8", q8_gemm())]
    for tile in TILES if tiles else []:
        try:
            variants.append((f"matmul_q8 {tile}", q8_gemm(**tile)))
        except ValueError as e:  # a tile that does not fit this shape
            print(f"    skip {tile}: {e}")

    once(g, [f32])
    ref = g.read(y_f32, np.float32, T * N)
    t_f32 = dispatch_seconds(g, *f32, reps) * 1e6
    t_quant = dispatch_seconds(g, *quantize, reps) * 1e6
    print(f"    {'matmul_int4 (f32 x)':30s} {t_f32:9.1f} us")
    print(f"    {'quantize_q8':30s} {t_quant:9.1f} us")
    t_default = None
    for label, (pipe, bg, grid, consts) in variants:
        g.write(y_q8, np.full(T * N, np.nan, np.float32))
        once(g, [quantize, (pipe, bg, grid)])
        out = g.read(y_q8, np.float32, T * N)
        err = np.abs(out - ref).max() / np.abs(ref).max()
        verdict = "ok" if err < TOLERANCE else "BAD"  # NaN (an unwritten output) fails too
        t = dispatch_seconds(g, pipe, bg, grid, reps) * 1e6
        tile = f"TM={consts['TM']} TN={consts['TN']} KC={consts['KC']}"
        print(f"    {label:30s} {t:9.1f} us  {tile:18s} vs f32 {err:.1e} {verdict}  "
              f"ratio {t_f32 / (t_quant + t):.2f}x", flush=True)
        t_default = t if t_default is None else t_default
    for buf in (w, s, x, xq, xm, y_f32, y_q8):
        buf.destroy()
    return t_f32, t_quant + t_default


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shape", nargs="?", default="phi3-mini", choices=list(SHAPES))
    ap.add_argument("--tokens", type=int, default=512, help="rows of the prefill chunk (T)")
    ap.add_argument("--reps", type=int, default=20, help="dispatches per timed submission")
    ap.add_argument("--tiles", action="store_true", help="also time matmul_q8 tile variants")
    ap.add_argument("--quick", action="store_true", help="small matrices, T=70, 2 reps (a smoke run)")
    args = ap.parse_args()
    T, reps = (70, 2) if args.quick else (args.tokens, args.reps)
    g = Gpu()
    print(f"{g.info.name}: prefill GEMMs of {args.shape if not args.quick else 'quick shapes'}", flush=True)
    total_f32 = total_q8 = 0.0
    for name, (K, N, gate_up) in matrices(args.shape, args.quick).items():
        t_f32, t_q8 = probe(g, name, K, N, gate_up, T, reps, args.tiles)
        total_f32, total_q8 = total_f32 + t_f32, total_q8 + t_q8
    print(f"one layer's GEMMs: matmul_int4 {total_f32:.1f} us, quantize_q8 + matmul_q8 {total_q8:.1f} us: "
          f"{total_f32 / total_q8:.2f}x")


if __name__ == "__main__":
    main()
