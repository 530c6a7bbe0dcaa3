// Gated delta rule as gdn_recur.wgsl computes it (same bindings, state layout and formulas; see its header), with
// every per-token reduction in subgroup shuffles instead of workgroup memory: the token loop has no barrier, so a
// column's threads run their tokens without waiting for the rest of the workgroup.
// Thread v (its place in its subgroup: v = sg_id·sg_size + sg_lane, whatever the driver's mapping of
// local_invocation_index) owns column v / RSPLIT and, of its rows, the runs of four 4·(j·RSPLIT + r) .. + 3 for
// j < RV, r = v % RSPLIT (a column's lanes read consecutive vec4s of q and k at each step), held as vec4s: constant
// loops of RV steps, the four lanes of a vec4 four partial sums. The RSPLIT threads of a column are RSPLIT aligned
// lanes of one subgroup, so subgroupShuffleXor over offsets < RSPLIT sums kv = Sᵀk, o = Sᵀq and the q/k sums of
// squares (each column takes its head's norms itself). Needs subgroups of at least RSPLIT lanes (the host checks)
// and full subgroups below WG (WG a power of two).
// q, k, v and the gates come straight from global memory, the next token's loaded before this token's arithmetic:
// only the state carries from token to token, through kv's sum.
// Constants: WG threads (a power of two), RSPLIT (a power of two; 4·RSPLIT divides DK, RSPLIT divides WG), KH, VH,
//   DK, DV, CONV (a multiple of 4) as in gdn_recur.wgsl.
// Bindings: as gdn_recur.wgsl, qkv read as vec4s. Grid: (VH, ceil(DV / COLS)).
#import step
#import reduce

@group(0) @binding(0) var<storage, read> qkv: array<vec4<f32>>;  // CONV % 4 == 0: a row starts on a vec4
@group(0) @binding(1) var<storage, read> gates: array<f32>;
@group(0) @binding(2) var<storage, read_write> state: array<f32>;
@group(0) @binding(3) var<storage, read_write> out: array<f32>;
@group(0) @binding(4) var<uniform> step: Step;

const KEY: u32 = KH * DK;
const COLS: u32 = WG / RSPLIT;
const RV: u32 = DK / (4u * RSPLIT);  // vec4s of rows a thread holds

// One token's inputs as this thread reads them: its rows of q and k, its column's v, the decay gate and β.
struct TokenIn {
    q: array<vec4<f32>, RV>,
    k: array<vec4<f32>, RV>,
    v: f32,
    g: f32,
    beta: f32,
}

fn load_token(t: u32, kh: u32, h: u32, r: u32, col: u32) -> TokenIn {
    var x: TokenIn;
    let row = t * CONV;
    for (var j = 0u; j < RV; j++) {
        let i = 4u * (j * RSPLIT + r);
        x.q[j] = qkv[(row + kh * DK + i) / 4u];
        x.k[j] = qkv[(row + KEY + kh * DK + i) / 4u];
    }
    let vi = row + 2u * KEY + h * DV + col;
    x.v = qkv[vi / 4u][vi % 4u];
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

fn lanes_sum(v: vec4<f32>) -> f32 {
    return (v.x + v.y) + (v.z + v.w);
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
    var s: array<vec4<f32>, RV>;
    for (var j = 0u; j < RV; j++) {
        let at = base + 4u * (j * RSPLIT + r) * DV;
        let held = vec4<f32>(state[at], state[at + DV], state[at + 2u * DV], state[at + 3u * DV]);
        s[j] = select(held, vec4<f32>(0.0), fresh);
    }
    var next = load_token(0u, kh, h, r, col);
    for (var t = 0u; t < step.n_tokens; t++) {
        let x = next;
        next = load_token(min(t + 1u, step.n_tokens - 1u), kh, h, r, col);  // in flight during this token
        var qq = vec4<f32>(0.0);
        var kk = vec4<f32>(0.0);
        for (var j = 0u; j < RV; j++) { qq += x.q[j] * x.q[j]; kk += x.k[j] * x.k[j]; }
        let sums = column_sum2(vec2<f32>(lanes_sum(qq), lanes_sum(kk)));
        let iq = inverseSqrt(sums.x + 1e-6) * inverseSqrt(f32(DK));
        let ik = inverseSqrt(sums.y + 1e-6);
        let decay = exp(x.g);
        var kv = vec4<f32>(0.0);
        for (var j = 0u; j < RV; j++) { s[j] *= decay; kv += s[j] * x.k[j]; }
        let delta = (x.v - column_sum(lanes_sum(kv)) * ik) * x.beta * ik;
        var o = vec4<f32>(0.0);
        for (var j = 0u; j < RV; j++) { s[j] += x.k[j] * delta; o += s[j] * x.q[j]; }
        let o_all = column_sum(lanes_sum(o));
        if (live && r == 0u) { out[(t * VH + h) * DV + col] = o_all * iq; }
    }
    if (live) {
        for (var j = 0u; j < RV; j++) {
            let at = base + 4u * (j * RSPLIT + r) * DV;
            state[at] = s[j].x;
            state[at + DV] = s[j].y;
            state[at + 2u * DV] = s[j].z;
            state[at + 3u * DV] = s[j].w;
        }
    }
}
