// Grouped expert GEMM for MoE prefill: the routing pairs of a chunk, grouped by expert (moe_sort.wgsl), each
// expert's pairs run as rows of one GEMM against that expert's weights, so a chunk reads each selected expert's
// weights once per tile instead of once per (token, slot). One dispatch covers every expert of the stack: the grid's
// y walks moe_sort's tile list (workgroups past its count leave at once). For tile (e, first, end) and output
// column tile j0: Y[p, n] = Σ_k X[row(p), k]·W_e[n, k] for the pairs p = order[first .. end), f32 accumulate; with
// GATE_UP y = silu(gate)·up (W_e has 2N rows, gate then up, as matmul_int4.wgsl). row(p) = p with X_SLOT (down: the
// pair's own gate_up output), else the token p / SLOTS. Each output row is computed alone (the same K loop whatever
// the tile holds) and written only to its pair's row of y, so results do not depend on the sort's order.
// Streaming contract (issue 20): the expert comes only from the tile list, which moe_sort built from the router's
// ids buffer; weights are addressed as expert e of the stacked binding 3 (and 4) and through nothing else.
// Staging (as matmul_int4.wgsl): per 32-wide K step the TM X rows and WN = TN·MATS dequantized weight rows go to
// workgroup memory as f32, k-major; thread (tx, ty) owns rows 4ty..4ty+3 and tile columns 4tx..4tx+3.
// Weight format (engine/kernels/matmul.py FORMATS): BITS 4 or 8 codes, element k at bits BITS·(k % (32/BITS)) of
//   word k·BITS/32 of its row; BITS 3 (MLX 3-bit): a row is one LSB-first bitstream of 3K/32 words, element k at
//   bits [3k, 3k + 3); w = (q − ZERO)·scale (+ min with AFFINE, (scale, min) f16 pairs), one scale per GROUP;
//   BITS 16: f16 weights (binding 4 bound but unread). Expert e's rows start at row e·MATS·N.
// Constants: K, N (outputs per expert), EXPERTS, TM, TN (multiples of 4), GATE_UP, SLOTS, X_SLOT, X_STRIDE
//   (floats per x row, a multiple of 4), Y_STRIDE (floats per y row; y row = pair), BITS, ZERO, AFFINE, GROUP.
//   Workgroup memory: 128·(TM + WN) bytes.
// Bindings: 0 x f32 (read), 1 order u32[pairs] (read), 2 tiles vec4<u32>[1 + tiles] (read), 3 w u32[EXPERTS, MATS·N,
//   K·BITS/32] (read), 4 s f16[EXPERTS, MATS·N, K/GROUP (, 2)] (read), 5 y f32[pairs, Y_STRIDE] (write).
// Grid: (x, max tiles, z) with (x, z) = fold_grid(ceil(N / TN)).
#import gemm_columns

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> order: array<u32>;
@group(0) @binding(2) var<storage, read> tiles: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> w: array<u32>;
@group(0) @binding(4) var<storage, read> s: array<f16>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

const TK: u32 = 32u;                        // K per step: one chunk
const CHUNKS: u32 = K / TK;
const QUANT: bool = BITS <= 8u;             // integer codes with scales (else plain f16)
const THREE: bool = BITS == 3u;
const WPC: u32 = BITS;                      // u32 words per row per chunk (32·BITS/32)
const SUBS: u32 = select(BITS, 4u, THREE);  // staging items per row per chunk: a word, or 8 three-bit codes
const EPI: u32 = 32u / SUBS;                // elements per staging item
const MASK: u32 = (1u << min(BITS, 31u)) - 1u;
const GROUPS: u32 = K / GROUP;
const CPG: u32 = GROUP / TK;
const SPG: u32 = select(1u, 2u, AFFINE);
const MATS: u32 = select(1u, 2u, GATE_UP);
const WN: u32 = TN * MATS;
const TX: u32 = WN / 4u;
const TY: u32 = TM / 4u;
const WG: u32 = TX * TY;
const N_TILES: u32 = (N + TN - 1u) / TN;

var<workgroup> x_tile: array<vec4<f32>, TK * TY>;  // [k][row / 4]
var<workgroup> w_tile: array<vec4<f32>, TK * TX>;  // [k][tile column / 4]
var<workgroup> pair_of: array<u32, TM>;            // the tile's pairs (the last one repeated past its end)

// The codes of staging item `sub` of chunk g of a row starting at word `base`, element e at bits BITS·e (3-bit:
// 8 codes taken from the bitstream, which may straddle two words).
fn item_bits(base: u32, g: u32, sub: u32) -> u32 {
    if (THREE) {
        let bit = 24u * sub;
        let b = base + 3u * g + bit / 32u;
        let sh = bit % 32u;
        var v = w[b] >> sh;
        if (sh > 8u) { v |= w[b + 1u] << (32u - sh); }  // sh is 16 or 24 here: the next word is in the chunk
        return v;
    }
    return w[base + g * WPC + sub];
}

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let col_tile = wid.z * nwg.x + wid.x;
    if (col_tile >= N_TILES || wid.y >= tiles[0].x) { return; }  // whole workgroup: barriers stay uniform
    let tile = tiles[1u + wid.y];
    let expert = min(tile.x, EXPERTS - 1u);
    let rows = tile.z - tile.y;  // 1..TM
    let j0 = col_tile * TN;
    let tx = lid % TX;
    let ty = lid / TX;
    for (var m = lid; m < TM; m += WG) { pair_of[m] = order[tile.y + min(m, rows - 1u)]; }
    workgroupBarrier();

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var g = 0u; g < CHUNKS; g++) {
        for (var i = lid; i < TM * 8u; i += WG) {
            let m = i / 8u;
            let kv = i % 8u;
            let p = pair_of[m];
            let xrow = select(p / SLOTS, p, X_SLOT);
            let v = x[xrow * (X_STRIDE / 4u) + g * 8u + kv];
            for (var e = 0u; e < 4u; e++) { x_tile[(kv * 4u + e) * TY + m / 4u][m % 4u] = v[e]; }
        }
        for (var i = lid; i < WN * SUBS; i += WG) {
            let c = i / SUBS;
            let sub = i % SUBS;
            let row = expert * MATS * N + weight_row(c, j0);
            let bits = item_bits(row * CHUNKS * WPC, g, sub);
            var scale = 1.0;
            var mn = 0.0;
            if (QUANT) {
                let si = (row * GROUPS + g / CPG) * SPG;
                scale = f32(s[si]);
                if (AFFINE) { mn = f32(s[si + 1u]); }
            }
            for (var e = 0u; e < EPI; e++) {
                var v: f32;
                if (!QUANT) {
                    v = unpack2x16float(bits)[e];
                } else {
                    v = (f32((bits >> (BITS * e)) & MASK) - f32(ZERO)) * scale + mn;
                }
                w_tile[(sub * EPI + e) * TX + c / 4u][c % 4u] = v;
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

    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var r = 0u; r < 4u; r++) {
        let m = 4u * ty + r;
        if (m >= rows) { break; }
        let base = pair_of[m] * Y_STRIDE;
        let v = accs[r];
        if (GATE_UP) {
            let j = j0 + 2u * tx;
            if (j < N) { y[base + j] = silu(v.x) * v.z; }
            if (j + 1u < N) { y[base + j + 1u] = silu(v.y) * v.w; }
        } else {
            for (var c = 0u; c < 4u; c++) {
                let j = j0 + 4u * tx + c;
                if (j < N) { y[base + j] = v[c]; }
            }
        }
    }
}
