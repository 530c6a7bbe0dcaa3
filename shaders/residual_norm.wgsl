// The residual add + RMSNorm of a row that add_rms_norm and add_rms_norm_rows share (one workgroup per row), so
// both write r_out and y bit for bit alike. The including kernel declares r_in, delta, w, r_out, y, Lane (reduce)
// and constants D, WG, EPS, NORM_OFFSET. Call from uniform control flow (wg_sum has barriers).

// r_out = r_in + delta over the row at `base`; returns its 1 / rms.
fn add_residual_inv_rms(base: u32, lane: Lane) -> f32 {
    var ss = 0.0;
    for (var i = lane.lid; i < D; i += WG) {
        let v = r_in[base + i] + delta[base + i];
        r_out[base + i] = v;
        ss += v * v;
    }
    return inverseSqrt(wg_sum(ss, lane) / f32(D) + EPS);
}

// y = r_out · inv · (w + NORM_OFFSET). Each thread rereads only the elements it wrote itself: no barrier needed.
fn store_normed_row(base: u32, inv: f32, lid: u32) {
    for (var i = lid; i < D; i += WG) { y[base + i] = r_out[base + i] * inv * (f32(w[i]) + NORM_OFFSET); }
}
