// The experts' gate_up of a decode token in one dispatch after the router's logits: each workgroup routes the
// token itself (shaders/moe_topk.wgsl, in its first subgroup: no top-k dispatch), computes 32 outputs
// silu(gate)·up of its slot's expert with matvec_q8's arithmetic (shaders/matvec_q8_body.wgsl) on the norm's int8
// row without 1/rms (matvec_q8_norm.wgsl's packed row; 1/rms from its Σ x², as matvec_q8_rms.wgsl), and writes
// them as one int8 chunk (q8_codes.wgsl: what quantize_q8 would write) for moe_down_q8.wgsl: no quantize dispatch.
// Workgroup (0, 0, 0) also writes the route (ids, weights) there for the down pass. With STREAM (experts streamed
// into a cache, engine/blocks/expert_cache.py) the experts are the cache slots the host wrote to slot_ids after
// reading the route back: they replace the ids, the weights stay the kernel's own.
// Experts: stacked as moe_matvec_q8.wgsl's (4-bit, or MLX 3-bit rows; MIXED_W / MIXED_S: a 4-bit expert
// EXPERTS − 1 stored after a 3-bit stack, the shared one). The slot's expert id is clamped to EXPERTS − 1.
// Constants: K (= D), N (= F, a multiple of 32), EXPERTS, WG, ROWS, BLOCKS (BLOCKS · ROWS = 32), GATE_UP (true),
//   BITS, ZERO, AFFINE, GROUP, MIXED_W, MIXED_S; E, TOPK, SHARED, NORM_TOPK (the route); STREAM; EPS; META, SS (u32
//   offsets of the norm row's (scale, Σ codes) pairs and Σ x² in nq); AMETA, AIDS, AWTS (u32 offsets in act:
//   engine/kernels/moe.py decode_pack_layout).
// Bindings: 0 nq u32 (read: codes u32[K / 4] at 0, pairs at META, Σ x² at SS), 1 logits f32[E (+ 1)] (read),
//   2 w u32[EXPERTS, 2N, K·BITS/32] as vec4, 3 s f16[EXPERTS, 2N, K / GROUP (, 2)], 4 act u32 (write: codes
//   [SLOTS, N / 4] at 0, (scale, Σ codes) pairs [SLOTS, N / 32] at AMETA, ids [SLOTS] at AIDS, weights (f32 bits)
//   [SLOTS] at AWTS), 5 slot_ids u32[SLOTS] (read with STREAM; bound, unread, without).
// Grid: (N / 32, 1, SLOTS).
#import reduce
#import matvec_q8_body
#import q8_codes
#import moe_topk

@group(0) @binding(0) var<storage, read> nq: array<u32>;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read> s: array<f16>;
@group(0) @binding(4) var<storage, read_write> act: array<u32>;
@group(0) @binding(5) var<storage, read> slot_ids: array<u32>;

var<workgroup> xq: array<vec4<u32>, K / 16u>;  // the norm's int8 row (two vec4 per chunk) and its chunks' pairs
var<workgroup> xm: array<vec2<f32>, K / 32u>;
var<workgroup> lg: array<f32, LSTRIDE>;
var<workgroup> y: array<f32, 32>;  // this workgroup's outputs
var<workgroup> expert_sh: u32;  // the slot's expert, as subgroup 0 routed

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let chunk = wid.x;
    let slot = wid.z;
    for (var i = lane.lid; i < K / 16u; i += WG) {
        xq[i] = vec4<u32>(nq[4u * i], nq[4u * i + 1u], nq[4u * i + 2u], nq[4u * i + 3u]);
    }
    for (var c = lane.lid; c < K / 32u; c += WG) {
        xm[c] = vec2<f32>(bitcast<f32>(nq[META + 2u * c]), bitcast<f32>(nq[META + 2u * c + 1u]));
    }
    for (var e = lane.lid; e < LSTRIDE; e += WG) { lg[e] = logits[e]; }
    workgroupBarrier();

    if (lane.sg_id == 0u) {  // one subgroup routes; the others wait at the barrier
        let route = route_subgroup(lane);
        if (lane.sg_lane == 0u) {
            expert_sh = select(route.ids[slot], slot_ids[slot], STREAM);
            if (chunk == 0u && slot == 0u) {
                for (var j = 0u; j < SLOTS; j++) {
                    act[AIDS + j] = select(route.ids[j], slot_ids[j], STREAM);
                    act[AWTS + j] = bitcast<u32>(route.weights[j]);
                }
            }
        }
    }
    var part = 0.0;
    for (var c = lane.sg_lane; c < K / 32u; c += lane.sg_size) { part += bitcast<f32>(nq[SS + c]); }
    let scale = inverseSqrt(subgroupAdd(part) / f32(K) + EPS);
    workgroupBarrier();
    let expert = min(expert_sh, EXPERTS - 1u);
    let apart = MIXED_W > 0u && expert == EXPERTS - 1u;  // the 4-bit rows after a 3-bit stack
    let row0 = select(expert * MATS * N, 0u, apart) + chunk * 32u;
    for (var blk = lane.sg_id; blk < BLOCKS; blk += lane.n_sg) {
        q8_block_scaled(blk * ROWS, row0, 0u, 0u, scale, lane, BITS == 3u && !apart, select(0u, MIXED_W, apart),
                        select(0u, MIXED_S, apart));
    }
    workgroupBarrier();
    if (lane.lid == 0u) {
        var v: array<vec4<f32>, 8>;
        for (var j = 0u; j < 8u; j++) { v[j] = vec4<f32>(y[4u * j], y[4u * j + 1u], y[4u * j + 2u], y[4u * j + 3u]); }
        let q = q8_chunk(&v);
        let c = slot * (N / 32u) + chunk;
        for (var j = 0u; j < 8u; j++) { act[c * 8u + j] = q.words[j]; }
        act[AMETA + 2u * c] = bitcast<u32>(q.scale_sum.x);
        act[AMETA + 2u * c + 1u] = bitcast<u32>(q.scale_sum.y);
    }
}
