// matvec_q8 (int8 activations, 4-bit weights) with one 32-output chunk per workgroup, for decode, in two optional
// roles around it:
// - OUT8: the output also goes to int8 (q8_codes.wgsl) for the next int8 matvec (gate_up's silu(gate)·up row for
//   down), sparing that matvec's quantize_q8 dispatch. Once the workgroup's outputs are written (storageBarrier:
//   visible within the workgroup), one thread quantizes the chunk into yq / ym. No workgroup reads another's outputs.
// - RMS: the int8 input row is an RMSNorm's output without its 1/rms factor (matvec_q8_norm.wgsl wrote the codes
//   of v = x·w, whose chunk scales times 1/rms are those of x·w/rms, and Σ x² per chunk in ss): every workgroup sums
//   ss into 1/rms = rsqrt(Σ x² / K + EPS) in the same order and multiplies its dot products by it.
// Each workgroup's BLOCKS blocks of ROWS outputs (BLOCKS · ROWS = 32) go to its subgroups in turn.
// Constants: matvec_q8's (K, N a multiple of 32, WG, ROWS, BLOCKS, GATE_UP, ZERO, AFFINE, GROUP), OUT8, RMS, EPS.
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32[N or 2N, K / 8], 2 s f16[N or 2N, K / GROUP (, 2 with AFFINE)],
//   3 y f32[N] (write), 4 xm vec2<f32>[K / 32], 5 yq u32[N / 4] (write), 6 ym vec2<f32>[N / 32] (write),
//   7 ss f32[K / 32] (read); 5, 6 and 7 are bound whether or not OUT8 and RMS.
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
@group(0) @binding(7) var<storage, read> ss: array<f32>;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let chunk = wid.y * nwg.x + wid.x;  // uniform: a folded grid's spare workgroups skip the store together
    var scale = 1.0;
    if (RMS) {  // a constant: the reduction stays in uniform control flow
        var part = 0.0;
        for (var c = lane.lid; c < K / 32u; c += WG) { part += ss[c]; }
        scale = inverseSqrt(wg_sum(part, lane) / f32(K) + EPS);
    }
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block_scaled((chunk * BLOCKS + blk) * ROWS, 0u, 0u, 0u, scale, lane);
    }
    if (OUT8) {
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
}
