// Workgroup-wide reductions with a shared-memory tree: the path for GPUs without subgroup ops.
// Needs const WG (threads, a power of two). Call from uniform control flow only.

struct Lane {
    @builtin(local_invocation_index) lid: u32,
}

var<workgroup> red_vec: array<vec4<f32>, WG>;

fn wg_sum4(v: vec4<f32>, lane: Lane) -> vec4<f32> {
    red_vec[lane.lid] = v;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lane.lid < stride) { red_vec[lane.lid] += red_vec[lane.lid + stride]; }
        workgroupBarrier();
    }
    let total = red_vec[0];
    workgroupBarrier();
    return total;
}

fn wg_sum(v: f32, lane: Lane) -> f32 {
    return wg_sum4(vec4<f32>(v, 0.0, 0.0, 0.0), lane).x;
}

fn wg_max(v: f32, lane: Lane) -> f32 {
    red_vec[lane.lid] = vec4<f32>(v);
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride = stride / 2u) {
        if (lane.lid < stride) { red_vec[lane.lid].x = max(red_vec[lane.lid].x, red_vec[lane.lid + stride].x); }
        workgroupBarrier();
    }
    let m = red_vec[0].x;
    workgroupBarrier();
    return m;
}

// Without subgroup ops every thread is a subgroup of one: (size 1, lane 0, id = the thread's index).
fn subgroup_place(lane: Lane) -> vec3<u32> {
    return vec3<u32>(1u, 0u, lane.lid);
}

// The sum over groups of `width` lanes: here width is 1, the value itself.
fn lanes_sum4(v: vec4<f32>, width: u32) -> vec4<f32> {
    return v;
}
