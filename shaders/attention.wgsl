// Paged causal attention with online softmax, for decode (T = 1) and prefill chunks (T = n_tokens).
// Query t sits at position pos0 + t and sees keys 0..pos0+t inclusive, all read from the paged f16
// cache (the chunk's own keys were appended before). Head h reads kv head h / (H / KVH) (GQA).
// One workgroup per (head h, token t, split s): grid (H, T, S), S = step.attn_splits. Split s takes the
// contiguous key range [s·c, min((s+1)·c, n)) with c = ceil(n / S), n = pos0 + t + 1; it may be empty.
// Keys go in blocks of WG: thread i scores key i of the block (a full HD dot with q held in workgroup
// memory), one wg_max gives the block max for the online-softmax rescale, then every thread
// accumulates P·V for its own 4 output dims over a share of the block's keys (HD/4 dim chunks × E key
// lanes, E = WG / (HD/4)); the E lanes and the per-thread softmax sums meet once at the end.
// Constants: WG threads (≥ HD/4; a power of two without subgroups), H, KVH, HD (multiple of 4, ≤ 4·WG),
//   PAGE tokens per page, SCALE f32 (1/√HD), SPLIT bool.
// Bindings: 0 q f32[T, H·HD] (read), 1 k_cache f16[n_pages, KVH, PAGE, HD] (read), 2 v_cache (same),
//   3 page_table u32[max_pages] (read),
//   4 SPLIT false: out f32[T, H·HD] normalized (write); SPLIT true: part_o f32[S, T, H, HD], unnormalized,
//     relative to the split's own max (write),
//   5 part_ml f32[S, T, H, 2] = (max m, sum l) per split (write; SPLIT false never writes it, but it is
//     still referenced so the auto layout keeps it: bind any small buffer, e.g. 16 bytes),
//   6 step uniform (n_tokens, pos0, attn_splits).
// A split with no keys writes part_o = 0, m = NEG_BIG, l = 0, which the combine weighs as zero.
#import step
#import reduce

@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> page_table: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<storage, read_write> part_ml: array<f32>;
@group(0) @binding(6) var<uniform> step: Step;

const C: u32 = HD / 4u;       // vec4 chunks per head row
const E: u32 = WG / C;        // key lanes in the P·V phase (threads lid ≥ E·C sit it out)
const GROUP: u32 = H / KVH;   // query heads per kv head
const NEG_BIG: f32 = -3.0e38; // "minus infinity" that keeps exp(a − b) and a − b finite

var<workgroup> q_sh: array<vec4<f32>, C>;   // q · SCALE, read by every thread in the score phase
var<workgroup> p_sh: array<f32, WG>;        // the block's softmax weights
var<workgroup> row_sh: array<u32, WG>;      // the block's cache row offsets (in vec4 units)
var<workgroup> acc_sh: array<vec4<f32>, WG>; // the final meeting of the E key lanes

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t = wid.y;
    let split = wid.z;
    let n_splits = step.attn_splits;
    if (t >= step.n_tokens || split >= n_splits) { return; }  // uniform: whole workgroup leaves
    let lid = lane.lid;
    let kvh = h / GROUP;
    let n_keys = step.pos0 + t + 1u;
    let per_split = (n_keys + n_splits - 1u) / n_splits;
    let start = min(split * per_split, n_keys);
    let end = min(start + per_split, n_keys);

    let q_row = (t * H + h) * C;
    for (var c = lid; c < C; c += WG) { q_sh[c] = q[q_row + c] * SCALE; }
    workgroupBarrier();

    let chunk = lid % C;
    let key_lane = lid / C;
    var acc = vec4<f32>(0.0);
    var m = NEG_BIG;   // running max, identical in every thread
    var l = 0.0;       // this thread's share of the running sum (its own keys' weights)
    for (var kb = start; kb < end; kb += WG) {
        let key = kb + lid;
        let valid = key < end;
        var score = NEG_BIG;
        var row = 0u;
        if (valid) {
            row = ((page_table[key / PAGE] * KVH + kvh) * PAGE + key % PAGE) * C;
            var d = 0.0;
            for (var c = 0u; c < C; c++) { d += dot(q_sh[c], vec4<f32>(k_cache[row + c])); }
            score = d;
        }
        let m_new = max(m, wg_max(score, lane));
        let alpha = exp(m - m_new);  // 0 on the first block: m was NEG_BIG
        let p = select(0.0, exp(score - m_new), valid);
        l = l * alpha + p;
        acc *= alpha;
        m = m_new;
        p_sh[lid] = p;
        row_sh[lid] = row;
        workgroupBarrier();
        if (key_lane < E) {
            let n_in_block = min(WG, end - kb);
            for (var j = key_lane; j < n_in_block; j += E) {
                acc += p_sh[j] * vec4<f32>(v_cache[row_sh[j] + chunk]);
            }
        }
        workgroupBarrier();  // p_sh / row_sh are rewritten by the next block
    }
    let l_total = wg_sum(l, lane);

    // Sum the E key lanes' partial outputs; lane 0 of each chunk writes.
    acc_sh[lid] = acc;
    workgroupBarrier();
    if (lid < C) {
        var o = acc;
        for (var e = 1u; e < E; e++) { o += acc_sh[e * C + lid]; }
        // Same index formula for both modes: out is part_o with S = 1, s = 0 when not split.
        let dst = ((split * step.n_tokens + t) * H + h) * C + lid;
        if (SPLIT) {
            out[dst] = o;
        } else {
            out[dst] = o / l_total;
        }
    }
    if (SPLIT && lid == 0u) {
        let ml = ((split * step.n_tokens + t) * H + h) * 2u;
        part_ml[ml] = m;
        part_ml[ml + 1u] = l_total;
    }
}
