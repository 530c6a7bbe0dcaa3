// Decode matvec on packed weights: y[n] = Σ_k W[n, k]·x[k] for one activation row, f32 accumulate.
// A workgroup owns ROWS outputs. Each thread walks K one 32-element chunk at a time: per chunk it loads
// the chunk's weight words (one vec4<u32> at 4 bits) and scale for every weight row of the workgroup
// before doing any math, so ROWS (2·ROWS with GATE_UP) independent loads are in flight, and reuses the
// 8 vec4 of x across them. Partial sums meet through wg_sum4, four rows per call.
// Weight format (engine/matmul.py FORMATS; the defaults BITS=4, ZERO=7, AFFINE=false, GROUP=32 are MLC q4f16_1):
//   BITS 4 or 8: element k of a row is the code q at bits BITS·(k % (32/BITS)) of u32 word k·BITS/32;
//     w = (q − ZERO)·scale[k / GROUP], or (q − ZERO)·scale + min with AFFINE. GROUP is a multiple of 32:
//     a chunk never straddles two groups, a larger group simply shares its scale across GROUP/32 chunks.
//   BITS 16: w is f16, two per word (element 2j in the low half); binding 2 must be bound but is not read.
// Constants: K (multiple of GROUP), N outputs, WG threads (a power of two for the workgroup-memory
//   reduction), ROWS outputs per workgroup, LAST_ROW (read x row n_tokens-1 instead of row 0: the LM
//   head after a prefill), GATE_UP (W has 2N rows, gate [0, N) then up [N, 2N); y[j] = silu(gate_j)·up_j),
//   BITS, ZERO, AFFINE, GROUP.
// Bindings: 0 x f32[T, K] (read), 1 w u32[N or 2N, K·BITS/32] (read),
//   2 s f16[N or 2N, K/GROUP] (read; with AFFINE (scale, min) pairs f16[N or 2N, K/GROUP, 2]),
//   3 y f32[N] (write), 4 step uniform (n_tokens).
// Grid: fold_grid(ceil(N / ROWS)); the workgroup id is rebuilt from (x, y).
#import step
#import reduce

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const QUANT: bool = BITS <= 8u;              // integer codes with scales (else plain f16)
const CHUNKS: u32 = K / 32u;                 // 32-element chunks per row
const WPC: u32 = BITS / 4u;                  // vec4<u32> words per chunk: 1 (4-bit), 2 (8-bit), 4 (f16)
const GROUPS: u32 = K / GROUP;               // scale groups per row
const CPG: u32 = GROUP / 32u;                // chunks per scale group
const SPG: u32 = select(1u, 2u, AFFINE);     // f16 per group in s: scale, or (scale, min)
const MATS: u32 = select(1u, 2u, GATE_UP);   // weight rows per output
const SLOTS: u32 = ROWS * MATS;              // weight rows per workgroup: gate rows first, then up rows
const SLOTS4: u32 = (SLOTS + 3u) / 4u * 4u;  // padded to whole wg_sum4 calls
const N_GROUPS: u32 = (N + ROWS - 1u) / ROWS;
const MAGIC: u32 = 0x4B000000u;              // bits of 2^23: a code OR-ed in is 2^23 + q exactly
const MAGIC_PLUS_ZERO: f32 = 8388608.0 + f32(ZERO);

// The code q goes into the mantissa of 2^23 instead of through an int→float conversion, and
// subtracting 2^23 + ZERO leaves q − ZERO; both steps are exact.
fn codes_minus_zero(q: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(q | vec4<u32>(MAGIC)) - MAGIC_PLUS_ZERO;
}

// Σ (q_i − ZERO)·x_i over the 8 nibbles of one word (element i at bits 4i).
fn dot8(word: u32, lo: vec4<f32>, hi: vec4<f32>) -> f32 {
    let q_lo = (vec4<u32>(word) >> vec4<u32>(0u, 4u, 8u, 12u)) & vec4<u32>(15u);
    let q_hi = (vec4<u32>(word) >> vec4<u32>(16u, 20u, 24u, 28u)) & vec4<u32>(15u);
    return dot(codes_minus_zero(q_lo), lo) + dot(codes_minus_zero(q_hi), hi);
}

// Σ (q_i − ZERO)·x_i over the 4 bytes of one word (element i at bits 8i).
fn dot4(word: u32, xv: vec4<f32>) -> f32 {
    return dot(codes_minus_zero((vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u)), xv);
}

// Σ (q_e − ZERO)·x_e (or Σ w_e·x_e for f16) over the elements of word vector j of a chunk.
fn vec_dot(v: vec4<u32>, j: u32, xs: ptr<function, array<vec4<f32>, 8>>) -> f32 {
    if (BITS == 4u) {  // 32 nibbles: x vec4s 0..7
        return dot8(v.x, (*xs)[0], (*xs)[1]) + dot8(v.y, (*xs)[2], (*xs)[3])
             + dot8(v.z, (*xs)[4], (*xs)[5]) + dot8(v.w, (*xs)[6], (*xs)[7]);
    } else if (BITS == 8u) {  // 16 bytes: x vec4s 4j..4j+3
        let b = 4u * j;
        return dot4(v.x, (*xs)[b]) + dot4(v.y, (*xs)[b + 1u]) + dot4(v.z, (*xs)[b + 2u]) + dot4(v.w, (*xs)[b + 3u]);
    }
    // f16: 8 halves, x vec4s 2j and 2j+1.
    let a = vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y));
    let c = vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w));
    return dot(a, (*xs)[2u * j]) + dot(c, (*xs)[2u * j + 1u]);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    if (group_id >= N_GROUPS) { return; }  // the whole workgroup leaves, so reductions stay uniform
    let first = group_id * ROWS;
    let x_row = select(0u, max(step.n_tokens, 1u) - 1u, LAST_ROW);
    let x_base = x_row * (K / 4u);

    // Rows past N are clamped to N-1: they load real data and join the reduction, but are not written.
    var w_base: array<u32, SLOTS>;  // first vec4 of the row in w
    var s_base: array<u32, SLOTS>;  // first group of the row in s
    for (var i = 0u; i < SLOTS; i++) {
        let row = (i / ROWS) * N + min(first + i % ROWS, N - 1u);
        w_base[i] = row * CHUNKS * WPC;
        s_base[i] = row * GROUPS;
    }

    var acc: array<f32, SLOTS4>;
    for (var c = lane.lid; c < CHUNKS; c += WG) {
        var words: array<vec4<u32>, SLOTS * WPC>;
        var scales: array<f32, SLOTS>;
        var mins: array<f32, SLOTS>;
        for (var i = 0u; i < SLOTS; i++) {
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
        // With AFFINE, Σ (s·q + m)·x = s·Σ q·x + m·Σ x: the minimum costs one multiply per chunk.
        var xsum = 0.0;
        if (AFFINE) {
            let t = xs[0] + xs[1] + xs[2] + xs[3] + xs[4] + xs[5] + xs[6] + xs[7];
            xsum = t.x + t.y + t.z + t.w;
        }
        for (var i = 0u; i < SLOTS; i++) {
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

    var total: array<f32, SLOTS4>;
    for (var i = 0u; i < SLOTS4; i += 4u) {
        let t = wg_sum4(vec4<f32>(acc[i], acc[i + 1u], acc[i + 2u], acc[i + 3u]), lane);
        total[i] = t.x;
        total[i + 1u] = t.y;
        total[i + 2u] = t.z;
        total[i + 3u] = t.w;
    }

    let row = first + lane.lid;
    if (lane.lid < ROWS && row < N) {
        if (GATE_UP) {
            y[row] = silu(total[lane.lid]) * total[ROWS + lane.lid];
        } else {
            y[row] = total[lane.lid];
        }
    }
}
