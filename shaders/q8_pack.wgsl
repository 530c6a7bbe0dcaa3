// Store one 32-element chunk of an activation row as int8 for matvec_q8 (the including kernel declares
// xq: array<u32> and xm: array<vec2<f32>>); the codes and scale as q8_codes.wgsl computes them.
#import q8_codes

fn store_q8_chunk(c: u32, v: ptr<function, array<vec4<f32>, 8>>) {
    let q = q8_chunk(v);
    for (var j = 0u; j < 8u; j++) { xq[c * 8u + j] = q.words[j]; }
    xm[c] = q.scale_sum;
}
