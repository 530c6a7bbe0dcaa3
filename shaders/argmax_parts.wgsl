// Greedy sampling over a big vocabulary, first pass: workgroup w finds the largest logit (lowest index on ties) of
// its slice [w·SLICE, (w + 1)·SLICE) and writes it to parts: value at [w], index (as f32 bits) at [PARTS + w].
// argmax.wgsl with PARTS then reduces those PARTS pairs in one workgroup: two short passes instead of one
// workgroup walking the whole row (slow for Qwen3's 151,936 logits on the H200: BENCH.md).
// Constants: WG (power of two), VOCAB, PARTS, SLICE (= ceil(VOCAB / PARTS)).
// Bindings: 0 logits f32[VOCAB] (read), 1 parts f32[2·PARTS] (write). Grid: PARTS workgroups.
#import argmax_reduce

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> parts: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let end = min((wid.x + 1u) * SLICE, VOCAB);
    var v = -3.4e38;
    var idx = 0xffffffffu;
    for (var i = wid.x * SLICE + lid; i < end; i += WG) {
        let l = logits[i];
        if (l > v) { v = l; idx = i; }  // strided scan: the first hit per thread is its lowest index
    }
    reduce_best(lid, v, idx);
    if (lid == 0u) {
        parts[wid.x] = best_val[0];
        parts[PARTS + wid.x] = bitcast<f32>(best_idx[0]);
    }
}
