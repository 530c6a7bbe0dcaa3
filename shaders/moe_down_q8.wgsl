// The experts' down of a decode token fused with the combine and the residual add + next norm's per-chunk half:
// each workgroup owns one 32-output chunk of D and computes it for every slot (one thread a weight row:
// q8_row_dot of shaders/matvec_q8_body.wgsl, on the slot's int8 activations moe_gate_up_q8.wgsl wrote), then sums
// the slots in slot order with the route's weights (moe_combine.wgsl's sum). With NORM it finishes as
// matvec_q8_norm.wgsl does: out = r_in + Σ, and for the chunk the int8 codes and scale of out · (nw + NORM_OFFSET)
// and Σ out² into nq (read by the next matvec_q8_rms); without (the last layer, whose add + final norm stays a
// dispatch) out = Σ. No workgroup reads another's outputs.
// Experts: stacked as moe_matvec_q8.wgsl's (4-bit, or MLX 3-bit rows; MIXED_W / MIXED_S: a 4-bit expert
// EXPERTS − 1 after a 3-bit stack). Expert ids come from act and are clamped to EXPERTS − 1.
// Constants: K (= F), N (= D, a multiple of 32), EXPERTS, SLOTS, WG, ROWS (1, unused), GATE_UP (false), BITS, ZERO,
//   AFFINE, GROUP, MIXED_W, MIXED_S, NORM, NORM_OFFSET, META, SS (u32 offsets in nq), AMETA, AIDS, AWTS (u32 offsets
//   in act: engine/kernels/moe.py decode_pack_layout).
// Bindings: 0 act u32 (read: moe_gate_up_q8's codes, pairs, ids, weights), 1 w u32[EXPERTS, N, K·BITS/32] as vec4,
//   2 s f16[EXPERTS, N, K / GROUP (, 2)], 3 out f32[N] (write), 4 r_in f32[N] (read), 5 nw f16[N] (read),
//   6 nq u32 (write with NORM: codes u32[N / 4] at 0, (scale, Σ codes) pairs at META, Σ out² at SS).
// Grid: fold_grid(N / 32).
#import reduce
#import matvec_q8_body
#import q8_codes
#import norm_chunk_out

@group(0) @binding(0) var<storage, read> act: array<u32>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<storage, read> r_in: array<f32>;
@group(0) @binding(5) var<storage, read> nw: array<f16>;
@group(0) @binding(6) var<storage, read_write> nq: array<u32>;

fn nq_put(i: u32, v: u32) { nq[i] = v; }  // norm_chunk_out's store

var<workgroup> xq: array<vec4<u32>, SLOTS * K / 16u>;  // every slot's int8 row (two vec4 per chunk) and pairs
var<workgroup> xm: array<vec2<f32>, SLOTS * K / 32u>;
var<workgroup> y: array<f32, SLOTS * 32u>;  // y[slot · 32 + i]: output i of the chunk by the slot's expert

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let chunk = wid.y * nwg.x + wid.x;
    let live = chunk < N / 32u;  // uniform: a folded grid's spare workgroups skip the work together
    for (var i = lane.lid; i < SLOTS * K / 16u; i += WG) {
        xq[i] = vec4<u32>(act[4u * i], act[4u * i + 1u], act[4u * i + 2u], act[4u * i + 3u]);
    }
    for (var c = lane.lid; c < SLOTS * K / 32u; c += WG) {
        xm[c] = vec2<f32>(bitcast<f32>(act[AMETA + 2u * c]), bitcast<f32>(act[AMETA + 2u * c + 1u]));
    }
    workgroupBarrier();
    for (var p = lane.lid; p < SLOTS * 32u && live; p += WG) {
        let slot = p / 32u;
        let expert = min(act[AIDS + slot], EXPERTS - 1u);
        let apart = MIXED_W > 0u && expert == EXPERTS - 1u;  // the 4-bit rows after a 3-bit stack
        let row = select(expert * N, 0u, apart) + chunk * 32u + p % 32u;
        y[p] = q8_row_dot(row, slot, BITS == 3u && !apart, select(0u, MIXED_W, apart), select(0u, MIXED_S, apart));
    }
    workgroupBarrier();
    if (lane.lid < 32u && live) {
        let i = chunk * 32u + lane.lid;
        var acc = 0.0;
        for (var j = 0u; j < SLOTS; j++) { acc += bitcast<f32>(act[AWTS + j]) * y[j * 32u + lane.lid]; }
        if (NORM) {
            let x = r_in[i] + acc;
            out[i] = x;
            v_sh[lane.lid] = x * (f32(nw[i]) + NORM_OFFSET);
            sq_sh[lane.lid] = x * x;
        } else {
            out[i] = acc;
        }
    }
    workgroupBarrier();
    if (NORM && lane.lid == 0u && live) {
        store_norm_chunk(chunk);
    }
}
