"""The weights budget: how many bytes of model weights may live on the GPU (RuntimeOptions.gpu_weights).

Spelled as bytes or with a K/M/G suffix (powers of 1024: `--gpu-weights 12G`, `ZEROTVM_GPU_WEIGHTS=12G`), or
`auto`. Auto (auto_weights), when the adapter's memory is known (engine/vram.py), gives a MoE model the most expert
cache slots whose whole load, as wgpu's allocator holds it in blocks (the plan's footprint, engine/gpu_heap.py),
leaves a margin of that memory free; else no limit. The runtime's plan and memfit's streaming verdict both ask it.
A MoE model over its budget streams its routed experts from host memory (engine/blocks/expert_cache.py); a dense
model over an explicit budget is refused. The CLI and the app say so in one line (streaming_line) and report the
cache's hit rate (hit_rate_line).
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, replace
from fractions import Fraction

from engine.errors import BudgetSpellingError

ENV = "ZEROTVM_GPU_WEIGHTS"
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
MAX_BYTES = 2**50  # a petabyte of weights is a typo, not a GPU
# What auto leaves free beyond the model's blocks of memory (which the allocator model counts): the desktop and the
# driver's own pools.
AUTO_MARGIN_BYTES = 768 * 2**20
AUTO_MARGIN_SHARE = 0.05


def parse_size(text, where: str = "--gpu-weights") -> int | None:
    """Bytes from '123', '512M', '12G', '1.5G' (K/M/G/T = 1024-based, either case; an optional 'iB'/'B'), None for
    'auto'. Anything else, huge or negative included, is a BudgetSpellingError (a ValueError) naming `where` and
    the accepted forms."""
    if text is None:
        return None
    too_big = f"{where}: a weights budget must be above 0 and at most {MAX_BYTES // 2**40} TiB, got"
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip()
        if s.lower() in ("", "auto"):
            return None
        m = re.fullmatch(r"([0-9]+)(\.[0-9]+)?\s*([kKmMgGtT]?)(?:i?[bB])?", s)  # ASCII digits only
        if not m:
            raise BudgetSpellingError(f"{where}: {s[:40]!r} is not a size; give bytes or a number with K, M or G "
                             "(e.g. 12G, 8192M), or auto")
        whole = m[1].lstrip("0") or "0"
        if len(whole) > 20:  # past any limit; float() would make 400 digits inf, and int() an OverflowError
            raise BudgetSpellingError(f"{too_big} {s[:40]!r}")
        value = int(Fraction(whole + (m[2] or "")[:21]) * _UNITS[m[3].upper()])  # exact, whatever the digits
    if not 0 < value <= MAX_BYTES:
        raise BudgetSpellingError(f"{too_big} {value:,} bytes" if abs(value) < 10**21 else f"{too_big} far more")
    return value


def from_env(environ=None) -> int | None:
    """The budget ZEROTVM_GPU_WEIGHTS gives (None: unset or auto)."""
    return parse_size((environ if environ is not None else os.environ).get(ENV), ENV)


def setting_budget(typed: str) -> int | None:
    """The budget the app's Settings entry gives (as typed: a size or "auto"), else ZEROTVM_GPU_WEIGHTS."""
    return parse_size(typed, "GPU weights budget") if typed != "auto" else from_env()


def auto_margin(memory_bytes: int) -> int:
    """What auto leaves free of an adapter with `memory_bytes` of memory."""
    return max(AUTO_MARGIN_BYTES, int(memory_bytes * AUTO_MARGIN_SHARE))


@dataclass(frozen=True)
class AutoWeights:
    budget: int | None  # weight bytes the model may keep on the GPU (None: no limit)
    slots: int | None  # expert cache slots a MoE layer (None: every expert resident)


def auto_weights(plan, memory_bytes: int | None) -> AutoWeights:
    """Auto for the MoE model `plan` plans (a RuntimePlan: its spec, formats, options and traits are used, the
    adapter's memory is `memory_bytes`). A plan fits when its load's peak footprint in wgpu's allocator (every
    buffer, in blocks: RuntimePlan.footprint) plus auto_margin is at most the memory. Every expert resident when that
    fits, else the most cache slots that fit (the budget their weights take); no limit when the memory is unknown or
    not even top_k slots fit (the model then loads whole and the driver has the last word)."""
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import RuntimePlan, expert_weight_bytes, moe_block

    if not memory_bytes:
        return AutoWeights(None, None)
    spec, formats, options, traits = plan.spec, plan.formats, plan.options, plan.traits
    room = memory_bytes - auto_margin(memory_bytes)
    peak = lambda p: p.footprint(traits.memory_kind).peak  # noqa: E731
    whole = RuntimePlan(spec, formats, RuntimeOptions.of(options, gpu_weights=None), replace(traits, memory_bytes=None))
    moe = moe_block(whole)
    weights, fixed, per_slot = expert_weight_bytes(whole, moe)
    if (whole_peak := peak(whole)) <= room:
        return AutoWeights(room - (whole_peak - weights), None)

    def fits(slots: int) -> bool:  # an explicit budget of exactly these slots' weights plans them
        return peak(RuntimePlan(spec, formats, RuntimeOptions.of(options, gpu_weights=fixed + slots * per_slot),
                                traits)) <= room

    lo, hi = moe.top_k, moe.E  # fits(lo) is asked first; E slots is the whole model, which does not fit
    if not fits(lo):
        return AutoWeights(None, None)
    while hi - lo > 1:  # fits(lo) and not fits(hi): the answer fits and one slot more does not
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return AutoWeights(fixed + lo * per_slot, lo)


def shown(n: int, up: bool = False) -> str:
    """A budget in words, in the largest unit the flag takes that it reaches (GiB to 2 decimals, MiB, KiB, else
    bytes). `up` rounds up, for a minimum: typed back as a budget, the figure shown is enough."""
    for unit, size, digits in (("GiB", 2**30, 2), ("MiB", 2**20, 0), ("KiB", 2**10, 0)):
        if n >= size:
            scaled = Fraction(n * 10**digits, size)
            value = (math.ceil(scaled) if up else round(scaled)) / 10**digits
            return f"{value:.{digits}f} {unit}"
    return f"{n:,} bytes"


def streaming_line(runtime) -> str | None:
    """One line on the expert stream (None when every weight is on the GPU)."""
    st = runtime.plan.streaming
    if st is None:
        return None
    return (f"experts streamed from RAM: {st.slots} of {st.E} routed experts a layer on the GPU "
            f"({100 * st.resident_share():.0f}% resident)")


def hit_rate_line(runtime) -> str | None:
    """The expert cache's hit rate so far, and the bytes it uploaded (None when not streaming)."""
    st = runtime.plan.streaming
    if st is None or st.hit_rate() is None:
        return None
    gb = st.uploaded_bytes / 1e9
    rate = f", {gb / st.upload_seconds:.1f} GB/s" if st.upload_seconds > 0 else ""
    return f"expert cache hit rate {100 * st.hit_rate():.1f}% ({st.hits} hits, {st.misses} misses; {gb:.2f} GB " \
           f"uploaded{rate})"
