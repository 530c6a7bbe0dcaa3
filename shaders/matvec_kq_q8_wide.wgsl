// Decode matvec on Q2_K / Q3_K blocks with int8 activations (quantize_q8.wgsl's layout, or a norm's Q8 output),
// built for few instructions per weight byte: a lane per 64-element item of WROWS rows, the code bytes put in the
// activations' order per row, integer per-sub-block scales, i32 → f32 through the MAGIC bias (kq_wide.wgsl). w is
// read as u32 words (these blocks are not whole 16-byte units); Q4_K runs matvec_kq_q8_wide_vec4.wgsl.
// Constants: K (a multiple of QK), N, WG, ROWS, BLOCKS, SPLIT, GATE_UP, KTYPE (10 or 11), QK, BW.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32 q_blocks, 2 wh f16 (q_d, or q_blocks again), 3 y f32[N] (write),
//   4 xm vec2<f32>[K / 32] (scale, Σ codes). Grid: fold_grid(ceil(N / (SPLIT · ROWS · BLOCKS))).
#import reduce
#import kq_wide

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

fn wv(word: u32) -> vec4<u32> { return vec4<u32>(w[word], w[word + 1u], w[word + 2u], w[word + 3u]); }
fn ws(word: u32) -> u32 { return w[word]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    kq_wide_rows(wid.y * nwg.x + wid.x, lane);
}
