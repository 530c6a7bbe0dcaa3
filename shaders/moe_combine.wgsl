// MoE combine: out[t, d] (+)= Σ_s weights[t, s]·y[t, s, d] over the SLOTS routing slots of token t (the
// routed experts, then the shared expert whose weight the router already set to sigmoid(its gate logit)).
// With ACCUMULATE the sum is added to out (out is the residual stream), else out is overwritten.
// One thread per 4 outputs (a vec4), f32 throughout.
// Constants: D (a multiple of 4), SLOTS, ACCUMULATE (bool), WG threads.
// Bindings: 0 y f32[T, SLOTS, D] (read), 1 weights f32[T, SLOTS] (read), 2 out f32[T, D] (read_write),
//   3 step uniform (n_tokens).
// Grid: fold_grid(ceil(T·D/4 / WG)); the workgroup id is rebuilt from (x, y).
#import step

@group(0) @binding(0) var<storage, read> y: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> weights: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(3) var<uniform> step: Step;

const D4: u32 = D / 4u;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    if (i >= step.n_tokens * D4) { return; }
    let t = i / D4;
    let d4 = i % D4;
    var acc = vec4<f32>(0.0);
    for (var slot = 0u; slot < SLOTS; slot++) {
        acc += weights[t * SLOTS + slot] * y[(t * SLOTS + slot) * D4 + d4];
    }
    if (ACCUMULATE) {
        out[i] += acc;
    } else {
        out[i] = acc;
    }
}
