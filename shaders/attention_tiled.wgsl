// Paged causal attention for a prefill chunk, tiled like a GEMM (flash-attention style): a workgroup owns 32
// query rows of one kv head (BT = 32 / HG tokens × HG query heads that share the kv head, so GQA heads reuse every
// staged key) and walks the keys in blocks of 32, online softmax. Rows and keys meet in register tiles: thread
// (tr = lid / 8, tk = lid % 8) scores rows 2tr, 2tr+1 against keys tk + 8j (j < 4) and accumulates the same two
// rows' outputs for the vec4 columns tk + 8d (d < HD/32). Q and K are staged 32 dims at a time, V 32 dims at a
// time into K's tile; everything is f32 arithmetic on the f16 cache, as attention.wgsl.
// Query t sits at position pos0 + t and sees keys 0..pos0+t, all in the paged cache (the chunk's own keys
// were appended before). Grid (H / HG, ceil(T / BT)); token blocks run last-first, so the longest start first.
// Constants: H, KVH, HD (a multiple of 32), HG (a power of two dividing H / KVH, ≤ 32), PAGE, SCALE (1/√HD).
// Bindings: 0 q f32[T, H·HD] (read), 1 k_cache f16[n_pages, KVH, PAGE, HD] (read), 2 v_cache (same),
//   3 page_table u32 (read), 4 out f32[T, H·HD] (write), 5 step uniform (n_tokens, pos0).
#import step

@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> page_table: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> step: Step;

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

    // The thread's two rows: token, head, and the last key each may see (a row past T sees none).
    var t_of: array<u32, 2>;
    var last: array<i32, 2>;
    for (var a = 0u; a < 2u; a++) {
        let r = 2u * tr + a;
        t_of[a] = tb + r / HG;
        last[a] = select(-1, i32(pos0 + t_of[a]), t_of[a] < T);
    }

    var o: array<vec4<f32>, 2u * NCH>;
    var m = array<f32, 2>(NEG_BIG, NEG_BIG);
    var l = array<f32, 2>(0.0, 0.0);
    for (var kb = 0u; kb < n_keys; kb += BK) {
        // ---- scores: s[a·4 + j] = q(row 2tr+a) · k(key kb + tk + 8j), over HD in chunks of 32 dims
        var s: array<f32, 8>;
        s = array<f32, 8>();  // an assignment: a declaration's zero init may run only once (naga hoists it)
        for (var d = 0u; d < NCH; d++) {
            workgroupBarrier();  // the previous readers of q_sh / kv_sh are done
            for (var i = lid; i < ROWS * 8u; i += WG) {
                let r = i / 8u;
                let c = i % 8u;
                let t = tb + r / HG;
                var qv = vec4<f32>(0.0);
                if (t < T) { qv = q[(t * H + h0 + r % HG) * C + d * 8u + c] * SCALE; }
                q_sh[r * PAD + c] = qv;
                let key = kb + r;
                var kv = vec4<f32>(0.0);
                if (key < n_keys) { kv = vec4<f32>(k_cache[cache_row(key, kvh) + d * 8u + c]); }
                kv_sh[r * PAD + c] = kv;
            }
            workgroupBarrier();
            for (var c = 0u; c < 8u; c++) {
                let q0 = q_sh[(2u * tr) * PAD + c];
                let q1 = q_sh[(2u * tr + 1u) * PAD + c];
                for (var j = 0u; j < 4u; j++) {
                    let kv = kv_sh[(tk + 8u * j) * PAD + c];
                    s[j] += dot(q0, kv);
                    s[4u + j] += dot(q1, kv);
                }
            }
        }
        // ---- online softmax: causal mask, row max over the 8 threads of a row, weights to p_sh
        for (var a = 0u; a < 2u; a++) {
            var mx = NEG_BIG;
            for (var j = 0u; j < 4u; j++) {
                let key = i32(kb + tk + 8u * j);
                s[4u * a + j] = select(NEG_BIG, s[4u * a + j], key <= last[a]);
                mx = max(mx, s[4u * a + j]);
            }
            red_sh[(2u * tr + a) * 8u + tk] = mx;
        }
        workgroupBarrier();
        for (var a = 0u; a < 2u; a++) {
            let r = 2u * tr + a;
            var m_new = m[a];
            for (var e = 0u; e < 8u; e++) { m_new = max(m_new, red_sh[r * 8u + e]); }
            let alpha = exp(m[a] - m_new);
            m[a] = m_new;
            var sum = 0.0;
            for (var j = 0u; j < 4u; j++) {
                let key = i32(kb + tk + 8u * j);
                let p = select(0.0, exp(s[4u * a + j] - m_new), key <= last[a]);
                sum += p;
                p_sh[r * PS + tk + 8u * j] = p;
            }
            l[a] = l[a] * alpha + sum;
            for (var d = 0u; d < NCH; d++) { o[a * NCH + d] *= alpha; }
        }
        // ---- outputs: o(row) += Σ_key p · v(key), over HD in chunks of 32 dims
        for (var d = 0u; d < NCH; d++) {
            workgroupBarrier();  // p_sh is written, the previous readers of kv_sh / red_sh are done
            for (var i = lid; i < BK * 8u; i += WG) {
                let key = kb + i / 8u;
                var vv = vec4<f32>(0.0);  // keys past the end: p = 0, but the cache there may hold anything
                if (key < n_keys) { vv = vec4<f32>(v_cache[cache_row(key, kvh) + d * 8u + i % 8u]); }
                kv_sh[(i / 8u) * PAD + i % 8u] = vv;
            }
            workgroupBarrier();
            var o0 = o[d];
            var o1 = o[NCH + d];
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
    for (var a = 0u; a < 2u; a++) { red_sh[(2u * tr + a) * 8u + tk] = l[a]; }
    workgroupBarrier();
    for (var a = 0u; a < 2u; a++) {
        let r = 2u * tr + a;
        if (t_of[a] < T) {
            var total = 0.0;
            for (var e = 0u; e < 8u; e++) { total += red_sh[r * 8u + e]; }
            let base = (t_of[a] * H + h0 + r % HG) * C + tk;
            for (var d = 0u; d < NCH; d++) { out[base + 8u * d] = o[a * NCH + d] / total; }
        }
    }
}
