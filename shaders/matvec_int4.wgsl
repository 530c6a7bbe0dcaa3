// Decode matvec on packed weights: y[n] = Σ_k W[n, k]·x[k] for one activation row, f32 accumulate.
// A workgroup owns ROWS outputs. Each thread walks K one 32-element chunk at a time: per chunk it loads
// the chunk's weight words (one vec4<u32> at 4 bits) and scale for every weight row of the workgroup
// before doing any math, so ROWS (2·ROWS with GATE_UP) independent loads are in flight, and reuses the
// 8 vec4 of x across them. Partial sums meet through wg_sum4, four rows per call.
// Weight format (engine/kernels/matmul.py FORMATS; the defaults BITS=4, ZERO=7, AFFINE=false, GROUP=32 are MLC q4f16_1):
//   BITS 4 or 8: element k of a row is the code q at bits BITS·(k % (32/BITS)) of u32 word k·BITS/32;
//     w = (q − ZERO)·scale[k / GROUP], or (q − ZERO)·scale + min with AFFINE. GROUP is a multiple of 32:
//     a chunk never straddles two groups, a larger group simply shares its scale across GROUP/32 chunks.
//   BITS 16: w is f16, two per word (element 2j in the low half); binding 2 must be bound but is not read.
// Constants: K (multiple of GROUP), N outputs, WG threads (a power of two for the workgroup-memory
//   reduction), ROWS outputs per workgroup, LAST_ROW (read x row n_tokens-1 instead of row 0: the LM
//   head after a prefill), GATE_UP (W has 2N rows, gate [0, N) then up [N, 2N); y[j] = silu(gate_j)·up_j),
//   BITS, ZERO, AFFINE, GROUP.
// Bindings: 0 x f32[T, K] (read), 1 w u32[N or 2N, K·BITS/32] (read),
//   2 s f16[N or 2N, K/GROUP] (read; with AFFINE (scale, min) pairs f16[N or 2N, K/GROUP, 2]),
//   3 y f32[N] (write), 4 step uniform (n_tokens).
// Grid: fold_grid(ceil(N / ROWS)); the workgroup id is rebuilt from (x, y).
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
    if (group_id >= N_GROUPS) { return; }  // the whole workgroup leaves, so reductions stay uniform
    let first = group_id * ROWS;
    let x_base = select(0u, max(step.n_tokens, 1u) - 1u, LAST_ROW) * (K / 4u);
    let total = row_totals(row_sums(first, 0u, x_base, lane.lid, WG), lane);
    write_row(first, 0u, lane.lid, total);
}
