// Gated DeltaNet gates per token t and value head h, as transformers' Qwen3_5GatedDeltaNet computes them in f32:
//   g = −exp(A_log[h]) · softplus(a[t, h] + dt_bias[h])   (log of the state decay, ≤ 0; softplus threshold 20)
//   β = sigmoid(b[t, h])                                   (the delta rule's write strength)
// a and b are columns A_OFF + h and B_OFF + h of the in_proj rows.
// Constants: WG threads, VH value heads, ROW in_proj row length, A_OFF, B_OFF.
// Bindings: 0 x f32[T, ROW] (read), 1 a_log f32[VH] (read), 2 dt_bias f32[VH] (read),
//   3 gates f32[T, 2·VH] (write; g in [0, VH), β in [VH, 2·VH)), 4 step uniform (n_tokens).
// Grid: (ceil(VH / WG), T).
#import step

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> a_log: array<f32>;
@group(0) @binding(2) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(3) var<storage, read_write> gates: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

// torch's softplus: x above 20, else log(1 + eˣ). WGSL's log is only accurate to 2^-21 absolute near 1,
// so a small eˣ (≤ 1/4) takes log1p's series instead (12 terms: error below 1e-8 relative).
fn softplus(v: f32) -> f32 {
    if (v > 20.0) { return v; }
    let e = exp(v);
    if (e > 0.25) { return log(1.0 + e); }
    var acc = 0.0;
    for (var n = 12u; n >= 1u; n--) { acc = 1.0 / f32(n) - e * acc; }
    return e * acc;
}

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let h = gid.x;
    let t = gid.y;
    if (h >= VH || t >= step.n_tokens) { return; }
    let a = x[t * ROW + A_OFF + h];
    let b = x[t * ROW + B_OFF + h];
    gates[t * 2u * VH + h] = -exp(a_log[h]) * softplus(a + dt_bias[h]);
    gates[t * 2u * VH + VH + h] = 1.0 / (1.0 + exp(-b));
}
