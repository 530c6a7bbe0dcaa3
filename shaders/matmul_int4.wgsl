// Prefill GEMM on packed weights: Y[t, n] = Σ_k X[t, k]·W[n, k] for t < T = step.n_tokens, f32 accumulate.
// A workgroup computes a TM×TN tile of Y. Per 32-wide K step (one chunk) it stages the X rows and the
// dequantized weight rows in workgroup memory as f32, both k-major so that for each k a thread reads one
// vec4 of X (its 4 rows) and one vec4 of W (its 4 tile columns) and does 16 FMAs.
// Threads: WG = (TM/4)·(TN·MATS/4); thread (tx, ty) owns rows 4ty..4ty+3 and tile columns 4tx..4tx+3.
// With GATE_UP the staged tile holds 2·TN weight rows laid out so a thread's 4 columns are
// (gate j, gate j+1, up j, up j+1), j = j0 + 2tx: it finishes silu(gate)·up itself.
// Weight format (as in matvec_int4.wgsl; the defaults BITS=4, ZERO=7, AFFINE=false, GROUP=32 are q4f16_1):
//   BITS 4 or 8: element k of a row is the code q at bits BITS·(k % (32/BITS)) of u32 word k·BITS/32,
//     w = (q − ZERO)·scale[k / GROUP] (+ min with AFFINE); GROUP a multiple of 32 (one scale per K step
//     at 32, shared by GROUP/32 steps above). BITS 16: f16 weights, two per word; binding 2 is not read.
// Constants: K (multiple of GROUP), N outputs, TM, TN (multiples of 4), GATE_UP (W has 2N rows, gate [0, N)
//   then up [N, 2N); Y[t, j] = silu(gate)·up), YS (floats per row of Y, ≥ N: a slice of the vocabulary writes
//   its columns of the full logits), BITS, ZERO, AFFINE, GROUP.
//   Workgroup memory: 128·(TM + TN·MATS) bytes.
// Bindings: 0 x f32[T, K] (read), 1 w u32[N or 2N, K·BITS/32] (read),
//   2 s f16[N or 2N, K/GROUP] (read; with AFFINE (scale, min) pairs f16[N or 2N, K/GROUP, 2]),
//   3 y f32[T, YS] (write), 4 step uniform (n_tokens).
// Grid: (x, ceil(T/TM), z) with (x, z) = fold_grid(ceil(N/TN)); rows t ≥ n_tokens are never written.
#import step
#import gemm_tile
#import group_scale

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const TK: u32 = 32u;                        // K per step: one chunk
const CHUNKS: u32 = K / TK;
const QUANT: bool = BITS <= 8u;             // integer codes with scales (else plain f16)
const WPC: u32 = BITS;                      // u32 words per row per chunk (32·BITS/32)
const EPW: u32 = 32u / BITS;                // elements per word
const MASK: u32 = (1u << BITS) - 1u;         // one code
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
        // W: WN rows × WPC words; each thread dequantizes the EPW elements of one word.
        for (var i = lid; i < WN * WPC; i += WG) {
            let c = i / WPC;
            let word_in_chunk = i % WPC;
            let row = weight_row(c, j0);
            let word = w[(row * CHUNKS + g) * WPC + word_in_chunk];
            var scale = 1.0;
            var mn = 0.0;
            if (QUANT) {
                let sm = group_scale(row, g);
                scale = sm.x;
                mn = sm.y;
            }
            for (var e = 0u; e < EPW; e++) {
                var v: f32;
                if (!QUANT) {
                    v = unpack2x16float(word)[e];
                } else if (AFFINE) {
                    v = (f32((word >> (BITS * e)) & MASK) - f32(ZERO)) * scale + mn;
                } else {
                    v = (f32((word >> (BITS * e)) & MASK) - f32(ZERO)) * scale;
                }
                w_tile[(word_in_chunk * EPW + e) * TX + c / 4u][c % 4u] = v;
            }
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
