// Prefill RoPE + KV append. For each token t (position p = pos0 + t) of the fused QKV rows:
// q heads → q_out with RoPE, k heads → k_cache with RoPE, v heads → v_cache as is (caches f16).
// RoPE is the rotate-half form: for i < ROT/2 the pair (i, i + ROT/2) turns by p · inv_freq[i];
// dims ≥ ROT pass through. Grid (T, Y) for any Y ≥ 1: workgroup (t, y) handles head slots y, y + Y, …
// of token t, so (T, 1) loops over all heads and (T, H + 2·KVH) gives one head per workgroup.
// Constants: WG threads, H query heads, KVH kv heads, HD head dim (even), ROT rotary dims (even, ≤ HD),
//   PAGE tokens per cache page, QK_NORM (bool), EPS, NORM_OFFSET (added to the q/k norm weights; 1.0:
//   zero-centred norms, x̂ · (1 + w), as Qwen3.5 defines them), ROPE_SCALE (multiplies cos and sin: YaRN's and
//   LongRoPE's attention factor, put on the rotation as transformers and llama.cpp do, so q·k grows by its square;
//   1.0 otherwise).
// Bindings: 0 qkv f32[T, (H+2·KVH)·HD] (read), 1 q_out f32[T, H·HD] (write),
//   2 k_cache f16[n_pages, KVH, PAGE, HD] (read_write), 3 v_cache f16 (same layout, read_write),
//   4 page_table u32[max_pages] (read), 5 inv_freq f32[ROT/2] (read), 6 step uniform (n_tokens, pos0),
//   7 q_norm f16[HD], 8 k_norm f16[HD] (read; Qwen3's per-head RMSNorm before RoPE when QK_NORM, with EPS;
//   bind any f16 buffer when QK_NORM is false).
#import step
#import rope
#import reduce

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<f16>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<f16>;
@group(0) @binding(4) var<storage, read> page_table: array<u32>;
@group(0) @binding(5) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(6) var<uniform> step: Step;
@group(0) @binding(7) var<storage, read> q_norm: array<f16>;
@group(0) @binding(8) var<storage, read> k_norm: array<f16>;

const HALF: u32 = ROT / 2u;
// Element i of head slot j after the optional per-head RMSNorm (inv = that head's 1/rms).
fn head_value(src: u32, i: u32, j: u32, inv: f32) -> f32 {
    let v = qkv[src + i];
    if (!QK_NORM || j >= H + KVH) { return v; }
    return v * inv * (f32(select(k_norm[i], q_norm[i], j < H)) + NORM_OFFSET);
}

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let t = wid.x;
    if (t >= step.n_tokens) { return; }  // uniform: t is the workgroup's
    let lid = lane.lid;
    let p = step.pos0 + t;
    let page_row = (page_table[p / PAGE] * KVH * PAGE + p % PAGE) * HD;  // kv head 0 of position p
    // Head slot j: [0, H) q, [H, H+KVH) k, [H+KVH, H+2·KVH) v.
    for (var j = wid.y; j < H + 2u * KVH; j += nwg.y) {
        let src = (t * (H + 2u * KVH) + j) * HD;
        let is_v = j >= H + KVH;
        let kvh = select(j - H, j - H - KVH, is_v);
        let dst = page_row + kvh * PAGE * HD;
        var inv = 1.0;
        if (QK_NORM) {  // a constant, so the reduction stays in uniform control flow
            var ss = 0.0;
            for (var i = lid; i < HD; i += WG) { let v = qkv[src + i]; ss += v * v; }
            inv = inverseSqrt(wg_sum(ss, lane) / f32(HD) + EPS);
        }
        for (var i = lid; i < HD; i += WG) {
            var val = head_value(src, i, j, inv);
            if (!is_v && i < ROT) {
                let cs = rope_cos_sin(p, i % HALF) * ROPE_SCALE;
                // rotate_half: the first half pairs with −x2, the second half with +x1.
                if (i < HALF) {
                    val = val * cs.x - head_value(src, i + HALF, j, inv) * cs.y;
                } else {
                    val = val * cs.x + head_value(src, i - HALF, j, inv) * cs.y;
                }
            }
            if (j < H) {
                q_out[(t * H + j) * HD + i] = val;
            } else if (is_v) {
                v_cache[dst + i] = f16(val);
            } else {
                k_cache[dst + i] = f16(val);
            }
        }
    }
}
