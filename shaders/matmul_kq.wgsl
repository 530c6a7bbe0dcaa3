// Prefill GEMM on K-quant / Q5_0 / Q5_1 blocks read as stored, f32 activations: Y[t, n] = Σ_k X[t, k]·W[n, k] for
// t < T = step.n_tokens. matmul_int4.wgsl's tiling: a workgroup computes a TM×TN tile of Y; per 32-wide K step (one
// chunk) it stages the X rows and the dequantized weight rows (w = a_h·u + b_h, kq_decode.wgsl) in workgroup memory
// as f32, k-major, and each thread does 16 FMAs per k for its 4 rows × 4 tile columns.
// Threads: (TM/4)·(TN·MATS/4); GATE_UP stages 2·TN weight rows so a thread's 4 columns are (gate j, gate j+1, up j,
// up j+1) and it writes silu(gate)·up itself (gemm_tile.wgsl).
// Constants: K (a multiple of QK), N, TM, TN (multiples of 4), GATE_UP, YS (floats per row of Y, ≥ N), KTYPE, QK, BW,
//   BH, HALVES. Workgroup memory: 128·(TM + TN·MATS) bytes.
// Bindings: 0 x f32[T, K], 1 w u32 q_blocks, 2 wh f16 (q_d, or q_blocks again), 3 y f32[T, YS] (write), 4 step.
// Grid: (x, ceil(T/TM), z) with (x, z) = fold_grid(ceil(N/TN)); rows t ≥ n_tokens and columns ≥ N are never written.
#import step
#import gemm_tile
#import kq_decode

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const TK: u32 = 32u;                        // K per step: one chunk
const CHUNKS: u32 = K / TK;
const NB: u32 = K / QK;
const MATS: u32 = select(1u, 2u, GATE_UP);
const WN: u32 = TN * MATS;                  // weight rows staged per tile
const TX: u32 = WN / 4u;
const TY: u32 = TM / 4u;
const WG: u32 = TX * TY;
const N_TILES: u32 = (N + TN - 1u) / TN;

var<workgroup> x_tile: array<vec4<f32>, TK * TY>;  // [k][row / 4]
var<workgroup> w_tile: array<vec4<f32>, TK * TX>;  // [k][tile column / 4]

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
    for (var g = 0u; g < CHUNKS; g++) {
        // X: TM rows × 8 vec4; rows past n_tokens are clamped (their results are never written).
        for (var i = lid; i < TM * 8u; i += WG) {
            let m = i / 8u;
            let kv = i % 8u;
            let v = x[min(t0 + m, last_t) * (K / 4u) + g * 8u + kv];
            for (var e = 0u; e < 4u; e++) { x_tile[(kv * 4u + e) * TY + m / 4u][m % 4u] = v[e]; }
        }
        // W: WN rows × 8 code words; each thread dequantizes the 4 elements of one word.
        let blk_off = g / CPB;
        let cc = g % CPB;
        for (var i = lid; i < WN * 8u; i += WG) {
            let c = i / 8u;
            let j = i % 8u;
            let blk = weight_row(c, j0) * NB + blk_off;
            let ab = kq_affine(blk, cc);
            let h = j / 4u;
            let v = kq_codes_f32(kq_word(blk, cc, j)) * ab[h] + ab[2u + h];
            for (var e = 0u; e < 4u; e++) { w_tile[(j * 4u + e) * TX + c / 4u][c % 4u] = v[e]; }
        }
        workgroupBarrier();
        for (var k = 0u; k < TK; k++) {
            let a = x_tile[k * TY + ty];
            let b = w_tile[k * TX + tx];
            acc0 += a.x * b;
            acc1 += a.y * b;
            acc2 += a.z * b;
            acc3 += a.w * b;
        }
        workgroupBarrier();
    }

    store_tile(array<vec4<f32>, 4>(acc0, acc1, acc2, acc3), t0, ty, j0, tx);
}
