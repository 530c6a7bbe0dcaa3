// Decode matvec with the residual add and RMSNorm fused in front (one dispatch instead of add_rms_norm +
// matvec): v = r_in + delta; x = v · rsqrt(mean(v²) + EPS) · (norm_w + NORM_OFFSET); y = W·x as matvec_int4.
// Every workgroup recomputes the norm of the one row into workgroup memory (K·4 bytes, read from cache);
// workgroup 0 also writes v to r_out, the residual the next block adds to. r_in and r_out never alias.
// Constants: as matvec_int4 (K ≤ 4096 so x fits workgroup memory; no LAST_ROW: decode, one row) plus EPS.
// Override NORM_OFFSET (default 0.0; 1.0 = zero-centred norms).
// Bindings: 0 r_in f32[K], 1 w, 2 s, 3 y (as matvec_int4), 4 delta f32[K], 5 norm_w f16[K],
//   6 r_out f32[K] (write, workgroup 0). No step uniform: decode has exactly one row.
// Grid: fold_grid(ceil(N / ROWS)).
#import reduce
#import matvec_lib

@group(0) @binding(0) var<storage, read> r_in: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> delta: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read> norm_w: array<f16>;
@group(0) @binding(6) var<storage, read_write> r_out: array<vec4<f32>>;

override NORM_OFFSET: f32 = 0.0;
var<workgroup> xn: array<vec4<f32>, K / 4u>;

fn load_x(i: u32) -> vec4<f32> { return xn[i]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    if (group_id >= N_GROUPS) { return; }  // the whole workgroup leaves, so barriers stay uniform
    var ss = 0.0;
    for (var i = lane.lid; i < K / 4u; i += WG) {
        let v = r_in[i] + delta[i];
        xn[i] = v;
        ss += dot(v, v);
        if (group_id == 0u) { r_out[i] = v; }
    }
    let inv = inverseSqrt(wg_sum(ss, lane) / f32(K) + EPS);
    for (var i = lane.lid; i < K / 4u; i += WG) {  // each thread scales the vec4s it wrote itself
        let g = vec4<f32>(f32(norm_w[4u * i]), f32(norm_w[4u * i + 1u]), f32(norm_w[4u * i + 2u]),
                          f32(norm_w[4u * i + 3u])) + NORM_OFFSET;
        xn[i] = xn[i] * inv * g;
    }
    workgroupBarrier();
    matvec_rows(lane, group_id);
}
