// Residual add fused with the next RMSNorm: r_out = r_in + delta; y = r_out · rsqrt(mean(r_out²)+EPS) · w.
// Residuals ping-pong between two buffers (r_in and r_out never alias). One workgroup per row.
// Constants: WG, D, EPS. Override NORM_OFFSET (default 0.0) is added to w (1.0: zero-centred, y = x̂ · (1 + w)).
// Bindings: 0 r_in f32[T,D], 1 delta f32[T,D], 2 w f16[D], 3 r_out f32[T,D] (write),
//           4 y f32[T,D] (write), 5 step uniform.
#import step
#import reduce

@group(0) @binding(0) var<storage, read> r_in: array<f32>;
@group(0) @binding(1) var<storage, read> delta: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f16>;
@group(0) @binding(3) var<storage, read_write> r_out: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<uniform> step: Step;

// An override, not an injected const, so builds that never mention it keep compiling unchanged.
override NORM_OFFSET: f32 = 0.0;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x;
    if (row >= step.n_tokens) { return; }
    let base = row * D;
    var ss = 0.0;
    for (var i = lane.lid; i < D; i += WG) {
        let v = r_in[base + i] + delta[base + i];
        r_out[base + i] = v;
        ss += v * v;
    }
    let inv = inverseSqrt(wg_sum(ss, lane) / f32(D) + EPS);
    // Each thread rereads only the elements it wrote itself, so no barrier is needed here.
    for (var i = lane.lid; i < D; i += WG) { y[base + i] = r_out[base + i] * inv * (f32(w[i]) + NORM_OFFSET); }
}
