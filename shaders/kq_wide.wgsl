// The body of matvec_kq_q8_wide (Q2_K, Q3_K: w as u32) and matvec_kq_q8_wide_vec4 (Q4_K: w as vec4): int8-activation
// decode matvecs built to spend few instructions per weight byte. A lane owns one 64-element item of a block for
// WROWS rows at once, its rows' loads and the activations' independent of one another (in flight together):
// | type | item t (0..3) | sub-block k (16 elements) and its codes |
// | Q2_K, Q3_K | qs bytes 16t..16t + 15 | half t%2 of chunk 4·(t/2) + k: (q >> 2k) & 3 a byte, Q3_K | hmask bit << 2 |
// | Q4_K | qs bytes 32t..32t + 31 | half k%2 of chunk 2t + k/2: nibble k/2 of qs bytes 32t + 16·(k%2).. |
// The activations stay in q8_pack's order (per 8 elements a word of the evens, one of the odds): each row's code
// bytes are put in that order instead, once for all the sub-blocks that share their byte positions, fewer
// instructions than reordering an item's activations. Per row the codes meet the activations through dot4I8Packed,
// the integer sum is scaled by its sub-block's (Q4_K: chunk's) integer scale, decoded from whole words once per
// sub-block, and turned into f32 through int8_dot.wgsl's MAGIC bias (an integer add and an FADD, no I2F in the loop):
//   Q2_K  Σ w·x = d·Σ_k xs_k·f(sc_k·Σ u·xq) − dmin·Σ_k f(m_k)·(xs_k·Σ xq)     (f(m_k) from m_k's bits, no I2F)
//   Q3_K  Σ w·x = d·Σ_k xs_k·f((s_k − 32)·(Σ u·xq − 4·Σ xq))                  (−4·Σ xq seeds the integer sum)
//   Q4_K  Σ w·x = d·Σ_c xs_c·f(sc_c·Σ u·xq) − dmin·Σ_c f(m_c)·(xs_c·Σ xq)     (per chunk c; its Σ xq from xm)
// Each subgroup owns SPLIT · ROWS outputs (row blocks sg_id, sg_id + n_sg, ... of the workgroup's BLOCKS), its lanes
// cut into SPLIT segments of consecutive lanes, one per ROWS outputs (a subgroup smaller than SPLIT takes them in
// turns), each segment's lanes on consecutive items of its rows; sums meet through subgroupAdd. Needs subgroup ops.
// The including kernel declares xq (vec4<u32>), wh (f16), y (f32), xm (vec2<f32>), defines wv(word) -> vec4<u32>
// (words word .. word + 3 of w) and ws(word) -> u32, and imports reduce. Constants: K (a multiple of QK), N, WG,
// ROWS, BLOCKS, SPLIT, GATE_UP (gate rows then up rows; y = silu(gate)·up), KTYPE (10, 11 or 12), QK, BW.
#import kq_q8_rows
#import kq_scale_min

const IPB: u32 = QK / 64u;    // items per block
const ITEMS: u32 = NB * IPB;  // items per row
const CODE2: vec4<u32> = vec4<u32>(0x03030303u);
const HBIT2: vec4<u32> = vec4<u32>(0x04040404u);
const CODE4: vec4<u32> = vec4<u32>(0x0F0F0F0Fu);
// i32 sums biased by the bits of 1.5·2^23 read back as f32 minus 1.5·2^23 exactly (|sum| < 2^22: here < 2^22 for
// Q4_K's 63·32·15·127, < 2^19 for the others).
const MAGIC: i32 = 0x4B400000;
const MAGIC_F: f32 = 12582912.0;

// A small unsigned integer as f32 from its bits: OR'd into the mantissa of 2^23, minus 2^23 (exact, no I2F).
fn small_f32(v: u32) -> f32 { return bitcast<f32>(v | 0x4B000000u) - 8388608.0; }

// An i32 (|v| < 2^22) biased by MAGIC, as f32.
fn biased_f32(v: i32) -> f32 { return bitcast<f32>(v) - MAGIC_F; }

// An item's activations, shared by the lane's rows: sub-block k's 16 codes as stored (q8_pack's order), its chunk's
// scale xs, xs·Σ xq (the minimums multiply it: Q2_K per sub-block; Q4_K per chunk, in k = 0 and 2) and −4·Σ xq
// (Q3_K's zero point).
struct WideX {
    codes: array<vec4<u32>, 4>,
    xs: vec4<f32>,
    xsum: vec4<f32>,
    seed: vec4<i32>,
}

// xq's vec4 of sub-block k of item t of block bo (half h of chunk c is vec4 2c + h).
fn wide_half(bo: u32, t: u32, k: u32) -> u32 {
    if (KTYPE == 12u) { return 2u * (8u * bo + 2u * t + k / 2u) + k % 2u; }
    return 2u * (8u * bo + 4u * (t / 2u) + k) + t % 2u;
}

fn wide_x(bo: u32, t: u32) -> WideX {
    var x: WideX;
    for (var k = 0u; k < 4u; k++) {
        let hv = wide_half(bo, t, k);
        let v = xq[hv];
        let m = xm[hv / 2u];  // (scale, Σ xq over the chunk)
        x.codes[k] = v;
        x.xs[k] = m.x;
        if (KTYPE == 12u) {
            x.xsum[k] = m.x * m.y;
        } else {
            let s = dot4I8Packed(v.x, ONES) + dot4I8Packed(v.y, ONES) + dot4I8Packed(v.z, ONES)
                  + dot4I8Packed(v.w, ONES);
            x.xsum[k] = m.x * f32(s);
            x.seed[k] = -4 * s;
        }
    }
    return x;
}

// One row's words of an item: code bytes (Q4_K: the first 16 of its 32), Q3_K's hmask words or Q4_K's second 16
// code bytes, scale words (Q2_K: its two, and (d, dmin) in .z; Q3_K: all three; Q4_K: d, dmin, scales[12] in hd)
// and Q3_K's d.
struct WideW {
    q: vec4<u32>,
    hm: vec4<u32>,
    s: vec3<u32>,
    hd: vec4<u32>,
    d: f32,
}

// Q2_K: scales[16] (words 0..3), qs[64] (4..19), (d, dmin) (20). Q3_K (d split off to wh): hmask[32] (0..7), qs[64]
// (8..23), scales[12] (24..26); item t's high bits are bit 4·(t/2) + k of hmask bytes 16·(t%2)... Q4_K: d, dmin,
// scales[12] (0..3), qs[128] (4..35; byte 32·(c/2) + l holds chunk c's element l in nibble c%2).
fn wide_w(blk: u32, t: u32) -> WideW {
    let base = blk * BW;
    var o: WideW;
    if (KTYPE == 10u) {
        o.q = wv(base + 4u + 4u * t);
        o.s = vec3<u32>(ws(base + 2u * (t / 2u)), ws(base + 2u * (t / 2u) + 1u), ws(base + 20u));
    } else if (KTYPE == 11u) {
        o.q = wv(base + 8u + 4u * t);
        o.hm = wv(base + 4u * (t % 2u));
        o.s = vec3<u32>(ws(base + 24u), ws(base + 25u), ws(base + 26u));
        o.d = f32(wh[blk]);
    } else {
        o.hd = wv(base);
        o.q = wv(base + 4u + 8u * t);
        o.hm = wv(base + 8u + 8u * t);
    }
    return o;
}

fn dot16(u: vec4<u32>, x: vec4<u32>, init: i32) -> i32 {
    return init + dot4I8Packed(u.x, x.x) + dot4I8Packed(u.y, x.y) + dot4I8Packed(u.z, x.z) + dot4I8Packed(u.w, x.w);
}

// Bytes 1 and 2 of each component swapped.
fn swap_mid(v: vec2<u32>) -> vec2<u32> {
    let d = (v ^ (v >> vec2<u32>(8u))) & vec2<u32>(0x0000FF00u);
    return v ^ d ^ (d << vec2<u32>(8u));
}

// 16 bytes of element-order positions (words: positions 0..3, 4..7, 8..11, 12..15) in q8_pack's order: per 8
// positions a word of the evens, then one of the odds, so each word meets the activation word at its index. Rows in
// element order (Q8_NATURAL) meet the codes as stored.
fn q8_order(q: vec4<u32>) -> vec4<u32> {
    if (Q8_NATURAL) { return q; }
    let a = q.xz;
    let b = q.yw;
    let ev = swap_mid((a & vec2<u32>(0x00FF00FFu)) | ((b << vec2<u32>(8u)) & vec2<u32>(0xFF00FF00u)));  // 0 4 2 6
    let od = swap_mid(((a >> vec2<u32>(8u)) & vec2<u32>(0x00FF00FFu)) | (b & vec2<u32>(0xFF00FF00u)));  // 1 5 3 7
    return vec4<u32>(ev.x, od.x, ev.y, od.y);
}

// Σ w·x over item t of one row.
fn wide_dot(o: WideW, t: u32, x: WideX) -> f32 {
    if (KTYPE == 10u) {
        // Sub-block k's byte (scale | min << 4) is byte 8·(t/2) + t%2 + 2k of scales: bytes 0 and 2 of sc.x
        // (k = 0, 1), of sc.y (k = 2, 3).
        let sc = o.s.xy >> vec2<u32>(8u * (t % 2u));
        let q = q8_order(o.q);
        var fd = 0.0;
        var fm = 0.0;
        for (var k = 0u; k < 4u; k++) {
            let u = (q >> vec4<u32>(2u * k)) & CODE2;
            let b = select(sc.x, sc.y, k >= 2u) >> (16u * (k % 2u));
            fd += x.xs[k] * biased_f32(i32(b & 15u) * dot16(u, x.codes[k], 0) + MAGIC);
            fm += small_f32((b >> 4u) & 15u) * x.xsum[k];
        }
        let dm = unpack2x16float(o.s.z);
        return dm.x * fd - dm.y * fm;
    }
    if (KTYPE == 12u) {
        // Chunk 2t + p: nibble p of both code vec4s (its halves); its scale and minimum in byte p of sm.x, sm.y.
        let sm = scale_min_k4_pair(o.hd.yzw, t);
        let q0 = q8_order(o.q);
        let q1 = q8_order(o.hm);
        var fd = 0.0;
        var fm = 0.0;
        for (var p = 0u; p < 2u; p++) {
            let u0 = (q0 >> vec4<u32>(4u * p)) & CODE4;
            let u1 = (q1 >> vec4<u32>(4u * p)) & CODE4;
            let d = dot16(u1, x.codes[2u * p + 1u], dot16(u0, x.codes[2u * p], 0));
            fd += x.xs[2u * p] * biased_f32(i32((sm.x >> (8u * p)) & 0xFFu) * d + MAGIC);
            fm += small_f32((sm.y >> (8u * p)) & 0xFFu) * x.xsum[2u * p];
        }
        let dm = unpack2x16float(o.hd.x);
        return dm.x * fd - dm.y * fm;
    }
    // Q3_K scale j = 8·(t/2) + t%2 + 2k: low 4 bits in nibble t/2 of byte t%2 + 2k of words 24, 25; high 2 bits at
    // bit 4·(t/2) + 2·(k/2) of byte t%2 + 2·(k%2) of word 26; k = 0, 1 land in bytes 0 and 2 of s01, k = 2, 3 of s23.
    let sh = 8u * (t % 2u) + 4u * (t / 2u);
    let hi = o.s.z >> sh;
    let s01 = ((o.s.x >> sh) & 0x000F000Fu) | ((hi & 0x00030003u) << 4u);
    let s23 = ((o.s.y >> sh) & 0x000F000Fu) | (((hi >> 2u) & 0x00030003u) << 4u);
    let q = q8_order(o.q);
    let hb = q8_order(o.hm) >> vec4<u32>(4u * (t / 2u)) << vec4<u32>(2u);  // bit k of a byte at bit 2 + k
    var f = 0.0;
    for (var k = 0u; k < 4u; k++) {
        let u = ((q >> vec4<u32>(2u * k)) & CODE2) | ((hb >> vec4<u32>(k)) & HBIT2);
        let s = i32((select(s01, s23, k >= 2u) >> (16u * (k % 2u))) & 0xFFu) - 32;
        f += x.xs[k] * biased_f32(s * dot16(u, x.codes[k], x.seed[k]) + MAGIC);
    }
    return o.d * f;
}

// The workgroup's rows (the kernels' main).
fn kq_wide_rows(group_id: u32, lane: Lane) {
    let segs = min(SPLIT, lane.sg_size);  // powers of two: segs divides SPLIT and the subgroup
    let seg_lanes = lane.sg_size / segs;
    let seg = lane.sg_lane / seg_lanes;
    let lane0 = lane.sg_lane % seg_lanes;  // the lane's first item
    for (var blkrow = lane.sg_id; blkrow < BLOCKS; blkrow += lane.n_sg) {
        for (var turn = 0u; turn < SPLIT / segs; turn++) {
            let first = ((group_id * BLOCKS + blkrow) * SPLIT + turn * segs + seg) * ROWS;
            let blk0 = kq_row_blocks(first);
            var acc = array<f32, WROWS>();
            for (var item = lane0; item < ITEMS; item += seg_lanes) {
                let bo = item / IPB;
                let t = item % IPB;
                // Straight-line once the constant row loop unrolls, so every row's loads issue with the
                // activations' before any math; no array of loaded words that a loop left rolled would spill.
                let x = wide_x(bo, t);
                for (var i = 0u; i < WROWS; i++) { acc[i] += wide_dot(wide_w(blk0[i] + bo, t), t, x); }
            }
            store_kq_segments(first, acc, lane, seg, segs, seg_lanes);
        }
    }
}
