// Paged causal attention for a prefill chunk, QB queries of one head per workgroup (flash-attention style).
// attention.wgsl gives every (head, token) its own workgroup, so each query re-reads all its keys: at 512 tokens that
// is ~1.6 GB of K/V traffic a layer (Phi-3: 0.5 ms). Here a workgroup stages each block of KB keys once in
// workgroup memory for its QB queries and streams V through the cache, with the same online softmax.
// Query t (< n_tokens) sits at position pos0 + t and sees keys 0..pos0+t; head h reads kv head h / (H / KVH).
// Per key block: scores S[i][j] = q_i·k_j·SCALE for the block's QB × KB pairs (causally masked), then QB threads
// fold each row into its running max / sum and turn S into weights, then each thread updates its outputs: thread
// (row group g, dim chunk c) owns rows g, g + RG, ... of dims 4c..4c+3.
// Constants: H, KVH, HD (a multiple of 4), PAGE, SCALE, QB (queries per workgroup), KB (keys per block),
//   RG (row groups; WG = RG·HD/4 threads, QB a multiple of RG).
// Bindings: 0 q f32[T, H·HD] (read), 1 k_cache f16[n_pages, KVH, PAGE, HD] (read), 2 v_cache (same),
//   3 page_table u32 (read), 4 out f32[T, H·HD] (write), 5 step uniform (n_tokens, pos0).
// Grid: (H, ceil(n_tokens / QB)).
#import step

@group(0) @binding(0) var<storage, read> q: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> k_cache: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> v_cache: array<vec4<f16>>;
@group(0) @binding(3) var<storage, read> page_table: array<u32>;
@group(0) @binding(4) var<storage, read_write> out: array<vec4<f32>>;
@group(0) @binding(5) var<uniform> step: Step;

const C: u32 = HD / 4u;        // vec4 chunks per head row
const WG: u32 = RG * C;
const ROWS: u32 = QB / RG;     // output rows a thread owns
const GROUP: u32 = H / KVH;
const NEG_BIG: f32 = -3.0e38;

var<workgroup> q_sh: array<vec4<f32>, QB * C>;   // the block's queries · SCALE
var<workgroup> k_sh: array<vec4<f16>, KB * C>;   // one key block
var<workgroup> p_sh: array<f32, QB * KB>;        // scores, then softmax weights
var<workgroup> row_sh: array<u32, KB>;           // the block's cache rows (vec4 units)
var<workgroup> m_sh: array<f32, QB>;             // running max per query
var<workgroup> l_sh: array<f32, QB>;             // running sum per query
var<workgroup> alpha_sh: array<f32, QB>;         // this block's rescale of the earlier outputs

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) lid: u32, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let t0 = wid.y * QB;
    if (t0 >= step.n_tokens) { return; }  // uniform: the whole workgroup leaves
    let kvh = h / GROUP;
    let rows_here = min(QB, step.n_tokens - t0);
    let n_keys = step.pos0 + t0 + rows_here;  // the last row's keys: every row sees a prefix of them

    for (var i = lid; i < QB * C; i += WG) {
        let r = min(i / C, rows_here - 1u);  // rows past n_tokens repeat the last one (computed, never written)
        q_sh[i] = q[((t0 + r) * H + h) * C + i % C] * SCALE;
    }
    for (var i = lid; i < QB; i += WG) {
        m_sh[i] = NEG_BIG;
        l_sh[i] = 0.0;
    }
    let c = lid % C;
    let g = lid / C;
    var acc = array<vec4<f32>, ROWS>();

    for (var kb = 0u; kb < n_keys; kb += KB) {
        workgroupBarrier();  // the previous block's k_sh / p_sh / row_sh reads are done (and q_sh is written)
        for (var j = lid; j < KB; j += WG) {
            let key = min(kb + j, n_keys - 1u);
            row_sh[j] = ((page_table[key / PAGE] * KVH + kvh) * PAGE + key % PAGE) * C;
        }
        workgroupBarrier();
        for (var i = lid; i < KB * C; i += WG) { k_sh[i] = k_cache[row_sh[i / C] + i % C]; }
        workgroupBarrier();
        for (var e = lid; e < QB * KB; e += WG) {
            let i = e / KB;
            let j = e % KB;
            var d = 0.0;
            for (var cc = 0u; cc < C; cc++) { d += dot(q_sh[i * C + cc], vec4<f32>(k_sh[j * C + cc])); }
            let visible = kb + j <= step.pos0 + t0 + i;  // causal (also drops keys past n_keys)
            p_sh[e] = select(NEG_BIG, d, visible);
        }
        workgroupBarrier();
        for (var i = lid; i < QB; i += WG) {
            var m_blk = NEG_BIG;
            for (var j = 0u; j < KB; j++) { m_blk = max(m_blk, p_sh[i * KB + j]); }
            let m_new = max(m_sh[i], m_blk);
            let alpha = exp(m_sh[i] - m_new);
            var l = l_sh[i] * alpha;
            for (var j = 0u; j < KB; j++) {
                let s = p_sh[i * KB + j];
                let p = select(0.0, exp(s - m_new), s > NEG_BIG);
                p_sh[i * KB + j] = p;
                l += p;
            }
            m_sh[i] = m_new;
            l_sh[i] = l;
            alpha_sh[i] = alpha;
        }
        workgroupBarrier();
        let n_here = min(KB, n_keys - kb);
        for (var r = 0u; r < ROWS; r++) {
            let i = g + r * RG;
            var o = acc[r] * alpha_sh[i];
            for (var j = 0u; j < n_here; j++) {
                o += p_sh[i * KB + j] * vec4<f32>(v_cache[row_sh[j] + c]);
            }
            acc[r] = o;
        }
    }
    for (var r = 0u; r < ROWS; r++) {
        let i = g + r * RG;
        if (i < rows_here) { out[((t0 + i) * H + h) * C + c] = acc[r] / l_sh[i]; }
    }
}
