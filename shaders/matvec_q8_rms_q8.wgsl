// matvec_q8_rms (its input a norm's int8 row without 1/rms) whose output row also goes out in int8, for decode: the
// dense MLP's gate_up writes down's input as quantize_q8 would, so no quantize_q8 dispatch sits between them. Each
// workgroup owns one 32-output chunk c; once its outputs are in y (storageBarrier: visible within the workgroup), one
// thread reads the chunk's 32 f32 values back and stores their int8 codes and (scale, Σ codes) with quantize_q8's
// arithmetic (q8_codes.wgsl), so the bytes are those quantize_q8 writes from the same row. No workgroup reads
// another's outputs.
// Constants: matvec_q8_rms's (K, N a multiple of 32, WG, ROWS, BLOCKS with BLOCKS · ROWS = 32, GATE_UP, BITS, ZERO,
//   AFFINE, GROUP, EPS).
// Bindings: 0 xq u32[K / 4] as vec4, 1 w u32[N or 2N, K / 8], 2 s f16[N or 2N, K / GROUP (, 2 with AFFINE)],
//   3 y f32[N] (read_write), 4 xm vec2<f32>[K / 32], 5 ss f32[K / 32] (read), 6 yq u32[N / 4] (write: y's codes),
//   7 ym vec2<f32>[N / 32] (write: y's (scale, Σ codes) per chunk). Grid: fold_grid(N / 32).
#import reduce
#import matvec_q8_body
#import q8_codes

@group(0) @binding(0) var<storage, read> xq: array<vec4<u32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> xm: array<vec2<f32>>;
@group(0) @binding(5) var<storage, read> ss: array<f32>;
@group(0) @binding(6) var<storage, read_write> yq: array<u32>;
@group(0) @binding(7) var<storage, read_write> ym: array<vec2<f32>>;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    var part = 0.0;
    for (var c = lane.sg_lane; c < K / 32u; c += lane.sg_size) { part += ss[c]; }
    let scale = inverseSqrt(subgroupAdd(part) / f32(K) + EPS);
    let chunk = wid.y * nwg.x + wid.x;  // uniform: a folded grid's spare workgroups skip the epilogue together
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block_scaled((chunk * BLOCKS + blk) * ROWS, 0u, 0u, 0u, scale, lane, BITS == 3u, 0u, 0u);
    }
    storageBarrier();
    if (lane.lid == 0u && chunk < N / 32u) {
        var v: array<vec4<f32>, 8>;
        let b = chunk * 32u;
        for (var j = 0u; j < 8u; j++) {
            v[j] = vec4<f32>(y[b + 4u * j], y[b + 4u * j + 1u], y[b + 4u * j + 2u], y[b + 4u * j + 3u]);
        }
        let q = q8_chunk(&v);
        for (var j = 0u; j < 8u; j++) { yq[chunk * 8u + j] = q.words[j]; }
        ym[chunk] = q.scale_sum;
    }
}
