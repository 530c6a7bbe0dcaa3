// quantize_q8's activation bytes (q8_codes.wgsl: per 8 elements a word of the evens, then one of the odds) put in
// element order, to meet weight codes stored in element order (the K-quant int8 kernels). A model whose rows are in
// element order already (Q8_NATURAL) takes them as they are.

// Bytes 0 and 1 of v moved to bytes 0 and 2.
fn spread2(v: u32) -> u32 { return ((v & 0xFFFFu) | ((v & 0xFFFFu) << 8u)) & 0x00FF00FFu; }

// One 8-element word pair of q8_pack order (ev = elements 0, 2, 4, 6; od = 1, 3, 5, 7) in element order (0..3, 4..7).
fn in_order(ev: u32, od: u32) -> vec2<u32> {
    if (Q8_NATURAL) { return vec2<u32>(ev, od); }
    return vec2<u32>(spread2(ev) | (spread2(od) << 8u), spread2(ev >> 16u) | (spread2(od >> 16u) << 8u));
}
