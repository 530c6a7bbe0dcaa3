"""The gated-delta-rule recurrence on its subgroup-shuffle kernel (gdn_recur_sg.wgsl) where it fits, instead of the
runtime's workgroup-memory kernel (gdn_recur.wgsl): for A/B runs. The shuffle kernel measured 2.8× slower on the
H200 at a 512-token chunk (BENCH.md, session 5), so the runtime does not choose it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.blocks.gdn import GatedDeltaNetMixer


@contextmanager
def subgroup_recurrence(enabled: bool = True) -> Iterator[None]:
    """Runtimes built inside run gdn_recur_sg.wgsl where it fits (when `enabled`)."""
    saved = GatedDeltaNetMixer.recur_on_subgroups
    if enabled:
        GatedDeltaNetMixer.recur_on_subgroups = True
    try:
        yield
    finally:
        GatedDeltaNetMixer.recur_on_subgroups = saved
