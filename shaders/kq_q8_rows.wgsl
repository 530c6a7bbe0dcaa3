// What the K-quant int8 decode matvecs (matvec_kq_q8_body, matvec_kq_q8_chunks, kq_wide) share around
// their dot loops: a subgroup's ROWS output rows (× 2 with GATE_UP: gate rows, then up rows at N), their first block,
// and the sums written once per row, y = silu(gate)·up with GATE_UP.
// The including kernel declares y (f32, read_write) and the constants K, QK, N, ROWS and GATE_UP.

const NB: u32 = K / QK;
const MATS: u32 = select(1u, 2u, GATE_UP);
const WROWS: u32 = ROWS * MATS;
const ONES: u32 = 0x01010101u;

fn silu(v: f32) -> f32 { return v / (1.0 + exp(-v)); }

// Each weight row's first block; rows past N are clamped to N − 1: read, summed, never written.
fn kq_row_blocks(first: u32) -> array<u32, WROWS> {
    var blk0: array<u32, WROWS>;
    for (var i = 0u; i < WROWS; i++) { blk0[i] = ((i / ROWS) * N + min(first + i % ROWS, N - 1u)) * NB; }
    return blk0;
}

// Rows first .. first + ROWS below N from their sums (gate rows, then up rows with GATE_UP).
fn write_kq_rows(first: u32, total: array<f32, WROWS>) {
    for (var i = 0u; i < ROWS; i++) {
        let r = first + i;
        if (r < N) {
            if (GATE_UP) {
                y[r] = silu(total[i]) * total[ROWS + i];
            } else {
                y[r] = total[i];
            }
        }
    }
}

// The subgroup's partial sums added across its lanes; lane 0 writes rows first .. first + ROWS below N.
fn store_kq_rows(first: u32, acc: array<f32, WROWS>, lane: Lane) {
    var total: array<f32, WROWS>;
    for (var i = 0u; i < WROWS; i++) { total[i] = subgroupAdd(acc[i]); }
    if (lane.sg_lane == 0u) {
        write_kq_rows(first, total);
    }
}

// store_kq_rows for a subgroup cut into `segs` segments of consecutive lanes, segment s owning its own ROWS outputs
// from `first` (each lane passes its segment's): each segment's sums added apart, its first lane writes them.
fn store_kq_segments(first: u32, acc: array<f32, WROWS>, lane: Lane, seg: u32, segs: u32, seg_lanes: u32) {
    var total = array<f32, WROWS>();
    for (var s = 0u; s < segs; s++) {
        for (var i = 0u; i < WROWS; i++) {
            let t = subgroupAdd(select(0.0, acc[i], seg == s));
            if (seg == s) { total[i] = t; }
        }
    }
    if (lane.sg_lane % seg_lanes == 0u) {
        write_kq_rows(first, total);
    }
}
