// Split-K decode attention in one dispatch (T = 1, position p = step.pos0, S = step.attn_splits): what rope_append,
// attention (SPLIT) and attention_combine (and for the gated variant attn_gate) do for one token, with no dispatch
// between them. Workgroup (h, s) does attention_decode.wgsl's work for head h (attention_decode_head.wgsl: q head h
// and the new key and value of its kv head, as attention_decode computes them) over split s's keys
// [s·c, min((s+1)·c, n)), c = ceil(n / S), n = p + 1, as attention.wgsl splits them (a split may be empty). The split
// holding p scores the new key from workgroup memory and, in the group's first query head, writes it and the value
// to the cache slot of p; no workgroup reads that slot from the cache.
// Each workgroup writes its partial (unnormalized o, m, l) to `part`, then (storageBarrier) takes a ticket of head h;
// the one that draws S − 1 arrives last: every other split's partial is written and visible to it, so it resets the
// ticket (for the next layer's dispatch; dispatches are ordered by barriers), combines the S partials exactly as
// attention_combine.wgsl does (the same order of summation over s) and writes the epilogue (gate, out, o's int8 row).
// No workgroup waits for another, so any order of execution and any number of workgroups in flight is fine.
// storageBarrier() is what orders the partial's stores before the ticket (and the last workgroup's loads after its
// own): naga lowers it to OpControlBarrier(Workgroup, Device, AcquireRelease | UniformMemory) and storage atomics to
// Device scope (gfx-rs/wgpu naga/src/back/spv/writer.rs write_barrier and helpers.rs to_spirv_semantics_and_scope;
// newer naga names it write_control_barrier).
// S = 1 skips the partials and tickets: attention_decode.wgsl's arithmetic, bit for bit.
// Constants: attention_decode.wgsl's.
// Bindings: attention_decode.wgsl's 0-8, then 9 part u32[H, S, R4, 4], f32 bits through atomics (read_write; per
//   head and split a record of R4 vec4s: o [C], then (m, l, 0, 0); records are 128-byte multiples, so no two
//   share a cache line),
//   10 tickets atomic<u32>[H] (read_write; zero between dispatches).
// Grid: (H, S', 1), S' ≥ S (workgroups past S leave at once).
#import step
#import attention_decode_head

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read_write> k_cache: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read_write> v_cache: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> page_table: array<u32>;
@group(0) @binding(4) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(5) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(6) var<uniform> step: Step;
@group(0) @binding(7) var<storage, read_write> xq: array<u32>;
@group(0) @binding(8) var<storage, read_write> xm: array<vec2<f32>>;
@group(0) @binding(9) var<storage, read_write> part: array<atomic<u32>>;
@group(0) @binding(10) var<storage, read_write> tickets: array<atomic<u32>>;

const R4: u32 = (C + 8u) / 8u * 8u;  // vec4s a partial record: C + 1, rounded up to 8 (128 bytes)

var<workgroup> ticket_sh: u32;

// The partials move through atomics (relaxed, Device scope): naga gives storage buffers no Coherent decoration, so
// plain loads of what another workgroup wrote in this dispatch may hit a stale cache line on some GPUs.
fn part_store(i: u32, v: vec4<f32>) {
    for (var j = 0u; j < 4u; j++) { atomicStore(&part[4u * i + j], bitcast<u32>(v[j])); }
}

fn part_load(i: u32) -> vec4<f32> {
    return vec4<f32>(bitcast<f32>(atomicLoad(&part[4u * i])), bitcast<f32>(atomicLoad(&part[4u * i + 1u])),
                     bitcast<f32>(atomicLoad(&part[4u * i + 2u])), bitcast<f32>(atomicLoad(&part[4u * i + 3u])));
}

// BATCHED's combine: a thread a split loads its (m, l) at once, the weights e^(m_s − M) meet in p_sh, then a thread
// a chunk loads UC splits' partials before summing any (the loads of a split group are independent). Needs S ≤ WG.
const UC: u32 = 8u;

fn combine_batched(lane: Lane, h: u32, rec0: u32, n_splits: u32) {
    let lid = lane.lid;
    var ml = vec4<f32>(NEG_BIG, 0.0, 0.0, 0.0);
    if (lid < n_splits) { ml = part_load(rec0 + lid * R4 + C); }
    let m_max = wg_max(ml.x, lane);
    let w = select(0.0, exp(ml.x - m_max), lid < n_splits);
    p_sh[lid] = w;  // read after wg_sum's barriers
    let inv = 1.0 / wg_sum(w * ml.y, lane);
    for (var c = lid; c < C; c += WG) {
        var o = vec4<f32>(0.0);
        for (var t0 = 0u; t0 < n_splits; t0 += UC) {
            var part_o: array<vec4<f32>, UC>;
            for (var u = 0u; u < UC; u++) { part_o[u] = part_load(rec0 + min(t0 + u, n_splits - 1u) * R4 + c); }
            for (var u = 0u; u < UC; u++) {
                o += select(0.0, p_sh[min(t0 + u, n_splits - 1u)], t0 + u < n_splits) * part_o[u];
            }
        }
        write_out(h, c, o * inv);
    }
    write_q8(lane, h);
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let s = wid.y;
    let n_splits = step.attn_splits;
    if (s >= n_splits) { return; }  // uniform: the whole workgroup leaves
    let lid = lane.lid;
    let p = step.pos0;
    let n_keys = p + 1u;
    let per_split = (n_keys + n_splits - 1u) / n_splits;
    let start = min(s * per_split, n_keys);
    let end = min(start + per_split, n_keys);
    load_head(lane, h, p, start <= p && p < end && h % GROUP == 0u);
    let ml = attend(lane, h / GROUP, p, start, end);
    if (n_splits == 1u) {
        for (var c = lid; c < C; c += WG) { write_out(h, c, o_sh[c] / ml.y); }
        write_q8(lane, h);
        return;
    }

    let rec = (h * n_splits + s) * R4;
    for (var c = lid; c < C; c += WG) { part_store(rec + c, o_sh[c]); }
    if (lid == 0u) { part_store(rec + C, vec4<f32>(ml.x, ml.y, 0.0, 0.0)); }
    storageBarrier();  // the partial is visible at device scope before the ticket is taken
    if (lid == 0u) { ticket_sh = atomicAdd(&tickets[h], 1u); }
    if (workgroupUniformLoad(&ticket_sh) != n_splits - 1u) { return; }
    // The last of head h: every split has taken its ticket, so none adds to it again in this dispatch.
    if (lid == 0u) { atomicStore(&tickets[h], 0u); }
    storageBarrier();  // the other splits' partials are read after their tickets

    // attention_combine.wgsl's arithmetic: M = max_s m_s, out = Σ_s e^(m_s − M) · o_s · (1 / Σ_s e^(m_s − M) · l_s).
    let rec0 = h * n_splits * R4;
    if (BATCHED) {
        combine_batched(lane, h, rec0, n_splits);
        return;
    }
    var m_max = part_load(rec0 + C).x;
    for (var t = 1u; t < n_splits; t++) { m_max = max(m_max, part_load(rec0 + t * R4 + C).x); }
    var denom = 0.0;
    for (var t = 0u; t < n_splits; t++) {
        let ml_t = part_load(rec0 + t * R4 + C);
        denom += exp(ml_t.x - m_max) * ml_t.y;
    }
    let inv = 1.0 / denom;
    for (var c = lid; c < C; c += WG) {
        var o = vec4<f32>(0.0);
        for (var t = 0u; t < n_splits; t++) {
            o += exp(part_load(rec0 + t * R4 + C).x - m_max) * part_load(rec0 + t * R4 + c);
        }
        write_out(h, c, o * inv);
    }
    write_q8(lane, h);
}
