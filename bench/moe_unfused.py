"""The MoE decode token as it ran before its fused passes, for A/B runs only (the product keeps one path): the MoE
block carries no norms, so a decode token runs the router matvec, moe_router's top-k, the expert passes, quantize_q8,
moe_combine and every residual add + norm as dispatches of their own (engine/blocks/moe.py, moe_fused.py)."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.blocks.moe import MoeFfn


@contextmanager
def unfused_moe(enabled: bool = True) -> Iterator[None]:
    """Runtimes built inside take the unfused MoE decode (when `enabled`)."""
    saved = MoeFfn.can_carry_norms
    if enabled:
        MoeFfn.can_carry_norms = lambda self: False
    try:
        yield
    finally:
        MoeFfn.can_carry_norms = saved
