// Decode (one token): fused QKV int4 matvec + RoPE + KV append in one kernel.
// y[n] = Σ_k x[k] · (q[n,k] − 7) · scale[n, k/32] over the fused QKV weight (q4f16_1), N = (H+2·KVH)·HD
// rows: [0, H·HD) q, then k, then v. Rows are taken in RoPE pairs — (i, i + ROT/2) for i < ROT/2 inside
// a head, the pass-through dims ≥ ROT as neighbours (i, i+1) — so a workgroup holds both halves of a
// rotation. Each workgroup computes PAIRS pairs (2·PAIRS rows), reduced four rows per wg_sum4.
// q rows → q_out (roped), k rows → k_cache (roped, f16), v rows → v_cache (f16), at position pos0.
// Grid: fold_grid(ceil(N / (2·PAIRS))) workgroups; the id is rebuilt as wid.y · nwg.x + wid.x.
// Constants: WG threads, PAIRS (even, ≤ WG), K model dim (multiple of 32), H, KVH, HD (even), ROT (even, ≤ HD),
// PAGE.
// Bindings: 0 x f32[T, K] (read, row 0 used), 1 w u32[N, K/8] (read), 2 s f16[N, K/32] (read),
//   3 q_out f32[H·HD] (write), 4 k_cache f16[n_pages, KVH, PAGE, HD] (read_write), 5 v_cache (same),
//   6 page_table u32[max_pages] (read), 7 inv_freq f32[ROT/2] (read), 8 step uniform (pos0).
#import step
#import rope
#import reduce

@group(0) @binding(0) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;  // one vec4 = one 32-element group
@group(0) @binding(2) var<storage, read> s: array<f16>;
@group(0) @binding(3) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(4) var<storage, read_write> k_cache: array<f16>;
@group(0) @binding(5) var<storage, read_write> v_cache: array<f16>;
@group(0) @binding(6) var<storage, read> page_table: array<u32>;
@group(0) @binding(7) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(8) var<uniform> step: Step;

const N: u32 = (H + 2u * KVH) * HD;
const GROUPS: u32 = K / 32u;     // scale groups (and vec4<u32> words) per row
const N_PAIRS: u32 = N / 2u;
const HALF: u32 = ROT / 2u;

// The two rows of RoPE pair `pair` (global index); row_a is the first-half one.
fn pair_rows(pair: u32) -> vec2<u32> {
    let head = pair / (HD / 2u);
    let u = pair % (HD / 2u);
    let base = head * HD;
    if (u < HALF) { return vec2<u32>(base + u, base + u + HALF); }
    let i = ROT + 2u * (u - HALF);
    return vec2<u32>(base + i, base + i + 1u);
}

// Σ over one 32-element group of q · x, where word `qw` holds 32 nibbles (8 per u32, element i at bits 4i).
fn dot_group(qw: vec4<u32>, xg: array<vec4<f32>, 8>) -> f32 {
    let sh_lo = vec4<u32>(0u, 4u, 8u, 12u);
    let sh_hi = vec4<u32>(16u, 20u, 24u, 28u);
    var acc = 0.0;
    for (var c = 0u; c < 4u; c++) {
        let word = qw[c];
        acc += dot(vec4<f32>((vec4<u32>(word) >> sh_lo) & vec4<u32>(15u)), xg[2u * c]);
        acc += dot(vec4<f32>((vec4<u32>(word) >> sh_hi) & vec4<u32>(15u)), xg[2u * c + 1u]);
    }
    return acc;
}

// Store one finished row value to q_out or the caches.
fn store_row(row: u32, val: f32, dst_page_row: u32) {
    let head = row / HD;
    let i = row % HD;
    if (head < H) {
        q_out[row] = val;
    } else if (head < H + KVH) {
        k_cache[dst_page_row + (head - H) * PAGE * HD + i] = f16(val);
    } else {
        v_cache[dst_page_row + (head - H - KVH) * PAGE * HD + i] = f16(val);
    }
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let id = wid.y * nwg.x + wid.x;
    // Whole-workgroup exit (id is uniform), so wg_sum4 below stays in uniform control flow.
    if (id * PAIRS >= N_PAIRS) { return; }
    let pair0 = id * PAIRS;
    // Rows 2j and 2j+1 of the workgroup are RoPE pair j; pairs past the end repeat the last one, unstored.
    var rows: array<u32, 2u * PAIRS>;
    for (var j = 0u; j < PAIRS; j++) {
        let r = pair_rows(min(pair0 + j, N_PAIRS - 1u));
        rows[2u * j] = r.x;
        rows[2u * j + 1u] = r.y;
    }

    var acc: array<vec4<f32>, PAIRS / 2u>;
    for (var g = lane.lid; g < GROUPS; g += WG) {
        var xg: array<vec4<f32>, 8>;
        var xsum = vec4<f32>(0.0);
        for (var c = 0u; c < 8u; c++) { xg[c] = x[g * 8u + c]; xsum += xg[c]; }
        // Σ (q − 7)·x = Σ q·x − 7·Σ x: the offset costs one multiply per group, not per element.
        let x7 = 7.0 * (xsum.x + xsum.y + xsum.z + xsum.w);
        // Load every row's weights first so 2·PAIRS independent 16-byte loads are in flight.
        var qw: array<vec4<u32>, 2u * PAIRS>;
        var sc: array<f32, 2u * PAIRS>;
        for (var r = 0u; r < 2u * PAIRS; r++) {
            qw[r] = w[rows[r] * GROUPS + g];
            sc[r] = f32(s[rows[r] * GROUPS + g]);
        }
        for (var r = 0u; r < 2u * PAIRS; r++) {
            acc[r / 4u][r % 4u] += sc[r] * (dot_group(qw[r], xg) - x7);
        }
    }
    var y: array<vec4<f32>, PAIRS / 2u>;
    for (var v = 0u; v < PAIRS / 2u; v++) { y[v] = wg_sum4(acc[v], lane); }

    let j = lane.lid;
    if (j < PAIRS && pair0 + j < N_PAIRS) {
        let ab = vec2<f32>(y[j / 2u][(j % 2u) * 2u], y[j / 2u][(j % 2u) * 2u + 1u]);
        let rr = vec2<u32>(rows[2u * j], rows[2u * j + 1u]);
        let p = step.pos0;
        var out = ab;
        let head = rr.x / HD;
        let i = rr.x % HD;
        if (head < H + KVH && i < HALF) {
            let cs = rope_cos_sin(p, i);
            out = vec2<f32>(ab.x * cs.x - ab.y * cs.y, ab.y * cs.x + ab.x * cs.y);
        }
        // Row base of position p in the physical page, kv head 0; store_row adds the kv head.
        let dst = (page_table[p / PAGE] * KVH * PAGE + p % PAGE) * HD;
        store_row(rr.x, out.x, dst);
        store_row(rr.y, out.y, dst);
    }
}
