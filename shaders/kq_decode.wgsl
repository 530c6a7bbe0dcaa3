// ggml's K-quant (Q2_K..Q6_K) and Q5_0 / Q5_1 blocks read as stored (engine/formats/kquant.py gives the arrays), in
// one form for every type: a row is walked in 32-element chunks, and chunk element e has an unsigned code u_e < 64
// and w_e = a_h·u_e + b_h, h = e / 16 (types with one scale per 32 elements have a_0 = a_1, b_0 = b_1). The zero
// points (Q6_K's 32, Q3_K's 4, Q5_0's 16) and the minimums (Q2_K, Q4_K, Q5_K, Q5_1) are all b: the kernels add
// b_h·Σ x over the half instead of touching every code.
// The including kernel declares w: array<u32> (q_blocks: BW words per block) and wh: array<f16> (BH halves per block:
// q_d for the split types, q_blocks itself for the whole-block ones). Constants: KTYPE (ggml's type id), QK
// (elements per block), BW, BH, HALVES (16-element scales).

const CPB: u32 = QK / 32u;                  // chunks per block
const NIB: u32 = 0x0F0F0F0Fu;
const TWO: u32 = 0x03030303u;
const BIT: u32 = 0x01010101u;

// Bits 0..3 of t, one per byte (the four products t·2^0, t·2^7, t·2^14, t·2^21 do not overlap, so no carries).
fn spread4(t: u32) -> u32 { return (t * 0x00204081u) & BIT; }

// Codes of elements 4i .. 4i + 3 of chunk c (0 .. CPB − 1) of block blk, one per byte.
fn kq_word(blk: u32, c: u32, i: u32) -> u32 {
    let base = blk * BW;
    if (KTYPE == 12u) {  // Q4_K: d, dmin, scales[12], qs[128]; qs byte 32·(c/2) + l holds chunk c's element l in nibble c%2
        return (w[base + 4u + 8u * (c / 2u) + i] >> (4u * (c % 2u))) & NIB;
    } else if (KTYPE == 13u) {  // Q5_K: ... qh[32], qs[128]; bit c of qh byte l is chunk c's fifth bit
        let lo = (w[base + 12u + 8u * (c / 2u) + i] >> (4u * (c % 2u))) & NIB;
        return lo | (((w[base + 4u + i] >> c) & BIT) << 4u);
    } else if (KTYPE == 14u) {  // Q6_K: ql[128], qh[64], scales[16]; chunk c = 4h + 2n + s2 of half h of the block
        let lo = (w[base + 16u * (c / 4u) + 8u * (c % 2u) + i] >> (4u * (c / 2u % 2u))) & NIB;
        return lo | (((w[base + 32u + 8u * (c / 4u) + i] >> (2u * (c % 4u))) & TWO) << 4u);
    } else if (KTYPE == 11u) {  // Q3_K: hmask[32], qs[64], scales[12]; u = low 2 bits | hmask bit << 2, q = u − 4
        let lo = (w[base + 8u + 8u * (c / 4u) + i] >> (2u * (c % 4u))) & TWO;
        return lo | (((w[base + i] >> c) & BIT) << 2u);
    } else if (KTYPE == 10u) {  // Q2_K: scales[16], qs[64], d, dmin; 2-bit codes, 4 chunks per 32 bytes
        return (w[base + 4u + 8u * (c / 4u) + i] >> (2u * (c % 4u))) & TWO;
    }
    // Q5_0 (qh, qs[16] after the split d) and Q5_1 (d, m, qh, qs[16]): qs byte l holds element l (low nibble) and
    // l + 16 (high); bit e of qh is element e's fifth bit.
    let qh = select(base, base + 1u, KTYPE == 7u);
    let lo = (w[qh + 1u + i % 4u] >> (4u * (i / 4u))) & NIB;
    return lo | (spread4((w[qh] >> (4u * i)) & 0xFu) << 4u);
}

fn kq_byte(q: vec3<u32>, k: u32) -> u32 { return (q[k / 4u] >> (8u * (k % 4u))) & 0xFFu; }

// ggml's get_scale_min_k4: the 6-bit scale and min of sub-block j from Q4_K / Q5_K's 12 scale bytes.
fn scale_min_k4(j: u32, q: vec3<u32>) -> vec2<f32> {
    if (j < 4u) {
        return vec2<f32>(f32(kq_byte(q, j) & 63u), f32(kq_byte(q, j + 4u) & 63u));
    }
    let sc = (kq_byte(q, j + 4u) & 15u) | ((kq_byte(q, j - 4u) >> 6u) << 4u);
    let mn = (kq_byte(q, j + 4u) >> 4u) | ((kq_byte(q, j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(mn));
}

// Q3_K's signed 6-bit scale j (low 4 bits in bytes 0..7, high 2 bits in bytes 8..11), minus its offset 32.
fn scale_q3(j: u32, q: vec3<u32>) -> f32 {
    let lo = select(kq_byte(q, j) & 15u, kq_byte(q, j - 8u) >> 4u, j >= 8u);
    let hi = (kq_byte(q, 8u + j % 4u) >> (2u * (j / 4u))) & 3u;
    return f32(i32(lo | (hi << 4u)) - 32);
}

// (a_0, a_1, b_0, b_1) of chunk c of block blk: w = a_h·u + b_h on half h.
fn kq_affine(blk: u32, c: u32) -> vec4<f32> {
    let base = blk * BW;
    let hb = blk * BH;
    if (KTYPE == 12u || KTYPE == 13u) {  // w = d·sc·u − dmin·m
        let sm = scale_min_k4(c, vec3<u32>(w[base + 1u], w[base + 2u], w[base + 3u]));
        let a = f32(wh[hb]) * sm.x;
        let b = -(f32(wh[hb + 1u]) * sm.y);
        return vec4<f32>(a, a, b, b);
    } else if (KTYPE == 14u) {  // w = d·s·(u − 32), s int8, one per 16 elements
        let sw = w[base + 48u + c / 2u] >> (16u * (c % 2u));
        let a = f32(wh[blk]) * vec2<f32>(f32(i32(sw << 24u) >> 24u), f32(i32(sw << 16u) >> 24u));
        return vec4<f32>(a, -32.0 * a);
    } else if (KTYPE == 11u) {  // w = d·s·(u − 4)
        let q = vec3<u32>(w[base + 24u], w[base + 25u], w[base + 26u]);
        let a = f32(wh[blk]) * vec2<f32>(scale_q3(2u * c, q), scale_q3(2u * c + 1u, q));
        return vec4<f32>(a, -4.0 * a);
    } else if (KTYPE == 10u) {  // w = d·(sc & 15)·u − dmin·(sc >> 4), one scale byte per 16 elements
        let sw = w[base + c / 2u] >> (16u * (c % 2u));
        let sc = vec2<f32>(f32(sw & 15u), f32((sw >> 8u) & 15u));
        let mn = vec2<f32>(f32((sw >> 4u) & 15u), f32((sw >> 12u) & 15u));
        return vec4<f32>(f32(wh[hb + 40u]) * sc, -(f32(wh[hb + 41u]) * mn));
    } else if (KTYPE == 6u) {  // Q5_0: w = d·(u − 16)
        let d = f32(wh[blk]);
        return vec4<f32>(d, d, -16.0 * d, -16.0 * d);
    }
    let d = f32(wh[hb]);  // Q5_1: w = d·u + m
    let m = f32(wh[hb + 1u]);
    return vec4<f32>(d, d, m, m);
}

// The four byte codes of a word as f32: each byte ORed into the mantissa of 2^23, minus 2^23 (exact, no conversion).
fn kq_codes_f32(word: u32) -> vec4<f32> {
    let q = (vec4<u32>(word) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(0xFFu);
    return bitcast<vec4<f32>>(q | vec4<u32>(0x4B000000u)) - 8388608.0;
}
