// matvec_q8 (int8 activations, 4-bit weights; same grid and constants) whose int8 input row is an RMSNorm's output
// without its 1/rms: matvec_q8_norm.wgsl wrote the codes and scales of v = x·w, with Σ x² per 32-element chunk in ss
// (the int8 codes of v are those of v/rms; its scales are 1/rms times larger). Each subgroup sums ss into
// 1/rms = rsqrt(Σ x² / K + EPS) (subgroupAdd: the same order in every subgroup, no barrier) and multiplies its dot
// products by it, so the norm needs no dispatch of its own.
// Constants: matvec_q8's (K, N, WG, ROWS, BLOCKS, GATE_UP, BITS, ZERO, AFFINE, GROUP), EPS.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32[N or 2N, K / 8], 2 s f16[N or 2N, K / GROUP (, 2 with AFFINE)],
//   3 y f32[N] (write), 4 xm vec2<f32>[K / 32], 5 ss f32[K / 32] (read). Grid: fold_grid(ceil(N / (ROWS · BLOCKS))).
#import reduce
#import matvec_q8_body

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read> ss: array<f32>;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    var part = 0.0;
    for (var c = lane.sg_lane; c < K / 32u; c += lane.sg_size) { part += ss[c]; }
    let scale = inverseSqrt(subgroupAdd(part) / f32(K) + EPS);
    let group_id = wid.y * nwg.x + wid.x;
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block_scaled((group_id * BLOCKS + blk) * ROWS, 0u, 0u, 0u, scale, lane, BITS == 3u, 0u, 0u);
    }
}
