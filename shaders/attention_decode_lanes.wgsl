// LANES' walk over the keys of one head (attention_decode_head.wgsl's `attend` picks it): lanes across the head dim.
// The workgroup splits into NG groups of G aligned lanes of a subgroup, G the largest power of two ≤ min(subgroup
// size, C), taken at run time; lane j of a group owns the vec4 chunks j, j + G, .. (< C; LANE_CHUNKS at most), so
// neighbouring lanes read neighbouring 8 bytes of a key row. A group takes 4 keys at a time (keys kb + 4·g .. + 3 of
// each step of 4·NG): every K and V chunk of the four is loaded before any math, the four scores are summed across
// the group by a shuffle tree at once, then the group's own online softmax (m, l, identical in its lanes) and its
// lanes' share of P·V — no barrier and no workgroup memory per step. The new key (p) comes from k_sh / v_sh and is
// group 0's last. One meeting of the groups' (m, l, o) in acc_sh at the end leaves o_sh as walk_keys + meet_lanes do.
// Needs LANE_CHUNKS · G ≥ C (the host sizes LANE_CHUNKS for the adapter's subgroup size; `attend` checks it) and subgroups
// whose lanes sit in order (subgroup id · size + lane), as reduce_subgroup.wgsl's workgroups have.

var<private> lane_acc: array<vec4<f32>, LANE_CHUNKS>;  // this lane's chunks of the group's unnormalized P·V

// A key row's offset (vec4 units) in the paged cache of kv head kvh.
fn cache_row(kvh: u32, key: u32) -> u32 {
    return ((page_table[key / PAGE] * KVH + kvh) * PAGE + key % PAGE) * C;
}

// G for a subgroup of `size` lanes: the largest power of two ≤ min(size, C).
fn lane_group_width(size: u32) -> u32 {
    return 1u << firstLeadingBit(min(size, C));
}

// Keys [start, end) of kv head kvh (end ≤ p + 1), as walk_keys + meet_lanes: o_sh gets the unnormalized output,
// returns (m, l). `rounds` = ceil(C / G), the same in every thread (a workgroupUniformLoad): the meeting's barriers
// stay in uniform control flow. Call only where LANE_CHUNKS · G ≥ C.
fn walk_lanes(lane: Lane, kvh: u32, p: u32, start: u32, end: u32, rounds: u32) -> vec2<f32> {
    let place = subgroup_place(lane);
    let width = lane_group_width(place.x);
    let j = place.y % width;                                   // this lane in its group
    let g = place.z * (place.x / width) + place.y / width;     // its group in the workgroup
    let n_groups = WG / width;
    for (var r = 0u; r < LANE_CHUNKS; r++) { lane_acc[r] = vec4<f32>(0.0); }
    var m = NEG_BIG;
    var l = 0.0;
    let cache_end = max(start, min(end, p));  // keys [start, cache_end) come from the cache
    for (var kb = start; kb < cache_end; kb += 4u * n_groups) {
        let k0 = kb + 4u * g;
        let valid = vec4<u32>(k0, k0 + 1u, k0 + 2u, k0 + 3u) < vec4<u32>(cache_end);
        let last = cache_end - 1u;  // past the end, a key loads the last cache key's row and weighs 0
        let rows = vec4<u32>(cache_row(kvh, min(k0, last)), cache_row(kvh, min(k0 + 1u, last)),
                             cache_row(kvh, min(k0 + 2u, last)), cache_row(kvh, min(k0 + 3u, last)));
        var vals: array<array<vec4<f16>, 4>, LANE_CHUNKS>;
        var s = vec4<f32>(0.0);
        for (var r = 0u; r < LANE_CHUNKS; r++) {
            let c = j + r * width;
            if (c < C) {
                let ka = k_cache[rows.x + c];
                let kb2 = k_cache[rows.y + c];
                let kc = k_cache[rows.z + c];
                let kd = k_cache[rows.w + c];
                vals[r][0] = v_cache[rows.x + c];
                vals[r][1] = v_cache[rows.y + c];
                vals[r][2] = v_cache[rows.z + c];
                vals[r][3] = v_cache[rows.w + c];
                let q = q_sh[c];
                s += vec4<f32>(dot(q, vec4<f32>(ka)), dot(q, vec4<f32>(kb2)), dot(q, vec4<f32>(kc)),
                               dot(q, vec4<f32>(kd)));
            }
        }
        s = select(vec4<f32>(NEG_BIG), lanes_sum4(s, width), valid);
        let m_new = max(m, max(max(s.x, s.y), max(s.z, s.w)));
        let alpha = exp(m - m_new);
        let w = select(vec4<f32>(0.0), exp(s - m_new), valid);
        l = l * alpha + (w.x + w.y + w.z + w.w);
        m = m_new;
        for (var r = 0u; r < LANE_CHUNKS; r++) {
            if (j + r * width < C) {
                lane_acc[r] = lane_acc[r] * alpha + w.x * vec4<f32>(vals[r][0]) + w.y * vec4<f32>(vals[r][1])
                              + w.z * vec4<f32>(vals[r][2]) + w.w * vec4<f32>(vals[r][3]);
            }
        }
    }
    if (start <= p && p < end) {  // the new key: every group sums its score (uniform), group 0 takes it
        var d = vec4<f32>(0.0);
        for (var r = 0u; r < LANE_CHUNKS; r++) {
            let c = j + r * width;
            if (c < C) { d.x += dot(q_sh[c], k_sh[c]); }
        }
        let score = lanes_sum4(d, width).x;
        if (g == 0u) {
            let m_new = max(m, score);
            let alpha = exp(m - m_new);
            let w = exp(score - m_new);
            l = l * alpha + w;
            m = m_new;
            for (var r = 0u; r < LANE_CHUNKS; r++) {
                let c = j + r * width;
                if (c < C) { lane_acc[r] = lane_acc[r] * alpha + w * v_sh[c]; }
            }
        }
    }
    // The meeting: M = max_g m_g, l = Σ_g e^(m_g − M) · l_g, o = Σ_g e^(m_g − M) · o_g, a round of G chunks at a time.
    let m_all = wg_max(m, lane);
    let f = exp(m - m_all);
    let l_all = wg_sum(select(0.0, l * f, j == 0u), lane);
    for (var r = 0u; r < LANE_CHUNKS; r++) {
        if (r < rounds) {
            acc_sh[g * width + j] = lane_acc[r] * f;
            workgroupBarrier();
            let c = lane.lid + r * width;
            if (lane.lid < width && c < C) {
                var o = vec4<f32>(0.0);
                for (var e = 0u; e < n_groups; e++) { o += acc_sh[e * width + lane.lid]; }
                o_sh[c] = o;
            }
            workgroupBarrier();  // acc_sh is rewritten for the next round
        }
    }
    return vec2<f32>(m_all, l_all);
}
