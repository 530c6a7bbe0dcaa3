// Repetition penalty and the recent-token window; runs right before sample.wgsl on the same logits row.
// 1. Appends this forward's input ids tokens[0..n_tokens) to the window: the id fed at sequence position q
//    lives in window[q % WINDOW], so the window always holds the last WINDOW ids fed to the model (prompt
//    chunks and sampled tokens alike). The host only rewrites it after rolling the context back.
// 2. For each distinct id at the last params.window positions (HF RepetitionPenaltyLogitsProcessor):
//    logit = logit * r if logit < 0 else logit / r. In place: the LM head rewrites the row every step.
//    Greedy decoding sees the penalised row too, as in transformers. Dedup costs window^2 / (2·WG) compares.
// One workgroup. Constants: WG, VOCAB, WINDOW.
// Bindings: 0 logits f32[VOCAB] (row 0, read_write), 1 tokens u32[n_tokens] (read), 2 window u32[WINDOW]
// (read_write; ids >= VOCAB are empty slots), 3 params uniform SampleParams, 4 step uniform.
#import step
#import sample_params

@group(0) @binding(0) var<storage, read_write> logits: array<f32>;
@group(0) @binding(1) var<storage, read> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> window: array<u32>;
@group(0) @binding(3) var<uniform> params: SampleParams;
@group(0) @binding(4) var<uniform> step: Step;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32) {
    let end = step.pos0 + step.n_tokens;  // positions [0, end) have now been fed
    for (var q = end - min(step.n_tokens, WINDOW) + lid; q < end; q += WG) {
        window[q % WINDOW] = tokens[q - step.pos0];
    }
    storageBarrier();
    if (params.penalty == 1.0) { return; }
    let start = end - min(min(params.window, WINDOW), end);
    for (var q = start + lid; q < end; q += WG) {
        let id = window[q % WINDOW];
        if (id >= VOCAB) { continue; }
        var first = true;  // only the first occurrence applies it, so repeats are penalised once
        for (var e = start; e < q; e++) {
            if (window[e % WINDOW] == id) { first = false; break; }
        }
        if (first) {
            let l = logits[id];
            logits[id] = select(l / params.penalty, l * params.penalty, l < 0.0);
        }
    }
}
