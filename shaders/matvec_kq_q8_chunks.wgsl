// Decode matvec on Q2_K / Q3_K blocks with int8 activations (quantize_q8.wgsl's layout, q8_pack.wgsl: per 32-element
// chunk int8 codes xq, scale xs and Σ xq), four products per dot4I8Packed as llama.cpp's q8_1 path does. Their
// kernel from FEW_ROWS_N outputs (below it matvec_kq_q8_wide.wgsl); the other types run matvec_kq_q8.wgsl or
// matvec_kq_q8_vec4.wgsl (engine/kquant_plan.py).
// Per chunk and half h (16 elements; both types scale per 16): Σ w·x = xs·(a_h·Σ u·xq + b_h·Σ xq) in kq_decode.wgsl's
// form, the integer sums exact. Each lane puts its chunk's activation words in element order once and reuses them
// for the ROWS rows it owns.
// Each subgroup owns ROWS outputs (row blocks sg_id, sg_id + n_sg, ... of the workgroup's BLOCKS, as matvec_q8.wgsl);
// its lanes walk K one chunk at a time and meet through subgroupAdd. Needs subgroup ops.
// Constants: K (a multiple of QK), N, WG, ROWS, BLOCKS, GATE_UP (gate rows then up rows; y = silu(gate)·up),
//   BATCH (chunks a lane takes per pass), KTYPE (10 or 11), QK, BW, BH.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32 q_blocks, 2 wh f16 (q_d, or q_blocks again), 3 y f32[N] (write),
//   4 xm vec2<f32>[K / 32] (scale, Σ codes). Grid: fold_grid(ceil(N / (ROWS · BLOCKS))).
#import reduce
#import kq_decode
#import q8_element_order
#import kq_q8_rows

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

const CHUNKS: u32 = K / 32u;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let group_id = wid.y * nwg.x + wid.x;
    for (var blkrow = lane.sg_id; blkrow < BLOCKS; blkrow += lane.n_sg) {
        let first = (group_id * BLOCKS + blkrow) * ROWS;
        let blk0 = kq_row_blocks(first);
        var acc = array<f32, WROWS>();
        for (var c0 = lane.sg_lane; c0 < CHUNKS; c0 += BATCH * lane.sg_size) {
          for (var u = 0u; u < BATCH; u++) {
            // BATCH chunks a lane at a time, none behind a branch (past the row: its last chunk, not summed), so
            // their loads can all be in flight together.
            let live = c0 + u * lane.sg_size < CHUNKS;
            let c = min(c0 + u * lane.sg_size, CHUNKS - 1u);
            let blk_off = c / CPB;
            let cc = c % CPB;
            let a = xq[2u * c];
            let b = xq[2u * c + 1u];
            var xc: array<u32, 8>;
            let w0 = in_order(a.x, a.y);
            let w1 = in_order(a.z, a.w);
            let w2 = in_order(b.x, b.y);
            let w3 = in_order(b.z, b.w);
            xc[0] = w0.x; xc[1] = w0.y; xc[2] = w1.x; xc[3] = w1.y;
            xc[4] = w2.x; xc[5] = w2.y; xc[6] = w3.x; xc[7] = w3.y;
            let m = xm[c];  // (activation scale, Σ xq over the chunk)
            // Σ xq over the first half (elements 0..15 are a's bytes in either order); the second is the rest.
            let s0 = dot4I8Packed(a.x, ONES) + dot4I8Packed(a.y, ONES) + dot4I8Packed(a.z, ONES)
                   + dot4I8Packed(a.w, ONES);
            let xsum = vec2<f32>(f32(s0), m.y - f32(s0));
            for (var i = 0u; i < WROWS; i++) {
                let blk = blk0[i] + blk_off;
                let ab = kq_affine(blk, cc);
                var d0 = 0;
                var d1 = 0;
                for (var j = 0u; j < 4u; j++) {
                    d0 += dot4I8Packed(kq_word(blk, cc, j), xc[j]);
                    d1 += dot4I8Packed(kq_word(blk, cc, j + 4u), xc[j + 4u]);
                }
                acc[i] += select(0.0, m.x * (ab.x * f32(d0) + ab.y * f32(d1) + ab.z * xsum.x + ab.w * xsum.y), live);
            }
          }
        }
        store_kq_rows(first, acc, lane);
    }
}
