// What the tiled GEMMs (matmul_int4, matmul_q8w, matmul_kq, matmul_kq_q8) share: the weight row behind a tile
// column, and the epilogue.
// Thread (tx, ty) holds rows 4ty..4ty+3 of its 4 tile columns and writes those below step.n_tokens and N: plain
// columns j0 + 4tx..+3, or with GATE_UP silu(gate)·up for outputs j0 + 2tx and j0 + 2tx + 1 from its columns
// (gate j, gate j+1, up j, up j+1). The including kernel declares y, step and constants N, YS, GATE_UP.

// The weight row behind tile column c. Columns past N are clamped: loaded, computed, never written.
fn weight_row(c: u32, j0: u32) -> u32 {
    if (GATE_UP) {
        let j = j0 + 2u * (c / 4u) + c % 2u;
        return (c % 4u / 2u) * N + min(j, N - 1u);
    }
    return min(j0 + c, N - 1u);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

fn store_tile(accs: array<vec4<f32>, 4>, t0: u32, ty: u32, j0: u32, tx: u32) {
    for (var r = 0u; r < 4u; r++) {
        let t = t0 + 4u * ty + r;
        if (t >= step.n_tokens) { break; }
        let v = accs[r];
        if (GATE_UP) {
            let j = j0 + 2u * tx;
            if (j < N) { y[t * YS + j] = silu(v.x) * v.z; }
            if (j + 1u < N) { y[t * YS + j + 1u] = silu(v.y) * v.w; }
        } else {
            for (var c = 0u; c < 4u; c++) {
                let j = j0 + 4u * tx + c;
                if (j < N) { y[t * YS + j] = v[c]; }
            }
        }
    }
}
