// The MoE router's logits in decode when the matvec before the block carried the residual add and the norm's
// per-chunk half (matvec_q8_norm.wgsl): matvec_int4's arithmetic (shaders/matvec_body.wgsl) on the normed row
// x = r · 1/rms · (nw + NORM_OFFSET), which add_rms_norm would have written, rebuilt on the fly from the new
// residual r and Σ r² per 32-element chunk (ss), so the router keeps f32 activations (its top-k picks what the
// unfused path picks) and the norm needs no dispatch of its own. Every workgroup sums ss into 1/rms itself.
// Constants: matvec_int4's (K = D, N = E (+ 1: the shared expert's gate row), WG, ROWS, GATE_UP false, BITS, ZERO,
//   AFFINE, GROUP), EPS, NORM_OFFSET.
// Bindings: 0 r f32[K] (read: the residual), 1 nw f16[K] (read: the norm weight), 2 ss f32[K / 32] (read),
//   3 w u32[N, K·BITS/32], 4 s f16[N, K/GROUP (, 2)], 5 y f32[N] (write: the logits).
// Grid: fold_grid(ceil(N / ROWS)).
#import reduce
#import matvec_body

@group(0) @binding(0) var<storage, read> r: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> nw: array<f16>;
@group(0) @binding(2) var<storage, read> ss: array<f32>;
@group(0) @binding(3) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> s: array<f16>;
@group(0) @binding(5) var<storage, read_write> y: array<f32>;

var<private> inv_rms: f32;

// add_rms_norm's y = r · inv · (w + NORM_OFFSET), four elements at a time.
fn x_vec(i: u32) -> vec4<f32> {
    let g = vec4<f32>(f32(nw[4u * i]), f32(nw[4u * i + 1u]), f32(nw[4u * i + 2u]), f32(nw[4u * i + 3u]));
    return r[i] * inv_rms * (g + NORM_OFFSET);
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    if (group_id >= N_GROUPS) { return; }  // the whole workgroup leaves, so reductions stay uniform
    var part = 0.0;
    for (var c = lane.lid; c < K / 32u; c += WG) { part += ss[c]; }
    inv_rms = inverseSqrt(wg_sum(part, lane) / f32(K) + EPS);
    let first = group_id * ROWS;
    let total = row_totals(row_sums(first, 0u, 0u, lane.lid, WG), lane);
    write_row(first, 0u, lane.lid, total);
}
