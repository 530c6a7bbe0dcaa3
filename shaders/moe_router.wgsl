// MoE routing for one token per workgroup: softmax over all E router logits in f32, the TOPK largest
// (ties go to the lower expert index), renormalised to sum 1 when NORM_TOPK; with SHARED the shared expert
// takes slot TOPK with id E and weight sigmoid(logit[E]) (its gate logit rides in the router matrix's row E).
// Selection compares logits, not probabilities: softmax is monotonic, and exp underflow cannot make ties.
// Slots come out in selection order (largest probability first), like torch.topk.
// Constants: E experts, TOPK, SHARED (bool), NORM_TOPK (bool), WG threads (a power of two for the
//   workgroup-memory reduction); SLOTS = TOPK + SHARED and LSTRIDE = E + SHARED are derived here.
// Bindings: 0 logits f32[T, LSTRIDE] (read), 1 ids u32[T, SLOTS] (write), 2 weights f32[T, SLOTS] (write),
//   3 step uniform (n_tokens).
// Grid: fold_grid(T); the workgroup id is the token, rebuilt from (x, y).
#import step
#import reduce

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> ids: array<u32>;
@group(0) @binding(2) var<storage, read_write> weights: array<f32>;
@group(0) @binding(3) var<uniform> step: Step;

const SLOTS: u32 = TOPK + select(0u, 1u, SHARED);
const LSTRIDE: u32 = E + select(0u, 1u, SHARED);
const PER: u32 = (E + WG - 1u) / WG;  // logits per thread: expert lid + j·WG
const NONE: f32 = -3.4028235e38;       // below every real logit: marks padding and chosen experts

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = wid.y * nwg.x + wid.x;
    if (t >= step.n_tokens) { return; }  // the whole workgroup leaves, so reductions stay uniform
    let base = t * LSTRIDE;

    var l: array<f32, PER>;
    var local_max = NONE;
    for (var j = 0u; j < PER; j++) {
        let e = lane.lid + j * WG;
        l[j] = select(NONE, logits[base + min(e, E - 1u)], e < E);
        local_max = max(local_max, l[j]);
    }
    let m = wg_max(local_max, lane);
    var local_sum = 0.0;
    for (var j = 0u; j < PER; j++) {
        if (lane.lid + j * WG < E) { local_sum += exp(l[j] - m); }
    }
    let total = wg_sum(local_sum, lane);

    var top_id: array<u32, TOPK>;
    var top_p: array<f32, TOPK>;
    var picked = 0.0;
    for (var r = 0u; r < TOPK; r++) {
        // This thread's best (strict > keeps the lower index on ties), then the workgroup's best value,
        // then the lowest index holding it (indices go through f32 negated: exact below 2^24).
        var best = NONE;
        var best_j = PER;
        for (var j = 0u; j < PER; j++) {
            if (l[j] > best) { best = l[j]; best_j = j; }
        }
        let best_all = wg_max(best, lane);
        let mine = best_j < PER && best == best_all;
        let idx = u32(-wg_max(select(NONE, -f32(lane.lid + best_j * WG), mine), lane));
        if (mine && lane.lid + best_j * WG == idx) { l[best_j] = NONE; }
        top_id[r] = idx;
        top_p[r] = exp(best_all - m) / total;
        picked += top_p[r];
    }

    if (lane.lid == 0u) {
        let out = t * SLOTS;
        for (var r = 0u; r < TOPK; r++) {
            ids[out + r] = top_id[r];
            weights[out + r] = select(top_p[r], top_p[r] / picked, NORM_TOPK);
        }
        if (SHARED) {
            ids[out + TOPK] = E;
            weights[out + TOPK] = 1.0 / (1.0 + exp(-logits[base + E]));
        }
    }
}
