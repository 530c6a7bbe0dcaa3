// Embedding lookup with dequantization: x[t, :] = row tokens[t] of the packed table, as f32.
// One thread per u32 word (32/BITS values). Grid: (ceil(D·BITS/32 / WG), n_tokens).
// Constants: WG, D (model dim, multiple of GROUP), VOCAB; the weight format (engine/kernels/matmul.py FORMATS):
//   BITS 4 or 8: element i of a row is the code q at bits BITS·(i % (32/BITS)) of word i·BITS/32,
//     x = (q − ZERO)·scale[i / GROUP], or (q − ZERO)·scale + min with AFFINE; BITS 16: f16 values.
//   ROW0, NROWS: a table too big for one binding is bound in parts: this dispatch holds rows [ROW0, ROW0 + NROWS)
//     and embeds only the tokens among them (NROWS 0 = the whole vocabulary).
// Bindings: 0 tokens u32[T], 1 q_weight u32[VOCAB, D·BITS/32],
//           2 q_scale f16[VOCAB, D/GROUP] (with AFFINE (scale, min) pairs [VOCAB, D/GROUP, 2]; bound but
//           not read with BITS 16), 3 x f32[T, D] (write), 4 step uniform.
#import step

@group(0) @binding(0) var<storage, read> tokens: array<u32>;
@group(0) @binding(1) var<storage, read> q_weight: array<u32>;
@group(0) @binding(2) var<storage, read> q_scale: array<f16>;
@group(0) @binding(3) var<storage, read_write> x: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let per_word = 32u / BITS;
    let words = D / per_word;
    let word = gid.x;
    let t = gid.y;
    if (word >= words || t >= step.n_tokens) { return; }
    let token = tokens[t];
    let out = t * D + word * per_word;
    if (token >= VOCAB) {  // an id outside the vocabulary embeds as zeros instead of reading garbage
        if (ROW0 == 0u) { for (var i = 0u; i < per_word; i++) { x[out + i] = 0.0; } }
        return;
    }
    let rows = select(NROWS, VOCAB, NROWS == 0u);
    if (token < ROW0 || token >= ROW0 + rows) { return; }  // another part's row
    let row = token - ROW0;
    let packed = q_weight[row * words + word];
    if (BITS == 16u) {
        let h = unpack2x16float(packed);
        x[out] = h.x;
        x[out + 1u] = h.y;
        return;
    }
    // A word never straddles two groups (GROUP is a multiple of 32).
    let si = (row * (D / GROUP) + word * per_word / GROUP) * select(1u, 2u, AFFINE);
    let scale = f32(q_scale[si]);
    var mn = 0.0;
    if (AFFINE) { mn = f32(q_scale[si + 1u]); }
    let mask = (1u << BITS) - 1u;
    for (var i = 0u; i < per_word; i++) {
        x[out + i] = (f32((packed >> (BITS * i)) & mask) - f32(ZERO)) * scale + mn;
    }
}
