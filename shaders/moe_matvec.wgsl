// Expert matvec for MoE: for token t and routing slot s, y[t, s, n] = Σ_k W_e[n, k]·x[k] with expert
// e = ids[t, s] read from the GPU (no host round trip), f32 accumulate. The slot and the token are in the
// dispatch grid, so one dispatch runs every selected expert of every token: the gate_up matvec (with
// GATE_UP, y = silu(gate)·up, as in matvec_int4.wgsl) or the down matvec (with X_SLOT: x is that slot's own
// gate_up output). A stack of one expert (EXPERTS = 1) ignores the ids: the shared expert run apart, or the
// router logits of a prefill as a plain per-token matvec. The inner loop is matvec_int4's: ROWS outputs per
// workgroup, 32-element chunks, every weight load of a chunk issued before the math. For T > 1 each
// (token, slot) re-reads its expert's weights: prefill costs T times the decode weight traffic (no batching
// across tokens that share an expert).
// Weight format (engine/matmul.py FORMATS): BITS 4 or 8 codes, element k at bits BITS·(k % (32/BITS)) of word
//   k·BITS/32, w = (q − ZERO)·scale (+ min with AFFINE, (scale, min) f16 pairs), one scale per GROUP along K;
//   BITS 16: f16 weights (binding 3 bound but unread). Experts are stacked: expert e's rows start at row
//   e·MATS·N of binding 2 (and group row e·MATS·N of binding 3).
// Constants: K, N (outputs per expert), EXPERTS (experts in this stack), WG (power of two), ROWS, GATE_UP,
//   BITS, ZERO, AFFINE, GROUP, SLOTS (slots per token in ids), SLOT0 (the slot of grid z = 0),
//   X_SLOT (x row = t·SLOTS + s instead of t), X_STRIDE (floats per x row, a multiple of 4),
//   Y_STRIDE (floats per y row; y row = t·SLOTS + s).
// Bindings: 0 x f32 (read), 1 ids u32[T, SLOTS] (read), 2 w u32[EXPERTS, MATS·N, K·BITS/32] (read),
//   3 s f16[EXPERTS, MATS·N, K/GROUP (, 2)] (read), 4 y f32 (write), 5 step uniform (n_tokens).
// Grid: (ceil(N / ROWS), T, slots in this dispatch).
#import step
#import reduce

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> s: array<f16>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<uniform> step: Step;

const QUANT: bool = BITS <= 8u;
const CHUNKS: u32 = K / 32u;
const WPC: u32 = BITS / 4u;                  // vec4<u32> words per chunk
const GROUPS: u32 = K / GROUP;
const CPG: u32 = GROUP / 32u;
const SPG: u32 = select(1u, 2u, AFFINE);
const MATS: u32 = select(1u, 2u, GATE_UP);
const SLOTS_WG: u32 = ROWS * MATS;           // weight rows per workgroup (named SLOTS in matvec_int4)
const SLOTS_WG4: u32 = (SLOTS_WG + 3u) / 4u * 4u;
const MAGIC: u32 = 0x4B000000u;
const MAGIC_PLUS_ZERO: f32 = 8388608.0 + f32(ZERO);

fn codes_minus_zero(q: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(q | vec4<u32>(MAGIC)) - MAGIC_PLUS_ZERO;
}

fn dot8(word: u32, lo: vec4<f32>, hi: vec4<f32>) -> f32 {
    let q_lo = (vec4<u32>(word) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    let q_hi = (vec4<u32>(word) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u);
    return dot(codes_minus_zero(q_lo), lo) + dot(codes_minus_zero(q_hi), hi);
}

fn dot4(word: u32, xv: vec4<f32>) -> f32 {
    return dot(codes_minus_zero((vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u)), xv);
}

fn vec_dot(v: vec4<u32>, j: u32, xs: ptr<function, array<vec4<f32>, 8>>) -> f32 {
    if (BITS == 4u) {
        return dot8(v.x, (*xs)[0], (*xs)[1]) + dot8(v.y, (*xs)[2], (*xs)[3])
             + dot8(v.z, (*xs)[4], (*xs)[5]) + dot8(v.w, (*xs)[6], (*xs)[7]);
    } else if (BITS == 8u) {
        let b = 4u * j;
        return dot4(v.x, (*xs)[b]) + dot4(v.y, (*xs)[b + 1u]) + dot4(v.z, (*xs)[b + 2u]) + dot4(v.w, (*xs)[b + 3u]);
    }
    let a = vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
    let c = vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w));
    return dot(a, (*xs)[2u * j]) + dot(c, (*xs)[2u * j + 1u]);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = wid.y;
    if (t >= step.n_tokens) { return; }  // the whole workgroup leaves, so reductions stay uniform
    let slot = SLOT0 + wid.z;
    let row_slot = t * SLOTS + slot;
    let expert = min(ids[row_slot], EXPERTS - 1u);  // clamped: a bad id reads a real expert, never out of bounds
    let first = wid.x * ROWS;
    let x_base = select(t, row_slot, X_SLOT) * (X_STRIDE / 4u);

    var w_base: array<u32, SLOTS_WG>;
    var s_base: array<u32, SLOTS_WG>;
    for (var i = 0u; i < SLOTS_WG; i++) {
        let row = expert * MATS * N + (i / ROWS) * N + min(first + i % ROWS, N - 1u);
        w_base[i] = row * CHUNKS * WPC;
        s_base[i] = row * GROUPS;
    }

    var acc: array<f32, SLOTS_WG4>;
    for (var c = lane.lid; c < CHUNKS; c += WG) {
        var words: array<vec4<u32>, SLOTS_WG * WPC>;
        var scales: array<f32, SLOTS_WG>;
        var mins: array<f32, SLOTS_WG>;
        for (var i = 0u; i < SLOTS_WG; i++) {
            for (var j = 0u; j < WPC; j++) {
                words[i * WPC + j] = w[w_base[i] + c * WPC + j];
            }
            if (QUANT) {
                let si = (s_base[i] + c / CPG) * SPG;
                scales[i] = f32(s[si]);
                if (AFFINE) { mins[i] = f32(s[si + 1u]); }
            }
        }
        var xs: array<vec4<f32>, 8>;
        for (var j = 0u; j < 8u; j++) { xs[j] = x[x_base + c * 8u + j]; }
        var xsum = 0.0;
        if (AFFINE) {  // Σ (s·q + m)·x = s·Σ q·x + m·Σ x
            let v = xs[0] + xs[1] + xs[2] + xs[3] + xs[4] + xs[5] + xs[6] + xs[7];
            xsum = v.x + v.y + v.z + v.w;
        }
        for (var i = 0u; i < SLOTS_WG; i++) {
            var d = 0.0;
            for (var j = 0u; j < WPC; j++) { d += vec_dot(words[i * WPC + j], j, &xs); }
            if (!QUANT) {
                acc[i] += d;
            } else if (AFFINE) {
                acc[i] += scales[i] * d + mins[i] * xsum;
            } else {
                acc[i] += scales[i] * d;
            }
        }
    }

    var total: array<f32, SLOTS_WG4>;
    for (var i = 0u; i < SLOTS_WG4; i += 4u) {
        let v = wg_sum4(vec4<f32>(acc[i], acc[i + 1u], acc[i + 2u], acc[i + 3u]), lane);
        total[i] = v.x;
        total[i + 1u] = v.y;
        total[i + 2u] = v.z;
        total[i + 3u] = v.w;
    }

    let n = first + lane.lid;
    if (lane.lid < ROWS && n < N) {
        let out = row_slot * Y_STRIDE + n;
        if (GATE_UP) {
            y[out] = silu(total[lane.lid]) * total[ROWS + lane.lid];
        } else {
            y[out] = total[lane.lid];
        }
    }
}
