// Workgroup tree reduction to the largest value, lowest index on ties (argmax, argmax_parts). Needs const WG, a
// power of two. Call from uniform control flow; the winner is left in best_val[0] and best_idx[0].

var<workgroup> best_val: array<f32, WG>;
var<workgroup> best_idx: array<u32, WG>;

fn reduce_best(lid: u32, v: f32, idx: u32) {
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
}
