// The int8 epilogue of the gate_up GEMMs with int8 activations (matmul_q8w, matmul_kq_q8, moe_gemm_q8; ROWS_Q8): a
// tile is TN = 32 outputs wide, exactly one 32-element chunk of each row of Y, so the workgroup writes its rows'
// chunk as quantize_q8 would (q8_codes.wgsl's q8_chunk, the same function), the down GEMM's input, without a
// quantize_q8 dispatch. The f32 values silu(gate)·up go through workgroup memory in two passes of half the thread's
// rows (Q8_HALF = RPT / 2); one thread per staged row packs it.
// The including kernel declares yq: array<u32> (codes, Y row r at r·N/4), ym: array<vec2<f32>> (scale, Σ codes; row
// r at r·N/32), fn q8_row(i: u32) -> u32 (the Y row behind index i: i itself, or the pair a sorted order names), and
// constants N (a multiple of 32), TY (thread rows), RPT (tile rows a thread owns: RPT·ty .. RPT·ty + RPT − 1),
// ROWS_Q8.
#import q8_codes

const Q8_HALF: u32 = RPT / 2u;
const Q8_STAGED: u32 = TY * Q8_HALF;  // rows a pass stages (≤ the workgroup's threads: the plan checks)
const Q8_STRIDE: u32 = 33u;  // f32s a staged row (32 + 1: the packers' reads of a row each fall on distinct banks)
var<workgroup> q8_stage: array<f32, select(1u, Q8_STAGED * Q8_STRIDE, ROWS_Q8)>;

// Row i (< Q8_HALF) of this pass of thread (tx, ty): its outputs silu(gate)·up at chunk elements 2tx and 2tx + 1
// (gemm_columns.wgsl's columns (gate j, gate j+1, up j, up j+1), j = j0 + 2tx).
fn q8_stage_row(v: vec4<f32>, i: u32, tx: u32, ty: u32) {
    let at = (ty * Q8_HALF + i) * Q8_STRIDE + 2u * tx;
    q8_stage[at] = silu(v.x) * v.z;
    q8_stage[at + 1u] = silu(v.y) * v.w;
}

// Pass p (0: the thread's first Q8_HALF rows, 1: the others) of the tile at column j0 whose rows m < count are live
// (row m is q8_row(first + m)) to int8: thread lid < Q8_STAGED packs staged row lid, tile row RPT·(lid / Q8_HALF) +
// p·Q8_HALF + lid % Q8_HALF. Call from uniform control flow (barriers).
fn q8_store_staged(first: u32, count: u32, j0: u32, p: u32, lid: u32) {
    workgroupBarrier();
    let m = RPT * (lid / Q8_HALF) + p * Q8_HALF + lid % Q8_HALF;
    if (lid < Q8_STAGED && m < count) {
        var v: array<vec4<f32>, 8>;
        for (var j = 0u; j < 8u; j++) {
            let at = lid * Q8_STRIDE + 4u * j;
            v[j] = vec4<f32>(q8_stage[at], q8_stage[at + 1u], q8_stage[at + 2u], q8_stage[at + 3u]);
        }
        let q = q8_chunk(&v);
        let c = q8_row(first + m) * (N / 32u) + j0 / 32u;
        for (var j = 0u; j < 8u; j++) { yq[c * 8u + j] = q.words[j]; }
        ym[c] = q.scale_sum;
    }
    workgroupBarrier();  // the next pass restages
}
