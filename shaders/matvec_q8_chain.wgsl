// matvec_q8 (int8 activations, 4-bit weights) whose output also goes to int8 for the next int8 matvec (gate_up's
// silu(gate)·up row for down), sparing that matvec's quantize_q8 dispatch. Each workgroup owns 32 consecutive outputs
// (BLOCKS blocks of ROWS, BLOCKS · ROWS = 32: one int8 chunk), its subgroups taking the blocks in turn; once they are
// written (storageBarrier: visible within the workgroup), one thread quantizes the chunk (q8_codes.wgsl) into yq / ym.
// No workgroup reads another's outputs.
// Constants: matvec_q8's (K, N a multiple of 32, WG, ROWS, BLOCKS, GATE_UP, ZERO, AFFINE, GROUP).
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32[N or 2N, K / 8], 2 s f16[N or 2N, K / GROUP (, 2 with AFFINE)],
//   3 y f32[N] (write), 4 xm vec2<f32>[K / 32], 5 yq u32[N / 4] (write), 6 ym vec2<f32>[N / 32] (write).
// Grid: fold_grid(N / 32).
#import reduce
#import matvec_q8_body
#import q8_codes

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read_write> yq: array<u32>;
@group(0) @binding(6) var<storage, read_write> ym: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let chunk = wid.y * nwg.x + wid.x;  // uniform: a folded grid's spare workgroups skip the store together
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block((chunk * BLOCKS + blk) * ROWS, 0u, 0u, 0u, lane);
    }
    storageBarrier();
    if (lane.lid == 0u && chunk < N / 32u) {
        var v: array<vec4<f32>, 8>;
        for (var j = 0u; j < 8u; j++) {
            let o = chunk * 32u + 4u * j;
            v[j] = vec4<f32>(y[o], y[o + 1u], y[o + 2u], y[o + 3u]);
        }
        let q = q8_chunk(&v);
        for (var j = 0u; j < 8u; j++) { yq[chunk * 8u + j] = q.words[j]; }
        ym[chunk] = q.scale_sum;
    }
}
