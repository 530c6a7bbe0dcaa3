"""The weights budget: how many bytes of model weights may live on the GPU (RuntimeOptions.gpu_weights).

Spelled as bytes or with a K/M/G suffix (powers of 1024: `--gpu-weights 12G`, `ZEROTVM_GPU_WEIGHTS=12G`), or
`auto`. Auto is the adapter's memory less the KV cache, the working buffers and a margin when the adapter's memory
is known (engine/vram.py), else no limit. A MoE model over its budget streams its routed experts from host memory
(engine/blocks/expert_cache.py); a dense model over an explicit budget is refused. The CLI and the app say so in
one line (streaming_line) and report the cache's hit rate (hit_rate_line).
"""

from __future__ import annotations

import os
import re

ENV = "ZEROTVM_GPU_WEIGHTS"
_UNITS = {"": 1, "B": 1, "K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}
MAX_BYTES = 2**50  # a petabyte of weights is a typo, not a GPU
# What auto leaves free beyond the model's own buffers: the desktop, the driver's pools, allocation rounding.
AUTO_MARGIN_BYTES = 768 * 2**20
AUTO_MARGIN_SHARE = 0.05


def parse_size(text, where: str = "--gpu-weights") -> int | None:
    """Bytes from '123', '512M', '12G', '1.5G' (K/M/G/T = 1024-based; an optional 'iB'/'B'), None for 'auto'.
    Anything else is a ValueError naming `where` and the accepted forms."""
    if text is None:
        return None
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        s = str(text).strip()
        if s.lower() in ("", "auto"):
            return None
        m = re.fullmatch(r"(\d+(?:\.\d+)?)\s*([kKmMgGtT]?)(?:i?[bB])?", s)
        if not m:
            raise ValueError(f"{where}: {s[:40]!r} is not a size; give bytes or a number with K, M or G "
                             "(e.g. 12G, 8192M), or auto")
        value = int(float(m[1]) * _UNITS[m[2].upper()])
    if not 0 < value <= MAX_BYTES:
        raise ValueError(f"{where}: a weights budget must be above 0 and at most {MAX_BYTES // 2**40} TiB, got "
                         f"{value:,} bytes")
    return value


def from_env(environ=None) -> int | None:
    """The budget ZEROTVM_GPU_WEIGHTS gives (None: unset or auto)."""
    return parse_size((environ if environ is not None else os.environ).get(ENV), ENV)


def auto_budget(memory_bytes: int | None, other_bytes: int) -> int | None:
    """Auto: the adapter's memory less the model's non-weight buffers (`other_bytes`: KV cache, state, working
    buffers, expert staging) and a margin; None (no limit) when the memory is unknown."""
    if not memory_bytes:
        return None
    margin = max(AUTO_MARGIN_BYTES, int(memory_bytes * AUTO_MARGIN_SHARE))
    return max(1, memory_bytes - other_bytes - margin)


def shown(n: int) -> str:
    """A budget in words: GiB above 1 GiB (the unit the flag takes), else MiB."""
    return f"{n / 2**30:.2f} GiB" if n >= 2**30 else f"{n / 2**20:.0f} MiB"


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
