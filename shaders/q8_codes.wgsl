// One 32-element chunk of an activation row as int8 (llama.cpp's q8_1 scheme): scale = max|v| / 127, codes
// round(v / scale) and their sum. Pure: q8_pack.wgsl stores it into xq / xm, matvec_q8_norm.wgsl into its packed row.
// The bytes' order is the model's (Q8_NATURAL, a constant every kernel that reads or writes int8 rows shares: the
// runtime sets it per model, engine/transformer.py): by default matvec_q8's, for each 8-element word j u32 2j =
// elements 0, 2, 4, 6 and u32 2j + 1 = 1, 3, 5, 7 (what its nibble-packed weights meet); with Q8_NATURAL element
// order, u32 j = elements 4j .. 4j + 3, which the GGUF K-quant blocks' codes meet as stored (no reordering per row).

struct Q8Chunk {
    words: array<u32, 8>,
    scale_sum: vec2<f32>,  // (scale, Σ codes)
}

fn q8_chunk(v: ptr<function, array<vec4<f32>, 8>>) -> Q8Chunk {
    var out: Q8Chunk;
    var m = vec4<f32>(0.0);
    for (var j = 0u; j < 8u; j++) { m = max(m, abs((*v)[j])); }
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    var total = 0;
    for (var j = 0u; j < 4u; j++) {  // one rounding for both orders: they hold the same codes
        let a = vec4<i32>(clamp(round((*v)[2u * j] * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
        let b = vec4<i32>(clamp(round((*v)[2u * j + 1u] * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
        if (Q8_NATURAL) {
            out.words[2u * j] = pack4xI8(a);
            out.words[2u * j + 1u] = pack4xI8(b);
        } else {
            out.words[2u * j] = pack4xI8(vec4<i32>(a.x, a.z, b.x, b.z));
            out.words[2u * j + 1u] = pack4xI8(vec4<i32>(a.y, a.w, b.y, b.w));
        }
        total += a.x + a.y + a.z + a.w + b.x + b.y + b.z + b.w;
    }
    out.scale_sum = vec2<f32>(amax / 127.0, f32(total));
    return out;
}

// Where element e (0..31) of a chunk's codes goes: (u32 word of the chunk, byte of the word), in the model's order.
fn q8_slot(e: u32) -> vec2<u32> {
    if (Q8_NATURAL) { return vec2<u32>(e / 4u, e % 4u); }
    return vec2<u32>(2u * (e / 8u) + e % 2u, (e % 8u) / 2u);
}
