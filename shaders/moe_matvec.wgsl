// Expert matvec for MoE: for token t and routing slot s, y[t, s, n] = Σ_k W_e[n, k]·x[k] with expert
// e = ids[t, s] read from the GPU (no host round trip), f32 accumulate. The slot and the token are in the
// dispatch grid, so one dispatch runs every selected expert of every token: the gate_up matvec (with
// GATE_UP, y = silu(gate)·up, as in matvec_int4.wgsl) or the down matvec (with X_SLOT: x is that slot's own
// gate_up output). A stack of one expert (EXPERTS = 1) ignores the ids: the shared expert run apart, or the
// router logits of a prefill as a plain per-token matvec. The inner loop is matvec_int4's (shaders/matvec_body):
// ROWS outputs per workgroup, 32-element chunks, every weight load of a chunk issued before the math. For T > 1 each
// (token, slot) re-reads its expert's weights, so prefill runs the experts through moe_sort + moe_gemm instead; this
// kernel serves decode (f32 activations) and the router logits of a prefill.
// Weight format (engine/kernels/matmul.py FORMATS): BITS 4 or 8 codes, element k at bits BITS·(k % (32/BITS)) of word
//   k·BITS/32, w = (q − ZERO)·scale (+ min with AFFINE, (scale, min) f16 pairs), one scale per GROUP along K;
//   BITS 16: f16 weights (binding 3 bound but unread). Experts are stacked: expert e's rows start at row
//   e·MATS·N of binding 2 (and group row e·MATS·N of binding 3).
// Constants: K, N (outputs per expert), EXPERTS (experts in this stack), WG (power of two), ROWS, GATE_UP,
//   BITS, ZERO, AFFINE, GROUP, SLOTS (slots per token in ids), SLOT0 (the slot of grid z = 0),
//   X_SLOT (x row = t·SLOTS + s instead of t), X_STRIDE (floats per x row, a multiple of 4),
//   Y_STRIDE (floats per y row; y row = t·SLOTS + s).
// Streaming contract (issue 20): the expert is read from ids only; weights are expert e of the stacked bindings 2, 3.
// Bindings: 0 x f32 (read), 1 ids u32[T, SLOTS] (read), 2 w u32[EXPERTS, MATS·N, K·BITS/32] (read),
//   3 s f16[EXPERTS, MATS·N, K/GROUP (, 2)] (read), 4 y f32 (write), 5 step uniform (n_tokens).
// Grid: (ceil(N / ROWS), T, slots in this dispatch).
#import step
#import reduce
#import matvec_body

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> s: array<f16>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<uniform> step: Step;

fn x_vec(i: u32) -> vec4<f32> { return x[i]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let t = wid.y;
    if (t >= step.n_tokens) { return; }  // the whole workgroup leaves, so reductions stay uniform
    let slot = SLOT0 + wid.z;
    let row_slot = t * SLOTS + slot;
    let expert = min(ids[row_slot], EXPERTS - 1u);  // clamped: a bad id reads a real expert, never out of bounds
    let first = wid.x * ROWS;
    let x_base = select(t, row_slot, X_SLOT) * (X_STRIDE / 4u);

    let total = row_totals(row_sums(first, expert * MATS * N, x_base, lane.lid, WG), lane);
    write_row(first, row_slot * Y_STRIDE, lane.lid, total);
}
