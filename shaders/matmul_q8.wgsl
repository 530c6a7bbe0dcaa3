// Prefill GEMM on 4-bit weights with int8 activations: Y[t, n] = Σ_k X[t, k]·W[n, k] for t < T = step.n_tokens.
// X comes as quantize_q8 writes it (q8_pack.wgsl: per 32-element chunk int8 codes, scale = max|x|/127 and Σ codes),
// so a dot4I8Packed takes four products: 4× the f32 GEMM's MACs per instruction and a quarter of its
// workgroup-memory bytes per MAC (matmul_int4's inner loop is bound by those loads). The arithmetic per chunk is
// matvec_q8_body.wgsl's: Σ (q − ZERO)·x = xs·Σ (q − ZERO)·xq, or with AFFINE Σ (s·q + m)·x = xs·(s·Σ q·xq + m·Σ xq).
// A workgroup computes a TM×TN tile of Y; each step stages KC chunks (32·KC of K) of the TM int8 X rows and of the
// tile's weight rows in workgroup memory. The weight nibbles are unpacked to int8 once at staging, with the zero
// point subtracted there (so the inner loop is dot4I8Packed and nothing else), in the order dot32 pairs them with
// the activation bytes. Each thread keeps its 4×4 int sums per chunk, then folds them into f32 with the two scales.
// The next step's global loads are issued into registers before the current step's math (one stage of prefetch).
// Threads: WG = (TM/4)·(TN·MATS/4); thread (tx, ty) owns rows 4ty..4ty+3 and tile columns 4tx..4tx+3. With
// GATE_UP the staged tile holds 2·TN weight rows laid out so a thread's 4 columns are (gate j, gate j+1, up j,
// up j+1), j = j0 + 2tx (as matmul_int4): it finishes silu(gate)·up itself.
// Constants: K (a multiple of GROUP and of 32·KC), N outputs, TM, TN (multiples of 4), KC (chunks per step),
//   GATE_UP (W has 2N rows, gate [0, N) then up [N, 2N); Y[t, j] = silu(gate)·up), YS (floats per row of Y, ≥ N: a
//   slice of the vocabulary writes its columns of the full logits), ZERO, AFFINE, GROUP (matvec_q8's formats:
//   q4f16_1, q4_0, q4_1, mlx4). Workgroup memory: KC·(TM + WN)·48 bytes with AFFINE, ·40 without (WN = TN·MATS).
// Bindings: 0 xq u32[rows, K/4] read as vec4 (int8 codes, row t at t·K/4), 1 w u32[N or 2N, K/8] read as vec4 (one
//   per 32-element chunk), 2 s f16[N or 2N, K/GROUP] (with AFFINE (scale, min) pairs f16[N or 2N, K/GROUP, 2]),
//   3 y f32[T, YS] (write), 4 xm vec2<f32>[rows, K/32] (scale, Σ codes), 5 step uniform (n_tokens).
// Grid: (x, ceil(T/TM), z) with (x, z) = fold_grid(ceil(N/TN)); rows t ≥ n_tokens and columns ≥ N are never written.
#import step
#import gemm_tile

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(5) var<uniform> step: Step;

const CHUNKS: u32 = K / 32u;
const STEPS: u32 = CHUNKS / KC;
const GROUPS: u32 = K / GROUP;              // scale groups per row
const CPG: u32 = GROUP / 32u;               // chunks per scale group
const SPG: u32 = select(1u, 2u, AFFINE);    // f16 per group in s: scale, or (scale, min)
const MATS: u32 = select(1u, 2u, GATE_UP);
const WN: u32 = TN * MATS;                  // weight rows staged per tile
const TX: u32 = WN / 4u;
const TY: u32 = TM / 4u;
const WG: u32 = TX * TY;
const N_TILES: u32 = (N + TN - 1u) / TN;
const NIB: u32 = 0x0F0F0F0Fu;
const SIGN: u32 = 0x80808080u;
const ZERO4: u32 = ZERO * 0x01010101u;      // ZERO in each byte
// i32 sums start at the bits of 1.5·2^23, so bitcast<f32>(sum) − 1.5·2^23 is the sum exactly (|sum| < 2^22):
// an FADD instead of an int-to-float conversion, which runs at a fraction of the FMA rate on NVIDIA GPUs.
const MAGIC: i32 = 0x4B400000;
const MAGIC_F: f32 = 12582912.0;

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

// The 4 bytes of each u32 of `v` as signed int8 (v's bytes are 4-bit codes; without AFFINE minus ZERO): bytes
// 0x80 + q − ZERO stay in 1..0x8F (no borrow between bytes), and flipping bit 7 gives q − ZERO in two's complement.
fn codes(v: vec4<u32>) -> vec4<u32> {
    if (AFFINE) { return v; }
    return ((v | vec4<u32>(SIGN)) - vec4<u32>(ZERO4)) ^ vec4<u32>(SIGN);
}

// One row's 16 activation bytes against the same 16 bytes of 4 weight columns.
fn dot16(a: vec4<u32>, w: vec4<u32>) -> i32 {
    return dot4I8Packed(a.x, w.x) + dot4I8Packed(a.y, w.y) + dot4I8Packed(a.z, w.z) + dot4I8Packed(a.w, w.w);
}

fn dots(a: vec4<u32>, b0: vec4<u32>, b1: vec4<u32>, b2: vec4<u32>, b3: vec4<u32>) -> vec4<i32> {
    return vec4<i32>(dot16(a, b0), dot16(a, b1), dot16(a, b2), dot16(a, b3));
}


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

    // This thread's staged items: where they come from (fixed over the steps) and the registers that carry one
    // step's loads to the next step's stores.
    var px = array<vec4<u32>, X_PER>();
    var pxm = array<vec2<f32>, XM_PER>();
    var pw = array<vec4<u32>, W_PER>();
    var pws = array<vec2<f32>, W_PER>();
    var w_row = array<u32, W_PER>();
    for (var r = 0u; r < W_PER; r++) { w_row[r] = weight_row(min(lid + r * WG, W_ITEMS - 1u) / KC, j0); }

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
                    let row = min(t0 + i / (2u * KC), last_t);
                    px[r] = xq[row * (2u * CHUNKS) + g * (2u * KC) + i % (2u * KC)];
                }
            }
            for (var r = 0u; r < XM_PER; r++) {
                let i = lid + r * WG;
                if (i < XM_ITEMS) { pxm[r] = xm[min(t0 + i / KC, last_t) * CHUNKS + g * KC + i % KC]; }
            }
            for (var r = 0u; r < W_PER; r++) {
                let i = lid + r * WG;
                if (i < W_ITEMS) {
                    let chunk = g * KC + i % KC;
                    pw[r] = w[w_row[r] * CHUNKS + chunk];
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
                    let lo = codes(pw[r] & vec4<u32>(NIB));
                    let hi = codes((pw[r] >> vec4<u32>(4u)) & vec4<u32>(NIB));
                    // dot32's pairing: word j's even nibbles meet activation u32 2j, its odd nibbles u32 2j + 1.
                    w_tile[(c * 8u + col % 4u) * TX + col / 4u] = vec4<u32>(lo.x, hi.x, lo.y, hi.y);
                    w_tile[(c * 8u + 4u + col % 4u) * TX + col / 4u] = vec4<u32>(lo.z, hi.z, lo.w, hi.w);
                    w_scale[c * TX + col / 4u][col % 4u] = pws[r].x;
                    if (AFFINE) { w_min[c * TX + col / 4u][col % 4u] = pws[r].y; }
                }
            }
            workgroupBarrier();
        }
    }

    store_tile(array<vec4<f32>, 4>(acc0, acc1, acc2, acc3), t0, ty, j0, tx);
}
