// Residual add fused with the next RMSNorm: r_out = r_in + delta; y = r_out · rsqrt(mean(r_out²)+EPS) · w.
// Residuals ping-pong between two buffers (r_in and r_out never alias). One workgroup per row.
// With Q8 the last row's y also goes to int8 (norm_q8.wgsl) for the q8 decode matvecs that read it, which then
// need no quantize_q8 dispatch of their own (the LM head after a prefill reads that last row too).
// Constants: WG, D, EPS, Q8, NORM_OFFSET (added to w: 1.0 runs a zero-centred norm, y = x̂ · (1 + w)).
// Bindings: 0 r_in f32[T,D], 1 delta f32[T,D], 2 w f16[D], 3 r_out f32[T,D] (write),
//           4 y f32[T,D] (write), 5 step uniform, 6 xq u32[D/4] (write), 7 xm vec2<f32>[D/32] (write);
//           6 and 7 are bound whether or not Q8.
#import step
#import reduce
#import residual_norm
#import norm_q8

@group(0) @binding(0) var<storage, read> r_in: array<f32>;
@group(0) @binding(1) var<storage, read> delta: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f16>;
@group(0) @binding(3) var<storage, read_write> r_out: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;
@group(0) @binding(5) var<uniform> step: Step;
@group(0) @binding(6) var<storage, read_write> xq: array<u32>;
@group(0) @binding(7) var<storage, read_write> xm: array<vec2<f32>>;

fn norm_src(i: u32) -> f32 { return r_out[i]; }

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let row = wid.x;
    if (row >= step.n_tokens) { return; }
    let base = row * D;
    let inv = add_residual_inv_rms(base, lane);
    if (Q8 && row == step.n_tokens - 1u) {
        norm_row_q8(base, inv, lane.lid);
    } else {
        store_normed_row(base, inv, lane.lid);
    }
}
