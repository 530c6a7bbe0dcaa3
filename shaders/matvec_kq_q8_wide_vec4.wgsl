// matvec_kq_q8_wide.wgsl for Q4_K, whose blocks are whole 16-byte units: w read 16 bytes a load (a block's d, dmin
// and scales in one, an item's 32 code bytes in two), the rest as kq_wide.wgsl.
// Constants: K (a multiple of QK), N, WG, ROWS, BLOCKS, SPLIT, GATE_UP, KTYPE (12), QK, BW.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w vec4<u32> q_blocks, 2 wh f16 (q_blocks again), 3 y f32[N] (write),
//   4 xm vec2<f32>[K / 32] (scale, Σ codes). Grid: fold_grid(ceil(N / (SPLIT · ROWS · BLOCKS))).
#import reduce
#import kq_wide

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

fn wv(word: u32) -> vec4<u32> { return w[word / 4u]; }  // word: a multiple of 4 for Q4_K
fn ws(word: u32) -> u32 { return w[word / 4u][word % 4u]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    kq_wide_rows(wid.y * nwg.x + wid.x, lane);
}
