// Decode matvec, subgroup variant: like matvec_int4, but each SUBGROUP owns ROWS outputs and splits K among its
// own lanes, so rows meet in one subgroupAdd with no workgroup memory and no barrier; the WG / SG subgroups of
// a workgroup work on different rows. Needs the subgroup feature; SG (the device's subgroup size, probed at run
// time) must divide WG. Layout, formats, constants and bindings as matvec_int4.wgsl, plus SG.
// Grid: fold_grid(ceil(N_GROUPS / (WG / SG))) with N_GROUPS = ceil(N / ROWS).
#import step
#import reduce
#import matvec_body

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = (wid.y * nwg.x + wid.x) * (WG / SG) + lane.sg_id;
    if (group_id >= N_GROUPS) { return; }  // the whole subgroup leaves, so subgroupAdd stays uniform
    let first = group_id * ROWS;
    let x_base = select(0u, max(step.n_tokens, 1u) - 1u, LAST_ROW) * (K / 4u);
    let acc = row_sums(first, x_base, lane.sg_lane, SG);
    var total: array<f32, SLOTS4>;
    for (var i = 0u; i < SLOTS4; i += 4u) {
        let t = subgroupAdd(vec4<f32>(acc[i], acc[i + 1u], acc[i + 2u], acc[i + 3u]));
        total[i] = t.x;
        total[i + 1u] = t.y;
        total[i + 2u] = t.z;
        total[i + 3u] = t.w;
    }
    write_row(first, lane.sg_lane, total);
}
