// matvec_kq_q8.wgsl with w read 16 bytes at a time: for the types whose blocks are whole 16-byte units (Q4_K 144,
// Q5_K 176 and Q6_K's 208 bytes less d), where every run of words an item reads starts on one. One load instruction
// then fetches a lane's code bytes (or a block's d, dmin and 12 scale bytes), as matvec_q8.wgsl's one vec4 per chunk.
// Needs subgroup ops. Constants, bindings and grid: matvec_kq_q8.wgsl's (w as vec4<u32>: q_blocks' words).
#import reduce
#import matvec_kq_q8_body

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> wh: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;

fn wv(word: u32) -> vec4<u32> { return w[word / 4u]; }  // word: a multiple of 4 for these types
fn ws(word: u32) -> u32 { return w[word / 4u][word % 4u]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    if (STAGE) {
        kq_q8_rows_staged(wid.y * nwg.x + wid.x, lane);
    } else {
        kq_q8_rows(wid.y * nwg.x + wid.x, lane);
    }
}
