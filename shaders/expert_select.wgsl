// Expert-cache row select: y[r] = yb[r] for every (token, routing slot) row r = t·SLOTS + s whose mask[r] is 1.
// A prefill chunk whose experts outnumber the GPU expert cache runs in batches of experts (engine/blocks/
// expert_cache.py); each batch's down pass writes yb, and this keeps only that batch's rows, so every row of y is
// written once, by the expert kernels' own arithmetic.
// Constants: D (floats per row, a multiple of 4), SLOTS (rows per token), WG threads.
// Bindings: 0 yb f32[T, SLOTS, D] (read), 1 mask u32[T, SLOTS] (read), 2 y f32[T, SLOTS, D] (read_write),
//   3 step uniform (n_tokens).
// Grid: fold_grid(ceil(T·SLOTS·D/4 / WG)); the workgroup id is rebuilt from (x, y).
#import step

@group(0) @binding(0) var<storage, read> yb: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> mask: array<u32>;
@group(0) @binding(2) var<storage, read_write> y: array<vec4<f32>>;
@group(0) @binding(3) var<uniform> step: Step;

const D4: u32 = D / 4u;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = (wid.y * nwg.x + wid.x) * WG + lid;
    if (i >= step.n_tokens * SLOTS * D4) { return; }
    if (mask[i / D4] == 1u) {
        y[i] = yb[i];
    }
}
