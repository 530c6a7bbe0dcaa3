// Sampling parameters shared by sample_penalty.wgsl and sample.wgsl: one 32-byte uniform written by
// engine/sampling.py (GpuSampler.set_params). "Gap" below is the scaled distance to the best logit,
// d = (max - l) / temperature, so a token's weight relative to the best is exp(-d).
struct SampleParams {
    inv_temp: f32,   // 1 / temperature; 0 = greedy (argmax, lowest index on ties)
    top_k: u32,      // keep the k largest logits (all ties of the k-th too); 0 = off
    top_p: f32,      // nucleus mass in (0, 1], over the top-k survivors; 1 = off
    min_p_gap: f32,  // -ln(min_p): keep d <= this, i.e. p >= min_p * p_max; 3e38 = off
    penalty: f32,    // repetition penalty (HF semantics); 1 = off
    window: u32,     // how many of the latest positions the penalty looks at (<= WINDOW)
    seed_lo: u32,    // 64-bit seed of the counter-based RNG
    seed_hi: u32,
}
