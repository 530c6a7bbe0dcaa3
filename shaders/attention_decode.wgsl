// Decode attention in one dispatch (T = 1, position p = step.pos0): what rope_append, attention and (for the gated
// variant) attn_gate do for one token, for contexts short enough that one workgroup per query head keeps up, so
// there is no split-K and no combine (attention_decode_split.wgsl is the split-K form). Workgroup h does head h's
// part (attention_decode_head.wgsl): q head h and the new key and value of its kv head kvh = h / (H / KVH); the
// group's first query head writes them to the cache slot of p; keys 0..p (p from workgroup memory) in blocks of WG;
// then the gate (GATE) and o's int8 row (Q8).
// Constants: WG threads (≥ HD/4; a power of two without subgroups), H, KVH, HD (multiple of 4; of 32 with Q8),
//   ROT rotary dims (even, ≤ HD), PAGE, SCALE f32 (1/√HD), QK_NORM, EPS, NORM_OFFSET, ROPE_SCALE (rope_append.wgsl's),
//   GATE bool, GATE_OFF (f32 index of the gate row in qkv), Q8 bool, PV (divides HD/4), BATCHED bool (the P·V
//   phase's value loads, and the split kernel's combine loads, issued in groups before any is used).
// Bindings: 0 qkv f32[(H+2·KVH)·HD] (+ the gate row H·HD at GATE_OFF) (read),
//   1 k_cache f16[n_pages, KVH, PAGE, HD] (read_write), 2 v_cache (same), 3 page_table u32[max_pages] (read),
//   4 inv_freq f32[ROT/2 + 2·HD]: the RoPE inverse frequencies, then the q and the k norm weights (read; the
//   norms are read only with QK_NORM), 5 out f32[H·HD] (write), 6 step uniform (pos0),
//   7 xq u32[H·HD/4] (write), 8 xm vec2<f32>[H·HD/32] (write); 7 and 8 are bound whether or not Q8.
// Grid: (H, 1, 1).
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

@compute @workgroup_size(WG)
fn main(lane: Lane, @builtin(workgroup_id) wid: vec3<u32>) {
    let h = wid.x;
    let p = step.pos0;
    load_head(lane, h, p, h % GROUP == 0u);
    let ml = attend(lane, h / GROUP, p, 0u, p + 1u);
    for (var c = lane.lid; c < C; c += WG) { write_out(h, c, o_sh[c] / ml.y); }
    write_q8(lane, h);
}
