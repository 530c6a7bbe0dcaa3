// One activation row to int8 for matvec_q8 (layout in q8_pack.wgsl): per 32-element chunk one f32 scale
// (max|x| / 127), the codes round(x / scale), and their sum (for the weights' zero point or minimum), in the order
// matvec_q8's dot4I8Packed meets the 4-bit weights. One thread per chunk (q8_pack.wgsl's store_q8_chunk). The
// norms write the same for their output row themselves (Q8 in rms_norm / add_rms_norm), so only the other matvec
// inputs come through here.
// Constants: K (a multiple of 32), WG, LAST_ROW (quantize row n_tokens - 1: the LM head after a prefill),
//   ROW0 and X_STRIDE (otherwise rows ROW0 + grid y of x, X_STRIDE floats apart, a multiple of 4; MoE slots).
// Bindings: 0 x f32 (read), 1 xq u32[rows, K / 4] (write; row r at r·K/4), 2 xm vec2<f32>[rows, K / 32]
//   (scale, Σ codes) (write), 3 step uniform. Grid: (ceil(K / 32 / WG), rows).
#import step
#import q8_pack

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read_write> xq: array<u32>;
@group(0) @binding(2) var<storage, read_write> xm: array<vec2<f32>>;
@group(0) @binding(3) var<uniform> step: Step;

const CHUNKS: u32 = K / 32u;

// The workgroup's WG chunks are first staged here by all threads (consecutive threads read consecutive vec4s, so the
// global reads coalesce; a thread reading its own 128 contiguous bytes did not), 9 vec4 per chunk so that a warp's
// reads of its chunks spread over the banks.
var<workgroup> tile: array<vec4<f32>, WG * 9u>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let c0 = wid.x * WG;  // the workgroup's first chunk
    let row = ROW0 + wid.y;
    let base = select(row, max(step.n_tokens, 1u) - 1u, LAST_ROW) * (X_STRIDE / 4u) + c0 * 8u;
    let n = min(WG, CHUNKS - c0) * 8u;  // vec4s to read
    for (var i = lid; i < WG * 8u; i += WG) {
        if (i < n) { tile[i / 8u * 9u + i % 8u] = x[base + i]; }
    }
    workgroupBarrier();
    let c = c0 + lid;
    if (c >= CHUNKS) { return; }
    var v: array<vec4<f32>, 8>;
    for (var j = 0u; j < 8u; j++) { v[j] = tile[lid * 9u + j]; }
    store_q8_chunk(select(row, 0u, LAST_ROW) * CHUNKS + c, &v);
}
