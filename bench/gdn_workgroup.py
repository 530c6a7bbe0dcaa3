"""The gated-delta-rule recurrence on its workgroup-memory kernel (gdn_recur.wgsl, the path of GPUs without
subgroups) where the subgroup-shuffle kernel (gdn_recur_sg.wgsl) would run: for A/B runs."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from engine.blocks.gdn import GatedDeltaNetMixer


@contextmanager
def workgroup_recurrence(enabled: bool = True) -> Iterator[None]:
    """Runtimes built inside run gdn_recur.wgsl (when `enabled`)."""
    saved = GatedDeltaNetMixer.recur_on_subgroups
    if enabled:
        GatedDeltaNetMixer.recur_on_subgroups = False
    try:
        yield
    finally:
        GatedDeltaNetMixer.recur_on_subgroups = saved
