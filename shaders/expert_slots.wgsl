// Expert-cache lookup of a decode token: slot_ids[s] = table[min(ids[s], E - 1)] for the routed slots s < TOPK and
// SHARED_SLOT for the rest (the stacked shared expert's cache slot; unread otherwise). `table` is one MoE layer's
// expert -> cache slot map, which the host copies to the GPU with every upload (engine/blocks/expert_cache.py), so a
// layer whose experts are all cached needs nothing from the host between its routing and its experts. A bad id
// (NaN logits) reads expert E - 1, as the resident model reads its clamped row.
// Constants: E experts, TOPK, SLOTS (routing slots per token), SHARED_SLOT, WG threads (≥ SLOTS).
// Bindings: 0 ids u32[SLOTS] (read), 1 table u32[E] (read), 2 slot_ids u32[SLOTS] (write).
// Grid: (1, 1, 1).

@group(0) @binding(0) var<storage, read> ids: array<u32>;
@group(0) @binding(1) var<storage, read> table: array<u32>;
@group(0) @binding(2) var<storage, read_write> slot_ids: array<u32>;

@compute @workgroup_size(WG)
fn main(@builtin(local_invocation_index) s: u32) {
    if (s >= SLOTS) { return; }
    slot_ids[s] = select(SHARED_SLOT, table[min(ids[s], E - 1u)], s < TOPK);
}
