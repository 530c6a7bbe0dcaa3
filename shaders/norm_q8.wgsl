// The int8 tail of the norm kernels (rms_norm, add_rms_norm with Q8): chunk c of the normed row that starts at
// `base` is computed from the kernel's own `norm_src(i)` (its input, or its residual sum), written to y and
// stored in int8 (q8_pack.wgsl). The including kernel declares w, y, xq, xm, NORM_OFFSET and norm_src.
#import q8_pack

fn norm_chunk_q8(c: u32, base: u32, inv: f32) {
    var v: array<vec4<f32>, 8>;
    for (var j = 0u; j < 8u; j++) {
        let i = c * 32u + 4u * j;
        v[j] = vec4<f32>(norm_src(base + i), norm_src(base + i + 1u), norm_src(base + i + 2u), norm_src(base + i + 3u))
               * inv * (vec4<f32>(f32(w[i]), f32(w[i + 1u]), f32(w[i + 2u]), f32(w[i + 3u])) + NORM_OFFSET);
        y[base + i] = v[j].x;
        y[base + i + 1u] = v[j].y;
        y[base + i + 2u] = v[j].z;
        y[base + i + 3u] = v[j].w;
    }
    store_q8_chunk(c, &v);
}
