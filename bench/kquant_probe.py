"""K-quant kernels vs Q4_0 on model-size matrices: weight bytes streamed per second by the decode matvecs (f32 x:
matvec_kq vs the engine's matvec_int4 / matvec_sg; int8 x: the type's matvec_kq_q8_wide(_vec4), matvec_kq_q8_chunks,
matvec_kq_q8 or matvec_kq_q8_vec4, as engine/kquant_plan.py matvec_kq_q8_kernel picks by type and N, vs matvec_q8)
and the prefill GEMMs (matmul_kq vs matmul_int4; quantize_q8 + matmul_kq_q8 vs quantize_q8 + matmul_q8w) on random
weights of each type.

Before anything is timed, each type's four kernels are checked on the matrix they are timed on: the f32 matvec
against float64 numpy on gguf's dequantization (1e-4 of max|y|), the f32 GEMM's rows against the matvec on the
same rows (f32 rounding), and both int8 kernels against their f32 twins (int8 rounding of x: 5e-2 of max|y|).
A BAD line means a kernel is wrong on this GPU, and its times mean nothing. Times are µs per dispatch from the GPU's
pass timestamps (engine.bench.PassTimer; `--reps` dispatches a pass), every kernel of a matrix timed once a round in
rotated order, `--warmup` rounds thrown away, the median of `--rounds`; GB/s counts the weight bytes as the kernels
read them; "×" is the median over the rounds of the type's GB/s over Q4_0's in the same round (same kind and
matrix). The last table has one row per type: GB/s and × Q4_0 per timed kind and matrix
(markdown, as BENCH.md's tables).

`--weight-mib M` uploads as many copies of each weight as make M MiB and takes them in turn, so that with M above
the GPU's L2 cache (50 MiB on the H100 / H200) the weights come from memory, as a model's do in decode; the default
0 reads one copy over and over, which a matrix smaller than the L2 cache serves from there.
`--kinds` times only some kernel kinds (all four are still checked). `--variants` also times other plan settings
(ROWS, WG, tiles; the u32-load int8 kernel for the types that have a vec4 one; the wide kernels and their SPLIT, or
not, against the N's default; STAGE), each checked against the default. Issue 19's A/B:
`--types q2_k,q3_k,q4_k --kinds "matvec int8" --variants` (the `{'wide': True, ...}` / `{'wide': False}` lines
against the default line above them).

    python3 bench/kquant_probe.py [--tokens 512] [--reps 50] [--types q4_k,q6_k] [--kinds "matvec int8"]
                                  [--weight-mib 256] [--variants] [--quick] [--json out.json]
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gguf.quants import dequantize as gguf_dequantize  # noqa: E402

from engine.bench import PassTimer, copy_kernel_bandwidth, dispatch_seconds  # noqa: E402
from engine.formats import kquant  # noqa: E402
from engine.gpu import UNIFORM, Gpu, Recorder  # noqa: E402
from engine.kernels.matmul import (  # noqa: E402
    format_knobs,
    gemm_plan,
    gemm_q8w_plan,
    matvec_plan,
    matvec_q8_plan,
    matvec_sg_plan,
    prefers_subgroup_rows,
    quantize_q8_plan,
)
from engine.kquant_plan import (  # noqa: E402
    SUB_BLOCK_TYPES,
    WIDE_TYPES,
    gemm_kq_plan,
    gemm_kq_q8_plan,
    has_vec4_blocks,
    matvec_kq_plan,
    matvec_kq_q8_kernel,
    matvec_kq_q8_plan,
    q8_kernel_kind,
    weight_buffers,
)

MATRICES = {"9216x3072": (3072, 9216), "3072x8192": (8192, 3072)}  # name: (K, N outputs), Phi-3 qkv / down
QUICK = {"200x512": (512, 200), "70x256": (256, 70)}
F32_TOL, Q8_TOL = 1e-4, 5e-2  # relative to max|y|: f32 rounding; int8 rounding of x (as bench/gemm_probe.py)
KINDS = ("matvec f32", "matvec int8", "gemm f32", "gemm int8")
# --variants: other plan settings of the K-quant kernels, each checked against the default one first (same x, so
# only the summation order differs: 1e-5 of max|y|). vec4=False: matvec_kq_q8 (u32 loads) where the default is the
# vec4 kernel. chunks=True: Q2_K / Q3_K on matvec_kq_q8_chunks where their default is the wide kernel.
# stage=True: the activation row staged in workgroup memory, not read per lane (measured slower on the H200).
# wide=True: Q2_K / Q3_K on matvec_kq_q8_wide, Q4_K on matvec_kq_q8_wide_vec4 (few instructions a weight byte), with
# split: its segments per subgroup; wide=False: the non-wide kernel where N makes wide the default (issue 19's A/B).
# batch: items (Q2_K / Q3_K: chunks) a lane of the item kernels or matvec_kq_q8_chunks takes per pass, their loads
# unbranched (issue 19's A/B).
# A knob that does not apply to a type, or repeats its default, is not timed.
VARIANTS = [("matvec f32", dict(rows=2)), ("matvec f32", dict(rows=8)), ("matvec f32", dict(rows=4, wg=128)),
            ("matvec int8", dict(rows=1)), ("matvec int8", dict(rows=2)), ("matvec int8", dict(rows=4)),
            ("matvec int8", dict(rows=2, wg=64)),
            ("matvec int8", dict(rows=2, wg=256)), ("matvec int8", dict(vec4=False)),
            ("matvec int8", dict(chunks=True)), ("matvec int8", dict(chunks=True, rows=4)),
            ("matvec int8", dict(stage=True)),
            ("matvec int8", dict(wide=True)), ("matvec int8", dict(wide=True, rows=4)),
            ("matvec int8", dict(wide=True, rows=1)), ("matvec int8", dict(wide=True, split=2)),
            ("matvec int8", dict(wide=False)),
            ("matvec int8", dict(batch=2)), ("matvec int8", dict(batch=4)), ("matvec int8", dict(batch=2, rows=1)),
            ("matvec int8", dict(batch=4, rows=1)), ("matvec int8", dict(batch=2, rows=4)),
            ("matvec int8", dict(batch=2, wg=256)),
            ("gemm int8", dict(kc=4, tm=32, tn=32)), ("gemm int8", dict(tm=32, tn=128)),
            # int8 rows in element order (shaders/q8_codes.wgsl Q8_NATURAL, a model of K-quant products): no
            # reordering of bytes per row; the same sums, so the same outputs
            ("matvec int8", dict(natural=True)), ("matvec int8", dict(natural=True, rows=1)),
            ("matvec int8", dict(natural=True, wide=True, rows=1)), ("matvec int8", dict(natural=True, wide=False)),
            ("gemm int8", dict(natural=True))]


def random_weight(g: Gpu, tag: str, N: int, K: int, rng, reference: bool = True) -> tuple[list, int, np.ndarray]:
    """(the two weight buffers as the kernels bind them, their bytes, float64 weights: None without `reference`)."""
    if tag == "q4_0":
        q = rng.integers(0, 2**32, (N, K // 8), dtype=np.uint32)
        s = rng.uniform(0.002, 0.02, (N, K // 32)).astype(np.float16)
        W = None
        if reference:
            nib = (q[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & np.uint32(15)
            W = (nib.reshape(N, -1).astype(np.float64) - 8) * np.repeat(s.astype(np.float64), 32, axis=1)
        return [g.upload("w", q), g.upload("s", s)], q.nbytes + s.nbytes, W
    t = kquant.TYPES[tag]
    raw = rng.integers(0, 256, (N, K // t.elements * t.nbytes), dtype=np.uint8)
    blocks = raw.reshape(N, -1, t.nbytes)
    for off in kquant._HALF_FIELDS[tag]:
        d = rng.uniform(0.002, 0.02, blocks.shape[:2]).astype("<f2")
        blocks[:, :, off:off + 2] = d.view(np.uint8).reshape(N, -1, 2)
    arrays = kquant.pack_rows(tag, raw, K)
    w, wh = weight_buffers(arrays)
    wb = g.upload("w", w)
    bufs = [wb, wb if wh is w else g.upload("wh", wh)]
    W = gguf_dequantize(raw, t.qtype).astype(np.float64) if reference else None
    return bufs, sum(a.nbytes for a in arrays.values()), W


def plans(g: Gpu, tag: str, K: int, N: int, T: int) -> dict:
    """kind -> (kernel or shader name, constants, grid) of one type's four kernels."""
    sg = g.subgroup_size
    if tag == "q4_0":
        fmt = format_knobs("q4_0")
        if prefers_subgroup_rows(K, N, False) and g.use_subgroups:
            mv = ("matvec_sg", *matvec_sg_plan(K, N, sg, **fmt))
        else:
            mv = ("matvec_int4", *matvec_plan(K, N, **fmt))
        return {"matvec f32": mv, "matvec int8": ("matvec_q8", *matvec_q8_plan(K, N, sg, **fmt)),
                "gemm f32": ("matmul_int4", *gemm_plan(K, N, T, **fmt)),
                "gemm int8": ("matmul_q8w", *gemm_q8w_plan(K, N, T, **fmt))}
    return {"matvec f32": ("matvec_kq", *matvec_kq_plan(tag, K, N)),
            "matvec int8": (matvec_kq_q8_kernel(tag, n=N), *matvec_kq_q8_plan(tag, K, N, sg)),
            "gemm f32": ("matmul_kq", *gemm_kq_plan(tag, K, N, T)),
            "gemm int8": ("matmul_kq_q8", *gemm_kq_q8_plan(tag, K, N, T))}


def variant_plan(g: Gpu, tag: str, K: int, N: int, T: int, kind: str, plan: dict):
    """(kernel or shader name, constants, grid) of one K-quant kernel with other plan settings; None where the
    setting is the default's (vec4=False on a type that has no vec4 kernel). ValueError where it does not fit."""
    plan = dict(plan)
    if kind == "matvec f32":
        return ("matvec_kq", *matvec_kq_plan(tag, K, N, **plan))
    if kind == "matvec int8":
        vec4 = plan.pop("vec4", None)
        if vec4 is not None and vec4 == has_vec4_blocks(tag):
            return None
        sub = tag in SUB_BLOCK_TYPES
        if (plan.get("wide") and tag not in WIDE_TYPES or "chunks" in plan and not sub
                or "split" in plan and not plan.get("wide")):
            return None
        knobs = dict(vec4=vec4, chunks=plan.get("chunks"), wide=plan.get("wide"))
        if plan.get("stage") and q8_kernel_kind(tag, **knobs, n=N) in ("chunks", "wide"):
            return None  # matvec_kq_q8_chunks and matvec_kq_q8_wide stage nothing
        consts, grid = matvec_kq_q8_plan(tag, K, N, g.subgroup_size, vec4=vec4, **plan)
        kernel = matvec_kq_q8_kernel(tag, **knobs, n=N)
        default = (matvec_kq_q8_kernel(tag, n=N).name, matvec_kq_q8_plan(tag, K, N, g.subgroup_size)[0])
        if (kernel.name, consts) == default:
            return None  # the default's kernel and settings again
        return (kernel, consts, grid)
    return ("matmul_kq_q8", *gemm_kq_q8_plan(tag, K, N, T, **plan))


def bind_list(kind: str, io: dict, wbufs: list, y) -> list:
    x, xq, xm, step = io["x"], io["xq"], io["xm"], io["step"]
    return {"matvec f32": [x, *wbufs, y, step], "matvec int8": [xq, *wbufs, y, xm],
            "gemm f32": [x, *wbufs, y, step], "gemm int8": [xq, *wbufs, y, xm, step, io["yq"], io["ym"]]}[kind]


def run_once(g: Gpu, steps) -> None:
    rec = Recorder(g, "check")
    for pipe, bg, grid in steps:
        rec.dispatch(pipe, bg, *grid)
    rec.submit()
    g.sync()


def output(g: Gpu, kind: str, step, quantize, y, T: int, N: int) -> np.ndarray:
    """One run of a kernel (after quantize_q8 for the int8 ones) on a NaN-poisoned y: its rows."""
    rows = 1 if kind.startswith("matvec") else T
    g.write(y, np.full(y.size // 4, np.nan, np.float32))
    run_once(g, ([quantize] if "int8" in kind else []) + [step])
    return g.read(y, np.float32, rows * N).reshape(rows, N)


def check(res: dict, W: np.ndarray, x: np.ndarray) -> list[str]:
    """The failures of the four kernels' outputs `res` (kind -> rows), as sentences (empty: all agree)."""
    ref = x[:1].astype(np.float64) @ W.T
    scale = np.abs(ref).max()
    pairs = [("matvec f32", ref, F32_TOL), ("gemm f32", res["matvec f32"], F32_TOL),
             ("matvec int8", res["matvec f32"], Q8_TOL), ("gemm int8", res["gemm f32"], Q8_TOL)]
    bad = []
    for kind, want, tol in pairs:
        err = np.abs(res[kind][: want.shape[0]] - want).max() / scale
        if not err < tol:  # NaN (an unwritten output) fails too
            bad.append(f"{kind} off by {err:.1e} of max|y| (tolerance {tol:.0e})")
    return bad


def summary(report: dict, kinds: list[str]) -> str:
    """Markdown: one row per type, GB/s and × Q4_0 per timed kind and matrix."""
    mats = list(report["matrices"])
    cols = [(k, m) for k in kinds for m in mats]
    lines = ["| type | bits/w | " + " | ".join(f"{k} {m}" for k, m in cols) + " |",
             "|---|---|" + "---|" * len(cols)]
    tags = list(report["matrices"][mats[0]]["types"])
    for tag in tags:
        first = report["matrices"][mats[0]]["types"][tag]
        cells = []
        for k, m in cols:
            r = report["matrices"][m]["types"][tag]
            cells.append(f"{r[k]['gbs']:,.1f} GB/s {r[k]['x_q4_0']:.2f}×" + (" BAD" if r["bad"] else ""))
        lines.append(f"| {tag.upper()} | {first['bits_per_weight']:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def variant_summary(report: dict, kind: str = "matvec int8") -> str:
    """Markdown: per type and plan (the default, then each variant timed), × Q4_0 on each matrix (median of rounds,
    the rounds' min–max in brackets)."""
    mats = list(report["matrices"])
    lines = ["| type | plan | " + " | ".join(mats) + " |", "|---|---|" + "---|" * len(mats)]
    for tag in report["matrices"][mats[0]]["types"]:
        if tag == "q4_0":
            continue
        plans = [None] + [v["plan"] for v in report["matrices"][mats[0]]["types"][tag]["variants"] if v["kind"] == kind]
        for plan in plans:
            cells = []
            for m in mats:
                r = report["matrices"][m]["types"][tag]
                c = r.get(kind) if plan is None else next(
                    (v for v in r["variants"] if v["kind"] == kind and v["plan"] == plan and "gbs" in v), None)
                cells.append("" if not c else f"{c['gbs']:,.1f} {c['x_q4_0']:.2f}× ({c['x_min']:.2f}–{c['x_max']:.2f})")
            lines.append(f"| {tag.upper()} | {'default' if plan is None else plan} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def time_rounds(timer: PassTimer, timed: list, reps: int, warmup: int, rounds: int) -> list[list[float]]:
    """Seconds per dispatch of every kernel in `timed`, one pass each per round, `warmup` rounds thrown away first
    (clocks and caches settle); each round starts one kernel later, so no kernel always runs first or after the
    same neighbour."""
    samples = [[] for _ in timed]
    for r in range(warmup + rounds):
        for j in range(len(timed)):
            i = (j + r) % len(timed)
            _, _, _, pipe, bgs, grid = timed[i]
            t = timer.seconds(pipe, bgs, grid, reps)
            if r >= warmup:
                samples[i].append(t)
    return samples


def report_matrix(entry: dict, timed: list, samples: list, kinds: list[str]) -> None:
    """Print and store one matrix's timings: per kernel the median µs and GB/s over the rounds, the rounds' spread
    of GB/s ((max − min) / median), and × Q4_0 as the median of the per-round ratios to Q4_0's same-kind kernel."""
    base = {kind: samples[i] for i, (tag, kind, plan, *_) in enumerate(timed) if tag == "q4_0" and plan is None}
    print(f"  {'type':6s} {'kind':12s} {'plan':34s} {'us':>8s} {'GB/s':>8s} {'spread':>7s} {'x Q4_0':>7s} "
          f"{'(min-max)':>11s}")
    for i, (tag, kind, plan, *_) in enumerate(timed):
        row = entry["types"][tag]
        t = np.array(samples[i])
        nbytes = row["bytes"]
        gbs = nbytes / t / 1e9
        q4 = entry["types"]["q4_0"]["bytes"] / np.array(base[kind]) / 1e9
        ratio = gbs / q4
        cell = {"us": float(np.median(t)) * 1e6, "gbs": float(np.median(gbs)),
                "spread": float((gbs.max() - gbs.min()) / np.median(gbs)), "x_q4_0": float(np.median(ratio)),
                "x_min": float(ratio.min()), "x_max": float(ratio.max()), "us_rounds": [float(v) * 1e6 for v in t]}
        if plan is None:
            row[kind] = cell
        else:
            next(v for v in row["variants"] if v["kind"] == kind and v["plan"] == plan).update(cell)
        label = "default" if plan is None else str(plan)
        bad = " BAD" if (row["bad"] if plan is None else not next(
            v for v in row["variants"] if v["kind"] == kind and v["plan"] == plan)["ok"]) else ""
        print(f"  {tag:6s} {kind:12s} {label:34s} {cell['us']:8.2f} {cell['gbs']:8.1f} {cell['spread']:6.1%} "
              f"{cell['x_q4_0']:6.2f}x ({cell['x_min']:.2f}-{cell['x_max']:.2f}){bad}", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=512, help="rows of the prefill chunk (T)")
    ap.add_argument("--reps", type=int, default=50, help="dispatches per timed submission")
    ap.add_argument("--types", default=",".join(["q4_0", *kquant.TYPES]), help="comma-separated tags")
    ap.add_argument("--kinds", default=",".join(KINDS), help=f"comma-separated kernel kinds to time, of: {KINDS}")
    ap.add_argument("--weight-mib", type=float, default=0, help="weight copies taken in turn, at least this many "
                    "MiB of them (more than the L2 cache: the weights come from memory)")
    ap.add_argument("--variants", action="store_true", help="also time other ROWS / WG / tile / load settings")
    ap.add_argument("--variant-keys", default="", help="with --variants, only the variants whose plan knobs are all "
                    "among these (comma-separated, e.g. batch,rows,wide)")
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds (each kernel one pass a round): medians")
    ap.add_argument("--warmup", type=int, default=2, help="rounds run before the timed ones, thrown away")
    ap.add_argument("--quick", action="store_true", help="small matrices, T=70, 2 reps (a software-GPU smoke run)")
    ap.add_argument("--json", help="also write the numbers to this file (per matrix, type and kernel kind)")
    args = ap.parse_args()
    tags = [t.strip() for t in args.types.split(",") if t.strip()]
    unknown = [t for t in tags if t != "q4_0" and t not in kquant.TYPES]
    if unknown:
        ap.error(f"unknown type(s) {', '.join(unknown)}; choose from q4_0, {', '.join(kquant.TYPES)}")
    if "q4_0" not in tags:
        tags.insert(0, "q4_0")  # the baseline every ratio is taken against
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not kinds or set(kinds) - set(KINDS):
        ap.error(f"--kinds takes some of {', '.join(KINDS)}")
    kinds = [k for k in KINDS if k in kinds]
    if args.weight_mib < 0:
        ap.error("--weight-mib must not be negative")
    if args.rounds < 1 or args.warmup < 0:
        ap.error("--rounds must be at least 1 and --warmup not negative")
    keys = {k.strip() for k in args.variant_keys.split(",") if k.strip()}
    T, reps = (70, 2) if args.quick else (args.tokens, args.reps)
    g = Gpu()
    copy = copy_kernel_bandwidth(g, 64 << 20 if args.quick else 1 << 30)
    print(f"{g.info.name}, subgroup {g.subgroup_size}: copy kernel {copy / 1e9:.0f} GB/s (read + write); "
          f"prefill T={T}; weights in copies of at least {args.weight_mib:g} MiB in all", flush=True)
    failures = 0
    timer = PassTimer(g)
    clock = "GPU pass timestamps" if timer.timestamps else "wall clock (no timestamp-query)"
    print(f"timing: {clock}, {reps} dispatches a pass, {args.warmup} warm-up rounds then the median of "
          f"{args.rounds} rounds, every kernel of a matrix once a round (order rotated)", flush=True)
    report = {"gpu": g.info.name, "subgroup": g.subgroup_size, "copy_gbs": copy / 1e9, "tokens": T, "reps": reps,
              "weight_mib": args.weight_mib, "kinds": kinds, "clock": clock, "rounds": args.rounds,
              "warmup": args.warmup, "matrices": {}}
    for name, (K, N) in (QUICK if args.quick else MATRICES).items():
        rng = np.random.default_rng(0)
        x = rng.standard_normal((T, K)).astype(np.float32)
        io = dict(x=g.upload("x", x), xq=g.buffer("xq", T * K), xm=g.buffer("xm", T * K // 32 * 8),
                  step=g.upload("step", np.array([T, 0, 0, 1], np.uint32), usage=UNIFORM),
                  y=[g.buffer(f"y{i}", (T if i >= 2 else 1) * N * 4) for i in range(5)],
                  yq=g.buffer("yq", 16), ym=g.buffer("ym", 16))  # the int8 GEMM's int8 output rows: not written
        consts, grid = quantize_q8_plan(K, rows=T)
        pipe = g.pipeline("quantize_q8", consts)
        quantize = (pipe, g.bind(pipe, [io["x"], io["xq"], io["xm"], io["step"]], "probe-quantize"), grid)
        # the same rows in element order, for the `natural` variants
        io_natural = dict(io, xq=g.buffer("xq-natural", T * K), xm=g.buffer("xm-natural", T * K // 32 * 8))
        pipe = g.pipeline("quantize_q8", dict(consts, Q8_NATURAL=True))
        quantize_natural = (pipe, g.bind(pipe, [io["x"], io_natural["xq"], io_natural["xm"], io["step"]],
                                         "probe-quantize-natural"), grid)
        t_quant = dispatch_seconds(g, *quantize, reps) * 1e6
        print(f"\n{name} (N={N} outputs, K={K}); quantize_q8 of {T} rows {t_quant:.1f} us (not in the int8 GEMM "
              "times below)")
        entry = report["matrices"][name] = {"K": K, "N": N, "quantize_us": t_quant, "types": {}}
        timed = []  # (tag, kind, variant plan or None, pipeline, bind groups, grid): every kernel timed, checked first
        buffers = []
        for tag in tags:
            copies = [random_weight(g, tag, N, K, rng)]
            wbufs, nbytes, W = copies[0]
            while len(copies) * nbytes < args.weight_mib * 2**20:
                copies.append(random_weight(g, tag, N, K, rng, reference=False))  # timed, never checked
            buffers += [b for c in copies for b in set(c[0])]
            steps = {}
            for i, (kind, (shader, consts, grid)) in enumerate(plans(g, tag, K, N, T).items()):
                pipe = g.pipeline(shader, consts)
                bgs = [g.bind(pipe, bind_list(kind, io, c[0], io["y"][i]), f"probe-{kind}") for c in copies]
                steps[kind] = (pipe, bgs, grid, io["y"][i])
            res = {kind: output(g, kind, (pipe, bgs[0], grid), quantize, y, T, N)
                   for kind, (pipe, bgs, grid, y) in steps.items()}
            bad = check(res, W, x)
            entry["types"][tag] = {"bits_per_weight": 8 * nbytes / (N * K), "bytes": nbytes, "copies": len(copies),
                                   "bad": bad, "variants": []}
            for sentence in bad:
                print(f"    BAD {tag}: {sentence}")
            failures += len(bad)
            timed += [(tag, kind, None, *steps[kind][:3]) for kind in kinds]
            for kind, plan in VARIANTS if args.variants and tag != "q4_0" else []:
                if kind not in kinds or (keys and not set(plan) <= keys):
                    continue
                natural = bool(plan.get("natural"))
                knobs = {k: v for k, v in plan.items() if k != "natural"}
                try:
                    vp = variant_plan(g, tag, K, N, T, kind, knobs) if knobs else None
                except ValueError as e:  # a setting that does not fit this shape
                    print(f"      {tag} {kind} {plan}: skipped ({e})")
                    continue
                if vp is None and natural:  # the default kernel, on rows in element order
                    vp = plans(g, tag, K, N, T)[kind]
                if vp is None:
                    continue
                shader, consts, grid = vp
                pipe = g.pipeline(shader, dict(consts, Q8_NATURAL=True) if natural else consts)
                rows_io, rows_quantize = (io_natural, quantize_natural) if natural else (io, quantize)
                bgs = [g.bind(pipe, bind_list(kind, rows_io, c[0], io["y"][4]), f"probe-{kind}") for c in copies]
                got = output(g, kind, (pipe, bgs[0], grid), rows_quantize, io["y"][4], T, N)
                want = res[kind]
                err = np.abs(got - want).max() / np.abs(want).max()
                ok = bool(err < 1e-5)
                if not ok:
                    failures += 1
                    print(f"    BAD {tag} {kind} {plan}: off the default by {err:.1e} of max|y|")
                entry["types"][tag]["variants"].append({"kind": kind, "plan": plan, "ok": ok, "err": float(err)})
                timed.append((tag, kind, plan, pipe, bgs, grid))
        samples = time_rounds(timer, timed, reps, args.warmup, args.rounds)
        report_matrix(entry, timed, samples, kinds)
        if args.json:  # after each matrix too: a run cut short keeps what it measured
            Path(args.json).write_text(json.dumps(report, indent=2))
        for b in buffers:
            b.destroy()
    print("\nGB/s of weight bytes and × Q4_0's, per type (default plans):\n" + summary(report, kinds))
    if args.variants and "matvec int8" in kinds:
        print("\nmatvec int8 per plan, GB/s and × Q4_0 (min–max over the rounds):\n" + variant_summary(report))
    report["failures"] = failures
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    if failures:
        sys.exit(f"{failures} kernel check(s) failed: the times above are not meaningful")


if __name__ == "__main__":
    main()
