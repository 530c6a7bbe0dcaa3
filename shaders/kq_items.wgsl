// ggml's Q4_K, Q5_K, Q6_K and Q5_0 / Q5_1 blocks as the int8 decode matvec reads them (as stored:
// engine/formats/kquant.py's arrays; Q2_K and Q3_K run matvec_kq_q8_wide.wgsl or matvec_kq_q8_chunks.wgsl). A block is cut into IPB = QK / 32
// items, item t being code bytes 16t.. of the block's code array (4 whole u32 words), so the lanes of a subgroup that
// take consecutive items read one contiguous run of a row. An item is two parts: part p is half h of chunk c of the
// block (16 elements, one activation vec4 of q8_pack's layout), its codes u in element order 4 to a word, and
// w = a·u + b on it. The scales and minimums an item needs are decoded once per item from whole words of the block,
// never per element.
// | type | item t | part p |
// | Q4_K, Q5_K | qs bytes 16t.. (Q5_K: + qh bytes 16h..) | chunk 2·(t/2) + p (p: low / high nibble), h = t % 2 |
// | Q6_K | ql bytes 16t.., qh bytes 32·(t/4) + 16h.. | chunk 4·(t/4) + (t/2)%2 + 2p, h = t % 2 |
// | Q5_0, Q5_1 | the whole block (qs, qh) | chunk 0, h = p (p: low / high nibble) |
// The offsets b are per 16 elements for Q6_K (HALVES) and per chunk for the others: the kernel then adds the chunk's
// b·Σx once, on its half-0 part (the per-chunk Σ xq of quantize_q8 covers both halves).
// The including kernel declares wh: array<f16> (q_d, or q_blocks itself) and defines wv(word) -> vec4<u32> (words
// word .. word + 3 of w) and ws(word) -> u32. Constants: KTYPE (ggml's type id), QK, BW (u32 words per block).

#import kq_scale_min

const CPB: u32 = QK / 32u;    // chunks per block
const IPB: u32 = CPB;         // items per block: 16 code bytes hold a chunk's 32 elements in each of these types
const PARTS: u32 = 2u;
const NIB4: vec4<u32> = vec4<u32>(0x0F0F0F0Fu);
const TWO4: vec4<u32> = vec4<u32>(0x03030303u);
const BIT4: vec4<u32> = vec4<u32>(0x01010101u);

struct KqItem {
    codes: array<vec4<u32>, PARTS>,  // part p's 16 codes, element order, one per byte
    a: array<f32, PARTS>,            // w = a·u + b on part p
    b: array<f32, PARTS>,
}

// (chunk within the block, half) of part p of item t.
fn kq_part(t: u32, p: u32) -> vec2<u32> {
    if (KTYPE == 12u || KTYPE == 13u) { return vec2<u32>(2u * (t / 2u) + p, t % 2u); }
    if (KTYPE == 14u) { return vec2<u32>(4u * (t / 4u) + (t / 2u) % 2u + 2u * p, t % 2u); }
    return vec2<u32>(0u, p);
}

// Bits 0..3 of each component's t, one per byte (no carries: the products t·2^0, t·2^7, t·2^14, t·2^21 do not overlap).
fn spread4v(t: vec4<u32>) -> vec4<u32> { return (t * 0x00204081u) & BIT4; }

// What item t of block blk needs of the block, loaded apart from the decoding so a kernel can have the next item's
// loads in flight while it computes this one (matvec_kq_q8_body's staged loop).
struct KqWords {
    head: vec4<u32>,  // Q4_K / Q5_K: d, dmin, scales[12]; Q6_K: scales[16]; Q5_1: (d, m) in .x
    q: vec4<u32>,     // the item's code bytes (Q6_K: ql)
    qh: vec4<u32>,    // Q5_K, Q6_K: their high bits; Q5_0 / Q5_1: qh in .x
    d: f32,           // Q6_K, Q5_0: d (from wh)
}

fn kq_words(blk: u32, t: u32) -> KqWords {
    let base = blk * BW;
    var o: KqWords;
    if (KTYPE == 12u || KTYPE == 13u) {  // Q4_K, Q5_K: d, dmin, scales[12] (one vec4), Q5_K's qh[32], qs[128]
        o.head = wv(base);
        o.q = wv(base + select(4u, 12u, KTYPE == 13u) + 4u * t);
        if (KTYPE == 13u) { o.qh = wv(base + 4u + 4u * (t % 2u)); }
    } else if (KTYPE == 14u) {  // Q6_K: ql[128], qh[64], scales[16] (int8, one vec4) · d in wh
        o.q = wv(base + 4u * t);
        o.qh = wv(base + 32u + 8u * (t / 4u) + 4u * (t % 2u));
        o.head = wv(base + 48u);
        o.d = f32(wh[blk]);
    } else {  // Q5_0 (qh, qs[16] · d in wh) and Q5_1 (d, m, qh, qs[16])
        let q51 = KTYPE == 7u;
        o.qh.x = ws(base + select(0u, 1u, q51));
        o.q = wv(base + select(1u, 2u, q51));
        if (q51) { o.head.x = ws(base); } else { o.d = f32(wh[blk]); }
    }
    return o;
}

fn kq_item(blk: u32, t: u32) -> KqItem { return kq_item_of(kq_words(blk, t), t); }

// Item t decoded from its words.
fn kq_item_of(o: KqWords, t: u32) -> KqItem {
    var it: KqItem;
    if (KTYPE == 12u || KTYPE == 13u) {
        let g = t / 2u;
        var lo = o.q & NIB4;
        var hi = (o.q >> vec4<u32>(4u)) & NIB4;
        if (KTYPE == 13u) {  // bit c of qh byte l: chunk c's fifth bit
            lo |= ((o.qh >> vec4<u32>(2u * g)) & BIT4) << vec4<u32>(4u);
            hi |= ((o.qh >> vec4<u32>(2u * g + 1u)) & BIT4) << vec4<u32>(4u);
        }
        let sm = scale_min_k4_pair(o.head.yzw, g);
        let dm = unpack2x16float(o.head.x);  // (d, dmin)
        it.codes[0] = lo;
        it.codes[1] = hi;
        it.a[0] = dm.x * f32(sm.x & 0xFFu);
        it.a[1] = dm.x * f32(sm.x >> 8u);
        it.b[0] = -dm.y * f32(sm.y & 0xFFu);
        it.b[1] = -dm.y * f32(sm.y >> 8u);
    } else if (KTYPE == 14u) {  // w = d·s·(u − 32)
        let hh = t / 4u;
        let kk = (t / 2u) % 2u;
        // part 0's scale is byte t % 4 of word 2·hh, part 1's of word 2·hh + 1
        let sh = 24u - 8u * (t % 4u);
        let s = vec2<i32>(bitcast<vec2<i32>>(select(o.head.xy, o.head.zw, vec2<bool>(hh == 1u)) << vec2<u32>(sh)) >>
                          vec2<u32>(24u));
        let a = o.d * vec2<f32>(s);
        it.codes[0] = (o.q & NIB4) | (((o.qh >> vec4<u32>(2u * kk)) & TWO4) << vec4<u32>(4u));
        it.codes[1] = ((o.q >> vec4<u32>(4u)) & NIB4) | (((o.qh >> vec4<u32>(2u * kk + 4u)) & TWO4) << vec4<u32>(4u));
        it.a[0] = a.x;
        it.a[1] = a.y;
        it.b[0] = -32.0 * a.x;
        it.b[1] = -32.0 * a.y;
    } else {  // Q5_0 / Q5_1: qs byte l holds elements l and l + 16; bit e of qh is element e's fifth bit
        let qh = vec4<u32>(o.qh.x);
        let sh = vec4<u32>(0u, 4u, 8u, 12u);
        it.codes[0] = (o.q & NIB4) | (spread4v((qh >> sh) & vec4<u32>(15u)) << vec4<u32>(4u));
        let hi = spread4v((qh >> (sh + 16u)) & vec4<u32>(15u));
        it.codes[1] = ((o.q >> vec4<u32>(4u)) & NIB4) | (hi << vec4<u32>(4u));
        var ab: vec2<f32>;
        if (KTYPE == 7u) {
            ab = unpack2x16float(o.head.x);  // w = d·u + m
        } else {
            ab = vec2<f32>(o.d, -16.0 * o.d);  // w = d·(u − 16)
        }
        it.a[0] = ab.x;
        it.a[1] = ab.x;
        it.b[0] = ab.y;
        it.b[1] = ab.y;
    }
    return it;
}
