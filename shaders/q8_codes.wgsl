// One 32-element chunk of an activation row as int8 (llama.cpp's q8_1 scheme): scale = max|v| / 127, codes
// round(v / scale) and their sum; bytes in matvec_q8's order, for each 8-element word j u32 2j = elements 0, 2, 4, 6
// and u32 2j + 1 = 1, 3, 5, 7. Pure: q8_pack.wgsl stores it into xq / xm, matvec_q8_norm.wgsl into its packed row.

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
    for (var j = 0u; j < 4u; j++) {
        let a = vec4<i32>(clamp(round((*v)[2u * j] * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
        let b = vec4<i32>(clamp(round((*v)[2u * j + 1u] * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
        let even = vec4<i32>(a.x, a.z, b.x, b.z);
        let odd = vec4<i32>(a.y, a.w, b.y, b.w);
        out.words[2u * j] = pack4xI8(even);
        out.words[2u * j + 1u] = pack4xI8(odd);
        total += even.x + even.y + even.z + even.w + odd.x + odd.y + odd.z + odd.w;
    }
    out.scale_sum = vec2<f32>(amax / 127.0, f32(total));
    return out;
}
