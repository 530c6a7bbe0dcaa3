// Sampling on the GPU: temperature, then top-k, top-p, min-p (transformers' order), then one draw from the
// renormalised distribution; temperature 0 is argmax (lowest index on ties). Runs after sample_penalty.wgsl.
// Writes tokens[0] (the next step's embedding input; draw 0 only) and out_tokens[out_index + j].
// Dispatch (n <= 65535): workgroup j is an independent draw (RNG counter out_index + j); the engine uses 1.
//
// With d = (max - l) / T and weight w = exp(-d), every filter keeps an upper set {l >= t}:
//   top-k: t_k = the k-th largest logit (all its ties kept)
//   top-p: t_p = the smallest t >= t_k with mass(l > t) < top_p * mass(l >= t_k) (ties kept together)
//   min-p: keep d <= -ln(min_p), i.e. p >= min_p * p_max
// Tokens with d > D_MAX get weight 0 (exp(-87) is where f32 underflows) and are never drawn.
// Fast path, no sort over the vocabulary: one "ladder" pass counts the tokens and their mass within 8 gaps
// ("rungs") of the max. The narrowest rung that provably holds every kept token (and all of top-k's mass
// when top-p needs it) and fits CAP slots is copied to workgroup memory and sorted by rank counting (value
// desc, id asc); thread 0 then cuts the sorted list the way transformers does and draws from it.
// Otherwise (top-k and top-p off, or no rung fits, e.g. top_p alone over a very flat distribution) t_k and
// t_p, when on, are bisections over the logits' order-preserving u32 keys (32 passes each, exact); each
// thread sums the kept weights of its strided slice, thread 0 finds the slice holding u * total, and that
// thread walks it.
// u = hash(seed, out_index + j, position) in [0, 1): the same seed gives the same tokens.
//
// One workgroup per draw. Constants: WG (threads, a power of two), VOCAB, CAP (candidate slots).
// Workgroup memory: 20·CAP + 20·WG (4·WG here, 16·WG in the reduce lib) + 12 bytes: 15 KiB at 512, 256.
// Bindings: 0 logits f32[VOCAB] (row 0, read), 1 tokens u32[...] (write [0]), 2 out_tokens u32[RING],
// 3 step uniform, 4 params uniform SampleParams.
#import step
#import sample_params
#import reduce

@group(0) @binding(0) var<storage, read> logits: array<f32>;
@group(0) @binding(1) var<storage, read_write> tokens: array<u32>;
@group(0) @binding(2) var<storage, read_write> out_tokens: array<u32>;
@group(0) @binding(3) var<uniform> step: Step;
@group(0) @binding(4) var<uniform> params: SampleParams;

const D_MAX = 87.0;
const NONE = 0xffffffffu;
const NEG_INF = -3.4028235e38;
const RUNGS_LO = vec4<f32>(D_MAX / 128.0, D_MAX / 64.0, D_MAX / 32.0, D_MAX / 16.0);  // gaps, doubling
const RUNGS_HI = vec4<f32>(D_MAX / 8.0, D_MAX / 4.0, D_MAX / 2.0, D_MAX);

var<workgroup> cand_val: array<f32, CAP>;
var<workgroup> cand_id: array<u32, CAP>;
var<workgroup> sorted_val: array<f32, CAP>;
var<workgroup> sorted_id: array<u32, CAP>;
var<workgroup> sorted_w: array<f32, CAP>;
var<workgroup> n_cand: atomic<u32>;
var<workgroup> broadcast: u32;
var<workgroup> part: array<f32, WG>;  // per-thread slice sums (fallback draw)
var<workgroup> pick_rest: f32;

var<private> best: f32;  // the largest logit

// Order-preserving map f32 -> u32: a < b  <=>  key(a) < key(b).
fn order_key(x: f32) -> u32 {
    let b = bitcast<u32>(x);
    return select(b | 0x80000000u, ~b, (b & 0x80000000u) != 0u);
}

fn logit(i: u32) -> f32 {
    let l = logits[i];
    return select(l, NEG_INF, l != l);  // NaN ranks last
}

fn gap(l: f32) -> f32 { return (best - l) * params.inv_temp; }

fn weight(l: f32) -> f32 {
    let d = gap(l);
    return select(0.0, exp(-d), d <= D_MAX);
}

fn pcg(v: u32) -> u32 {
    let s = v * 747796405u + 2891336453u;
    let w = ((s >> ((s >> 28u) + 4u)) ^ s) * 277803737u;
    return (w >> 22u) ^ w;
}

// Uniform in [0, 1) from (seed, ring slot, sequence position).
fn uniform01(draw: u32) -> f32 {
    var h = pcg(params.seed_lo ^ pcg(params.seed_hi));
    h = pcg(h ^ (step.out_index + draw));
    h = pcg(h ^ pcg(step.pos0 + step.n_tokens));
    return f32(h >> 8u) * (1.0 / 16777216.0);
}

fn emit(token: u32, draw: u32) {
    out_tokens[step.out_index + draw] = token;
    if (draw == 0u) { tokens[0] = token; }
}

// Does the rung {d <= reach} (count tokens, mass z) hold every kept token, with exact thresholds?
fn rung_holds(reach: f32, count: f32, z: f32, z_all: f32) -> bool {
    let k_on = params.top_k > 0u;
    let p_on = params.top_p < 1.0;
    if (reach >= D_MAX || (k_on && count >= f32(params.top_k))) { return true; }  // all of top-k inside
    if (k_on && p_on) { return false; }  // top-p would need top-k's mass from outside
    return reach >= params.min_p_gap || (p_on && z >= params.top_p * z_all);  // t_m or t_p inside
}

// Ladder pass: the narrowest rung that holds the kept tokens in <= CAP slots (-1 if none); sets z_all.
fn ladder(lane: Lane, z_all: ptr<function, f32>) -> f32 {
    var c_lo = vec4<f32>(0.0);
    var c_hi = vec4<f32>(0.0);
    var z_lo = vec4<f32>(0.0);
    var z_hi = vec4<f32>(0.0);
    for (var i = lane.lid; i < VOCAB; i += WG) {
        let d = gap(logit(i));
        let w = select(0.0, exp(-d), d <= D_MAX);
        let in_lo = vec4<f32>(d) <= RUNGS_LO;
        let in_hi = vec4<f32>(d) <= RUNGS_HI;
        c_lo += select(vec4<f32>(0.0), vec4<f32>(1.0), in_lo);
        c_hi += select(vec4<f32>(0.0), vec4<f32>(1.0), in_hi);
        z_lo += select(vec4<f32>(0.0), vec4<f32>(w), in_lo);
        z_hi += select(vec4<f32>(0.0), vec4<f32>(w), in_hi);
    }
    c_lo = wg_sum4(c_lo, lane);
    c_hi = wg_sum4(c_hi, lane);
    z_lo = wg_sum4(z_lo, lane);
    z_hi = wg_sum4(z_hi, lane);
    *z_all = z_hi.w;
    for (var r = 0u; r < 4u; r++) {
        if (c_lo[r] <= f32(CAP) && rung_holds(RUNGS_LO[r], c_lo[r], z_lo[r], z_hi.w)) { return RUNGS_LO[r]; }
    }
    for (var r = 0u; r < 4u; r++) {
        if (c_hi[r] <= f32(CAP) && rung_holds(RUNGS_HI[r], c_hi[r], z_hi[r], z_hi.w)) { return RUNGS_HI[r]; }
    }
    return -1.0;
}

// Copy the rung to workgroup memory, then rank it (value desc, id asc) into sorted_*; returns its size.
// Ranking by counting costs n^2 / WG compares with broadcast reads: cheap for n <= CAP.
fn sort_rung(reach: f32, lane: Lane) -> u32 {
    let lid = lane.lid;
    if (lid == 0u) { atomicStore(&n_cand, 0u); }
    workgroupBarrier();
    for (var i = lid; i < VOCAB; i += WG) {
        let l = logit(i);
        if (gap(l) <= reach) {
            let at = atomicAdd(&n_cand, 1u);
            if (at < CAP) { cand_val[at] = l; cand_id[at] = i; }
        }
    }
    workgroupBarrier();
    let n = min(atomicLoad(&n_cand), CAP);
    for (var i = lid; i < n; i += WG) {
        let key = order_key(cand_val[i]);
        let id = cand_id[i];
        var rank = 0u;
        for (var j = 0u; j < n; j++) {
            let kj = order_key(cand_val[j]);
            rank += u32(kj > key || (kj == key && cand_id[j] < id));
        }
        sorted_val[rank] = cand_val[i];
        sorted_id[rank] = id;
        sorted_w[rank] = weight(cand_val[i]);
    }
    workgroupBarrier();
    return n;
}

// Thread 0: cut the n sorted candidates by top-k, top-p, min-p, then draw from the kept prefix.
fn draw_sorted(n: u32, z_all: f32, u: f32) -> u32 {
    let k = params.top_k;
    var c = n;  // the kept prefix
    if (k > 0u && k < n) {
        c = k;
        while (c < n && sorted_val[c] == sorted_val[c - 1u]) { c++; }  // ties of the k-th stay
    }
    if (params.top_p < 1.0) {
        var z_k = z_all;
        if (k > 0u) {
            z_k = 0.0;
            for (var i = 0u; i < c; i++) { z_k += sorted_w[i]; }
        }
        var above = 0.0;  // mass strictly before i
        for (var i = 0u; i < c; i++) {
            if (above >= params.top_p * z_k) { c = i; break; }
            above += sorted_w[i];
        }
        while (c > 0u && c < n && sorted_val[c] == sorted_val[c - 1u]) { c++; }  // stops at top-k's cut
    }
    var total = 0.0;
    for (var i = 0u; i < c; i++) {
        if (gap(sorted_val[i]) > params.min_p_gap) { c = i; break; }
        total += sorted_w[i];
    }
    let goal = u * total;
    var run = 0.0;
    var token = NONE;
    for (var i = 0u; i < c; i++) {
        let w = sorted_w[i];
        if (w > 0.0) {
            token = sorted_id[i];  // rounding can leave goal past the end: keep the last one with mass
            if (run + w > goal) { break; }
            run += w;
        }
    }
    return token;
}

// Fallback: smallest key t in [lo, hi] with stat(l > t) < bound over all logits, stat = count or mass.
fn bisect(lo0: u32, hi0: u32, by_mass: bool, bound: f32, lane: Lane) -> u32 {
    var lo = lo0;
    var hi = hi0;  // the caller makes pred(hi) hold
    for (var it = 0u; it < 32u; it++) {  // a u32 range halves down to one key in 32 steps
        let mid = lo + (hi - lo) / 2u;
        var s = 0.0;
        for (var i = lane.lid; i < VOCAB; i += WG) {
            let l = logit(i);
            if (order_key(l) > mid) { s += select(1.0, weight(l), by_mass); }
        }
        if (wg_sum(s, lane) < bound) { hi = mid; } else { lo = mid + 1u; }
    }
    return lo;
}

fn kept(l: f32, tau: u32) -> bool { return order_key(l) >= tau && gap(l) <= params.min_p_gap; }

// Fallback draw over all logits; returns the id on the thread that found it, NONE elsewhere.
fn draw_all(z_all: f32, u: f32, lane: Lane) -> u32 {
    let lid = lane.lid;
    let k_on = params.top_k > 0u;
    let top = order_key(best);
    var tau = 0u;  // keep key(l) >= tau
    if (k_on) { tau = bisect(0u, top, false, f32(params.top_k), lane); }
    if (params.top_p < 1.0) {
        var z_k = z_all;
        if (k_on) {
            var s = 0.0;
            for (var i = lid; i < VOCAB; i += WG) {
                let l = logit(i);
                if (order_key(l) >= tau) { s += weight(l); }
            }
            z_k = wg_sum(s, lane);
        }
        tau = bisect(tau, top, true, params.top_p * z_k, lane);
    }
    var s = 0.0;
    for (var i = lid; i < VOCAB; i += WG) {
        let l = logit(i);
        if (kept(l, tau)) { s += weight(l); }
    }
    part[lid] = s;
    workgroupBarrier();
    if (lid == 0u) {
        var total = 0.0;
        for (var t = 0u; t < WG; t++) { total += part[t]; }
        let goal = u * total;
        var run = 0.0;
        broadcast = NONE;
        for (var t = 0u; t < WG; t++) {
            let p = part[t];
            if (p > 0.0) {
                broadcast = t;  // past the end (rounding), keep the last slice with mass
                pick_rest = goal - run;
                if (run + p > goal) { break; }
            }
            run += p;
        }
    }
    workgroupBarrier();
    var token = NONE;
    if (lid == broadcast) {
        var run = 0.0;
        for (var i = lid; i < VOCAB; i += WG) {
            let l = logit(i);
            let w = weight(l);
            if (kept(l, tau) && w > 0.0) {
                token = i;
                if (run + w > pick_rest) { break; }
                run += w;
            }
        }
    }
    return token;
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let lid = lane.lid;
    let draw = wid.x;

    // The max and its lowest index: the greedy answer.
    var m = NEG_INF;
    var mi = NONE;
    for (var i = lid; i < VOCAB; i += WG) {
        let l = logit(i);
        if (l > m) { m = l; mi = i; }  // strided scan: the first hit per thread is its lowest index
    }
    best = wg_max(m, lane);
    if (params.inv_temp == 0.0) {
        let neg_idx = wg_max(select(-1.0e9, -f32(mi), mi != NONE && m == best), lane);  // ids < 2^24: exact
        if (lid == 0u) { emit(select(0u, u32(-neg_idx), neg_idx > -1.0e8), draw); }
        return;
    }

    var z_all = 0.0;
    var reach = -1.0;
    if (params.top_k > 0u || params.top_p < 1.0) { reach = ladder(lane, &z_all); }  // else: one pass below
    if (lid == 0u) { broadcast = u32(reach >= 0.0); }
    if (workgroupUniformLoad(&broadcast) == 1u) {
        let n = sort_rung(reach, lane);
        if (lid == 0u) { emit(draw_sorted(n, z_all, uniform01(draw)), draw); }
    } else {
        let token = draw_all(z_all, uniform01(draw), lane);
        if (token != NONE) { emit(token, draw); }
    }
}
