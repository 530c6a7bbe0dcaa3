// RMSNorm of each row: y = x · rsqrt(mean(x²) + EPS) · w.  One workgroup per row (token).
// With Q8 the last row's y also goes to int8 (norm_q8.wgsl) for the q8 decode matvecs, as in add_rms_norm.
// Constants: WG threads, D row length, EPS, Q8, NORM_OFFSET (added to w: 1.0 runs a
//   zero-centred norm, y = x̂ · (1 + w) (Qwen3.5 checkpoints that do not bake the 1 in).
// Bindings: 0 x f32[T, D] (read), 1 w f16[D], 2 y f32[T, D] (write), 3 step uniform (n_tokens),
//   4 xq u32[D/4] (write), 5 xm vec2<f32>[D/32] (write); 4 and 5 are bound whether or not Q8.
#import step
#import reduce
#import norm_q8

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f16>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> step: Step;
@group(0) @binding(4) var<storage, read_write> xq: array<u32>;
@group(0) @binding(5) var<storage, read_write> xm: array<vec2<f32>>;

fn norm_src(i: u32) -> f32 { return x[i]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x;
    if (row >= step.n_tokens) { return; }
    let base = row * D;
    var ss = 0.0;
    for (var i = lane.lid; i < D; i += WG) { let v = x[base + i]; ss += v * v; }
    let inv = inverseSqrt(wg_sum(ss, lane) / f32(D) + EPS);
    if (Q8 && row == step.n_tokens - 1u) {
        norm_row_q8(base, inv, lane.lid);
    } else {
        for (var i = lane.lid; i < D; i += WG) { y[base + i] = x[base + i] * inv * (f32(w[i]) + NORM_OFFSET); }
    }
}
