// MoE routing of one token by one subgroup, with subgroup operations only (no barrier: one subgroup of a workgroup
// can route while the others wait): moe_router.wgsl's rule, softmax over all E logits in f32, the TOPK largest with
// ties to the lower expert index, renormalised to sum 1 when NORM_TOPK; with SHARED the shared expert takes slot
// TOPK with id E and weight sigmoid(logit E). Pick r is the largest logit after pick r − 1 in the order (value
// descending, index ascending), so no expert needs marking. A logit no finite value beats (−inf, NaN) is never
// picked; were fewer than TOPK pickable, the id is E (the expert kernels clamp it to a real expert).
// The including kernel declares lg (array<f32, LSTRIDE> the token's logits, in workgroup memory) and imports
// reduce (Lane); constants E, TOPK, SHARED, NORM_TOPK.

const SLOTS: u32 = TOPK + select(0u, 1u, SHARED);
const LSTRIDE: u32 = E + select(0u, 1u, SHARED);
const NO_LOGIT: f32 = -3.4028235e38;  // below every pickable logit

struct Route {
    ids: array<u32, SLOTS>,
    weights: array<f32, SLOTS>,
}

// Call from subgroup-uniform control flow; every lane gets the route.
fn route_subgroup(lane: Lane) -> Route {
    var m = NO_LOGIT;
    for (var e = lane.sg_lane; e < E; e += lane.sg_size) { m = max(m, lg[e]); }
    m = subgroupMax(m);
    var part = 0.0;
    for (var e = lane.sg_lane; e < E; e += lane.sg_size) { part += exp(lg[e] - m); }
    let total = subgroupAdd(part);
    var out: Route;
    var prob: array<f32, TOPK>;
    var picked = 0.0;
    var last_v = 0.0;
    var last_e = 0u;
    for (var k = 0u; k < TOPK; k++) {
        var best = NO_LOGIT;
        var best_e = E;
        for (var e = lane.sg_lane; e < E; e += lane.sg_size) {  // e ascending: strict > keeps the lower index
            let v = lg[e];
            let after = k == 0u || v < last_v || (v == last_v && e > last_e);
            if (after && v > best) { best = v; best_e = e; }
        }
        last_v = subgroupMax(best);
        last_e = subgroupMin(select(E, best_e, best == last_v));
        out.ids[k] = last_e;
        prob[k] = exp(last_v - m) / total;
        picked += prob[k];
    }
    for (var k = 0u; k < TOPK; k++) { out.weights[k] = select(prob[k], prob[k] / picked, NORM_TOPK); }
    if (SHARED) {
        out.ids[SLOTS - 1u] = E;  // slot TOPK (indices written so that they stay in bounds without SHARED)
        out.weights[SLOTS - 1u] = 1.0 / (1.0 + exp(-lg[LSTRIDE - 1u]));
    }
    return out;
}
