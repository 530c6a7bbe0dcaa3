"""Expert cache kernels' host side: the row select of a prefill chunk run in batches of cached experts
(shaders/expert_select.wgsl, engine/blocks/expert_cache.py)."""

from __future__ import annotations

from engine.kernels import declare, fold_grid

EXPERT_SELECT = declare("expert_select", writes=("y",))
SELECT_WG = 64


def select_plan(D: int, slots: int, T: int, wg: int = SELECT_WG):
    """Constants and grid for shaders/expert_select.wgsl (one thread per 4 floats of a (token, slot) row)."""
    if D % 4:
        raise ValueError(f"D must be a multiple of 4, got {D}")
    return dict(D=D, SLOTS=slots, WG=wg), fold_grid(-(-max(T, 1) * slots * D // 4 // wg))
