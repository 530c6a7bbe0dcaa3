// Gated DeltaNet output norm, transformers' Qwen3_5RMSNormGated ("norm before gate"; a plain weight, NOT
// zero-centred): per token t and value head h, over the head's DV values,
//   y = w · x · rsqrt(mean(x²) + EPS) · silu(z),   z = columns Z_OFF + h·DV .. of the in_proj row.
// One workgroup per (head, token). Epilogue: ROWS_F32 writes y as f32; ROWS_Q8 (DV a multiple of 32) writes the
// head's values as int8 as quantize_q8 would (q8_pack.wgsl), the out projection's input without a dispatch of its
// own: a decode token's into the workspace's int8 row, a prefill chunk's into its int8 rows (the host binds either).
// Constants: WG threads (a power of two without subgroups), VH value heads, DV head dim, EPS, ROW in_proj row
//   length, Z_OFF column of z, ROWS_F32, ROWS_Q8 (bools).
// Bindings: 0 x f32[T, VH·DV] (read; gdn_recur's output), 1 zsrc f32[T, ROW] (read), 2 w f16[DV] (read),
//   3 y f32[T, VH·DV] (write), 4 step uniform (n_tokens), 5 xq u32[T, VH·DV/4] (write), 6 xm vec2<f32>[T, VH·DV/32]
//   (write); 5 and 6 are bound whether or not ROWS_Q8.
// Grid: (VH, T).
#import step
#import reduce
#import q8_pack

@group(0) @binding(0) var<storage, read> x: array<f32>;
@group(0) @binding(1) var<storage, read> zsrc: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f16>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;
@group(0) @binding(5) var<storage, read_write> xq: array<u32>;
@group(0) @binding(6) var<storage, read_write> xm: array<vec2<f32>>;

const STAGE_STRIDE: u32 = 33u;  // f32s a staged chunk (32 + 1: the packers' reads fall on distinct banks)
var<workgroup> y_sh: array<f32, select(1u, DV / 32u * STAGE_STRIDE, ROWS_Q8)>;

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    if (t >= step.n_tokens) { return; }  // uniform: t is the workgroup's
    let base = (t * VH + h) * DV;
    var ss = 0.0;
    for (var i = lane.lid; i < DV; i += WG) { let v = x[base + i]; ss += v * v; }
    let inv = inverseSqrt(wg_sum(ss, lane) / f32(DV) + EPS);
    for (var i = lane.lid; i < DV; i += WG) {
        let z = zsrc[t * ROW + Z_OFF + h * DV + i];
        let v = f32(w[i]) * x[base + i] * inv * (z / (1.0 + exp(-z)));
        if (ROWS_F32) { y[base + i] = v; }
        if (ROWS_Q8) { y_sh[i / 32u * STAGE_STRIDE + i % 32u] = v; }
    }
    if (ROWS_Q8) {  // a constant: the barrier stays in uniform control flow
        workgroupBarrier();
        for (var c = lane.lid; c < DV / 32u; c += WG) {
            var v: array<vec4<f32>, 8>;
            for (var j = 0u; j < 8u; j++) {
                let d = c * STAGE_STRIDE + 4u * j;
                v[j] = vec4<f32>(y_sh[d], y_sh[d + 1u], y_sh[d + 2u], y_sh[d + 3u]);
            }
            store_q8_chunk(base / 32u + c, &v);  // row t's chunk h·DV/32 + c
        }
    }
}
