// The epilogue of the decode matvecs that end in the next RMSNorm's int8 row (matvec_q8_norm, moe_down_q8): the
// chunk's 32 threads leave v = x · (nw + NORM_OFFSET) and x² in v_sh / sq_sh; one thread then writes the chunk's
// int8 codes and (scale, Σ codes) (q8_codes.wgsl) and Σ x², which the next matvec sums into 1/rms.
// The including kernel imports q8_codes, declares the constants META and SS and the output `nq` (u32 words) and
// defines nq_put(i, v), its store of word i (an atomic store where nq is atomic: matvec_q8_norm_split.wgsl).

var<workgroup> v_sh: array<f32, 32>;
var<workgroup> sq_sh: array<f32, 32>;

fn store_norm_chunk(chunk: u32) {
    var v: array<vec4<f32>, 8>;
    var sq = 0.0;
    for (var j = 0u; j < 8u; j++) {
        v[j] = vec4<f32>(v_sh[4u * j], v_sh[4u * j + 1u], v_sh[4u * j + 2u], v_sh[4u * j + 3u]);
        sq += sq_sh[4u * j] + sq_sh[4u * j + 1u] + sq_sh[4u * j + 2u] + sq_sh[4u * j + 3u];
    }
    let q = q8_chunk(&v);
    for (var j = 0u; j < 8u; j++) { nq_put(chunk * 8u + j, q.words[j]); }
    nq_put(META + 2u * chunk, bitcast<u32>(q.scale_sum.x));
    nq_put(META + 2u * chunk + 1u, bitcast<u32>(q.scale_sum.y));
    nq_put(SS + chunk, bitcast<u32>(sq));
}
