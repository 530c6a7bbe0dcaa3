// Expert matvec for MoE decode (one token) on 4-bit or MLX 3-bit experts with int8 activations: moe_matvec.wgsl's
// routing (the slot in grid z, the expert id read from the GPU) with matvec_q8's arithmetic (matvec_q8_body.wgsl), each
// subgroup owning ROWS outputs (BLOCKS of them per workgroup, as matvec_sg.wgsl). x comes quantized: the norm's
// int8 row for gate_up, or one quantize_q8 row per slot for down (X_SLOT).
// Constants: K, N, EXPERTS, WG, ROWS, BLOCKS, GATE_UP, BITS (4, or 3: rows of 3K/32 words, one bitstream each),
//   ZERO, AFFINE, GROUP, SLOTS, SLOT0, X_SLOT, Y_STRIDE.
//   MIXED_W, MIXED_S: 0, or (a 3-bit stack followed by a 4-bit shared expert of the same shape, Qwen3.6's 3-bit
//   build) the u32 offset in w and the f16 offset in s of the 4-bit expert's rows; it is expert EXPERTS − 1 (the id
//   the router gives the shared slot), so one dispatch runs the routed and the shared slots.
// Streaming contract (issue 20): the expert is read from ids only; weights are expert e of the stacked w and s
//   (with MIXED_W, id EXPERTS − 1 selects the 4-bit rows stored after the stack).
// Bindings: 0 xq u32[rows, K / 4] as vec4, 1 ids u32[SLOTS] (read), 2 w u32[EXPERTS, MATS·N, K·BITS/32],
//   3 s f16[EXPERTS, MATS·N, K / GROUP (, 2)], 4 y f32[SLOTS, Y_STRIDE] (write; row = slot),
//   5 xm vec2<f32>[rows, K / 32]. Grid: (ceil(N / (ROWS · BLOCKS)), 1, slots in this dispatch).
#import reduce
#import matvec_q8_body

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> ids: array<u32>;
@group(0) @binding(2) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> s: array<f16>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<storage, read> xm: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let slot = SLOT0 + wid.z;
    let expert = min(ids[slot], EXPERTS - 1u);  // clamped: a bad id reads a real expert, never out of bounds
    let apart = MIXED_W > 0u && expert == EXPERTS - 1u;  // workgroup-uniform: the 4-bit rows after a 3-bit stack
    let row0 = select(expert * MATS * N, 0u, apart);
    let wbase = select(0u, MIXED_W, apart);
    let sbase = select(0u, MIXED_S, apart);
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block((wid.x * BLOCKS + blk) * ROWS, row0, select(0u, slot, X_SLOT), slot * Y_STRIDE, lane,
                 BITS == 3u && !apart, wbase, sbase);
    }
}
