"""Prefill GEMM probe: the int8-activation GEMM kernels side by side on real prefill shapes, random q4f16_1 weights.

Variants (`--variants`, default all): `q8w` (the runtime's kernel, shaders/matmul_q8w.wgsl at its default 64×64
tile, 8×4 outputs a thread) and q8w tile variants `q8w-TMxWN` (WN = staged weight rows; gate_up takes WN/2
outputs). `--f32` adds the f32-activation matmul_int4.
Each matrix is first run once by every variant, checked against q8w on the same int8 input (same integer
sums: agreement within 1e-5 of max|y|, else the variant is marked BAD; NaN-poisoned outputs), then timed: rounds
of every variant in turn (interleaved against clock drift), each a pass of `--reps` dispatches, best round kept
(µs per dispatch, the barrier to the next included). quantize_q8 of the same rows is timed once (all int8
variants share it). TFLOP/s counts 2·T·K·(weight rows) per GEMM.

    python3 bench/gemm_probe.py [SHAPE ...] [--tokens 512] [--reps 10] [--rounds 3] [--variants a,b] [--f32]
                                [--json OUT.json] [--quick]
"""

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import SHAPES  # noqa: E402
from engine.gpu import UNIFORM, Gpu, Recorder  # noqa: E402
from engine.kernels.matmul import gemm_plan, gemm_q8w_plan, quantize_q8_plan  # noqa: E402

AGREE = 1e-5  # int8 variants vs q8w, relative to max|y|: the same integer sums, f32 scaling only
REFERENCE = "q8w"
VARIANTS = [REFERENCE, "q8w-128x64", "q8w-64x128", "q8w-32x64"]
# The GEMMs of one layer, name -> (K, N outputs, gate_up); Qwen3.5-4B's MLP (its attention/GDN projections are
# a minority of the prefill FLOPs).
EXTRA_SHAPES = {"qwen3.5-4b-mlp": {"gate_up": (2560, 9216, True), "down": (9216, 2560, False)}}


def matrices(shape: str, quick: bool) -> dict[str, tuple[int, int, bool]]:
    if quick:  # small enough for a software GPU; partial tiles and several steps of K
        return {"small": (256, 200, False), "gate_up": (192, 70, True)}
    if shape in EXTRA_SHAPES:
        return EXTRA_SHAPES[shape]
    d, _, h, kvh, hd, ffn = SHAPES[shape][:6]
    return {"qkv": (d, (h + 2 * kvh) * hd, False), "o": (h * hd, d, False), "gate_up": (d, ffn, True),
            "down": (ffn, d, False)}


def variant_plan(name: str, K: int, N: int, T: int, gate_up: bool) -> tuple[str, dict, tuple]:
    """(shader, constants, grid) of a variant name."""
    if name == "q8w":
        return ("matmul_q8w", *gemm_q8w_plan(K, N, T, gate_up=gate_up))
    if name.startswith("q8w-"):
        try:
            tm, wn = (int(v) for v in name[4:].split("x"))
        except ValueError:
            raise ValueError(f"variant {name!r} is not q8w-TMxWN with integer TM and WN") from None
        return ("matmul_q8w", *gemm_q8w_plan(K, N, T, gate_up=gate_up, tm=tm, tn=wn // 2 if gate_up else wn))
    raise ValueError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)} or q8w-TMxWN")


def run_once(g: Gpu, pipe, bg, grid) -> None:
    rec = Recorder(g, "check")
    rec.dispatch(pipe, bg, *grid)
    rec.submit()
    g.sync()


def time_pass(g: Gpu, pipe, bg, grid, reps: int) -> float:
    """Seconds per dispatch of one pass of `reps` dispatches (submit to readback)."""
    rec = Recorder(g, "timed")
    for _ in range(reps):
        rec.dispatch(pipe, bg, *grid)
    g.sync()
    t = time.perf_counter()
    rec.submit()
    g.sync()
    return (time.perf_counter() - t) / reps


def probe(g: Gpu, K: int, N: int, gate_up: bool, T: int, variants: list[str], f32: bool, reps: int,
          rounds: int) -> dict:
    rng = np.random.default_rng(0)
    rows = 2 * N if gate_up else N
    w = g.upload("w", rng.integers(0, 2**32, (rows, K // 8), dtype=np.uint32))
    s = g.upload("s", rng.uniform(0.002, 0.02, (rows, K // 32)).astype(np.float16))
    x = g.upload("x", rng.standard_normal((T, K)).astype(np.float32))
    step = g.upload("step", np.array([T, 0, 0, 1], np.uint32), usage=UNIFORM)
    xq, xm = g.buffer("xq", T * K), g.buffer("xm", T * K // 32 * 8)
    y = g.buffer("y", T * N * 4)
    yq, ym = g.buffer("yq", 16), g.buffer("ym", 16)  # the int8 GEMMs' int8 output rows: bound, not written here
    flop = 2.0 * T * K * rows

    consts, grid = quantize_q8_plan(K, rows=T)
    pipe = g.pipeline("quantize_q8", consts)
    quantize = (pipe, g.bind(pipe, [x, xq, xm, step], "probe-quantize"), grid)
    run_once(g, *quantize)

    kernels, out = {}, {}
    for name in variants:
        try:
            shader, consts, grid = variant_plan(name, K, N, T, gate_up)
        except ValueError as e:  # a tile that does not fit this shape
            out[name] = dict(skipped=str(e))
            continue
        pipe = g.pipeline(shader, consts)
        kernels[name] = (pipe, g.bind(pipe, [xq, w, s, y, xm, step, yq, ym], f"probe-{name}"), grid)
        out[name] = dict(shader=shader, consts={k: consts[k] for k in ("TM", "TN", "KC") if k in consts},
                         grid=list(grid))
    if f32:
        consts, grid = gemm_plan(K, N, T, gate_up=gate_up)
        pipe = g.pipeline("matmul_int4", consts)
        kernels["matmul_int4"] = (pipe, g.bind(pipe, [x, w, s, y, step], "probe-int4"), grid)
        out["matmul_int4"] = dict(shader="matmul_int4", consts={k: consts[k] for k in ("TM", "TN")},
                                  grid=list(grid))

    ref = None
    for name in [n for n in (REFERENCE, *kernels) if n in kernels]:
        if name == REFERENCE and ref is not None:
            continue
        g.write(y, np.full(T * N, np.nan, np.float32))
        run_once(g, *kernels[name])
        got = g.read(y, np.float32, T * N)
        if ref is None:
            ref = got
        err = float(np.abs(got - ref).max() / np.abs(ref).max())  # NaN (an unwritten output) stays NaN
        tol = 5e-2 if name == "matmul_int4" else AGREE  # f32 x vs its int8 rounding
        out[name].update(rel_err_vs_q8w=err, ok=bool(err <= tol))

    best = {name: float("inf") for name in kernels}
    best_q = float("inf")
    for _ in range(rounds):
        best_q = min(best_q, time_pass(g, *quantize, reps))
        for name, k in kernels.items():
            best[name] = min(best[name], time_pass(g, *k, reps))
    for name, t in best.items():
        out[name].update(us=round(t * 1e6, 2), tflops=round(flop / t / 1e12, 2))
    for buf in (w, s, x, xq, xm, y, step):
        buf.destroy()
    return dict(K=K, N=N, gate_up=gate_up, weight_rows=rows, gflop=round(flop / 1e9, 3),
                quantize_q8_us=round(best_q * 1e6, 2), variants=out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("shapes", nargs="*", metavar="SHAPE",
                    help=f"default: phi3-mini qwen3-4b qwen3.5-4b-mlp; known: {', '.join([*SHAPES, *EXTRA_SHAPES])}")
    ap.add_argument("--tokens", type=int, default=512, help="rows of the prefill chunk (T)")
    ap.add_argument("--reps", type=int, default=10, help="dispatches per timed pass")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved timing rounds (best kept)")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="comma-separated kernel variants")
    ap.add_argument("--f32", action="store_true", help="also time the f32-activation matmul_int4")
    ap.add_argument("--json", type=Path, help="write the results here as JSON")
    ap.add_argument("--quick", action="store_true", help="small matrices, T=70, 2 reps, 1 round (a smoke run)")
    args = ap.parse_args()
    args.shapes = args.shapes or ["phi3-mini", "qwen3-4b", "qwen3.5-4b-mlp"]
    for shape in args.shapes:
        if shape not in SHAPES and shape not in EXTRA_SHAPES:
            ap.error(f"unknown SHAPE {shape!r}; known: {', '.join([*SHAPES, *EXTRA_SHAPES])}")
    variants = [v for v in args.variants.split(",") if v]
    for v in variants:  # refuse unknown names and tiles no shape can run before opening the GPU
        try:
            variant_plan(v, 3072, 3072, 512, False)
        except ValueError as e:
            ap.error(f"--variants {v}: {e}")
    if args.tokens < 1 or args.reps < 1 or args.rounds < 1:
        ap.error("--tokens, --reps and --rounds must be ≥ 1")
    T, reps, rounds = (70, 2, 1) if args.quick else (args.tokens, args.reps, args.rounds)
    shapes = ["quick"] if args.quick else args.shapes
    g = Gpu()
    result = dict(device=g.info.summary(), tokens=T, reps=reps, rounds=rounds, shapes={})
    print(f"{g.info.summary()}: prefill GEMMs at T={T}", flush=True)
    for shape in shapes:
        per = result["shapes"][shape] = dict(matrices={}, layer_us={})
        for mname, (K, N, gate_up) in matrices(shape, args.quick).items():
            r = per["matrices"][mname] = probe(g, K, N, gate_up, T, variants, args.f32, reps, rounds)
            print(f"{shape} {mname} K={K} N={N}{' gate_up' if gate_up else ''}: "
                  f"quantize_q8 {r['quantize_q8_us']:.1f} us", flush=True)
            for name, v in r["variants"].items():
                if "skipped" in v:
                    print(f"    {name:14s} skipped: {v['skipped']}")
                    continue
                print(f"    {name:14s} {v['us']:9.1f} us {v['tflops']:7.2f} TFLOP/s  {v['consts']!s:28s} "
                      f"err {v['rel_err_vs_q8w']:.1e} {'ok' if v['ok'] else 'BAD'}", flush=True)
        names = {n for m in per["matrices"].values() for n, v in m["variants"].items() if "us" in v}
        for name in sorted(names):
            if all("us" in m["variants"].get(name, {}) for m in per["matrices"].values()):
                per["layer_us"][name] = round(sum(m["variants"][name]["us"] for m in per["matrices"].values()), 1)
        print(f"{shape} one layer's GEMMs (us): {per['layer_us']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1))
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
