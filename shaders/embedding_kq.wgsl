// Embedding lookup from a K-quant / Q5_0 / Q5_1 table read as stored: x[t, :] = row tokens[t], dequantized to f32
// (w = a_h·u + b_h, kq_decode.wgsl). One thread per 4 elements (one code word). Real files store the table as Q4_K,
// Q6_K or Q8_0 (the last through embedding.wgsl).
// A table too big for one binding is bound in parts: this dispatch holds rows [ROW0, ROW0 + NROWS) (NROWS 0: the
// whole vocabulary) and embeds only the tokens among them; a token id ≥ VOCAB embeds as zeros (written by the part
// with ROW0 = 0) instead of reading garbage.
// Constants: WG, D (model dim, a multiple of QK), VOCAB, ROW0, NROWS, KTYPE, QK, BW, BH, HALVES.
// Bindings: 0 tokens u32[T], 1 w u32 q_blocks [rows, D/QK·BW], 2 wh f16 (q_d, or q_blocks again), 3 x f32[T, D]
//   (write), 4 step uniform. Grid: (ceil(D / 4 / WG), n_tokens).
#import step
#import kq_decode

@group(0) @binding(0) var<storage, read> tokens: array<u32>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> x: array<vec4<f32>>;
@group(0) @binding(4) var<uniform> step: Step;

const NB: u32 = D / QK;
const WORDS: u32 = D / 4u;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let word = gid.x;
    let t = gid.y;
    if (word >= WORDS || t >= step.n_tokens) { return; }
    let token = tokens[t];
    let out = t * WORDS + word;
    if (token >= VOCAB) {
        if (ROW0 == 0u) { x[out] = vec4<f32>(0.0); }
        return;
    }
    let rows = select(NROWS, VOCAB, NROWS == 0u);
    if (token < ROW0 || token >= ROW0 + rows) { return; }  // another part's row
    let c = word / 8u;  // chunk of the row
    let j = word % 8u;
    let blk = (token - ROW0) * NB + c / CPB;
    let ab = kq_affine(blk, c % CPB);
    let h = j / 4u;
    x[out] = kq_codes_f32(kq_word(blk, c % CPB, j)) * ab[h] + ab[2u + h];
}
