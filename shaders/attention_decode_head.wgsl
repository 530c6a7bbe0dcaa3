// The pieces of decode attention for one query head that attention_decode.wgsl (a workgroup a head, every key) and
// attention_decode_split.wgsl (a workgroup a head and key split, the last of a head combining) share. The token sits
// at position p = step.pos0; head h reads kv head h / (H / KVH). load_head computes q head h from the fused QKV row
// (optional per-head RMSNorm, then RoPE: rope_append.wgsl's arithmetic) and the new key and value of its kv head,
// rounded to f16 as the cache holds them, and writes them to the cache slot of p when told; walk_keys scores the
// new key from workgroup memory, so no workgroup reads a slot another writes in the same dispatch. Keys come from the
// paged cache in blocks of WG, as attention.wgsl walks them (online softmax); in the P·V phase each thread
// accumulates PV consecutive vec4 chunks of the head for its share of the block's keys, so E = WG / (C / PV) key
// lanes run in parallel (more than attention.wgsl's one chunk a thread allows).
// Epilogue (write_out, write_q8): with GATE, out = attention · sigmoid(gate) (Qwen3.5; the gate projection wrote its
// row into the qkv buffer at GATE_OFF); with Q8 the output row also goes to int8 as quantize_q8 would write it
// (q8_pack.wgsl), the o-projection's input, each head's HD/32 chunks by the head's workgroup.
// Needs the includer's bindings qkv f32, k_cache / v_cache vec4<f16>, page_table u32, inv_freq f32 (the RoPE inverse
// frequencies, then the q and the k norm weights), out vec4<f32>, step, xq, xm, and its constants WG, H, KVH, HD,
// ROT, PAGE, SCALE, QK_NORM, EPS, NORM_OFFSET, ROPE_SCALE, GATE, GATE_OFF, Q8, PV (attention_decode.wgsl lists them).
#import rope
#import reduce
#import q8_pack
#import attention_decode_lanes

const C: u32 = HD / 4u;       // vec4 chunks per head row
const COLS: u32 = C / PV;     // threads covering one key's value row in the P·V phase
const E: u32 = WG / COLS;     // key lanes in the P·V phase (threads lid ≥ E·COLS sit it out)
const GROUP: u32 = H / KVH;   // query heads per kv head
const U: u32 = min(8u, (WG + E - 1u) / E);  // BATCHED: keys a key lane loads at once in the P·V phase
const HALF: u32 = ROT / 2u;
const NEG_BIG: f32 = -3.0e38; // "minus infinity" that keeps exp(a − b) and a − b finite
const NEW: u32 = 0xFFFFFFFFu; // row_sh's mark for the new key (held in k_sh / v_sh, not read from the cache)

var<workgroup> q_sh: array<vec4<f32>, C>;    // q · SCALE
var<workgroup> k_sh: array<vec4<f32>, C>;    // the new key and value, f16-rounded
var<workgroup> v_sh: array<vec4<f32>, C>;
var<workgroup> o_sh: array<vec4<f32>, C>;    // the output row: unnormalized after meet_lanes, final after write_out
var<workgroup> p_sh: array<f32, WG>;         // the block's softmax weights
var<workgroup> row_sh: array<u32, WG>;       // the block's cache row offsets (in vec4 units)
var<workgroup> acc_sh: array<vec4<f32>, WG>; // the final meeting of the E key lanes
var<private> acc: array<vec4<f32>, PV>;      // this thread's share of P·V (chunks chunk0 .. chunk0 + PV)
var<private> pre: array<vec4<f16>, U * PV>;  // BATCHED: a group of U keys' value chunks, loaded before use

// The value the f16 cache will hold (round to nearest even at f16's precision, f16 subnormals included), computed
// with round() on a power-of-two scale: NVIDIA's compiler folds both an f32 -> f16 -> f32 cast pair and an
// unpack2x16float(pack2x16float(.)) pair away, and the new key must score exactly as it does read back from the cache.
fn f16_rounded1(x: f32) -> f32 {
    let e = max(i32((bitcast<u32>(x) >> 23u) & 0xFFu) - 127, -14);  // the binade, f16's subnormal one at least
    return round(x * ldexp(1.0, 10 - e)) * ldexp(1.0, e - 10);
}

fn f16_rounded(v: vec4<f32>) -> vec4<f32> {
    return vec4<f32>(f16_rounded1(v.x), f16_rounded1(v.y), f16_rounded1(v.z), f16_rounded1(v.w));
}

// Element i of the head at qkv[src ..] after the optional RMSNorm (inv = the head's 1/rms; norm at inv_freq[w0 ..]).
fn normed(src: u32, i: u32, inv: f32, w0: u32) -> f32 {
    let v = qkv[src + i];
    if (!QK_NORM) { return v; }
    return v * inv * (inv_freq[w0 + i] + NORM_OFFSET);
}

// Element i of a q or k head after the norm and RoPE (rotate-half pairs (i, i + HALF)), as rope_append computes it;
// cs = rope_cos_sin(p, i % HALF) · ROPE_SCALE (used only for i < ROT), shared by q and k.
fn roped(src: u32, i: u32, inv: f32, w0: u32, cs: vec2<f32>) -> f32 {
    var val = normed(src, i, inv, w0);
    if (i < ROT) {
        if (i < HALF) {
            val = val * cs.x - normed(src, i + HALF, inv, w0) * cs.y;
        } else {
            val = val * cs.x + normed(src, i - HALF, inv, w0) * cs.y;
        }
    }
    return val;
}

fn head_inv_rms(src: u32, lane: Lane) -> f32 {
    var ss = 0.0;
    for (var i = lane.lid; i < HD; i += WG) { let v = qkv[src + i]; ss += v * v; }
    return inverseSqrt(wg_sum(ss, lane) / f32(HD) + EPS);
}

// q head h (· SCALE) and the new key and value of its kv head into workgroup memory; `append`: also into the
// cache slot of p. Ends with a barrier.
fn load_head(lane: Lane, h: u32, p: u32, append: bool) {
    let lid = lane.lid;
    let kvh = h / GROUP;
    let q_src = h * HD;
    let k_src = (H + kvh) * HD;
    let v_src = (H + KVH + kvh) * HD;
    var q_inv = 1.0;
    var k_inv = 1.0;
    if (QK_NORM) {  // a constant, so the reductions stay in uniform control flow
        q_inv = head_inv_rms(q_src, lane);
        k_inv = head_inv_rms(k_src, lane);
    }
    let new_row = ((page_table[p / PAGE] * KVH + kvh) * PAGE + p % PAGE) * C;
    for (var c = lid; c < C; c += WG) {
        var qv = vec4<f32>(0.0);
        var kv = vec4<f32>(0.0);
        for (var j = 0u; j < 4u; j++) {
            let i = 4u * c + j;
            var cs = vec2<f32>(1.0, 0.0);
            if (i < ROT) { cs = rope_cos_sin(p, i % HALF) * ROPE_SCALE; }
            qv[j] = roped(q_src, i, q_inv, HALF, cs);
            kv[j] = roped(k_src, i, k_inv, HALF + HD, cs);
        }
        let k16 = f16_rounded(kv);
        let v16 = f16_rounded(vec4<f32>(qkv[v_src + 4u * c], qkv[v_src + 4u * c + 1u], qkv[v_src + 4u * c + 2u],
                                        qkv[v_src + 4u * c + 3u]));
        q_sh[c] = qv * SCALE;
        k_sh[c] = k16;
        v_sh[c] = v16;
        if (append) {
            k_cache[new_row + c] = vec4<f16>(k16);
            v_cache[new_row + c] = vec4<f16>(v16);
        }
    }
    workgroupBarrier();
}

// BATCHED's P·V, U keys of a key lane at a time (j0, j0 + E, .. of the block's cache keys [0, n_cache)): every
// value load of the group is issued before any is used, the first group's before the block's scores (its loads
// overlap the key loads); a clamped index with weight 0 pads a group. The new key comes from v_sh, never the cache.
fn load_group(kvh: u32, kb: u32, j0: u32, n_cache: u32, chunk0: u32) {
    for (var u = 0u; u < U; u++) {
        let key = kb + min(j0 + u * E, n_cache - 1u);
        let r = ((page_table[key / PAGE] * KVH + kvh) * PAGE + key % PAGE) * C;
        for (var d = 0u; d < PV; d++) { pre[u * PV + d] = v_cache[r + chunk0 + d]; }
    }
}

fn add_group(j0: u32, n_cache: u32) {
    for (var u = 0u; u < U; u++) {
        let j = j0 + u * E;
        let w = select(0.0, p_sh[min(j, n_cache - 1u)], j < n_cache);
        for (var d = 0u; d < PV; d++) { acc[d] += w * vec4<f32>(pre[u * PV + d]); }
    }
}

// Online softmax over keys [start, end) of kv head kvh (end ≤ p + 1; key p from k_sh / v_sh): `acc` gets this
// thread's share of the unnormalized P·V; returns (m, l), the running max and the workgroup's sum of weights.
// [start, end) must be the same in every thread.
fn walk_keys(lane: Lane, kvh: u32, p: u32, start: u32, end: u32) -> vec2<f32> {
    let lid = lane.lid;
    let chunk0 = (lid % COLS) * PV;  // this thread's chunks chunk0 .. chunk0 + PV of the value rows
    let key_lane = lid / COLS;
    for (var d = 0u; d < PV; d++) { acc[d] = vec4<f32>(0.0); }
    var m = NEG_BIG;   // running max, identical in every thread
    var l = 0.0;       // this thread's share of the running sum (its own keys' weights)
    for (var kb = start; kb < end; kb += WG) {
        let has_new = p < end && kb <= p && p < kb + WG;  // the block ends with the new key
        let n_cache = select(min(WG, end - kb), p - kb, has_new);
        if (BATCHED && key_lane < min(E, n_cache)) { load_group(kvh, kb, key_lane, n_cache, chunk0); }
        let key = kb + lid;
        let valid = key < end;
        var score = NEG_BIG;
        var row = 0u;
        if (valid) {
            var d = 0.0;
            if (key == p) {
                row = NEW;
                for (var c = 0u; c < C; c++) { d += dot(q_sh[c], k_sh[c]); }
            } else {
                row = ((page_table[key / PAGE] * KVH + kvh) * PAGE + key % PAGE) * C;
                for (var c = 0u; c < C; c++) { d += dot(q_sh[c], vec4<f32>(k_cache[row + c])); }
            }
            score = d;
        }
        let m_new = max(m, wg_max(score, lane));
        let alpha = exp(m - m_new);  // 0 on the first block: m was NEG_BIG
        let pw = select(0.0, exp(score - m_new), valid);
        l = l * alpha + pw;
        for (var d = 0u; d < PV; d++) { acc[d] *= alpha; }
        m = m_new;
        p_sh[lid] = pw;
        row_sh[lid] = row;
        workgroupBarrier();
        if (BATCHED) {
            if (key_lane < min(E, n_cache)) { add_group(key_lane, n_cache); }
            for (var j0 = key_lane + E * U; key_lane < E && j0 < n_cache; j0 += E * U) {
                load_group(kvh, kb, j0, n_cache, chunk0);
                add_group(j0, n_cache);
            }
            if (has_new && key_lane == 0u) {
                for (var d = 0u; d < PV; d++) { acc[d] += p_sh[p - kb] * v_sh[chunk0 + d]; }
            }
        } else if (key_lane < E) {
            let n_in_block = min(WG, end - kb);
            for (var j = key_lane; j < n_in_block; j += E) {
                let r = row_sh[j];
                let pj = p_sh[j];
                if (r == NEW) {
                    for (var d = 0u; d < PV; d++) { acc[d] += pj * v_sh[chunk0 + d]; }
                } else {
                    for (var d = 0u; d < PV; d++) { acc[d] += pj * vec4<f32>(v_cache[r + chunk0 + d]); }
                }
            }
        }
        workgroupBarrier();  // p_sh / row_sh are rewritten by the next block
    }
    return vec2<f32>(m, wg_sum(l, lane));
}

// The E key lanes' partial outputs summed into o_sh (unnormalized), one of the PV chunks at a time. Ends with a
// barrier.
fn meet_lanes(lane: Lane) {
    let lid = lane.lid;
    let chunk0 = (lid % COLS) * PV;
    for (var d = 0u; d < PV; d++) {
        acc_sh[lid] = acc[d];
        workgroupBarrier();
        if (lid < COLS) {
            var o = acc[d];
            for (var e = 1u; e < E; e++) { o += acc_sh[e * COLS + lid]; }
            o_sh[chunk0 + d] = o;
        }
        workgroupBarrier();  // acc_sh is rewritten for the next chunk
    }
}

var<workgroup> rounds_sh: u32;  // LANES: ceil(C / G), 0 where LANE_CHUNKS · G < C (then walk_keys)

// Keys [start, end) of kv head kvh: o_sh gets the unnormalized output; returns (m, l). LANES takes walk_lanes where
// its lane groups cover the head (the subgroup size decides), else walk_keys + meet_lanes.
fn attend(lane: Lane, kvh: u32, p: u32, start: u32, end: u32) -> vec2<f32> {
    if (LANES) {  // a constant: what follows stays in uniform control flow
        if (lane.lid == 0u) {
            let width = lane_group_width(subgroup_place(lane).x);
            rounds_sh = select(0u, (C + width - 1u) / width, LANE_CHUNKS * width >= C);
        }
        let rounds = workgroupUniformLoad(&rounds_sh);
        if (rounds > 0u) { return walk_lanes(lane, kvh, p, start, end, rounds); }
    }
    let ml = walk_keys(lane, kvh, p, start, end);
    meet_lanes(lane);
    return ml;
}

// Chunk c of head h's normalized output: the gate (with GATE), then out and o_sh (for write_q8).
fn write_out(h: u32, c: u32, normalized: vec4<f32>) {
    var o = normalized;
    if (GATE) {
        let g = GATE_OFF + h * HD + 4u * c;
        o = o / (1.0 + exp(-vec4<f32>(qkv[g], qkv[g + 1u], qkv[g + 2u], qkv[g + 3u])));
    }
    out[h * C + c] = o;
    o_sh[c] = o;
}

// With Q8, head h's output row (o_sh, after write_out) as int8 chunks.
fn write_q8(lane: Lane, h: u32) {
    if (Q8) {  // a constant: the barrier stays in uniform control flow
        workgroupBarrier();
        for (var c = lane.lid; c < HD / 32u; c += WG) {
            var v: array<vec4<f32>, 8>;
            for (var j = 0u; j < 8u; j++) { v[j] = o_sh[8u * c + j]; }
            store_q8_chunk(h * (HD / 32u) + c, &v);
        }
    }
}
