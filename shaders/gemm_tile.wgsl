// The epilogue of the tiled GEMMs (matmul_int4, matmul_q8w, matmul_kq, matmul_kq_q8): a thread writes its rows of
// its 4 tile columns (gemm_columns.wgsl) below step.n_tokens and N: plain columns j0 + 4tx..+3, or with GATE_UP
// silu(gate)·up for outputs j0 + 2tx and j0 + 2tx + 1. The including kernel declares y, step and constants N, YS,
// GATE_UP.
#import gemm_columns

// Row t of the thread's 4 columns.
fn store_row(v: vec4<f32>, t: u32, j0: u32, tx: u32) {
    if (t >= step.n_tokens) { return; }
    if (GATE_UP) {
        let j = j0 + 2u * tx;
        if (j < N) { y[t * YS + j] = silu(v.x) * v.z; }
        if (j + 1u < N) { y[t * YS + j + 1u] = silu(v.y) * v.w; }
    } else {
        let j = j0 + 4u * tx;
        if (j < N) { y[t * YS + j] = v.x; }
        if (j + 1u < N) { y[t * YS + j + 1u] = v.y; }
        if (j + 2u < N) { y[t * YS + j + 2u] = v.z; }
        if (j + 3u < N) { y[t * YS + j + 3u] = v.w; }
    }
}

// Rows 4ty..4ty+3 of the tile starting at row t0 (thread (tx, ty) of a 4×4-per-thread GEMM).
fn store_tile(accs: array<vec4<f32>, 4>, t0: u32, ty: u32, j0: u32, tx: u32) {
    for (var r = 0u; r < 4u; r++) { store_row(accs[r], t0 + 4u * ty + r, j0, tx); }
}
