// Gated DeltaNet input conv: causal depthwise conv (width KC) + SiLU over the CONV q|k|v channels of each
// in_proj row, carrying a conv state across forwards (transformers' causal_conv1d_fn / _update, silu).
// Token t sits at position p = pos0 + t: y[t, c] = silu(Σ_j w[c, j] · x(p − (KC−1) + j, c)), where inputs
// before pos0 come from the state and inputs before position 0 are zero (so pos0 == 0 ignores whatever the
// state holds: a reset needs no clearing).
// A workgroup owns CH = WG / RUNS channels for all T tokens; its threads split the tokens into RUNS runs of
// ceil(T / RUNS) (thread = run · CH + channel, so neighbours read neighbouring channels). A run reads the KC−1
// raw inputs before its first token (from x, or from the state before token 0), then walks its tokens in order
// keeping them in registers: each output is the same f32 sum in the same order whatever RUNS is. The thread
// whose run ends at token T−1 rewrites the state only after a barrier, so every read of the old state comes
// first, and no workgroup reads a state column another writes. RUNS = 1: one thread per channel walks the chunk.
// The same dispatch computes the gates per token t and value head h (each thread of the grid takes every
// NTH-th (t, h); transformers' Qwen3_5GatedDeltaNet in f32), which gdn_recur reads after it:
//   g = −exp(A_log[h]) · softplus(a[t, h] + dt_bias[h])   (log of the state decay, ≤ 0; softplus threshold 20)
//   β = sigmoid(b[t, h])                                   (the delta rule's write strength)
// a and b are columns A_OFF + h and B_OFF + h of the in_proj rows.
// Constants: WG threads, RUNS runs a workgroup (dividing WG), CONV channels, ROW row length of x (channels are
//   x[t, 0..CONV)), KC width (≥ 2), VH value heads, A_OFF, B_OFF.
// Bindings: 0 x f32[T, ROW] (read; in_proj output, pre-activation), 1 w f16[CONV, KC] (read; conv1d_weight
//   [CONV, 1, KC], tap KC−1 multiplies the current token), 2 state f32[KC−1, CONV] (read_write; row i is the
//   raw input at position pos0 − (KC−1) + i on entry and pos0 + T − (KC−1) + i on exit),
//   3 y f32[T, CONV] (write), 4 step uniform (n_tokens, pos0), 5 a_log f32[VH] (read), 6 dt_bias f32[VH] (read),
//   7 gates f32[T, 2·VH] (write; g in [0, VH), β in [VH, 2·VH)).
// Grid: ceil(CONV / CH) workgroups, folded into (x, y) past 65,535 (workgroup id = y · nx + x).
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
const CH: u32 = WG / RUNS;

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
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let group = wid.y * nwg.x + wid.x;
    let n = step.n_tokens;
    let threads = nwg.x * nwg.y * WG;
    for (var i = group * WG + lid; i < n * VH; i += threads) {
        let t = i / VH;
        let h = i % VH;
        let a = x[t * ROW + A_OFF + h];
        let b = x[t * ROW + B_OFF + h];
        gates[t * 2u * VH + h] = -exp(a_log[h]) * softplus(a + dt_bias[h]);
        gates[t * 2u * VH + VH + h] = 1.0 / (1.0 + exp(-b));
    }
    let c = group * CH + lid % CH;
    let len = (n + RUNS - 1u) / RUNS;
    let t0 = min(lid / CH * len, n);
    let t1 = min(t0 + len, n);
    // hist[i]: the raw input HIST − i positions before the token about to be processed.
    var hist: array<f32, HIST>;
    if (c < CONV && t0 < t1) {
        var taps: array<f32, KC>;
        for (var j = 0u; j < KC; j++) { taps[j] = f32(w[c * KC + j]); }
        for (var i = 0u; i < HIST; i++) {
            // token t0 + i − HIST: in x, else state row t0 + i (zero before position 0)
            if (t0 + i >= HIST) {
                hist[i] = x[(t0 + i - HIST) * ROW + c];
            } else {
                hist[i] = select(0.0, state[(t0 + i) * CONV + c], step.pos0 + t0 + i >= HIST);
            }
        }
        for (var t = t0; t < t1; t++) {
            let cur = x[t * ROW + c];
            var acc = taps[HIST] * cur;
            for (var i = 0u; i < HIST; i++) { acc += taps[i] * hist[i]; }
            y[t * CONV + c] = acc / (1.0 + exp(-acc));
            for (var i = 0u; i + 1u < HIST; i++) { hist[i] = hist[i + 1u]; }
            hist[HIST - 1u] = cur;
        }
    }
    storageBarrier();  // every run's state reads above come before the last run's writes below
    if (c < CONV && t0 < t1 && t1 == n) {
        for (var i = 0u; i < HIST; i++) { state[i * CONV + c] = hist[i]; }
    }
}
