// Gated delta rule as gdn_recur.wgsl computes it (same bindings, state layout and formulas; see its header), with
// every per-token reduction in subgroup shuffles instead of workgroup memory: the token loop has no barrier, so a
// column's threads run their tokens without waiting for the rest of the workgroup.
// Thread v (its place in its subgroup: v = sg_id·sg_size + sg_lane, whatever the driver's mapping of
// local_invocation_index) owns column v / RSPLIT and rows r, r + RSPLIT, r + 2·RSPLIT, .. of it, r = v % RSPLIT
// (interleaved: a column's lanes read consecutive q/k values at each step); the RSPLIT threads of a column are
// RSPLIT aligned lanes of one subgroup, so subgroupShuffleXor over offsets < RSPLIT sums kv = Sᵀk, o = Sᵀq and the
// q/k sums of squares (each column takes its head's norms itself). Needs subgroups of at least RSPLIT lanes (the
// host checks) and full subgroups below WG (WG a power of two).
// q, k, v and the gates come straight from global memory, the next token's loaded before this token's arithmetic:
// only the state carries from token to token, through kv's sum (four partial sums, a shorter chain than one).
// Constants: WG threads (a power of two), RSPLIT (a power of two dividing DK and WG), KH, VH, DK, DV, CONV as in
//   gdn_recur.wgsl.
// Bindings: as gdn_recur.wgsl. Grid: (VH, ceil(DV / COLS)).
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

// One token's inputs as this thread reads them: its rows of q and k, its column's v, the decay gate and β.
struct TokenIn {
    q: array<f32, RROWS>,
    k: array<f32, RROWS>,
    v: f32,
    g: f32,
    beta: f32,
}

fn load_token(t: u32, kh: u32, h: u32, r: u32, col: u32) -> TokenIn {
    var x: TokenIn;
    let row = t * CONV;
    for (var i = 0u; i < RROWS; i++) {
        x.q[i] = qkv[row + kh * DK + r + i * RSPLIT];
        x.k[i] = qkv[row + KEY + kh * DK + r + i * RSPLIT];
    }
    x.v = qkv[row + 2u * KEY + h * DV + col];
    x.g = gates[t * 2u * VH + h];
    x.beta = gates[t * 2u * VH + VH + h];
    return x;
}

// The sum over a column's RSPLIT lanes, every one of them getting it.
fn column_sum(x: f32) -> f32 {
    var s = x;
    for (var off = 1u; off < RSPLIT; off <<= 1u) { s += subgroupShuffleXor(s, off); }
    return s;
}

fn column_sum2(x: vec2<f32>) -> vec2<f32> {
    var s = x;
    for (var off = 1u; off < RSPLIT; off <<= 1u) { s += subgroupShuffleXor(s, off); }
    return s;
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let kh = h / (VH / KH);
    let v_idx = lane.sg_id * lane.sg_size + lane.sg_lane;
    let c_local = v_idx / RSPLIT;
    let r = v_idx % RSPLIT;
    let live = wid.y * COLS + c_local < DV;
    let col = min(wid.y * COLS + c_local, DV - 1u);  // threads past DV shadow a real column but never write
    let base = h * DK * DV + col;
    let fresh = step.pos0 == 0u;
    var s: array<f32, RROWS>;
    for (var i = 0u; i < RROWS; i++) { s[i] = select(state[base + (r + i * RSPLIT) * DV], 0.0, fresh); }
    var next = load_token(0u, kh, h, r, col);
    for (var t = 0u; t < step.n_tokens; t++) {
        let x = next;
        next = load_token(min(t + 1u, step.n_tokens - 1u), kh, h, r, col);  // in flight during this token
        var sq = vec2<f32>(0.0);
        for (var i = 0u; i < RROWS; i++) { sq += vec2<f32>(x.q[i] * x.q[i], x.k[i] * x.k[i]); }
        let sums = column_sum2(sq);
        let iq = inverseSqrt(sums.x + 1e-6) * inverseSqrt(f32(DK));
        let ik = inverseSqrt(sums.y + 1e-6);
        let decay = exp(x.g);
        var kv = vec4<f32>(0.0);
        for (var i = 0u; i < RROWS; i++) { s[i] *= decay; kv[i % 4u] += s[i] * x.k[i]; }
        let delta = (x.v - column_sum((kv.x + kv.y) + (kv.z + kv.w)) * ik) * x.beta * ik;
        var o = vec4<f32>(0.0);
        for (var i = 0u; i < RROWS; i++) { s[i] += x.k[i] * delta; o[i % 4u] += s[i] * x.q[i]; }
        let o_all = column_sum((o.x + o.y) + (o.z + o.w));
        if (live && r == 0u) { out[(t * VH + h) * DV + col] = o_all * iq; }
    }
    if (live) {
        for (var i = 0u; i < RROWS; i++) { state[base + (r + i * RSPLIT) * DV] = s[i]; }
    }
}
