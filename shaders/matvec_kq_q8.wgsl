// Decode matvec on Q5_0 / Q5_1 blocks read as stored, int8 activations (quantize_q8.wgsl's layout, or a norm's Q8
// output): y = W x̂ through dot4I8Packed, four products at a time as llama.cpp's q8_1 path, w read as u32 words.
// Q4_K, Q5_K and Q6_K run matvec_kq_q8_vec4.wgsl, this arithmetic with 16-byte loads (this kernel reads them too:
// bench/kquant_probe.py --variants); Q2_K and Q3_K run matvec_kq_q8_wide.wgsl or matvec_kq_q8_chunks.wgsl, and
// Q4_K below FEW_ROWS_N outputs matvec_kq_q8_wide_vec4.wgsl. Layout of the work: matvec_kq_q8_body.wgsl (STAGE: its
// staged loop). Needs subgroup ops.
// Constants: K, N, WG, ROWS, BLOCKS, GATE_UP, HALVES, STAGE, KTYPE, QK, BW (engine/kquant_plan.py).
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32 q_blocks, 2 wh f16 (q_d, or q_blocks again), 3 y f32[N] (write),
//   4 xm vec2<f32>[K / 32] (scale, Σ codes). Grid: fold_grid(ceil(N / (ROWS · BLOCKS))).
#import reduce
#import matvec_kq_q8_body

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

fn wv(word: u32) -> vec4<u32> { return vec4<u32>(w[word], w[word + 1u], w[word + 2u], w[word + 3u]); }
fn ws(word: u32) -> u32 { return w[word]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    if (STAGE) {
        kq_q8_rows_staged(wid.y * nwg.x + wid.x, lane);
    } else {
        kq_q8_rows(wid.y * nwg.x + wid.x, lane);
    }
}
