// matvec_q8 (int8 activations, 4-bit weights) fused, for decode, with the residual add and the per-chunk half of
// the next RMSNorm: each workgroup owns one 32-output chunk c; once its outputs are in y (storageBarrier: visible
// within the workgroup), 32 threads make them the new residual, y = r_in + W·x, and one writes for the chunk the
// int8 codes and scale (q8_codes.wgsl) of v = y · (nw + NORM_OFFSET), the norm's output without its 1/rms, and
// Σ y². The matvecs that read the normed row (matvec_q8_rms.wgsl) sum those into 1/rms themselves, so
// the norm needs no dispatch (and no grid-wide sync) of its own. No workgroup reads another's outputs.
// Constants: matvec_q8's (K, N a multiple of 32, WG, ROWS, BLOCKS with BLOCKS · ROWS = 32, GATE_UP false, BITS, ZERO,
//   AFFINE, GROUP), NORM_OFFSET (added to nw: zero-centred norms), META and SS (u32 offsets in nq).
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32[N, K / 8], 2 s f16[N, K / GROUP (, 2 with AFFINE)],
//   3 y f32[N] (read_write: the residual out), 4 xm vec2<f32>[K / 32], 5 r_in f32[N] (read: the residual in),
//   6 nw f16[N] (read: the norm weight), 7 nq u32 (write): the codes u32[N / 4] at 0, the (scale, Σ codes) f32
//   pairs at META, Σ y² per chunk (f32) at SS.
// Grid: fold_grid(N / 32).
#import reduce
#import matvec_q8_body
#import q8_codes
#import norm_chunk_out

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read> r_in: array<f32>;
@group(0) @binding(6) var<storage, read> nw: array<f16>;
@group(0) @binding(7) var<storage, read_write> nq: array<u32>;

fn nq_put(i: u32, v: u32) { nq[i] = v; }  // norm_chunk_out's store


@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let chunk = wid.y * nwg.x + wid.x;  // uniform: a folded grid's spare workgroups skip the epilogue together
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block((chunk * BLOCKS + blk) * ROWS, 0u, 0u, 0u, lane, BITS == 3u, 0u, 0u);
    }
    storageBarrier();
    // The chunk's 32 elements over 32 threads (any subgroup size), then one thread packs them from workgroup memory.
    let live = chunk < N / 32u;  // uniform: the workgroup's
    if (lane.lid < 32u && live) {
        let i = chunk * 32u + lane.lid;
        let x = r_in[i] + y[i];
        y[i] = x;
        v_sh[lane.lid] = x * (f32(nw[i]) + NORM_OFFSET);
        sq_sh[lane.lid] = x * x;
    }
    workgroupBarrier();
    if (lane.lid == 0u && live) {
        store_norm_chunk(chunk);
    }
}
