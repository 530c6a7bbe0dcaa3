// The body of the decode matvecs (matvec_int4, moe_matvec): weight formats, dequantisation, the chunk loop over
// K, the workgroup reduction and the output write, apart from the indexing each kernel does its own way. Layouts
// and constants are documented in matvec_int4.wgsl; the including kernel declares the bindings w, s, y, imports
// `reduce` and defines `fn x_vec(i: u32) -> vec4<f32>`, the activation row's vec4 i (a binding x read as it is, or
// a row computed on the fly: moe_router_norm.wgsl's normed residual).

const QUANT: bool = BITS <= 8u;              // integer codes with scales (else plain f16)
const CHUNKS: u32 = K / 32u;                 // 32-element chunks per row
const WPC: u32 = max(BITS / 4u, 1u);        // vec4<u32> per chunk: 1 (3- or 4-bit), 2 (8-bit), 4 (f16)
const THREE: bool = BITS == 3u;              // MLX 3-bit: a chunk is 3 u32 of one LSB-first bitstream per row
const GROUPS: u32 = K / GROUP;               // scale groups per row
const CPG: u32 = GROUP / 32u;                // chunks per scale group
const SPG: u32 = select(1u, 2u, AFFINE);     // f16 per group in s: scale, or (scale, min)
const MATS: u32 = select(1u, 2u, GATE_UP);   // weight rows per output
const WROWS: u32 = ROWS * MATS;              // weight rows per workgroup: gate rows first, then up rows
const WROWS4: u32 = (WROWS + 3u) / 4u * 4u;  // padded to whole wg_sum4 calls
const N_GROUPS: u32 = (N + ROWS - 1u) / ROWS;
const MAGIC: u32 = 0x4B000000u;              // bits of 2^23: a code OR-ed in is 2^23 + q exactly
const MAGIC_PLUS_ZERO: f32 = 8388608.0 + f32(ZERO);

// The code q goes into the mantissa of 2^23 instead of through an int→float conversion, and
// subtracting 2^23 + ZERO leaves q − ZERO; both steps are exact.
fn codes_minus_zero(q: vec4<u32>) -> vec4<f32> {
    return bitcast<vec4<f32>>(q | vec4<u32>(MAGIC)) - MAGIC_PLUS_ZERO;
}

// Code e (0..31) of a 3-bit chunk held in v.xyz: bits [3e, 3e + 3) of the 96-bit stream, which may straddle two
// words (v.w is 0, so the straddle read past the last word is harmless).
fn code3(v: vec4<u32>, e: u32) -> u32 {
    let bit = 3u * e;
    let word = bit / 32u;
    let sh = bit % 32u;
    var q = v[word] >> sh;
    if (sh > 29u) { q |= v[word + 1u] << (32u - sh); }
    return q & 7u;
}

// Σ (q_e − ZERO)·x_e over the 32 codes of a 3-bit chunk.
fn dot32_3(v: vec4<u32>, xs: ptr<function, array<vec4<f32>, 8>>) -> f32 {
    var d = 0.0;
    for (var j = 0u; j < 8u; j++) {
        let q = vec4<u32>(code3(v, 4u * j), code3(v, 4u * j + 1u), code3(v, 4u * j + 2u), code3(v, 4u * j + 3u));
        d += dot(codes_minus_zero(q), (*xs)[j]);
    }
    return d;
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
    if (THREE) {  // 32 three-bit codes in v.xyz
        return dot32_3(v, xs);
    }
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

// Partial sums of this thread for the WROWS weight rows of outputs first.. (row0: the first weight row of the
// matrix in w, e.g. an expert's in a stack), over chunks c0, c0 + stride, ...; x_base: the activation row's vec4.
fn row_sums(first: u32, row0: u32, x_base: u32, c0: u32, stride: u32) -> array<f32, WROWS4> {
    // Rows past N are clamped to N-1: they load real data and join the reduction, but are not written.
    var w_base: array<u32, WROWS>;  // first vec4 of the row in w (first u32 with THREE)
    var s_base: array<u32, WROWS>;  // first group of the row in s
    for (var i = 0u; i < WROWS; i++) {
        let row = row0 + (i / ROWS) * N + min(first + i % ROWS, N - 1u);
        w_base[i] = row * CHUNKS * select(WPC, 3u, THREE);
        s_base[i] = row * GROUPS;
    }

    var acc: array<f32, WROWS4>;
    for (var c = c0; c < CHUNKS; c += stride) {
        var words: array<vec4<u32>, WROWS * WPC>;
        var scales: array<f32, WROWS>;
        var mins: array<f32, WROWS>;
        for (var i = 0u; i < WROWS; i++) {
            if (THREE) {  // rows of 3K/32 words need not start on a vec4: read the chunk's 3 words one by one
                let b = w_base[i] + 3u * c;
                words[i] = vec4<u32>(w[b / 4u][b % 4u], w[(b + 1u) / 4u][(b + 1u) % 4u],
                                     w[(b + 2u) / 4u][(b + 2u) % 4u], 0u);
            } else {
                for (var j = 0u; j < WPC; j++) {
                    words[i * WPC + j] = w[w_base[i] + c * WPC + j];
                }
            }
            if (QUANT) {
                let si = (s_base[i] + c / CPG) * SPG;
                scales[i] = f32(s[si]);
                if (AFFINE) { mins[i] = f32(s[si + 1u]); }
            }
        }
        var xs: array<vec4<f32>, 8>;
        for (var j = 0u; j < 8u; j++) { xs[j] = x_vec(x_base + c * 8u + j); }
        // With AFFINE, Σ (s·q + m)·x = s·Σ q·x + m·Σ x: the minimum costs one multiply per chunk.
        var xsum = 0.0;
        if (AFFINE) {
            let t = xs[0] + xs[1] + xs[2] + xs[3] + xs[4] + xs[5] + xs[6] + xs[7];
            xsum = t.x + t.y + t.z + t.w;
        }
        for (var i = 0u; i < WROWS; i++) {
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

    return acc;
}

// The workgroup's sums of its threads' partial sums, four rows per wg_sum4 (call from uniform control flow).
fn row_totals(acc: array<f32, WROWS4>, lane: Lane) -> array<f32, WROWS4> {
    var total: array<f32, WROWS4>;
    for (var i = 0u; i < WROWS4; i += 4u) {
        let t = wg_sum4(vec4<f32>(acc[i], acc[i + 1u], acc[i + 2u], acc[i + 3u]), lane);
        total[i] = t.x;
        total[i + 1u] = t.y;
        total[i + 2u] = t.z;
        total[i + 3u] = t.w;
    }
    return total;
}

// Writes output first + i to y[y_base + first + i], given the full sums of all WROWS weight rows.
fn write_row(first: u32, y_base: u32, i: u32, total: array<f32, WROWS4>) {
    let row = first + i;
    if (i < ROWS && row < N) {
        if (GATE_UP) {
            y[y_base + row] = silu(total[i]) * total[ROWS + i];
        } else {
            y[y_base + row] = total[i];
        }
    }
}
