// Decode matvec on Q2_K / Q3_K blocks with int8 activations (quantize_q8.wgsl's layout, or a norm's Q8 output),
// built to spend few instructions per weight byte: a lane owns one 64-element item of a block (qs bytes 16t..16t + 15:
// four 16-element sub-blocks k, each half t%2 of chunk 4·(t/2) + k; kq_sub_items.wgsl derives the layout) for WROWS
// rows at once, its rows' loads and the activations' independent of one another (in flight together). The
// activations stay in q8_pack's order (per 8 elements a word of the evens, one of the odds): each row's code bytes
// are put in that order instead, once for all four sub-blocks (they share byte positions), fewer instructions than
// reordering an item's activations. Per row and sub-block the codes come out four to a word ((q >> 2k) & 3 per byte,
// Q3_K | its hmask bit << 2), meet the activations through dot4I8Packed, the integer sum is scaled by the
// sub-block's integer scale (decoded from whole words, once per sub-block) and turned into f32 through
// int8_dot.wgsl's MAGIC bias (an integer add and an FADD, no I2F in the loop):
//   Q2_K  Σ w·x = d·Σ_k xs_k·f(sc_k·Σ u·xq) − dmin·Σ_k f(m_k)·(xs_k·Σ xq)     (f(m_k) from m_k's bits, no I2F)
//   Q3_K  Σ w·x = d·Σ_k xs_k·f((s_k − 32)·(Σ u·xq − 4·Σ xq))                  (−4·Σ xq seeds the integer sum)
// The lane's activation halves, their chunk scales and Σ xq are read once per item and shared by its rows.
// Each subgroup owns SPLIT · ROWS outputs (row blocks sg_id, sg_id + n_sg, ... of the workgroup's BLOCKS), its lanes
// cut into SPLIT segments of consecutive lanes, one per ROWS outputs (a subgroup smaller than SPLIT takes them in
// turns), each segment's lanes on consecutive items of its rows; sums meet through subgroupAdd. Needs subgroup ops.
// Constants: K (a multiple of QK), N, WG, ROWS, BLOCKS, SPLIT, GATE_UP (gate rows then up rows; y = silu(gate)·up),
//   KTYPE (10 or 11), QK, BW.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32 q_blocks, 2 wh f16 (q_d, or q_blocks again), 3 y f32[N] (write),
//   4 xm vec2<f32>[K / 32] (scale, Σ codes). Grid: fold_grid(ceil(N / (SPLIT · ROWS · BLOCKS))).
#import reduce
#import kq_q8_rows

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

const IPB: u32 = QK / 64u;    // items per block
const ITEMS: u32 = NB * IPB;  // items per row
const CODE2: vec4<u32> = vec4<u32>(0x03030303u);
const HBIT2: vec4<u32> = vec4<u32>(0x04040404u);
// i32 sums biased by the bits of 1.5·2^23 read back as f32 minus 1.5·2^23 exactly (|sum| < 2^22: here < 2^20).
const MAGIC: i32 = 0x4B400000;
const MAGIC_F: f32 = 12582912.0;

// An item's activations, shared by the lane's rows: sub-block k's 16 codes as stored (q8_pack's order), its chunk's
// scale xs, xs·Σ xq (Q2_K's minimums multiply it) and −4·Σ xq (Q3_K's zero point).
struct WideX {
    codes: array<vec4<u32>, 4>,
    xs: vec4<f32>,
    xsum: vec4<f32>,
    seed: vec4<i32>,
}

// Item t of block bo's activations: sub-block k is half t%2 of chunk 8·bo + 4·(t/2) + k, xq's vec4 2·chunk + t%2.
fn wide_x(bo: u32, t: u32) -> WideX {
    var x: WideX;
    let h0 = 2u * (8u * bo + 4u * (t / 2u)) + t % 2u;
    for (var k = 0u; k < 4u; k++) {
        let v = xq[h0 + 2u * k];
        let xs = xm[(h0 + 2u * k) / 2u].x;
        let s = dot4I8Packed(v.x, ONES) + dot4I8Packed(v.y, ONES) + dot4I8Packed(v.z, ONES) + dot4I8Packed(v.w, ONES);
        x.codes[k] = v;
        x.xs[k] = xs;
        x.xsum[k] = xs * f32(s);
        x.seed[k] = -4 * s;
    }
    return x;
}

// Bytes 1 and 2 of each component swapped.
fn swap_mid(v: vec2<u32>) -> vec2<u32> {
    let d = (v ^ (v >> vec2<u32>(8u))) & vec2<u32>(0x0000FF00u);
    return v ^ d ^ (d << vec2<u32>(8u));
}

// 16 bytes of element-order positions (words: positions 0..3, 4..7, 8..11, 12..15) in q8_pack's order: per 8
// positions a word of the evens, then one of the odds, so each word meets the activation word at its index.
fn q8_order(q: vec4<u32>) -> vec4<u32> {
    let a = q.xz;
    let b = q.yw;
    let ev = swap_mid((a & vec2<u32>(0x00FF00FFu)) | ((b << vec2<u32>(8u)) & vec2<u32>(0xFF00FF00u)));  // 0 4 2 6
    let od = swap_mid(((a >> vec2<u32>(8u)) & vec2<u32>(0x00FF00FFu)) | (b & vec2<u32>(0xFF00FF00u)));  // 1 5 3 7
    return vec4<u32>(ev.x, od.x, ev.y, od.y);
}

// One row's words of an item: code bytes, Q3_K's hmask words, scale words (Q2_K: its two, and (d, dmin) in .z;
// Q3_K: all three) and Q3_K's d.
struct WideW {
    q: vec4<u32>,
    hm: vec4<u32>,
    s: vec3<u32>,
    d: f32,
}

// Q2_K: scales[16] (words 0..3), qs[64] (4..19), (d, dmin) (20). Q3_K (d split off to wh): hmask[32] (0..7), qs[64]
// (8..23), scales[12] (24..26); item t's high bits are bit 4·(t/2) + k of hmask bytes 16·(t%2)...
fn wide_w(blk: u32, t: u32) -> WideW {
    let base = blk * BW;
    var o: WideW;
    if (KTYPE == 10u) {
        let q = base + 4u + 4u * t;
        o.q = vec4<u32>(w[q], w[q + 1u], w[q + 2u], w[q + 3u]);
        o.s = vec3<u32>(w[base + 2u * (t / 2u)], w[base + 2u * (t / 2u) + 1u], w[base + 20u]);
    } else {
        let q = base + 8u + 4u * t;
        let m = base + 4u * (t % 2u);
        o.q = vec4<u32>(w[q], w[q + 1u], w[q + 2u], w[q + 3u]);
        o.hm = vec4<u32>(w[m], w[m + 1u], w[m + 2u], w[m + 3u]);
        o.s = vec3<u32>(w[base + 24u], w[base + 25u], w[base + 26u]);
        o.d = f32(wh[blk]);
    }
    return o;
}

fn dot16(u: vec4<u32>, x: vec4<u32>, init: i32) -> i32 {
    return init + dot4I8Packed(u.x, x.x) + dot4I8Packed(u.y, x.y) + dot4I8Packed(u.z, x.z) + dot4I8Packed(u.w, x.w);
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
            fd += x.xs[k] * (bitcast<f32>(i32(b & 15u) * dot16(u, x.codes[k], 0) + MAGIC) - MAGIC_F);
            fm += (bitcast<f32>(((b >> 4u) & 15u) | 0x4B000000u) - 8388608.0) * x.xsum[k];  // f32(m_k), exactly
        }
        let dm = unpack2x16float(o.s.z);
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
        f += x.xs[k] * (bitcast<f32>(s * dot16(u, x.codes[k], x.seed[k]) + MAGIC) - MAGIC_F);
    }
    return o.d * f;
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
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
