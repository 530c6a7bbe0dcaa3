// Output gate of Qwen3.5's gated attention: y = x · sigmoid(gate), elementwise over each token's N = H·HD
// attention outputs (transformers: attn_output * torch.sigmoid(gate), before o_proj).
// Epilogue: ROWS_F32 writes y as f32; ROWS_Q8 writes it as int8 as quantize_q8 would (q8_pack.wgsl), the
// o-projection's int8 input, without a quantize_q8 dispatch: a workgroup's WG values are WG / 32 whole chunks of the
// row (WG and N multiples of 32), staged through workgroup memory and packed by one thread each.
// Constants: WG threads, N values per token, ROWS_F32, ROWS_Q8 (bools).
// Bindings: 0 x f32[T, N] (read), 1 gate f32[T, N] (read), 2 y f32[T, N] (write), 3 step uniform (n_tokens),
//   4 xq u32[T, N/4] (write), 5 xm vec2<f32>[T, N/32] (write); 4 and 5 are bound whether or not ROWS_Q8.
// Grid: (ceil(N / WG), T).
#import step
#import q8_pack

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> gate: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;
@group(0) @binding(3) var<uniform> step: Step;
@group(0) @binding(4) var<storage, read_write> xq: array<u32>;
@group(0) @binding(5) var<storage, read_write> xm: array<vec2<f32>>;

const STAGE_STRIDE: u32 = 33u;  // f32s a staged chunk (32 + 1: the packers' reads fall on distinct banks)
var<workgroup> y_sh: array<f32, select(1u, WG / 32u * STAGE_STRIDE, ROWS_Q8)>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let i = wid.x * WG + lid;
    let t = wid.y;
    if (t >= step.n_tokens) { return; }  // uniform: t is the workgroup's
    if (i < N) {
        let k = t * N + i;
        let v = x[k] / (1.0 + exp(-gate[k]));
        if (ROWS_F32) { y[k] = v; }
        if (ROWS_Q8) { y_sh[lid / 32u * STAGE_STRIDE + lid % 32u] = v; }
    }
    if (ROWS_Q8) {  // a constant: the barrier stays in uniform control flow
        workgroupBarrier();
        let c = wid.x * (WG / 32u) + lid;  // the chunk of row t thread lid packs
        if (lid < WG / 32u && c < N / 32u) {
            var v: array<vec4<f32>, 8>;
            for (var j = 0u; j < 8u; j++) {
                let at = lid * STAGE_STRIDE + 4u * j;
                v[j] = vec4<f32>(y_sh[at], y_sh[at + 1u], y_sh[at + 2u], y_sh[at + 3u]);
            }
            store_q8_chunk(t * (N / 32u) + c, &v);
        }
    }
}
