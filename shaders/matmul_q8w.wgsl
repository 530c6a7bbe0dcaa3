// Prefill GEMM on 4-bit weights with int8 activations: Y[t, n] = Σ_k X[t, k]·W[n, k] for t < T = step.n_tokens.
// X comes as quantize_q8 writes it (q8_pack.wgsl: per 32-element chunk int8 codes, scale = max|x|/127 and Σ codes),
// so a dot4I8Packed takes four products. The arithmetic per chunk is matvec_q8_body.wgsl's: Σ (q − ZERO)·x =
// xs·ws·Σ (q − ZERO)·xq, or with AFFINE xs·(s·Σ q·xq + m·Σ xq). The weight nibbles are unpacked to int8 once at
// staging, with the zero point subtracted there, so the inner loop is dot4I8Packed and nothing else. The tile:
// - each thread owns 8 token rows × 4 tile columns (32 outputs): per chunk it loads its 4 columns' 32 weight bytes
//   once (8 vec4, kept in registers) and each row's 32 activation bytes once, 27 loads for 256 dot4I8Packed;
// - one chunk (32 of K) per step, staged in two alternating workgroup buffers: one barrier per step, and the next
//   chunk's global loads are in flight while the current one is computed;
// - no private arrays and no inner loops over registers: the 8 rows are written out, so no compiler has to unroll
//   anything to keep the tile in registers.
// Threads: WG = (TM/8)·(WN/4), WN = TN·MATS staged weight rows; thread (tx, ty) owns rows 8ty..8ty+7 and tile
// columns 4tx..4tx+3 (gate_up: (gate j, gate j+1, up j, up j+1), j = j0 + 2tx; gemm_tile.wgsl's weight_row).
// Each thread stages at most one item of each kind per step (the plan checks 2·TM ≤ WG, WN ≤ WG).
// Constants: K (a multiple of GROUP), N, TM (multiple of 8), TN (multiple of 4), GATE_UP (W has 2N rows, gate then
//   up; Y[t, j] = silu(gate)·up), YS (floats per row of Y, ≥ N), ZERO, AFFINE, GROUP (q4f16_1, q4_0, q4_1, mlx4),
//   ROWS_F32 (Y's rows as f32 into y), ROWS_Q8 (GATE_UP, TN = 32: as int8 into yq / ym, gemm_rows_q8.wgsl).
// Workgroup memory: 2·(TM + WN)·(36, or 40 with AFFINE) bytes, and with ROWS_Q8 (TM/2)·132 more.
// Bindings: 0 xq u32[rows, K/4] read as vec4 (int8 codes, row t at t·K/4), 1 w u32[N or 2N, K/8] read as vec4 (one
//   per 32-element chunk), 2 s f16[N or 2N, K/GROUP] (with AFFINE (scale, min) pairs f16[N or 2N, K/GROUP, 2]),
//   3 y f32[T, YS] (write), 4 xm vec2<f32>[rows, K/32] (scale, Σ codes), 5 step uniform (n_tokens),
//   6 yq u32[T, N/4] (write), 7 ym vec2<f32>[T, N/32] (write); 6 and 7 are bound whether or not ROWS_Q8.
// Grid: (x, ceil(T/TM), z) with (x, z) = fold_grid(ceil(N/TN)); rows t ≥ n_tokens and columns ≥ N are never written.
#import step
#import gemm_tile
#import group_scale
#import int8_dot
#import int8_codes
#import gemm_rows_q8

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(5) var<uniform> step: Step;
@group(0) @binding(6) var<storage, read_write> yq: array<u32>;
@group(0) @binding(7) var<storage, read_write> ym: array<vec2<f32>>;

const CHUNKS: u32 = K / 32u;
const MATS: u32 = select(1u, 2u, GATE_UP);
const WN: u32 = TN * MATS;
const TX: u32 = WN / 4u;
const TY: u32 = TM / 8u;
const RPT: u32 = 8u;  // token rows a thread owns
const WG: u32 = TX * TY;
const N_TILES: u32 = (N + TN - 1u) / TN;

// One buffer each (the second at + its size): X [half][row % 8][row / 8], W [half][col % 4][col / 4] as int8.
const XB: u32 = 2u * TM;
const WB: u32 = 2u * WN;
var<workgroup> x_tile: array<vec4<u32>, 2u * XB>;
var<workgroup> w_tile: array<vec4<u32>, 2u * WB>;
var<workgroup> x_scale: array<vec4<f32>, 2u * (TM / 4u)>;   // [row / 4], component row % 4
var<workgroup> w_scale: array<vec4<f32>, 2u * TX>;          // [col / 4], component col % 4
var<workgroup> x_sum: array<vec4<f32>, select(1u, 2u * (TM / 4u), AFFINE)>;
var<workgroup> w_min: array<vec4<f32>, select(1u, 2u * TX, AFFINE)>;

// This thread's 4 columns of one chunk, in registers for all 8 rows: b0..b3 the first 16 bytes of columns 0..3,
// c0..c3 the last 16, their scales and (AFFINE) minima.
var<private> b0: vec4<u32>;
var<private> b1: vec4<u32>;
var<private> b2: vec4<u32>;
var<private> b3: vec4<u32>;
var<private> c0: vec4<u32>;
var<private> c1: vec4<u32>;
var<private> c2: vec4<u32>;
var<private> c3: vec4<u32>;
var<private> ws: vec4<f32>;
var<private> mn: vec4<f32>;

// One row of the chunk against the thread's 4 columns, folded into acc with the row's scale (and sum).
fn row(acc: vec4<f32>, base: u32, r: u32, ty: u32, xs: f32, xt: f32) -> vec4<f32> {
    let a = x_tile[base + r * TY + ty];
    let b = x_tile[base + (8u + r) * TY + ty];
    let d = vec4<i32>(MAGIC) + vec4<i32>(dot16(a, b0) + dot16(b, c0), dot16(a, b1) + dot16(b, c1),
                                         dot16(a, b2) + dot16(b, c2), dot16(a, b3) + dot16(b, c3));
    var out = fma(bitcast<vec4<f32>>(d) - MAGIC_F, xs * ws, acc);
    if (AFFINE) { out = fma(vec4<f32>(xt), mn, out); }
    return out;
}

fn q8_row(i: u32) -> u32 { return i; }  // gemm_rows_q8.wgsl: the tile's rows are Y's own

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let col_tile = wid.z * nwg.x + wid.x;
    let t0 = wid.y * TM;
    if (col_tile >= N_TILES || t0 >= step.n_tokens) { return; }  // whole workgroup: barriers stay uniform
    let j0 = col_tile * TN;
    let last_t = step.n_tokens - 1u;
    let tx = lid % TX;
    let ty = lid / TX;

    // This thread's staged items (fixed over the steps): X half lid % 2 of tile row (p % TY)·8 + p / TY,
    // p = lid / 2 (two lanes read a row's 32 bytes, and a warp's stores land on distinct banks), the scale and sum
    // of row lid, weight row lid. Rows past n_tokens are clamped: loaded, never written.
    let has_x = lid < XB;
    let has_xm = lid < TM;
    let has_w = lid < WN;
    let p = min(lid, XB - 1u) / 2u;
    let xrow = min(t0 + p % TY * 8u + p / TY, last_t);
    let x_src = xrow * (2u * CHUNKS) + lid % 2u;
    let x_dst = (lid % 2u * 8u + p / TY) * TY + p % TY;
    let m_src = min(t0 + min(lid, TM - 1u), last_t) * CHUNKS;
    let w_src = weight_row(min(lid, WN - 1u), j0);
    let w_dst = (lid % 4u) * TX + lid / 4u;

    var px = vec4<u32>(0u);
    var pxm = vec2<f32>(0.0);
    var pw = vec4<u32>(0u);
    var pws = vec2<f32>(0.0);

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    var acc4 = vec4<f32>(0.0);
    var acc5 = vec4<f32>(0.0);
    var acc6 = vec4<f32>(0.0);
    var acc7 = vec4<f32>(0.0);

    // Step g: issue chunk g + 1's loads, compute chunk g from buffer g % 2, store chunk g + 1 into the other
    // buffer (last read in step g − 1, before the barrier that ended it), one barrier. g = −1 only loads and stores.
    for (var gi = 0u; gi <= CHUNKS; gi++) {
        let next = gi;  // the chunk loaded this iteration; the chunk computed is gi − 1
        if (next < CHUNKS) {
            if (has_x) { px = xq[x_src + next * 2u]; }
            if (has_xm) { pxm = xm[m_src + next]; }
            if (has_w) {
                pw = w[w_src * CHUNKS + next];
                pws = group_scale(w_src, next);
            }
        }
        if (gi > 0u) {
            let buf = (gi - 1u) % 2u;
            let wb = buf * WB;
            b0 = w_tile[wb + tx];
            b1 = w_tile[wb + TX + tx];
            b2 = w_tile[wb + 2u * TX + tx];
            b3 = w_tile[wb + 3u * TX + tx];
            c0 = w_tile[wb + 4u * TX + tx];
            c1 = w_tile[wb + 5u * TX + tx];
            c2 = w_tile[wb + 6u * TX + tx];
            c3 = w_tile[wb + 7u * TX + tx];
            ws = w_scale[buf * TX + tx];
            mn = vec4<f32>(0.0);
            var xt0 = vec4<f32>(0.0);
            var xt1 = vec4<f32>(0.0);
            if (AFFINE) {
                mn = w_min[buf * TX + tx];
                xt0 = x_sum[buf * (TM / 4u) + 2u * ty];
                xt1 = x_sum[buf * (TM / 4u) + 2u * ty + 1u];
            }
            let xs0 = x_scale[buf * (TM / 4u) + 2u * ty];
            let xs1 = x_scale[buf * (TM / 4u) + 2u * ty + 1u];
            let xb = buf * XB;
            acc0 = row(acc0, xb, 0u, ty, xs0.x, xt0.x);
            acc1 = row(acc1, xb, 1u, ty, xs0.y, xt0.y);
            acc2 = row(acc2, xb, 2u, ty, xs0.z, xt0.z);
            acc3 = row(acc3, xb, 3u, ty, xs0.w, xt0.w);
            acc4 = row(acc4, xb, 4u, ty, xs1.x, xt1.x);
            acc5 = row(acc5, xb, 5u, ty, xs1.y, xt1.y);
            acc6 = row(acc6, xb, 6u, ty, xs1.z, xt1.z);
            acc7 = row(acc7, xb, 7u, ty, xs1.w, xt1.w);
        }
        if (next < CHUNKS) {
            let buf = next % 2u;
            if (has_x) { x_tile[buf * XB + x_dst] = px; }
            if (has_xm) {
                let slot = buf * (TM / 4u) + lid / 4u;
                x_scale[slot][lid % 4u] = pxm.x;
                if (AFFINE) { x_sum[slot][lid % 4u] = pxm.x * pxm.y; }
            }
            if (has_w) {
                let lo = codes(pw & vec4<u32>(NIB));
                let hi = codes((pw >> vec4<u32>(4u)) & vec4<u32>(NIB));
                // q8_codes.wgsl's order: word j's even nibbles meet activation u32 2j, its odd nibbles u32 2j + 1.
                w_tile[buf * WB + w_dst] = vec4<u32>(lo.x, hi.x, lo.y, hi.y);
                w_tile[buf * WB + 4u * TX + w_dst] = vec4<u32>(lo.z, hi.z, lo.w, hi.w);
                w_scale[buf * TX + lid / 4u][lid % 4u] = pws.x;
                if (AFFINE) { w_min[buf * TX + lid / 4u][lid % 4u] = pws.y; }
            }
        }
        workgroupBarrier();
    }

    if (ROWS_F32) {
        let t = t0 + 8u * ty;
        store_row(acc0, t, j0, tx);
        store_row(acc1, t + 1u, j0, tx);
        store_row(acc2, t + 2u, j0, tx);
        store_row(acc3, t + 3u, j0, tx);
        store_row(acc4, t + 4u, j0, tx);
        store_row(acc5, t + 5u, j0, tx);
        store_row(acc6, t + 6u, j0, tx);
        store_row(acc7, t + 7u, j0, tx);
    }
    if (ROWS_Q8) {  // a constant: the barriers stay in uniform control flow
        q8_stage_row(acc0, 0u, tx, ty);
        q8_stage_row(acc1, 1u, tx, ty);
        q8_stage_row(acc2, 2u, tx, ty);
        q8_stage_row(acc3, 3u, tx, ty);
        q8_store_staged(t0, min(step.n_tokens - t0, TM), j0, 0u, lid);
        q8_stage_row(acc4, 0u, tx, ty);
        q8_stage_row(acc5, 1u, tx, ty);
        q8_stage_row(acc6, 2u, tx, ty);
        q8_stage_row(acc7, 3u, tx, ty);
        q8_store_staged(t0, min(step.n_tokens - t0, TM), j0, 1u, lid);
    }
}
