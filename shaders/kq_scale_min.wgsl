// Q4_K / Q5_K's packed 6-bit scales and minimums, two sub-blocks at a time from whole words (kq_items.wgsl,
// kq_wide.wgsl).

// Q4_K / Q5_K's 6-bit scales and minimums of sub-blocks 2g and 2g + 1 (ggml's get_scale_min_k4) from the 12 scale
// bytes q: (scales, minimums), each pair in bytes 0 and 1. Both of get_scale_min_k4's cases are computed, no branch.
fn scale_min_k4_pair(q: vec3<u32>, g: u32) -> vec2<u32> {
    let sh = 16u * (g % 2u);
    let s0 = q.x >> sh;
    let s1 = q.y >> sh;
    let s2 = q.z >> sh;
    let low = vec2<u32>(s0 & 0x3F3Fu, s1 & 0x3F3Fu);  // g < 2: bytes j and j + 4, six bits each
    let high = vec2<u32>((s2 & 0x0F0Fu) | ((s0 >> 2u) & 0x3030u), ((s2 >> 4u) & 0x0F0Fu) | ((s1 >> 2u) & 0x3030u));
    return select(low, high, vec2<bool>(g >= 2u));
}
