// Prefill RoPE + KV append. For each token t (position p = pos0 + t) of the fused QKV rows:
// q heads → q_out with RoPE, k heads → k_cache with RoPE, v heads → v_cache as is (caches f16).
// RoPE is the rotate-half form: for i < ROT/2 the pair (i, i + ROT/2) turns by p · inv_freq[i];
// dims ≥ ROT pass through. Grid (T, Y) for any Y ≥ 1: workgroup (t, y) handles head slots y, y + Y, …
// of token t, so (T, 1) loops over all heads and (T, H + 2·KVH) gives one head per workgroup.
// Constants: WG threads, H query heads, KVH kv heads, HD head dim (even), ROT rotary dims (even, ≤ HD),
//   PAGE tokens per cache page.
// Bindings: 0 qkv f32[T, (H+2·KVH)·HD] (read), 1 q_out f32[T, H·HD] (write),
//   2 k_cache f16[n_pages, KVH, PAGE, HD] (read_write), 3 v_cache f16 (same layout, read_write),
//   4 page_table u32[max_pages] (read), 5 inv_freq f32[ROT/2] (read), 6 step uniform (n_tokens, pos0).
#import step

@group(0) @binding(0) var<storage, read> qkv: array<f32>;
@group(0) @binding(1) var<storage, read_write> q_out: array<f32>;
@group(0) @binding(2) var<storage, read_write> k_cache: array<f16>;
@group(0) @binding(3) var<storage, read_write> v_cache: array<f16>;
@group(0) @binding(4) var<storage, read> page_table: array<u32>;
@group(0) @binding(5) var<storage, read> inv_freq: array<f32>;
@group(0) @binding(6) var<uniform> step: Step;

const HALF: u32 = ROT / 2u;
// 2π split so that k · TWO_PI_HI is exact in f32 for k < 2^15 (Cody–Waite range reduction).
const TWO_PI_HI: f32 = 6.28125;
const TWO_PI_LO: f32 = 0.0019353071795864769;

// (cos, sin) of p · inv_freq[i]. The angle is formed in f32 like transformers does, then reduced to
// [-π, π] before cos/sin: WGSL only bounds their error inside that range.
fn rope_cos_sin(p: u32, i: u32) -> vec2<f32> {
    let angle = f32(p) * inv_freq[i];
    let k = round(angle * 0.15915494309189535);
    let r = (angle - k * TWO_PI_HI) - k * TWO_PI_LO;
    return vec2<f32>(cos(r), sin(r));
}

@compute @workgroup_size(WG)
fn main(
    @builtin(local_invocation_index) lid: u32,
    @builtin(workgroup_id) wid: vec3<u32>,
    @builtin(num_workgroups) nwg: vec3<u32>,
) {
    let t = wid.x;
    if (t >= step.n_tokens) { return; }
    let p = step.pos0 + t;
    let page_row = (page_table[p / PAGE] * KVH * PAGE + p % PAGE) * HD;  // kv head 0 of position p
    // Head slot j: [0, H) q, [H, H+KVH) k, [H+KVH, H+2·KVH) v.
    for (var j = wid.y; j < H + 2u * KVH; j += nwg.y) {
        let src = (t * (H + 2u * KVH) + j) * HD;
        let is_v = j >= H + KVH;
        let kvh = select(j - H, j - H - KVH, is_v);
        let dst = page_row + kvh * PAGE * HD;
        for (var i = lid; i < HD; i += WG) {
            var val = qkv[src + i];
            if (!is_v && i < ROT) {
                let cs = rope_cos_sin(p, i % HALF);
                // rotate_half: the first half pairs with −x2, the second half with +x1.
                if (i < HALF) {
                    val = val * cs.x - qkv[src + i + HALF] * cs.y;
                } else {
                    val = val * cs.x + qkv[src + i - HALF] * cs.y;
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
