// Gated delta rule, transformers' torch_recurrent_gated_delta_rule with use_qk_l2norm_in_kernel. Per value
// head h, token by token: S ← S·exp(g); kv = Sᵀk̂; δ = β·(v − kv); S ← S + k̂·δᵀ; o = Sᵀq̂, where
// k̂ = k / √(Σk² + 1e-6) and q̂ = q / √(Σq² + 1e-6) / √DK (l2norm's eps sits on the sum, as in transformers).
// GVA: value head h reads q/k head h / (VH / KH), transformers' repeat_interleave. pos0 == 0 starts from
// S = 0 whatever the state buffer holds (a reset needs no clearing).
// Workgroup (h, y) owns COLS = WG / RSPLIT state columns y·COLS .. of value head h; each column's DK rows are
// split over RSPLIT threads (DK / RSPLIT rows each, held in registers for the whole dispatch: a thread holding a
// whole 128-row column spilled registers on the H200: BENCH.md), so the token loop runs inside
// one dispatch for decode (T = 1) and prefill (T tokens) alike. Columns are independent, so a head may spread
// over several workgroups (each re-reads q/k and re-takes their norms). Per token: one workgroup reduction (the
// two norms), then kv = Sᵀk̂ and o = Sᵀq̂ each summed over a column's RSPLIT threads in workgroup memory.
// gdn_recur_sg.wgsl is the same recurrence with its sums in subgroup shuffles; this kernel runs where subgroups are
// missing or narrower than a column's threads.
// A chunked (UT-transform) prefill would turn the loop into matmuls, at the price of a second algorithm to keep
// in step with decode; correctness first.
// Constants: WG threads (a power of two without subgroups), RSPLIT (divides DK and WG), KH key heads, VH value
//   heads, DK, DV head dims, CONV row length of qkv (q in [0, KH·DK), k in [KH·DK, 2·KH·DK), v in
//   [2·KH·DK, 2·KH·DK + VH·DV)).
// Bindings: 0 qkv f32[T, CONV] (read; gdn_conv's output), 1 gates f32[T, 2·VH] (read; g then β),
//   2 state f32[VH, DK, DV] (read_write; S[h, i, j] at (h·DK + i)·DV + j), 3 out f32[T, VH·DV] (write),
//   4 step uniform (n_tokens, pos0).
// Grid: (VH, ceil(DV / COLS)).
#import step
#import reduce

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read> gates: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const KEY: u32 = KH * DK;
const COLS: u32 = WG / RSPLIT;
const RROWS: u32 = DK / RSPLIT;

var<workgroup> q_sh: array<f32, DK>;
var<workgroup> k_sh: array<f32, DK>;
var<workgroup> part: array<f32, WG>;  // per-thread partial sums of kv, then of o

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let kh = h / (VH / KH);
    let c_local = lane.lid % COLS;
    let r0 = (lane.lid / COLS) * RROWS;  // this thread's rows r0 .. r0 + RROWS of its column
    let live = wid.y * COLS + c_local < DV;
    let col = min(wid.y * COLS + c_local, DV - 1u);  // threads past DV shadow a real column but never write
    let base = h * DK * DV + col;
    let fresh = step.pos0 == 0u;
    var s: array<f32, RROWS>;
    for (var i = 0u; i < RROWS; i++) { s[i] = select(state[base + (r0 + i) * DV], 0.0, fresh); }
    for (var t = 0u; t < step.n_tokens; t++) {
        let row = t * CONV;
        var sq = vec4<f32>(0.0);
        for (var i = lane.lid; i < DK; i += WG) {
            let qv = qkv[row + kh * DK + i];
            let kv = qkv[row + KEY + kh * DK + i];
            q_sh[i] = qv;
            k_sh[i] = kv;
            sq += vec4<f32>(qv * qv, kv * kv, 0.0, 0.0);
        }
        let sums = wg_sum4(sq, lane);  // its barriers also publish q_sh / k_sh
        let iq = inverseSqrt(sums.x + 1e-6) * inverseSqrt(f32(DK));
        let ik = inverseSqrt(sums.y + 1e-6);
        let decay = exp(gates[t * 2u * VH + h]);
        let beta = gates[t * 2u * VH + VH + h];
        var kv = 0.0;
        for (var i = 0u; i < RROWS; i++) { s[i] *= decay; kv += s[i] * k_sh[r0 + i]; }
        part[lane.lid] = kv;
        workgroupBarrier();
        var kv_all = 0.0;
        for (var r = 0u; r < RSPLIT; r++) { kv_all += part[r * COLS + c_local]; }
        let delta = (qkv[row + 2u * KEY + h * DV + col] - kv_all * ik) * beta * ik;
        var o = 0.0;
        for (var i = 0u; i < RROWS; i++) { s[i] += k_sh[r0 + i] * delta; o += s[i] * q_sh[r0 + i]; }
        workgroupBarrier();  // every column has its kv before part is reused
        part[lane.lid] = o;
        workgroupBarrier();
        if (live && r0 == 0u) {
            var o_all = 0.0;
            for (var r = 0u; r < RSPLIT; r++) { o_all += part[r * COLS + c_local]; }
            out[(t * VH + h) * DV + col] = o_all * iq;
        }
        workgroupBarrier();  // the next token overwrites q_sh / k_sh / part
    }
    if (live) {
        for (var i = 0u; i < RROWS; i++) { state[base + (r0 + i) * DV] = s[i]; }
    }
}
