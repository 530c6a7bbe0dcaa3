// Gated DeltaNet input conv: causal depthwise conv (width KC) + SiLU over the CONV q|k|v channels of each
// in_proj row, carrying a conv state across forwards (transformers' causal_conv1d_fn / _update, silu).
// Token t sits at position p = pos0 + t: y[t, c] = silu(Σ_j w[c, j] · x(p − (KC−1) + j, c)), where inputs
// before pos0 come from the state and inputs before position 0 are zero (so pos0 == 0 ignores whatever the
// state holds: a reset needs no clearing). One thread per channel walks the chunk's tokens in order, keeping
// the last KC−1 raw inputs in registers; no thread reads another's channel, so the state updates in place.
// The same dispatch computes the gates per token t and value head h (threads h < VH; transformers'
// Qwen3_5GatedDeltaNet in f32), which gdn_recur reads after it:
//   g = −exp(A_log[h]) · softplus(a[t, h] + dt_bias[h])   (log of the state decay, ≤ 0; softplus threshold 20)
//   β = sigmoid(b[t, h])                                   (the delta rule's write strength)
// a and b are columns A_OFF + h and B_OFF + h of the in_proj rows.
// Constants: WG threads, CONV channels, ROW row length of x (channels are x[t, 0..CONV)), KC width (≥ 2),
//   VH value heads (≤ CONV), A_OFF, B_OFF.
// Bindings: 0 x f32[T, ROW] (read; in_proj output, pre-activation), 1 w f16[CONV, KC] (read; conv1d_weight
//   [CONV, 1, KC], tap KC−1 multiplies the current token), 2 state f32[KC−1, CONV] (read_write; row i is the
//   raw input at position pos0 − (KC−1) + i on entry and pos0 + T − (KC−1) + i on exit),
//   3 y f32[T, CONV] (write), 4 step uniform (n_tokens, pos0), 5 a_log f32[VH] (read), 6 dt_bias f32[VH] (read),
//   7 gates f32[T, 2·VH] (write; g in [0, VH), β in [VH, 2·VH)).
// Grid: ceil(CONV / WG).
#import step

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> w: array<f16>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;
@group(0) @binding(5) var<storage, read> a_log: array<f32>;
@group(0) @binding(6) var<storage, read> dt_bias: array<f32>;
@group(0) @binding(7) var<storage, read_write> gates: array<f32>;

const HIST: u32 = KC - 1u;

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
    let c = gid.x;
    if (c < VH) {
        for (var t = 0u; t < step.n_tokens; t++) {
            let a = x[t * ROW + A_OFF + c];
            let b = x[t * ROW + B_OFF + c];
            gates[t * 2u * VH + c] = -exp(a_log[c]) * softplus(a + dt_bias[c]);
            gates[t * 2u * VH + VH + c] = 1.0 / (1.0 + exp(-b));
        }
    }
    if (c >= CONV) { return; }
    var taps: array<f32, KC>;
    for (var j = 0u; j < KC; j++) { taps[j] = f32(w[c * KC + j]); }
    // hist[i]: the raw input HIST − i positions before the token about to be processed.
    var hist: array<f32, HIST>;
    for (var i = 0u; i < HIST; i++) {
        hist[i] = select(0.0, state[i * CONV + c], step.pos0 + i >= HIST);
    }
    for (var t = 0u; t < step.n_tokens; t++) {
        let cur = x[t * ROW + c];
        var acc = taps[HIST] * cur;
        for (var i = 0u; i < HIST; i++) { acc += taps[i] * hist[i]; }
        y[t * CONV + c] = acc / (1.0 + exp(-acc));
        for (var i = 0u; i + 1u < HIST; i++) { hist[i] = hist[i + 1u]; }
        hist[HIST - 1u] = cur;
    }
    for (var i = 0u; i < HIST; i++) { state[i * CONV + c] = hist[i]; }
}
