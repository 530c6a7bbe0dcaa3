// Which weight row a tiled GEMM's tile column reads, and the gate_up activation: shared by the GEMMs that store
// through gemm_tile.wgsl and the grouped expert GEMMs (moe_gemm*, rows within the expert's matrix). A thread's 4
// tile columns are plain columns j0 + 4tx..+3, or with GATE_UP (gate j, gate j+1, up j, up j+1), j = j0 + 2tx.
// The including kernel declares constants N and GATE_UP.

// The weight row behind tile column c. Columns past N are clamped: loaded, computed, never written.
fn weight_row(c: u32, j0: u32) -> u32 {
    if (GATE_UP) {
        let j = j0 + 2u * (c / 4u) + c % 2u;
        return (c % 4u / 2u) * N + min(j, N - 1u);
    }
    return min(j0 + c, N - 1u);
}

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }
