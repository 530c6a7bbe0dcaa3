"""Expert cache kernels' host side: the row select of a prefill chunk run in batches of cached experts
(shaders/expert_select.wgsl) and a decode token's slot lookup (shaders/expert_slots.wgsl); engine/blocks/
expert_cache.py."""

from __future__ import annotations

from engine.kernels import declare, fold_grid

EXPERT_SELECT = declare("expert_select", writes=("y",))
EXPERT_SLOTS = declare("expert_slots", writes=("slot_ids",))
SELECT_WG = 64


def select_plan(D: int, slots: int, T: int, wg: int = SELECT_WG):
    """Constants and grid for shaders/expert_select.wgsl (one thread per 4 floats of a (token, slot) row)."""
    if D % 4:
        raise ValueError(f"D must be a multiple of 4, got {D}")
    return dict(D=D, SLOTS=slots, WG=wg), fold_grid(-(-max(T, 1) * slots * D // 4 // wg))


def slots_plan(E: int, top_k: int, slots: int, shared_slot: int):
    """Constants and grid for shaders/expert_slots.wgsl (one thread per routing slot of one token)."""
    if not 1 <= top_k <= slots <= 256:
        raise ValueError(f"need 1 ≤ top_k ≤ slots ≤ 256, got top_k={top_k}, slots={slots}")
    wg = max(32, 1 << (slots - 1).bit_length())
    return dict(E=E, TOPK=top_k, SLOTS=slots, SHARED_SLOT=shared_slot, WG=wg), (1, 1, 1)
