// Decode matvec on 4-bit weights with int8 activations (quantize_q8.wgsl, or the norm that produced the row):
// the dot products run four products per dot4I8Packed instead of dequantising every weight to f32, which
// bench/matvec_probe.py measured as the matvecs' bottleneck on the H200 (the same loads without the dequant ALU
// ran faster, and this kernel faster still: BENCH.md). Activations carry int8 rounding per 32-element chunk (relative error ~0.4% of
// the chunk's largest value), as llama.cpp's q8_1 activations do; prefill GEMMs keep f32.
// Each subgroup owns ROWS outputs (as matvec_sg.wgsl, whose BLOCKS rule this shares) and its lanes walk K one
// 32-element chunk (one vec4<u32> of weights) at a time; the arithmetic is in matvec_q8_body.wgsl.
// Constants: K, N, WG, ROWS, BLOCKS, GATE_UP (y = silu(gate)·up, gate rows then up rows), BITS (4 here), ZERO,
//   AFFINE, GROUP.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32[N or 2N, K / 8], 2 s f16[N or 2N, K / GROUP (, 2 with AFFINE)],
//   3 y f32[N] (write), 4 xm vec2<f32>[K / 32]. Grid: fold_grid(ceil(N / (ROWS · BLOCKS))).
#import reduce
#import matvec_q8_body

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block((group_id * BLOCKS + blk) * ROWS, 0u, 0u, 0u, lane, BITS == 3u, 0u, 0u);
    }
}
