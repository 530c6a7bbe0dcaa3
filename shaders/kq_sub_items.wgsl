// Q2_K and Q3_K blocks (as stored: engine/formats/kquant.py) dotted with int8 activations, 64 elements at a time.
// Item t (0..3) of a block is qs bytes 16t..16t + 15: byte l holds, at bits 2k, element 128·(t/2) + 32k + 16·(t%2) + l
// (k = 0..3), so the item is four sub-blocks of 16 elements, sub-block k being half t%2 of chunk 4·(t/2) + k, each
// with one scale byte (Q2_K: scale | min << 4) or one 6-bit scale (Q3_K). A lane loads the item's code words once,
// takes sub-block k's codes as (q >> 2k) & 3 per byte (Q3_K: | its hmask bit << 2), decodes the four scales from
// whole words once, and sums in integers as far as the activation scales allow:
//   Q2_K  Σ w·x = d·Σ_k xs_k·(sc_k·Σ u·xq) − dmin·Σ_k m_k·(xs_k·Σ xq)
//   Q3_K  Σ w·x = d·Σ_k xs_k·((s_k − 32)·(Σ u·xq − 4·Σ xq))
// The including kernel declares w (u32, q_blocks) and wh (f16: Q3_K's q_d; Q2_K's d and dmin are read from w).
// Constants: KTYPE (10 or 11), BW (u32 words per block).

const TWO4: vec4<u32> = vec4<u32>(0x03030303u);
const BIT4: vec4<u32> = vec4<u32>(0x01010101u);

// An item's activations: sub-block k's 16 codes in element order, its chunk's scale xs, Σ codes and xs·Σ codes.
struct SubX {
    codes: array<vec4<u32>, 4>,
    scale: vec4<f32>,
    sum: vec4<i32>,
    scaled_sum: vec4<f32>,
}

fn dot16(u: vec4<u32>, x: vec4<u32>, init: i32) -> i32 {
    return init + dot4I8Packed(u.x, x.x) + dot4I8Packed(u.y, x.y) + dot4I8Packed(u.z, x.z) + dot4I8Packed(u.w, x.w);
}

fn words4(at: u32) -> vec4<u32> { return vec4<u32>(w[at], w[at + 1u], w[at + 2u], w[at + 3u]); }

// What item t of a block needs of it, loaded apart from the arithmetic so a kernel can have the next item's loads in
// flight while it computes this one.
struct SubWords {
    q: vec4<u32>,   // qs words 4t .. 4t + 3
    hm: vec4<u32>,  // Q3_K: hmask words 4·(t%2) .., shifted down by 4·(t/2)
    s: vec3<u32>,   // Q2_K: its two scale words and (d, dmin); Q3_K: the scale words 24..26
    d: f32,         // Q3_K: d
}

// Q2_K: scales[16] (words 0..3), qs[64] (4..19), (d, dmin) (word 20). Q3_K (d split off to wh): hmask[32] (words
// 0..7), qs[64] (8..23), scales[12] (24..26); element 32j + l has its high bit at bit j of hmask byte l: here bytes
// 16·(t%2).., bit 4·(t/2) + k.
fn sub_words(blk: u32, t: u32) -> SubWords {
    let base = blk * BW;
    var o: SubWords;
    if (KTYPE == 10u) {
        o.q = words4(base + 4u + 4u * t);
        o.s = vec3<u32>(w[base + 2u * (t / 2u)], w[base + 2u * (t / 2u) + 1u], w[base + 20u]);
    } else {
        o.q = words4(base + 8u + 4u * t);
        o.hm = words4(base + 4u * (t % 2u)) >> vec4<u32>(4u * (t / 2u));
        o.s = vec3<u32>(w[base + 24u], w[base + 25u], w[base + 26u]);
        o.d = f32(wh[blk]);
    }
    return o;
}

// Σ w·x over item t given its words.
fn sub_dot(o: SubWords, t: u32, x: SubX) -> f32 {
    if (KTYPE == 10u) {
        // Sub-block k's scale byte is byte 8·(t/2) + t%2 + 2k of scales: bytes 0 and 2 of sc.x (k = 0, 1), of sc.y.
        let sc = o.s.xy >> vec2<u32>(8u * (t % 2u));
        let dm = unpack2x16float(o.s.z);
        var fd = 0.0;
        var fm = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let u = (o.q >> vec4<u32>(2u * k)) & TWO4;
            let b = (select(sc.x, sc.y, k >= 2u) >> (16u * (k % 2u))) & 0xFFu;
            fd += x.scale[k] * f32(i32(b & 15u) * dot16(u, x.codes[k], 0));
            fm += f32(b >> 4u) * x.scaled_sum[k];
        }
        return dm.x * fd - dm.y * fm;
    }
    // Q3_K scale j = 8·(t/2) + t%2 + 2k: low 4 bits in nibble t/2 of byte t%2 + 2k of words 24, 25; high 2 bits at
    // bit 4·(t/2) + 2·(k/2) of byte t%2 + 2·(k%2) of word 26. k = 0, 1 land in bytes 0 and 2 of s.x, k = 2, 3 of s.y.
    let sh = 8u * (t % 2u) + 4u * (t / 2u);
    let hi = o.s.z >> sh;
    let s = ((o.s.xy >> vec2<u32>(sh)) & vec2<u32>(0x000F000Fu))
          | ((vec2<u32>(hi, hi >> 2u) & vec2<u32>(0x00030003u)) << vec2<u32>(4u));
    var f = 0.0;
    for (var k = 0u; k < 4u; k++) {
        let u = ((o.q >> vec4<u32>(2u * k)) & TWO4) | (((o.hm >> vec4<u32>(k)) & BIT4) << vec4<u32>(2u));
        let scale = i32((select(s.x, s.y, k >= 2u) >> (16u * (k % 2u))) & 0xFFu) - 32;
        f += x.scale[k] * f32(scale * dot16(u, x.codes[k], -4 * x.sum[k]));
    }
    return o.d * f;
}
