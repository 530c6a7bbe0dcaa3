// Embedding lookup with q4f16_1 dequantization: x[t, :] = (q − 7) · scale of row tokens[t].
// One thread per packed u32 word (8 values). Grid: (ceil(D/8 / WG), n_tokens).
// Constants: WG, D (model dim, multiple of 32), VOCAB.
// Bindings: 0 tokens u32[T], 1 q_weight u32[VOCAB, D/8], 2 q_scale f16[VOCAB, D/32],
//           3 x f32[T, D] (write), 4 step uniform.
#import step

@group(0) @binding(0) var<storage, read> tokens: array<u32>;
@group(0) @binding(1) var<storage, read> q_weight: array<u32>;
@group(0) @binding(2) var<storage, read> q_scale: array<f16>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const WORDS: u32 = D / 8u;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let word = gid.x;
    let t = gid.y;
    if (word >= WORDS || t >= step.n_tokens) { return; }
    let token = tokens[t];
    let out = t * D + word * 8u;
    if (token >= VOCAB) {  // an id outside the vocabulary embeds as zeros instead of reading garbage
        for (var i = 0u; i < 8u; i++) { x[out + i] = 0.0; }
        return;
    }
    let packed = q_weight[token * WORDS + word];
    let scale = f32(q_scale[token * (D / 32u) + word / 4u]);
    for (var i = 0u; i < 8u; i++) {
        x[out + i] = (f32((packed >> (4u * i)) & 15u) - 7.0) * scale;
    }
}
