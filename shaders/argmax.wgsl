// Greedy sampling: the index of the largest logit (lowest index on ties), kept on the GPU.
// Writes tokens[0] (the next step's embedding input) and out_tokens[step.out_index] (the readback ring).
// One workgroup. Constants: WG (power of two), VOCAB, PARTS: 0 reads the logits themselves; > 0 reads the PARTS
// (value, index) pairs argmax_parts.wgsl wrote (values at [0, PARTS), indices as f32 bits after them).
// Bindings: 0 logits f32[VOCAB] or parts f32[2·PARTS], 1 tokens u32[...] (write [0]), 2 out_tokens u32[RING],
//   3 step uniform.
#import step
#import argmax_reduce

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> out_tokens: array<u32>;
@group(0) @binding(3) var<uniform> step: Step;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    var v = -3.4e38;
    var idx = 0xffffffffu;
    if (PARTS == 0u) {
        for (var i = lid; i < VOCAB; i += WG) {
            let l = logits[i];
            if (l > v) { v = l; idx = i; }  // strided scan: the first hit per thread is its lowest index
        }
    } else {
        for (var i = lid; i < PARTS; i += WG) {
            let l = logits[i];
            let j = bitcast<u32>(logits[PARTS + i]);
            if (l > v || (l == v && j < idx)) { v = l; idx = j; }  // slices ascend, but keep ties exact anyway
        }
    }
    reduce_best(lid, v, idx);
    if (lid == 0u) {
        let token = select(best_idx[0], 0u, best_idx[0] == 0xffffffffu);
        tokens[0] = token;
        out_tokens[step.out_index] = token;
    }
}
