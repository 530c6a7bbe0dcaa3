// Merge split-K attention partials: out = Σ_s e^(m_s − M) · o_s / Σ_s e^(m_s − M) · l_s, M = max_s m_s.
// One workgroup per (head h, token t): grid (H, T); S = step.attn_splits.
// Empty splits carry m = -3e38, l = 0, o = 0 and so weigh nothing (split 0 is never empty).
// With Q8 (decode, n_tokens = 1; HD a multiple of 32) the head's output also goes to int8 as quantize_q8 would
// write it (q8_pack.wgsl): the o-projection's int8 input, without a quantize_q8 dispatch of its own. Each of the
// head's HD/32 chunks lies inside the head, so the workgroup quantizes its own.
// Constants: WG threads, H heads, HD head dim, Q8.
// Bindings: 0 part_o f32[S, T, H, HD] (read), 1 part_ml f32[S, T, H, 2] (read),
//   2 out f32[T, H·HD] (write), 3 step uniform (n_tokens, attn_splits), 4 xq u32[H·HD/4] (write),
//   5 xm vec2<f32>[H·HD/32] (write); 4 and 5 are bound whether or not Q8.
#import step
#import q8_pack

@group(0) @binding(0) var<storage, read> part_o: array<f32>;
@group(0) @binding(1) var<storage, read> part_ml: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;
@group(0) @binding(3) var<uniform> step: Step;
@group(0) @binding(4) var<storage, read_write> xq: array<u32>;
@group(0) @binding(5) var<storage, read_write> xm: array<vec2<f32>>;

var<workgroup> o_sh: array<f32, select(1u, HD, Q8)>;

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
        if (Q8) { o_sh[d] = o * inv; }
    }
    if (Q8 && n_tokens == 1u) {
        workgroupBarrier();
        for (var c = lid; c < HD / 32u; c += WG) {
            var v: array<vec4<f32>, 8>;
            for (var j = 0u; j < 8u; j++) {
                let d = 32u * c + 4u * j;
                v[j] = vec4<f32>(o_sh[d], o_sh[d + 1u], o_sh[d + 2u], o_sh[d + 3u]);
            }
            store_q8_chunk(h * (HD / 32u) + c, &v);
        }
    }
}
