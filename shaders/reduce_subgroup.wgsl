// Workgroup-wide reductions built on subgroup ops. Works for any subgroup size: the subgroup count
// and id come from builtins, partial sums meet in workgroup memory. Needs const WG (threads).
// Call from uniform control flow only.

struct Lane {
    @builtin(local_invocation_index) lid: u32,
    @builtin(subgroup_invocation_id) sg_lane: u32,
    @builtin(subgroup_id) sg_id: u32,
    @builtin(num_subgroups) n_sg: u32,
    @builtin(subgroup_size) sg_size: u32,
}

var<workgroup> red_vec: array<vec4<f32>, WG>;

fn wg_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    let s = subgroupAdd(v);
    if (lane.sg_lane == 0u) { red_vec[lane.sg_id] = s; }
    workgroupBarrier();
    var total = vec4<f32>(0.0);
    for (var i = 0u; i < lane.n_sg; i++) { total += red_vec[i]; }
    workgroupBarrier();
    return total;
}

fn wg_sum(v: f32, lane: Lane) -> f32 {
    return wg_sum4(vec4<f32>(v, 0.0, 0.0, 0.0), lane).x;
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    let s = subgroupMax(v);
    if (lane.sg_lane == 0u) { red_vec[lane.sg_id] = vec4<f32>(s); }
    workgroupBarrier();
    var m = red_vec[0].x;
    for (var i = 1u; i < lane.n_sg; i++) { m = max(m, red_vec[i].x); }
    workgroupBarrier();
    return m;
}

// The subgroup a thread sits in: (size, the thread's lane, the subgroup's id in the workgroup).
fn subgroup_place(lane: Lane) -> vec3<u32> {
    return vec3<u32>(lane.sg_size, lane.sg_lane, lane.sg_id);
}

// The sum over aligned groups of `width` lanes (a power of two ≤ the subgroup size), every lane of a group getting it.
fn lanes_sum4(v: vec4<f32>, width: u32) -> vec4<f32> {
    var s = v;
    for (var off = 1u; off < width; off <<= 1u) { s += subgroupShuffleXor(s, off); }
    return s;
}
