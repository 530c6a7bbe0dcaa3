// Greedy sampling: the index of the largest logit (lowest index on ties), kept on the GPU.
// Writes tokens[0] (the next step's embedding input) and out_tokens[step.out_index] (the readback ring).
// One workgroup. Constants: WG (power of two), VOCAB.
// Bindings: 0 logits f32[VOCAB], 1 tokens u32[...] (write [0]), 2 out_tokens u32[RING], 3 step uniform.
#import step

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> out_tokens: array<u32>;
@group(0) @binding(3) var<uniform> step: Step;

var<workgroup> best_val: array<f32, WG>;
var<workgroup> best_idx: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    var v = -3.4e38;
    var idx = 0xffffffffu;
    for (var i = lid; i < VOCAB; i += WG) {
        let l = logits[i];
        if (l > v) { v = l; idx = i; }  // strided scan: the first hit per thread is its lowest index
    }
    best_val[lid] = v;
    best_idx[lid] = idx;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lid < stride) {
            let ov = best_val[lid + stride];
            let oi = best_idx[lid + stride];
            if (ov > best_val[lid] || (ov == best_val[lid] && oi < best_idx[lid])) {
                best_val[lid] = ov;
                best_idx[lid] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid == 0u) {
        let token = select(best_idx[0], 0u, best_idx[0] == 0xffffffffu);
        tokens[0] = token;
        out_tokens[step.out_index] = token;
    }
}
