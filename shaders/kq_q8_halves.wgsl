// An int8 activation row (quantize_q8's layout, q8_pack.wgsl: per 32-element chunk xq codes, and xm = (scale, Σ codes))
// read as 16-element halves in element order, each with its chunk's scale and its own Σ codes: what a K-quant kernel
// needs for weights stored in element order with an offset per 16 elements. Half i is xq's vec4 i (elements 16·(i%2)..
// of chunk i / 2).
// With STAGE the workgroup puts the whole row in that form once (stage_halves), so the reordering and the sums are
// paid once per workgroup instead of once per subgroup row set; without it every read computes them from xq / xm.
// The including kernel declares xq (vec4<u32>) and xm (vec2<f32>), imports reduce (Lane) and sets K, WG and STAGE
// (plans stage only where the 1.25·K bytes fit the workgroup memory: engine/kquant_plan.py).
#import q8_element_order

struct XHalf {
    codes: vec4<u32>,  // elements 0..15 of the half, one int8 per byte in element order
    scale: f32,        // the chunk's activation scale
    sum: i32,          // Σ codes over the half
}

const X_ONES: u32 = 0x01010101u;
const STAGED_CHUNKS: u32 = select(1u, K / 32u, STAGE);

var<workgroup> x_codes: array<vec4<u32>, (2u * STAGED_CHUNKS + 7u) / 8u * 8u>;  // whole 8-half groups: see swizzle
var<workgroup> x_meta: array<vec2<u32>, STAGED_CHUNKS>;  // (scale's bits, Σ half 0 | Σ half 1 << 16, as i16)

fn half_sum(v: vec4<u32>) -> i32 {
    return dot4I8Packed(v.x, X_ONES) + dot4I8Packed(v.y, X_ONES) + dot4I8Packed(v.z, X_ONES)
         + dot4I8Packed(v.w, X_ONES);
}

fn half_in_order(v: vec4<u32>) -> vec4<u32> {
    let a = in_order(v.x, v.y);
    let b = in_order(v.z, v.w);
    return vec4<u32>(a, b);
}

// Where half i is staged: bits 3..4 of i flipped into bits 1..2, within its group of 8 halves (128 bytes). The lanes
// of a 64-element item kernel read halves 16b + 8·(t/2) + t%2 + 2k (block b, item t, sub-block k): unswizzled, the
// 8 lanes of each quarter subgroup that one 16-byte read serves would share 2 of 8 bank groups; swizzled all 8.
fn swizzle(i: u32) -> u32 { return i ^ ((i >> 2u) & 6u); }

// Half i straight from xq / xm.
fn x_half_global(i: u32) -> XHalf {
    let v = xq[i];
    return XHalf(half_in_order(v), xm[i / 2u].x, half_sum(v));
}

// The whole row into workgroup memory (STAGE only); call first, from uniform control flow.
fn stage_halves(lane: Lane) {
    for (var c = lane.lid; c < K / 32u; c += WG) {
        let v0 = xq[2u * c];
        let v1 = xq[2u * c + 1u];
        x_codes[swizzle(2u * c)] = half_in_order(v0);
        x_codes[swizzle(2u * c + 1u)] = half_in_order(v1);
        // |Σ| ≤ 16·127 over a half: an i16 each
        x_meta[c] = vec2<u32>(bitcast<u32>(xm[c].x), (u32(half_sum(v0)) & 0xFFFFu) | (u32(half_sum(v1)) << 16u));
    }
    workgroupBarrier();
}

fn x_half(i: u32) -> XHalf {
    if (!STAGE) { return x_half_global(i); }
    let m = x_meta[i / 2u];
    let sum = bitcast<i32>(m.y << (16u * (1u - i % 2u))) >> 16u;  // sign-extended i16
    return XHalf(x_codes[swizzle(i)], bitcast<f32>(m.x), sum);
}
