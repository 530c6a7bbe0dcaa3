// Paged causal attention for a prefill chunk, tiled like a GEMM (flash-attention style): a workgroup owns 32
// query rows of one kv head (BT = 32 / HG tokens × HG query heads that share the kv head, so GQA heads reuse every
// staged key) and walks the keys in blocks of 32, online softmax. Rows and keys meet in register tiles: thread
// (tr = lid / 8, tk = lid % 8) scores rows 2tr, 2tr+1 against keys tk + 8j (j < 4) and accumulates the same two
// rows' outputs for the vec4 columns tk + 8d (d < HD/32). Q and K are staged 32 dims at a time, V 32 dims at a
// time into K's tile; each step's global loads are issued into registers before the step before computes (one
// step ahead, as matmul_q8w). Everything is f32 arithmetic on the f16 cache, as attention.wgsl.
// Query t sits at position pos0 + t and sees keys 0..pos0+t, all in the paged cache (the chunk's own keys
// were appended before). Grid (H / HG, ceil(T / BT)); token blocks run last-first, so the longest start first.
// Epilogue: ROWS_F32 writes the output rows as f32; ROWS_Q8 writes them as int8 as quantize_q8 would (q8_pack.wgsl),
// the o-projection's int8 GEMM input, without a quantize_q8 dispatch: a head's 32-element chunks lie inside the head,
// so the workgroup owning a row's head packs them, each chunk staged through q_sh for its 32 rows.
// Constants: H, KVH, HD (a multiple of 32), HG (a power of two dividing H / KVH, ≤ 32), PAGE, SCALE (1/√HD),
//   ROWS_F32, ROWS_Q8 (bools).
// Bindings: 0 q f32[T, H·HD] (read), 1 k_cache f16[n_pages, KVH, PAGE, HD] (read), 2 v_cache (same),
//   3 page_table u32 (read), 4 out f32[T, H·HD] (write), 5 step uniform (n_tokens, pos0), 6 xq u32[T, H·HD/4]
//   (write), 7 xm vec2<f32>[T, H·HD/32] (write); 6 and 7 are bound whether or not ROWS_Q8.
#import step
#import q8_pack

@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> page_table: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> step: Step;
@group(0) @binding(6) var<storage, read_write> xq: array<u32>;
@group(0) @binding(7) var<storage, read_write> xm: array<vec2<f32>>;

const WG: u32 = 128u;
const ROWS: u32 = 32u;          // query rows a workgroup
const BK: u32 = 32u;            // keys a block
const BT: u32 = ROWS / HG;      // tokens a workgroup
const C: u32 = HD / 4u;         // vec4 columns of a head row
const NCH: u32 = HD / 32u;      // 8-vec4 column chunks
const GROUP: u32 = H / KVH;     // query heads per kv head
const PAD: u32 = 9u;            // vec4 stride of a staged row (8 + 1: the 4 rows a warp reads fall on distinct banks)
const PS: u32 = BK + 1u;        // f32 stride of a row of weights
const NEG_BIG: f32 = -3.0e38;   // "minus infinity" that keeps exp(a − b) and a − b finite

var<workgroup> q_sh: array<vec4<f32>, ROWS * PAD>;  // Q[32 rows × 8 vec4] of the current dim chunk, · SCALE
var<workgroup> kv_sh: array<vec4<f32>, BK * PAD>;   // K (score phase) or V (output phase) [32 keys × 8 vec4]
var<workgroup> p_sh: array<f32, ROWS * PS>;         // the block's softmax weights
var<workgroup> red_sh: array<f32, ROWS * 8u>;       // per row, the 8 threads' partial max (later: partial sums)

fn cache_row(key: u32, kvh: u32) -> u32 {
    return ((page_table[key / PAGE] * KVH + kvh) * PAGE + key % PAGE) * C;
}

// What a thread stages for one step (its two items: rows / keys lid / 8 and lid / 8 + 16, vec4 column lid % 8).
struct Staged { q0: vec4<f32>, q1: vec4<f32>, kv0: vec4<f32>, kv1: vec4<f32> }

struct Tile { tb: u32, h0: u32, kvh: u32, T: u32, n_keys: u32 }

fn fetch_kv(w: Tile, key: u32, col: u32, v: bool) -> vec4<f32> {
    if (key >= w.n_keys) { return vec4<f32>(0.0); }  // past the end: p = 0, but the cache there may hold anything
    let at = cache_row(key, w.kvh) + col;
    if (v) { return vec4<f32>(v_cache[at]); }
    return vec4<f32>(k_cache[at]);
}

fn fetch_q(w: Tile, r: u32, col: u32) -> vec4<f32> {
    let t = w.tb + r / HG;
    if (t >= w.T) { return vec4<f32>(0.0); }
    return q[(t * H + w.h0 + r % HG) * C + col] * SCALE;
}

// Step g of key block kb: g < NCH stages Q and K dims 32g..32g+31, g ≥ NCH stages V dims 32(g − NCH)...
fn fetch(w: Tile, kb: u32, g: u32, lid: u32) -> Staged {
    let r = lid / 8u;
    let v = g >= NCH;
    let col = (g % NCH) * 8u + lid % 8u;
    var out: Staged;
    out.kv0 = fetch_kv(w, kb + r, col, v);
    out.kv1 = fetch_kv(w, kb + r + 16u, col, v);
    if (v) {
        out.q0 = vec4<f32>(0.0);
        out.q1 = vec4<f32>(0.0);
    } else {
        out.q0 = fetch_q(w, r, col);
        out.q1 = fetch_q(w, r + 16u, col);
    }
    return out;
}

@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let T = step.n_tokens;
    let pos0 = step.pos0;
    let n_tb = (T + BT - 1u) / BT;
    if (wid.y >= n_tb) { return; }  // uniform: whole workgroup leaves
    let tb = (n_tb - 1u - wid.y) * BT;
    let h0 = wid.x * HG;
    let kvh = h0 / GROUP;
    let n_keys = pos0 + min(tb + BT, T);  // keys of the workgroup's last token
    let tr = lid / 8u;
    let tk = lid % 8u;

    // The thread's two rows (2tr, 2tr + 1): token, and the last key each may see (a row past T sees none).
    let t0 = tb + (2u * tr) / HG;
    let t1 = tb + (2u * tr + 1u) / HG;
    let last0 = vec4<i32>(select(-1, i32(pos0 + t0), t0 < T));
    let last1 = vec4<i32>(select(-1, i32(pos0 + t1), t1 < T));
    let key_off = vec4<i32>(i32(tk), i32(tk) + 8, i32(tk) + 16, i32(tk) + 24);  // this thread's keys of a block

    // Scores and softmax state in named vectors (no private arrays in the hot loops); the output tile o is only
    // touched once per 32 keys, so where a compiler keeps it does not matter.
    let w = Tile(tb, h0, kvh, T, n_keys);
    var st = fetch(w, 0u, 0u, lid);
    var o: array<vec4<f32>, 2u * NCH>;
    var m = vec2<f32>(NEG_BIG);
    var l = vec2<f32>(0.0);
    for (var kb = 0u; kb < n_keys; kb += BK) {
        // ---- scores: s0 / s1 = q(row 2tr / 2tr+1) · k(keys kb + key_off), over HD in chunks of 32 dims
        var s0 = vec4<f32>(0.0);
        var s1 = vec4<f32>(0.0);
        for (var d = 0u; d < NCH; d++) {
            workgroupBarrier();  // the previous readers of q_sh / kv_sh are done
            q_sh[(lid / 8u) * PAD + lid % 8u] = st.q0;
            q_sh[(lid / 8u + 16u) * PAD + lid % 8u] = st.q1;
            kv_sh[(lid / 8u) * PAD + lid % 8u] = st.kv0;
            kv_sh[(lid / 8u + 16u) * PAD + lid % 8u] = st.kv1;
            workgroupBarrier();
            st = fetch(w, kb, d + 1u, lid);  // the next step's loads fly while this one computes
            for (var c = 0u; c < 8u; c++) {
                let q0 = q_sh[(2u * tr) * PAD + c];
                let q1 = q_sh[(2u * tr + 1u) * PAD + c];
                let k0 = kv_sh[tk * PAD + c];
                let k1 = kv_sh[(tk + 8u) * PAD + c];
                let k2 = kv_sh[(tk + 16u) * PAD + c];
                let k3 = kv_sh[(tk + 24u) * PAD + c];
                s0 += vec4<f32>(dot(q0, k0), dot(q0, k1), dot(q0, k2), dot(q0, k3));
                s1 += vec4<f32>(dot(q1, k0), dot(q1, k1), dot(q1, k2), dot(q1, k3));
            }
        }
        // ---- online softmax: causal mask, row max over the 8 threads of a row, weights to p_sh
        let keys = vec4<i32>(i32(kb)) + key_off;
        let ok0 = keys <= last0;
        let ok1 = keys <= last1;
        s0 = select(vec4<f32>(NEG_BIG), s0, ok0);
        s1 = select(vec4<f32>(NEG_BIG), s1, ok1);
        red_sh[(2u * tr) * 8u + tk] = max(max(s0.x, s0.y), max(s0.z, s0.w));
        red_sh[(2u * tr + 1u) * 8u + tk] = max(max(s1.x, s1.y), max(s1.z, s1.w));
        workgroupBarrier();
        var m_new = m;
        for (var e = 0u; e < 8u; e++) {
            m_new = max(m_new, vec2<f32>(red_sh[(2u * tr) * 8u + e], red_sh[(2u * tr + 1u) * 8u + e]));
        }
        let alpha = exp(m - m_new);
        m = m_new;
        let p0 = select(vec4<f32>(0.0), exp(s0 - vec4<f32>(m_new.x)), ok0);
        let p1 = select(vec4<f32>(0.0), exp(s1 - vec4<f32>(m_new.y)), ok1);
        l = l * alpha + vec2<f32>(dot(p0, vec4<f32>(1.0)), dot(p1, vec4<f32>(1.0)));
        let r0 = (2u * tr) * PS + tk;
        let r1 = (2u * tr + 1u) * PS + tk;
        p_sh[r0] = p0.x;
        p_sh[r0 + 8u] = p0.y;
        p_sh[r0 + 16u] = p0.z;
        p_sh[r0 + 24u] = p0.w;
        p_sh[r1] = p1.x;
        p_sh[r1 + 8u] = p1.y;
        p_sh[r1 + 16u] = p1.z;
        p_sh[r1 + 24u] = p1.w;
        // ---- outputs: o(row) = alpha · o(row) + Σ_key p · v(key), over HD in chunks of 32 dims
        for (var d = 0u; d < NCH; d++) {
            workgroupBarrier();  // p_sh is written, the previous readers of kv_sh / red_sh are done
            kv_sh[(lid / 8u) * PAD + lid % 8u] = st.kv0;
            kv_sh[(lid / 8u + 16u) * PAD + lid % 8u] = st.kv1;
            workgroupBarrier();
            if (d + 1u < NCH) {
                st = fetch(w, kb, NCH + d + 1u, lid);
            } else {
                st = fetch(w, kb + BK, 0u, lid);  // the next block's first step (all zeros past the last block)
            }
            var o0 = o[d] * alpha.x;
            var o1 = o[NCH + d] * alpha.y;
            for (var j = 0u; j < BK; j++) {
                let vv = kv_sh[j * PAD + tk];
                o0 += p_sh[(2u * tr) * PS + j] * vv;
                o1 += p_sh[(2u * tr + 1u) * PS + j] * vv;
            }
            o[d] = o0;
            o[NCH + d] = o1;
        }
    }

    // ---- the row sums meet; each thread writes its vec4 columns of its two rows
    workgroupBarrier();
    red_sh[(2u * tr) * 8u + tk] = l.x;
    red_sh[(2u * tr + 1u) * 8u + tk] = l.y;
    workgroupBarrier();
    var total = vec2<f32>(0.0);
    for (var e = 0u; e < 8u; e++) {
        total += vec2<f32>(red_sh[(2u * tr) * 8u + e], red_sh[(2u * tr + 1u) * 8u + e]);
    }
    let base0 = (t0 * H + h0 + (2u * tr) % HG) * C + tk;
    let base1 = (t1 * H + h0 + (2u * tr + 1u) % HG) * C + tk;
    for (var d = 0u; d < NCH; d++) {
        let y0 = o[d] / total.x;
        let y1 = o[NCH + d] / total.y;
        if (ROWS_F32) {
            if (t0 < T) { out[base0 + 8u * d] = y0; }
            if (t1 < T) { out[base1 + 8u * d] = y1; }
        }
        if (ROWS_Q8) {  // a constant: the barriers stay in uniform control flow
            workgroupBarrier();  // the previous readers of q_sh are done
            q_sh[(2u * tr) * PAD + tk] = y0;
            q_sh[(2u * tr + 1u) * PAD + tk] = y1;
            workgroupBarrier();
            let t = tb + lid / HG;  // thread lid < 32 packs chunk d of row lid
            if (lid < ROWS && t < T) {
                var v: array<vec4<f32>, 8>;
                for (var j = 0u; j < 8u; j++) { v[j] = q_sh[lid * PAD + j]; }
                store_q8_chunk((t * H + h0 + lid % HG) * NCH + d, &v);
            }
        }
    }
}
