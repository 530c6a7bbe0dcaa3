// Prefill's residual add + RMSNorm that also writes every row in int8 (the prefill GEMMs' input, as quantize_q8
// over the rows would write it: q8_codes.wgsl's layout, in the model's byte order, and rounding), so the GEMMs after
// it need no quantize_q8.
// The add and norm are add_rms_norm.wgsl's (residual_norm.wgsl: r_out and y bit for bit); then the
// workgroup rereads its y row as vec4s (thread j: vec4 j, so the 8 threads of a 32-element chunk are neighbours),
// the chunk maxima and codes meet in workgroup memory, and thread j writes u32 word j of the row (word j of a chunk
// holds elements of vec4s j & ~1 and j | 1). One workgroup per row.
// Constants: WG, D (a multiple of 32, at most ROWS_Q8_MAX_DIM of engine/kernels/norm.py), EPS, NORM_OFFSET.
// Bindings: 0 r_in f32[T,D], 1 delta f32[T,D], 2 w f16[D], 3 r_out f32[T,D] (write), 4 y f32[T,D] (write),
//   5 step uniform, 6 xq u32[T, D/4] (write), 7 xm vec2<f32>[T, D/32] (write).
#import step
#import reduce
#import residual_norm
#import q8_codes

@group(0) @binding(0) var<storage, read> r_in: array<f32>;
@group(0) @binding(1) var<storage, read> delta: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f16>;
@group(0) @binding(3) var<storage, read_write> r_out: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<uniform> step: Step;
@group(0) @binding(6) var<storage, read_write> xq: array<u32>;
@group(0) @binding(7) var<storage, read_write> xm: array<vec2<f32>>;

const V: u32 = D / 4u;  // vec4s (and int8 words) of a row
var<workgroup> amax_sh: array<f32, V>;  // max |y| of each vec4
var<workgroup> code_sh: array<u32, V>;  // each vec4's four codes, pack4xI8 in element order

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x;
    if (row >= step.n_tokens) { return; }
    let base = row * D;
    let inv = add_residual_inv_rms(base, lane);
    store_normed_row(base, inv, lane.lid);
    storageBarrier();  // the row's y, written by all threads, is read back by others below

    for (var j = lane.lid; j < V; j += WG) {
        let i = base + 4u * j;
        let a = abs(vec4<f32>(y[i], y[i + 1u], y[i + 2u], y[i + 3u]));
        amax_sh[j] = max(max(a.x, a.y), max(a.z, a.w));
    }
    workgroupBarrier();
    for (var j = lane.lid; j < V; j += WG) {
        let c0 = j & ~7u;  // the chunk's first vec4
        var amax = 0.0;
        for (var e = 0u; e < 8u; e++) { amax = max(amax, amax_sh[c0 + e]); }
        let s = select(0.0, 127.0 / amax, amax > 0.0);
        let i = base + 4u * j;
        let v = vec4<f32>(y[i], y[i + 1u], y[i + 2u], y[i + 3u]);
        code_sh[j] = pack4xI8(vec4<i32>(clamp(round(v * s), vec4<f32>(-127.0), vec4<f32>(127.0))));
    }
    workgroupBarrier();
    for (var j = lane.lid; j < V; j += WG) {
        // Word j in the model's order (q8_codes.wgsl): element order is vec4 j's codes as they are; else even j takes
        // elements 0 and 2 of vec4s j and j + 1, odd j elements 1 and 3 of vec4s j − 1 and j.
        if (Q8_NATURAL) {
            xq[row * V + j] = code_sh[j];
        } else {
            let a = unpack4xI8(code_sh[j & ~1u]);
            let b = unpack4xI8(code_sh[j | 1u]);
            if ((j & 1u) == 0u) {
                xq[row * V + j] = pack4xI8(vec4<i32>(a.x, a.z, b.x, b.z));
            } else {
                xq[row * V + j] = pack4xI8(vec4<i32>(a.y, a.w, b.y, b.w));
            }
        }
        if ((j & 7u) == 0u) {
            var total = 0;
            var amax = 0.0;
            for (var e = 0u; e < 8u; e++) {
                let q = unpack4xI8(code_sh[j + e]);
                total += q.x + q.y + q.z + q.w;
                amax = max(amax, amax_sh[j + e]);
            }
            xm[row * (V / 8u) + j / 8u] = vec2<f32>(amax / 127.0, f32(total));
        }
    }
}
