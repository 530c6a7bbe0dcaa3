// Decode matvec for matrices with many rows and a short K (gate_up, the LM head): each subgroup owns ROWS
// outputs and its lanes walk K one 32-element chunk at a time, so one subgroupAdd per weight row replaces the
// workgroup reduction and every lane keeps more loads in flight. bench/matvec_probe.py on the H200 (BENCH.md): faster
// than matvec_int4 on 16384×3072 and 32064×3072, but slower where K is long and N short (o, down), which keep
// matvec_int4. Needs subgroup ops (engine/blocks/linear.py decode_kernel picks it only when the GPU has them).
// Layouts, bindings and constants are matvec_int4.wgsl's, plus BLOCKS: row blocks of ROWS outputs per
// workgroup. A subgroup takes blocks sg_id, sg_id + n_sg, ...: the host sizes BLOCKS with the probed subgroup
// size, and any other size still covers every block.
#import step
#import reduce
#import matvec_body

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

fn x_vec(i: u32) -> vec4<f32> { return x[i]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    let x_base = select(0u, max(step.n_tokens, 1u) - 1u, LAST_ROW) * (K / 4u);
    for (var b = lane.sg_id; b < BLOCKS; b += lane.n_sg) {
        let first = (group_id * BLOCKS + b) * ROWS;
        let acc = row_sums(first, 0u, x_base, lane.sg_lane, lane.sg_size);
        var total: array<f32, WROWS4>;
        for (var i = 0u; i < WROWS; i++) { total[i] = subgroupAdd(acc[i]); }
        if (lane.sg_lane == 0u) {
            for (var i = 0u; i < ROWS; i++) { write_row(first, 0u, i, total); }
        }
    }
}
