// Output gate of Qwen3.5's gated attention: y = x · sigmoid(gate), elementwise over each token's N = H·HD
// attention outputs (transformers: attn_output * torch.sigmoid(gate), before o_proj).
// Constants: WG threads, N values per token.
// Bindings: 0 x f32[T, N] (read), 1 gate f32[T, N] (read), 2 y f32[T, N] (write), 3 step uniform (n_tokens).
// Grid: (ceil(N / WG), T).
#import step

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> step: Step;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if (i >= N || t >= step.n_tokens) { return; }
    let k = t * N + i;
    y[k] = x[k] / (1.0 + exp(-gate[k]));
}
