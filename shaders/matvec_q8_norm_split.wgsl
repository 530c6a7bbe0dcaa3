// matvec_q8_norm.wgsl split along K (SPLITS > 1), for matrices with too few 32-output chunks to fill the GPU:
// workgroup g takes chunk g / SPLITS over split g % SPLITS of K's 32-element blocks ([t·P, min((t+1)·P, K/32)),
// P = ceil(K/32 / SPLITS); a split may be empty) and stores its 32 partial sums in the chunk's partial record, then
// (storageBarrier) takes the chunk's ticket; the one that draws SPLITS − 1 arrives last: every other split's partial
// is written and visible to it, so it resets the ticket (for the next dispatch; dispatches are ordered by barriers),
// sums the partials in split order (the same sum whatever order the workgroups ran in) and runs matvec_q8_norm's
// epilogue. No workgroup waits for another, so any order of execution and any number in flight is fine.
// Cross-workgroup data moves as attention_decode_split.wgsl's does: through Device-scope atomics (f32 bit-cast;
// naga gives storage buffers no Coherent decoration), so nq, which holds the partials and tickets past the packed
// row, is atomic and the epilogue stores its row through nq_put.
// Constants: matvec_q8_norm's, SPLITS, TICKETS and PART (u32 offsets in nq: engine/kernels/matmul.py
//   norm_pack_layout with room for SPLITS).
// Bindings: matvec_q8_norm's, with 7 nq atomic<u32> (read_write): the packed row as there, tickets u32[N / 32] at
//   TICKETS (zero between dispatches), the partials f32 bits [N / 32, SPLITS, 32] at PART (128-byte records).
// Grid: fold_grid(N / 32 · SPLITS).
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
@group(0) @binding(7) var<storage, read_write> nq: array<atomic<u32>>;

const PER_SPLIT: u32 = (CHUNKS + SPLITS - 1u) / SPLITS;

var<workgroup> ticket_sh: u32;

fn nq_put(i: u32, v: u32) { atomicStore(&nq[i], v); }  // norm_chunk_out's store

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let g = wid.y * nwg.x + wid.x;
    if (g >= N / 32u * SPLITS) { return; }  // uniform: a folded grid's spare workgroups leave together
    let chunk = g / SPLITS;
    let split = g % SPLITS;
    let c_begin = min(split * PER_SPLIT, CHUNKS);
    let c_end = min(c_begin + PER_SPLIT, CHUNKS);
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        let sums = q8_block_sums((chunk * BLOCKS + blk) * ROWS, 0u, 0u, lane, BITS == 3u, 0u, 0u, c_begin, c_end);
        if (lane.sg_lane == 0u) {
            let rec = PART + (chunk * SPLITS + split) * 32u + blk * ROWS;
            for (var i = 0u; i < ROWS; i++) { atomicStore(&nq[rec + i], bitcast<u32>(sums[i])); }
        }
    }
    storageBarrier();  // the partial is visible at device scope before the ticket is taken
    if (lane.lid == 0u) { ticket_sh = atomicAdd(&nq[TICKETS + chunk], 1u); }
    if (workgroupUniformLoad(&ticket_sh) != SPLITS - 1u) { return; }
    // The last of the chunk: every split has taken its ticket, so none adds to it again in this dispatch.
    if (lane.lid == 0u) { atomicStore(&nq[TICKETS + chunk], 0u); }
    storageBarrier();  // the other splits' partials are read after their tickets

    if (lane.lid < 32u) {
        // every split's partial loaded before any is summed: one memory latency, not SPLITS
        let rec = PART + chunk * SPLITS * 32u + lane.lid;
        var part: array<f32, SPLITS>;
        for (var t = 0u; t < SPLITS; t++) { part[t] = bitcast<f32>(atomicLoad(&nq[rec + t * 32u])); }
        var sum = part[0];
        for (var t = 1u; t < SPLITS; t++) { sum += part[t]; }
        let i = chunk * 32u + lane.lid;
        let x = r_in[i] + sum;
        y[i] = x;
        v_sh[lane.lid] = x * (f32(nw[i]) + NORM_OFFSET);
        sq_sh[lane.lid] = x * x;
    }
    workgroupBarrier();
    if (lane.lid == 0u) {
        store_norm_chunk(chunk);
    }
}
