// Merge split-K attention partials: out = Σ_s e^(m_s − M) · o_s / Σ_s e^(m_s − M) · l_s, M = max_s m_s.
// One workgroup per (head h, token t): grid (H, T); S = step.attn_splits.
// Empty splits carry m = -3e38, l = 0, o = 0 and so weigh nothing (split 0 is never empty).
// Constants: WG threads, H heads, HD head dim.
// Bindings: 0 part_o f32[S, T, H, HD] (read), 1 part_ml f32[S, T, H, 2] (read),
//   2 out f32[T, H·HD] (write), 3 step uniform (n_tokens, attn_splits).
#import step

@group(0) @binding(0) var<storage, read> part_o: array<f32>;
@group(0) @binding(1) var<storage, read> part_ml: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> step: Step;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let n_tokens = step.n_tokens;
    if (t >= n_tokens) { return; }
    let n_splits = step.attn_splits;
    // ml index of split s: ((s·T + t)·H + h)·2; consecutive splits are T·H·2 apart.
    let ml0 = (t * H + h) * 2u;
    let ml_stride = n_tokens * H * 2u;
    var m_max = part_ml[ml0];
    for (var s = 1u; s < n_splits; s++) { m_max = max(m_max, part_ml[ml0 + s * ml_stride]); }
    var denom = 0.0;
    for (var s = 0u; s < n_splits; s++) {
        let ml = ml0 + s * ml_stride;
        denom += exp(part_ml[ml] - m_max) * part_ml[ml + 1u];
    }
    let inv = 1.0 / denom;
    let o0 = (t * H + h) * HD;
    let o_stride = n_tokens * H * HD;
    for (var d = lid; d < HD; d += WG) {
        var o = 0.0;
        for (var s = 0u; s < n_splits; s++) {
            o += exp(part_ml[ml0 + s * ml_stride] - m_max) * part_o[o0 + s * o_stride + d];
        }
        out[o0 + d] = o * inv;
    }
}
