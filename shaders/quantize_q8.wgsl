// One activation row to int8 for matvec_q8: per 32-element chunk one f32 scale (max|x| / 127), the codes
// round(x / scale), and their sum (for the weights' zero point or minimum). Bytes go in the order matvec_q8's
// dot4I8Packed meets the 4-bit weights: for each 8-element word j of a chunk, u32 2j holds elements 0, 2, 4, 6
// of it (the even nibbles) and u32 2j + 1 elements 1, 3, 5, 7. One thread per chunk.
// Constants: K (a multiple of 32), WG, LAST_ROW (quantize row n_tokens - 1: the LM head after a prefill).
// Bindings: 0 x f32[T, K] (read), 1 xq u32[K / 4] (write), 2 xm vec2<f32>[K / 32] (scale, Σ codes) (write),
//   3 step uniform. Grid: ceil(K / 32 / WG).
#import step

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> xq: array<u32>;
@group(0) @binding(2) var<storage, read_write> xm: array<vec2<f32>>;
@group(0) @binding(3) var<uniform> step: Step;

const CHUNKS: u32 = K / 32u;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    if (c >= CHUNKS) { return; }
    let base = select(0u, max(step.n_tokens, 1u) - 1u, LAST_ROW) * (K / 4u) + c * 8u;
    var v: array<vec4<f32>, 8>;
    var m = vec4<f32>(0.0);
    for (var j = 0u; j < 8u; j++) {
        v[j] = x[base + j];
        m = max(m, abs(v[j]));
    }
    let amax = max(max(m.x, m.y), max(m.z, m.w));
    let inv = select(0.0, 127.0 / amax, amax > 0.0);
    var total = 0;
    for (var j = 0u; j < 4u; j++) {
        let a = vec4<i32>(clamp(round(v[2u * j] * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
        let b = vec4<i32>(clamp(round(v[2u * j + 1u] * inv), vec4<f32>(-127.0), vec4<f32>(127.0)));
        let even = vec4<i32>(a.x, a.z, b.x, b.z);
        let odd = vec4<i32>(a.y, a.w, b.y, b.w);
        xq[c * 8u + 2u * j] = pack4xI8(even);
        xq[c * 8u + 2u * j + 1u] = pack4xI8(odd);
        total += even.x + even.y + even.z + even.w + odd.x + odd.y + odd.z + odd.w;
    }
    xm[c] = vec2<f32>(amax / 127.0, f32(total));
}
