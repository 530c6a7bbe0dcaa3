// Per-forward uniform shared by every kernel: the only thing written per token besides token ids.
struct Step {
    n_tokens: u32,    // rows in this forward (1 for decode)
    pos0: u32,        // position of row 0 in the sequence
    out_index: u32,   // where the sampler writes this step's token in the output ring
    attn_splits: u32, // split-K partitions for decode attention (1 = no split)
}
