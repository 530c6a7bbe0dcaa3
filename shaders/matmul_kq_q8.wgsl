// Prefill GEMM on K-quant / Q5_0 / Q5_1 blocks with int8 activations: Y[t, n] = Σ_k X[t, k]·W[n, k], t < n_tokens.
// X comes as quantize_q8 writes it (q8_pack.wgsl); per chunk and half h (16 elements) the sum is
// xs·(a_h·Σ u·xq + b_h·Σ xq) in kq_decode.wgsl's form, with Σ u·xq through dot4I8Packed as matmul_q8w.wgsl does.
// A workgroup computes a TM×TN tile of Y; each step stages KC chunks of the TM int8 X rows (their bytes put in
// element order once, here, for every column of the tile) and of the tile's weight rows (codes straight from the
// blocks, in element order), plus per half the weights' (a, b) and the rows' xs·Σ xq. Thread (tx, ty) owns rows
// 4ty..4ty+3 and tile columns 4tx..4tx+3; with GATE_UP its columns are (gate j, gate j+1, up j, up j+1) and it writes
// silu(gate)·up itself (gemm_tile.wgsl); or with ROWS_Q8 (GATE_UP, TN = 32) writes those rows as int8 into yq / ym
// (gemm_rows_q8.wgsl), the down GEMM's input.
// Constants: K (a multiple of QK and of 32·KC), N, TM, TN (multiples of 4), KC (chunks per step), GATE_UP, YS (floats
//   per row of Y, ≥ N), KTYPE, QK, BW, BH, HALVES, ROWS_F32, ROWS_Q8. Workgroup memory: KC·(32·(TM + WN) + 16·WN +
//   12·TM) bytes, WN = TN·MATS, and with ROWS_Q8 (TM/2)·132 more (engine/kquant_plan.py gemm_kq_q8_workgroup_bytes).
// Bindings: 0 xq u32[rows, K/4] read as vec4, 1 w u32 q_blocks, 2 wh f16 (q_d, or q_blocks again), 3 y f32[T, YS]
//   (write), 4 xm vec2<f32>[rows, K/32] (scale, Σ codes), 5 step uniform (n_tokens), 6 yq u32[T, N/4] (write),
//   7 ym vec2<f32>[T, N/32] (write); 6 and 7 are bound whether or not ROWS_Q8.
// Grid: (x, ceil(T/TM), z) with (x, z) = fold_grid(ceil(N/TN)); rows t ≥ n_tokens and columns ≥ N are never written.
#import step
#import gemm_tile
#import kq_decode
#import q8_element_order
#import gemm_rows_q8

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(5) var<uniform> step: Step;
@group(0) @binding(6) var<storage, read_write> yq: array<u32>;
@group(0) @binding(7) var<storage, read_write> ym: array<vec2<f32>>;

const CHUNKS: u32 = K / 32u;
const STEPS: u32 = CHUNKS / KC;
const NB: u32 = K / QK;
const MATS: u32 = select(1u, 2u, GATE_UP);
const WN: u32 = TN * MATS;                  // weight rows staged per tile
const TX: u32 = WN / 4u;
const TY: u32 = TM / 4u;
const RPT: u32 = 4u;                        // token rows a thread owns
const WG: u32 = TX * TY;
const N_TILES: u32 = (N + TN - 1u) / TN;
const ONES: u32 = 0x01010101u;
// i32 sums start at the bits of 1.5·2^23, so bitcast<f32>(sum) − 1.5·2^23 is the sum exactly (|sum| < 2^22).
const MAGIC: i32 = 0x4B400000;
const MAGIC_F: f32 = 12582912.0;

const X_ITEMS: u32 = TM * KC * 2u;          // (row, chunk, half): 16 int8 codes each
const W_ITEMS: u32 = WN * KC * 2u;          // (column, chunk, half)

var<workgroup> x_tile: array<vec4<u32>, X_ITEMS>;    // [chunk][half][row % 4][row / 4], element order
var<workgroup> w_tile: array<vec4<u32>, W_ITEMS>;    // [chunk][half][col % 4][col / 4], element order
var<workgroup> w_a: array<vec4<f32>, KC * 2u * TX>;  // [chunk][half][col / 4]: a_h per column
var<workgroup> w_b: array<vec4<f32>, KC * 2u * TX>;  // b_h per column
var<workgroup> x_scale: array<vec4<f32>, KC * TY>;   // [chunk][row / 4]: xs per row
var<workgroup> x_sum: array<vec4<f32>, KC * 2u * TY>; // [chunk][half][row / 4]: xs·Σ xq over the half

fn dot16(a: vec4<u32>, b: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, b.x) + dot4I8Packed(a.y, b.y) + dot4I8Packed(a.z, b.z) + dot4I8Packed(a.w, b.w);
}

fn dots(a: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>, b2: vec4<u32>, b3: vec4<u32>) -> vec4<i32> {
    return vec4<i32>(dot16(a, b0), dot16(a, b1), dot16(a, b2), dot16(a, b3));
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

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var g = 0u; g < STEPS; g++) {
        for (var i = lid; i < X_ITEMS; i += WG) {
            let m = i / (2u * KC);
            let c = i % (2u * KC) / 2u;
            let h = i % 2u;
            let row = min(t0 + m, last_t);  // rows past n_tokens are clamped: computed, never written
            let chunk = g * KC + c;
            let v = xq[(row * CHUNKS + chunk) * 2u + h];
            let lo = in_order(v.x, v.y);
            let hi = in_order(v.z, v.w);
            x_tile[((c * 2u + h) * 4u + m % 4u) * TY + m / 4u] = vec4<u32>(lo, hi);
            let xs = xm[row * CHUNKS + chunk].x;
            let s = dot4I8Packed(v.x, ONES) + dot4I8Packed(v.y, ONES) + dot4I8Packed(v.z, ONES)
                  + dot4I8Packed(v.w, ONES);
            x_sum[(c * 2u + h) * TY + m / 4u][m % 4u] = xs * f32(s);
            if (h == 0u) { x_scale[c * TY + m / 4u][m % 4u] = xs; }
        }
        for (var i = lid; i < W_ITEMS; i += WG) {
            let col = i / (2u * KC);
            let c = i % (2u * KC) / 2u;
            let h = i % 2u;
            let chunk = g * KC + c;
            let blk = weight_row(col, j0) * NB + chunk / CPB;
            let cc = chunk % CPB;
            let q = vec4<u32>(kq_word(blk, cc, 4u * h), kq_word(blk, cc, 4u * h + 1u), kq_word(blk, cc, 4u * h + 2u),
                              kq_word(blk, cc, 4u * h + 3u));
            w_tile[((c * 2u + h) * 4u + col % 4u) * TX + col / 4u] = q;
            let ab = kq_affine(blk, cc);
            w_a[(c * 2u + h) * TX + col / 4u][col % 4u] = ab[h];
            w_b[(c * 2u + h) * TX + col / 4u][col % 4u] = ab[2u + h];
        }
        workgroupBarrier();
        for (var c = 0u; c < KC; c++) {
            let xs = x_scale[c * TY + ty];
            for (var h = 0u; h < 2u; h++) {
                let p = (c * 2u + h) * 4u;
                let b0 = w_tile[p * TX + tx];
                let b1 = w_tile[(p + 1u) * TX + tx];
                let b2 = w_tile[(p + 2u) * TX + tx];
                let b3 = w_tile[(p + 3u) * TX + tx];
                let d0 = vec4<i32>(MAGIC) + dots(x_tile[p * TY + ty], b0, b1, b2, b3);
                let d1 = vec4<i32>(MAGIC) + dots(x_tile[(p + 1u) * TY + ty], b0, b1, b2, b3);
                let d2 = vec4<i32>(MAGIC) + dots(x_tile[(p + 2u) * TY + ty], b0, b1, b2, b3);
                let d3 = vec4<i32>(MAGIC) + dots(x_tile[(p + 3u) * TY + ty], b0, b1, b2, b3);
                let wa = w_a[(c * 2u + h) * TX + tx];
                let wb = w_b[(c * 2u + h) * TX + tx];
                let xt = x_sum[(c * 2u + h) * TY + ty];
                acc0 = fma(bitcast<vec4<f32>>(d0) - MAGIC_F, xs.x * wa, fma(vec4<f32>(xt.x), wb, acc0));
                acc1 = fma(bitcast<vec4<f32>>(d1) - MAGIC_F, xs.y * wa, fma(vec4<f32>(xt.y), wb, acc1));
                acc2 = fma(bitcast<vec4<f32>>(d2) - MAGIC_F, xs.z * wa, fma(vec4<f32>(xt.z), wb, acc2));
                acc3 = fma(bitcast<vec4<f32>>(d3) - MAGIC_F, xs.w * wa, fma(vec4<f32>(xt.w), wb, acc3));
            }
        }
        workgroupBarrier();
    }

    if (ROWS_F32) { store_tile(array<vec4<f32>, 4>(acc0, acc1, acc2, acc3), t0, ty, j0, tx); }
    if (ROWS_Q8) {  // a constant: the barriers stay in uniform control flow
        q8_stage_row(acc0, 0u, tx, ty);
        q8_stage_row(acc1, 1u, tx, ty);
        q8_store_staged(t0, min(step.n_tokens - t0, TM), j0, 0u, lid);
        q8_stage_row(acc2, 0u, tx, ty);
        q8_stage_row(acc3, 1u, tx, ty);
        q8_store_staged(t0, min(step.n_tokens - t0, TM), j0, 1u, lid);
    }
}
