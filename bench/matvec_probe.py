"""Decode matvec shapes, probed on this GPU before one goes into shaders/: the engine's matvec_int4, matvec_sg and
matvec_q8 (int8 x, quantized here in its layout) against probe kernels (each subgroup owns R rows, its lanes stride
over K 16 bytes at a time, one subgroupAdd per row), with x from global or workgroup memory, ablations that drop
the dequant ALU / the x or scale loads, and the copy kernel over the same bytes. (Packed-f16 dequantisation was
another idea: naga 29 rejects bitcast<vec2<f16>>(u32), so it cannot be written in WGSL today.)

Every variant is first checked against numpy on the matrix it is timed on; then each is dispatched N_REPS times
in one pass, best of 5 rounds that interleave the variants, reported as µs per dispatch (barrier included) and
GB/s of weight bytes; the copy kernel over the same bytes gives the streaming rate at that size.

    python3 bench/matvec_probe.py [phi3-mini|qwen3-4b] [--quick]
"""

import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import SHAPES, dispatch_seconds  # noqa: E402
from engine.gpu import UNIFORM, Gpu, Recorder  # noqa: E402
from engine.kernels import fold_grid  # noqa: E402
from engine.kernels.matmul import matvec_plan, matvec_q8_plan, matvec_sg_plan  # noqa: E402
from engine.shaders import const_block  # noqa: E402

N_REPS = 100
ROUNDS = 5

SG_ROWS = """
@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const CHUNKS: u32 = K / 32u;
const TILE: u32 = min(K, 4096u);   // x elements staged at a time
var<workgroup> xt: array<vec4<f32>, XT_LEN>;   // 16 KiB when x is staged

fn dot32(v: vec4<u32>, xs: ptr<function, array<vec4<f32>, 8>>) -> f32 {
    var d = 0.0;
    for (var j = 0u; j < 4u; j++) {
        let wd = v[j];
        let m = vec4<u32>(0x4B000000u);  // 2^23: the nibble lands in the mantissa; 2^23 + 7 comes off exactly
        let lo = bitcast<vec4<f32>>(((vec4<u32>(wd) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u)) | m) - 8388615.0;
        let hi = bitcast<vec4<f32>>(((vec4<u32>(wd) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u)) | m)
                 - 8388615.0;
        d += dot(lo, (*xs)[2u * j]) + dot(hi, (*xs)[2u * j + 1u]);
    }
    return d;
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(subgroup_invocation_id) sl: u32,
        @builtin(subgroup_size) sgs: u32, @builtin(subgroup_id) sid: u32, @builtin(num_subgroups) nsg: u32,
        @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let first = ((wid.y * nwg.x + wid.x) * nsg + sid) * R;
    var rowc: array<u32, R>;
    for (var i = 0u; i < R; i++) { rowc[i] = min(first + i, N - 1u); }
    var acc: array<f32, R>;
    for (var t0 = 0u; t0 < K; t0 += TILE) {
        let t1 = min(t0 + TILE, K);
        if (XS) {
            for (var v = lid; v < (t1 - t0) / 4u; v += WG) { xt[v] = x[t0 / 4u + v]; }
            workgroupBarrier();
        }
        let c_end = t1 / 32u;
        for (var c0 = t0 / 32u + sl; c0 < c_end; c0 += sgs * U) {
            // U chunks per lane per iteration: every load of all U chunks is issued before any math.
            var words: array<vec4<u32>, RU>;
            var sc: array<f32, RU>;
            var xs: array<array<vec4<f32>, 8>, U>;
            for (var u = 0u; u < U; u++) {
                let live = c0 + u * sgs < c_end;
                let c = select(c_end - 1u, c0 + u * sgs, live);
                for (var i = 0u; i < R; i++) {
                    words[u * R + i] = w[rowc[i] * CHUNKS + c];
                    let sv = select(f32(s[rowc[i] * CHUNKS + c]), 1.0, CUT == 3u || CUT == 4u);
                    sc[u * R + i] = select(0.0, sv, live);
                }
                for (var j = 0u; j < 8u; j++) {
                    if (CUT == 2u || CUT == 4u) {
                        xs[u][j] = vec4<f32>(f32(j));
                    } else if (XS) {
                        xs[u][j] = xt[(c * 32u - t0) / 4u + j];
                    } else {
                        xs[u][j] = x[c * 8u + j];
                    }
                }
            }
            for (var u = 0u; u < U; u++) {
                var xu = xs[u];
                for (var i = 0u; i < R; i++) {
                    if (CUT == 1u || CUT == 4u) {  // ablation: the loads stay live, the dequant and dot are gone
                        let v = words[u * R + i];
                        acc[i] += sc[u * R + i] * bitcast<f32>((v.x ^ v.y ^ v.z ^ v.w) & 0x3FFFFFFFu) * xu[i % 8u].x;
                    } else {
                        acc[i] += sc[u * R + i] * dot32(words[u * R + i], &xu);
                    }
                }
            }
        }
        if (XS) { workgroupBarrier(); }
    }
    for (var i = 0u; i < R; i++) {
        let t = subgroupAdd(acc[i]);
        if (sl == 0u && first + i < N) { y[first + i] = t; }
    }
}
"""

def quantize_x_q8(xv: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """x in matvec_q8's int8 layout (shaders/q8_pack.wgsl): (packed bytes as u32 [K/4], (scale, Σq) per chunk,
    the dequantized x)."""
    blocks = xv.reshape(-1, 32).astype(np.float64)
    scale = np.abs(blocks).max(axis=1) / 127
    scale[scale == 0] = 1
    q = np.clip(np.round(blocks / scale[:, None]), -127, 127).astype(np.int8)
    words = q.reshape(-1, 4, 8)  # chunk, word j, element 0..7
    order = np.stack([words[:, :, 0::2], words[:, :, 1::2]], axis=2)  # chunk, j, (even, odd), 4 bytes
    packed = np.ascontiguousarray(order).view(np.uint32).reshape(-1)
    meta = np.stack([scale, q.astype(np.float64).sum(axis=1)], axis=1).astype(np.float32)
    return packed, meta, (q * scale.astype(np.float32)[:, None]).reshape(-1)


FLOOR = """
@group(0) @binding(0) var<storage, read_write> y: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) lid: u32) { y[lid] = y[lid] + 1.0; }
"""


def sg_pipeline(g: Gpu, k: int, n: int, r: int, wg: int, xs: bool, cut: int = 0, unroll: int = 1):
    """cut (ablations, wrong results on purpose): 1 no dequant/dot ALU, 2 no x loads, 3 no scale loads, 4 all three."""
    consts = dict(K=k, N=n, R=r, WG=wg, XS=xs, XT_LEN=1024 if xs else 1, CUT=cut, U=unroll, RU=r * unroll)
    code = f"enable f16;\n{const_block(consts)}\n{SG_ROWS}"
    pipe = g.pipeline_from_source("probe", code)
    rows_per_wg = (wg // g.subgroup_size) * r
    groups = -(-n // rows_per_wg)
    return pipe, (groups, 1) if groups <= 65535 else (65535, -(-groups // 65535))


def timed(g: Gpu, pipe, bg, grid, tries: int = 3) -> float:
    return dispatch_seconds(g, pipe, bg, grid, N_REPS, tries)


def main(shape: str, quick: bool) -> None:
    g = Gpu()
    print(f"{g.info.name} subgroup {g.subgroup_size}", flush=True)
    d, _, h, kvh, hd, ffn, vocab = SHAPES[shape][:7]
    mats = {"qkv": (d, (h + 2 * kvh) * hd), "o": (h * hd, d), "gate_up": (d, 2 * ffn), "down": (ffn, d),
            "lm": (d, vocab)}
    if quick:
        mats = {"small": (256, 200), "k_tail": (4096 + 512, 96)}
    rng = np.random.default_rng(0)
    step = g.upload("step", np.array([1, 0, 0, 1], np.uint32), usage=UNIFORM)
    yb = g.buffer("floor-y", 256)
    floor_pipe = g.pipeline_from_source("floor", FLOOR)
    floor = timed(g, floor_pipe, g.bind(floor_pipe, [yb], "floor"), (1, 1))
    print(f"one-workgroup dispatch floor: {floor * 1e6:.1f} us")
    for name, (k, n) in mats.items():
        words = rng.integers(0, 2**32, (n, k // 8), dtype=np.uint32)
        scales = rng.uniform(0.001, 0.01, (n, k // 32)).astype(np.float16)
        xv = rng.standard_normal(k).astype(np.float32)
        codes = ((words[:, :, None] >> (4 * np.arange(8, dtype=np.uint32))) & 15).reshape(n, k).astype(np.float64)
        ref = ((codes - 7) * np.repeat(scales.astype(np.float64), 32, axis=1)) @ xv.astype(np.float64)
        w, s, x = g.upload("w", words), g.upload("s", scales), g.upload("x", xv)
        packed, meta, x_deq = quantize_x_q8(xv)
        xq, xm = g.upload("xq", packed), g.upload("xm", meta)
        ref_q = ((codes - 7) * np.repeat(scales.astype(np.float64), 32, axis=1)) @ x_deq.astype(np.float64)
        y = g.buffer("y", 4 * n)
        nbytes = words.nbytes + scales.nbytes
        variants = [("engine matvec_int4 4x64", ("matvec_int4", matvec_plan(k, n, rows=4, wg=64))),
                    ("engine matvec_sg 4 rows/sg WG128", ("matvec_sg", matvec_sg_plan(k, n, g.subgroup_size)))]
        for r, wg, xs in ((4, 128, False), (8, 256, True), (2, 256, True)):
            variants.append((f"probe sg R{r} WG{wg} {'x-wg' if xs else 'x-global'}", (r, wg, xs)))
        for r, wg in ((2, 128), (4, 128), (8, 128), (4, 256)):  # int8 x (the engine's matvec_q8, x quantized here)
            variants.append((f"matvec_q8 R{r} WG{wg}", ("matvec_q8", matvec_q8_plan(k, n, g.subgroup_size, rows=r,
                                                                                    wg=wg))))
        for cut, what in ((1, "no dequant ALU"), (4, "weights only")):
            variants.append((f"ablation R4 WG128: {what}", (4, 128, False, cut)))
        built = []
        for label, v in variants:
            if v[0] == "matvec_q8":
                pipe, grid = g.pipeline(v[0], v[1][0]), v[1][1]
                bg = g.bind(pipe, [xq, w, s, y, xm], "probe")
            elif isinstance(v[0], str):
                pipe, grid = g.pipeline(v[0], v[1][0]), v[1][1]
                bg = g.bind(pipe, [x, w, s, y, step], "probe")
            else:
                pipe, grid = sg_pipeline(g, k, n, *v)
                bg = g.bind(pipe, [x, w, s, y], "probe")
            g.write(y, np.full(n, np.nan, np.float32))
            rec = Recorder(g, "check")
            rec.dispatch(pipe, bg, *grid)
            rec.submit()
            out = g.read(y)
            err = np.abs(out - (ref_q if v[0] == "matvec_q8" else ref)).max() / np.abs(ref).max()
            verdict = "ablation" if label.startswith("ablation") else "ok" if err < 1e-5 else "BAD"
            if v[0] == "matvec_q8":  # exact on the quantized x; vs the f32 x, the int8 rounding shows
                verdict += f" {np.abs(out - ref).max() / np.abs(ref).max():.0e}"
            built.append((f"{label:34s} {verdict:8s}", pipe, bg, grid, nbytes))
        # The same weight bytes through the vec4 copy kernel (reads them and writes a copy): a streaming ceiling
        # for this size with the same per-dispatch cost.
        n4 = words.nbytes // 16
        cgrid = fold_grid(-(-n4 // (256 * 4)))
        cpipe = g.pipeline("copy", dict(WG=256, PER_THREAD=4, N4=n4, GRID_X=cgrid[0]))
        dst = g.buffer("copy-dst", words.nbytes)
        built.append((f"{'copy kernel, same bytes (read GB/s)':34s}", cpipe, g.bind(cpipe, [w, dst], "c"), cgrid,
                      words.nbytes))
        best = {b[0]: 1e9 for b in built}
        for _ in range(3):  # warm the clocks
            timed(g, built[0][1], built[0][2], built[0][3])
        for _ in range(ROUNDS):  # interleaved, so a clock change hits every variant alike
            for label, pipe, bg, grid, _ in built:
                best[label] = min(best[label], timed(g, pipe, bg, grid, tries=1))
        print(f"{name} {n}x{k}", flush=True)
        for label, _, _, _, nb in built:
            print(f"    {label} {best[label] * 1e6:7.1f} us {nb / best[label] / 1e9:6.0f} GB/s", flush=True)
        dst.destroy()


if __name__ == "__main__":
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    for shape in args or ["phi3-mini"]:
        main(shape, "--quick" in sys.argv)
