// Grouped expert GEMM for MoE prefill with int8 activations: moe_gemm.wgsl's grouping (moe_sort's tiles; one
// dispatch for every expert of a stack; each output row computed alone and written only to its pair's row of y)
// with matmul_q8w.wgsl's arithmetic (4-bit or MLX 3-bit codes unpacked to int8 once at staging, dot4I8Packed against
// quantize_q8's activation bytes, one stage of prefetch). X rows: the token's row of the chunk's int8 rows (gate_up)
// or, with X_SLOT, the pair's own row of the quantized gate_up outputs (down).
// Streaming contract (issue 20): the expert comes only from the tile list, which moe_sort built from the router's
// ids buffer; weights are addressed as expert e of the stacked bindings 3 and 4 and through nothing else.
// Constants: K (a multiple of GROUP and of 32·KC), N (outputs per expert), EXPERTS, TM, TN (multiples of 4), KC,
//   GATE_UP, SLOTS, X_SLOT, Y_STRIDE (floats per y row; y row = pair), BITS (4, or 3: rows of 3K/32 words, one
//   LSB-first bitstream each), ZERO, AFFINE, GROUP, ROWS_F32 (y's rows as f32), ROWS_Q8 (GATE_UP, TN = 32: the
//   pairs' rows as int8 into yq / ym, gemm_rows_q8.wgsl: the down pass's input). Workgroup memory: KC·(TM + WN)·48
//   bytes with AFFINE, ·40 without, + 4·TM (WN = TN·MATS), and with ROWS_Q8 (TM/2)·132 more.
// Bindings: 0 xq u32[rows, K/4] read as vec4 (row r at r·K/4), 1 order u32[pairs], 2 tiles vec4<u32>[1 + tiles],
//   3 w u32[EXPERTS, MATS·N, K·BITS/32] as vec4, 4 s f16[EXPERTS,
//   MATS·N, K/GROUP (, 2)], 5 y f32[pairs, Y_STRIDE] (write), 6 xm vec2<f32>[rows, K/32] (scale, Σ codes),
//   7 yq u32[pairs, N/4] (write), 8 ym vec2<f32>[pairs, N/32] (write); 7 and 8 are bound whether or not ROWS_Q8.
// Grid: (x, max tiles, z) with (x, z) = fold_grid(ceil(N / TN)).
#import gemm_columns
#import int8_dot
#import int8_codes
#import gemm_rows_q8

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> order: array<u32>;
@group(0) @binding(2) var<storage, read> tiles: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> s: array<f16>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;
@group(0) @binding(6) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(7) var<storage, read_write> yq: array<u32>;
@group(0) @binding(8) var<storage, read_write> ym: array<vec2<f32>>;

const CHUNKS: u32 = K / 32u;
const STEPS: u32 = CHUNKS / KC;
const GROUPS: u32 = K / GROUP;              // scale groups per row
const CPG: u32 = GROUP / 32u;               // chunks per scale group
const SPG: u32 = select(1u, 2u, AFFINE);    // f16 per group in s: scale, or (scale, min)
const MATS: u32 = select(1u, 2u, GATE_UP);
const WN: u32 = TN * MATS;                  // weight rows staged per tile
const TX: u32 = WN / 4u;
const TY: u32 = TM / 4u;
const RPT: u32 = 4u;                        // tile rows a thread owns
const WG: u32 = TX * TY;
const N_TILES: u32 = (N + TN - 1u) / TN;
const THREE: bool = BITS == 3u;
const WPR: u32 = CHUNKS * BITS;             // u32 words per weight row
const EVEN3: u32 = 0x1C71C7u;               // 3-bit fields at bits 0, 6, 12, 18 of a 24-bit run of 8 codes

// Staged items per step and per thread: X vec4s (2 per row per chunk), X (scale, sum), W chunks (vec4 each).
const X_ITEMS: u32 = TM * KC * 2u;
const XM_ITEMS: u32 = TM * KC;
const W_ITEMS: u32 = WN * KC;
const X_PER: u32 = (X_ITEMS + WG - 1u) / WG;
const XM_PER: u32 = (XM_ITEMS + WG - 1u) / WG;
const W_PER: u32 = (W_ITEMS + WG - 1u) / WG;

var<workgroup> x_tile: array<vec4<u32>, X_ITEMS>;       // [chunk][half][row % 4][row / 4]
var<workgroup> w_tile: array<vec4<u32>, W_ITEMS * 2u>;  // [chunk][half][col % 4][col / 4], int8 (q − ZERO) or q
var<workgroup> x_scale: array<vec4<f32>, KC * TY>;      // [chunk][row / 4], component row % 4
var<workgroup> w_scale: array<vec4<f32>, KC * TX>;      // [chunk][col / 4], component col % 4
// AFFINE only (sized 1 otherwise): xs·Σ xq per row and the weights' minimum per column.
var<workgroup> x_sum: array<vec4<f32>, select(1u, KC * TY, AFFINE)>;
var<workgroup> w_min: array<vec4<f32>, select(1u, KC * TX, AFFINE)>;
var<workgroup> pair_of: array<u32, TM>;                  // the tile's pairs (the last one repeated past its end)

// Chunk `chunk` of weight row `row`: a 4-bit row's 4 words, or a 3-bit row's 3 words in .xyz.
fn chunk_words(row: u32, chunk: u32) -> vec4<u32> {
    if (THREE) {  // rows of 3K/32 words need not start on a vec4
        let b = row * WPR + chunk * 3u;
        return vec4<u32>(w[b / 4u][b % 4u], w[(b + 1u) / 4u][(b + 1u) % 4u], w[(b + 2u) / 4u][(b + 2u) % 4u], 0u);
    }
    return w[row * CHUNKS + chunk];
}

// Fields at bits 0, 6, 12, 18 (3 bits each) moved to bytes 0..3.
fn spread3(v: u32) -> u32 {
    return (v & 7u) | ((v & 0x1C0u) << 2u) | ((v & 0x7000u) << 4u) | ((v & 0x1C0000u) << 6u);
}

// A chunk's codes as int8 bytes in dot32's pairing: for each 8-code run j, u32 2j = its even codes, 2j + 1 = its
// odd ones (4-bit: run j is word j; 3-bit: the 24 bits at 24j of the 96-bit chunk). Returns runs 0–1 and 2–3.
fn chunk_bytes(v: vec4<u32>) -> array<vec4<u32>, 2> {
    if (THREE) {
        let r = vec4<u32>(v.x, (v.x >> 24u) | (v.y << 8u), (v.y >> 16u) | (v.z << 16u), v.z >> 8u);
        let e = vec4<u32>(spread3(r.x & EVEN3), spread3(r.y & EVEN3), spread3(r.z & EVEN3), spread3(r.w & EVEN3));
        let o = vec4<u32>(spread3((r.x >> 3u) & EVEN3), spread3((r.y >> 3u) & EVEN3), spread3((r.z >> 3u) & EVEN3),
                          spread3((r.w >> 3u) & EVEN3));
        let lo = codes(e);
        let hi = codes(o);
        return array<vec4<u32>, 2>(vec4<u32>(lo.x, hi.x, lo.y, hi.y), vec4<u32>(lo.z, hi.z, lo.w, hi.w));
    }
    let lo = codes(v & vec4<u32>(NIB));
    let hi = codes((v >> vec4<u32>(4u)) & vec4<u32>(NIB));
    return array<vec4<u32>, 2>(vec4<u32>(lo.x, hi.x, lo.y, hi.y), vec4<u32>(lo.z, hi.z, lo.w, hi.w));
}


fn q8_row(i: u32) -> u32 { return order[i]; }  // gemm_rows_q8.wgsl: tile row i is the pair order[] names

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
    for (var m = lid; m < TM; m += WG) {
        let p = order[tile.y + min(m, rows - 1u)];
        pair_of[m] = select(p / SLOTS, p, X_SLOT);  // the x row; the y row is order[] again at the store
    }
    workgroupBarrier();

    // This thread's staged items: where they come from (fixed over the steps) and the registers that carry one
    // step's loads to the next step's stores.
    var px = array<vec4<u32>, X_PER>();
    var pxm = array<vec2<f32>, XM_PER>();
    var pw = array<vec4<u32>, W_PER>();
    var pws = array<vec2<f32>, W_PER>();
    var w_row = array<u32, W_PER>();
    for (var r = 0u; r < W_PER; r++) {
        w_row[r] = expert * MATS * N + weight_row(min(lid + r * WG, W_ITEMS - 1u) / KC, j0);
    }

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    // Per step: issue step g's global loads, compute step g − 1 from workgroup memory while they are in flight,
    // then store step g.
    for (var g = 0u; g <= STEPS; g++) {
        if (g < STEPS) {
            // X rows past n_tokens are clamped (their results are never written).
            for (var r = 0u; r < X_PER; r++) {
                let i = lid + r * WG;
                if (i < X_ITEMS) {
                    let row = pair_of[i / (2u * KC)];
                    px[r] = xq[row * (2u * CHUNKS) + g * (2u * KC) + i % (2u * KC)];
                }
            }
            for (var r = 0u; r < XM_PER; r++) {
                let i = lid + r * WG;
                if (i < XM_ITEMS) { pxm[r] = xm[pair_of[i / KC] * CHUNKS + g * KC + i % KC]; }
            }
            for (var r = 0u; r < W_PER; r++) {
                let i = lid + r * WG;
                if (i < W_ITEMS) {
                    let chunk = g * KC + i % KC;
                    pw[r] = chunk_words(w_row[r], chunk);
                    let si = (w_row[r] * GROUPS + chunk / CPG) * SPG;
                    pws[r].x = f32(s[si]);
                    if (AFFINE) { pws[r].y = f32(s[si + 1u]); }
                }
            }
        }
        if (g > 0u) {
            for (var c = 0u; c < KC; c++) {
                var d0 = vec4<i32>(MAGIC);
                var d1 = vec4<i32>(MAGIC);
                var d2 = vec4<i32>(MAGIC);
                var d3 = vec4<i32>(MAGIC);
                for (var h = 0u; h < 2u; h++) {
                    let p = (c * 2u + h) * 4u;
                    let b0 = w_tile[p * TX + tx];
                    let b1 = w_tile[(p + 1u) * TX + tx];
                    let b2 = w_tile[(p + 2u) * TX + tx];
                    let b3 = w_tile[(p + 3u) * TX + tx];
                    d0 += dots(x_tile[p * TY + ty], b0, b1, b2, b3);
                    d1 += dots(x_tile[(p + 1u) * TY + ty], b0, b1, b2, b3);
                    d2 += dots(x_tile[(p + 2u) * TY + ty], b0, b1, b2, b3);
                    d3 += dots(x_tile[(p + 3u) * TY + ty], b0, b1, b2, b3);
                }
                let ws = w_scale[c * TX + tx];
                let xs = x_scale[c * TY + ty];
                acc0 = fma(bitcast<vec4<f32>>(d0) - MAGIC_F, xs.x * ws, acc0);
                acc1 = fma(bitcast<vec4<f32>>(d1) - MAGIC_F, xs.y * ws, acc1);
                acc2 = fma(bitcast<vec4<f32>>(d2) - MAGIC_F, xs.z * ws, acc2);
                acc3 = fma(bitcast<vec4<f32>>(d3) - MAGIC_F, xs.w * ws, acc3);
                if (AFFINE) {
                    let mn = w_min[c * TX + tx];
                    let xt = x_sum[c * TY + ty];
                    acc0 = fma(vec4<f32>(xt.x), mn, acc0);
                    acc1 = fma(vec4<f32>(xt.y), mn, acc1);
                    acc2 = fma(vec4<f32>(xt.z), mn, acc2);
                    acc3 = fma(vec4<f32>(xt.w), mn, acc3);
                }
            }
            workgroupBarrier();
        }
        if (g < STEPS) {
            for (var r = 0u; r < X_PER; r++) {
                let i = lid + r * WG;
                if (i < X_ITEMS) {
                    let m = i / (2u * KC);
                    x_tile[(i % (2u * KC) * 4u + m % 4u) * TY + m / 4u] = px[r];
                }
            }
            for (var r = 0u; r < XM_PER; r++) {
                let i = lid + r * WG;
                if (i < XM_ITEMS) {
                    let m = i / KC;
                    let slot = i % KC * TY + m / 4u;
                    x_scale[slot][m % 4u] = pxm[r].x;
                    if (AFFINE) { x_sum[slot][m % 4u] = pxm[r].x * pxm[r].y; }
                }
            }
            for (var r = 0u; r < W_PER; r++) {
                let i = lid + r * WG;
                if (i < W_ITEMS) {
                    let col = i / KC;
                    let c = i % KC;
                    let bytes = chunk_bytes(pw[r]);
                    w_tile[(c * 8u + col % 4u) * TX + col / 4u] = bytes[0];
                    w_tile[(c * 8u + 4u + col % 4u) * TX + col / 4u] = bytes[1];
                    w_scale[c * TX + col / 4u][col % 4u] = pws[r].x;
                    if (AFFINE) { w_min[c * TX + col / 4u][col % 4u] = pws[r].y; }
                }
            }
            workgroupBarrier();
        }
    }

    if (ROWS_Q8) {  // a constant: the barriers stay in uniform control flow
        q8_stage_row(acc0, 0u, tx, ty);
        q8_stage_row(acc1, 1u, tx, ty);
        q8_store_staged(tile.y, rows, j0, 0u, lid);
        q8_stage_row(acc2, 0u, tx, ty);
        q8_stage_row(acc3, 1u, tx, ty);
        q8_store_staged(tile.y, rows, j0, 1u, lid);
    }
    if (!ROWS_F32) { return; }
    let accs = array<vec4<f32>, 4>(acc0, acc1, acc2, acc3);
    for (var r = 0u; r < 4u; r++) {
        let m = 4u * ty + r;
        if (m >= rows) { break; }
        let base = order[tile.y + m] * Y_STRIDE;
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
