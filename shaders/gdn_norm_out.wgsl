// Gated DeltaNet output norm, transformers' Qwen3_5RMSNormGated ("norm before gate"; a plain weight, NOT
// zero-centred): per token t and value head h, over the head's DV values,
//   y = w · x · rsqrt(mean(x²) + EPS) · silu(z),   z = columns Z_OFF + h·DV .. of the in_proj row.
// One workgroup per (head, token).
// Constants: WG threads (a power of two without subgroups), VH value heads, DV head dim, EPS, ROW in_proj row
//   length, Z_OFF column of z.
// Bindings: 0 x f32[T, VH·DV] (read; gdn_recur's output), 1 zsrc f32[T, ROW] (read), 2 w f16[DV] (read),
//   3 y f32[T, VH·DV] (write), 4 step uniform (n_tokens).
// Grid: (VH, T).
#import step
#import reduce

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> zsrc: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    if (t >= step.n_tokens) { return; }  // uniform: t is the workgroup's
    let base = (t * VH + h) * DV;
    var ss = 0.0;
    for (var i = lane.lid; i < DV; i += WG) { let v = x[base + i]; ss += v * v; }
    let inv = inverseSqrt(wg_sum(ss, lane) / f32(DV) + EPS);
    for (var i = lane.lid; i < DV; i += WG) {
        let z = zsrc[t * ROW + Z_OFF + h * DV + i];
        y[base + i] = f32(w[i]) * x[base + i] * inv * (z / (1.0 + exp(-z)));
    }
}
