"""What decode speed to expect on a software adapter (the processor doing the GPU's work: lavapipe, WARP...).

Decode reads every weight a token uses once, so its speed is about (bytes the adapter streams per second) / (bytes
read per token). A software adapter streams what its processor cores can dequantize and multiply; the figure below
is measured (BENCH.md, "Software adapter") and scaled by the cores this machine has. It is a rough estimate and is
always presented as one: the real speed depends on the processor and on what else it is doing.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from engine.humanize import human_rate

# The demo model (96.5 MB read per token) decoded at 5.3 tokens/s on Mesa lavapipe with 2 cores that other jobs were
# also using: 511 MB/s, 255 MB/s a core; rounded down to stay conservative.
SOFTWARE_BYTES_PER_S_PER_CORE = 200e6
MAX_CORES = 16  # lavapipe's threads stop scaling once memory bandwidth, not arithmetic, is the limit
TOO_SLOW_TPS = 0.5  # below this a 200-token answer takes more than six minutes: not worth loading
DEMO_DECODE_BYTES = 96_506_496  # the demo model's weights (SmolLM2-135M Q4_1: tied embeddings, all read per token)


@dataclass(frozen=True)
class SpeedEstimate:
    tokens_per_s: float
    level: str  # "slow" | "too_slow"
    decode_bytes: int  # weight bytes one token reads
    message: str


def cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return max(1, os.cpu_count() or 1)


def software_tps(decode_bytes: int, n_cores: int | None = None) -> float:
    """Rough decode tokens/s on a software adapter for a model reading `decode_bytes` of weights per token."""
    n = min(MAX_CORES, n_cores or cores())
    return SOFTWARE_BYTES_PER_S_PER_CORE * n / max(1, decode_bytes)


def software_speed(decode_bytes: int, n_cores: int | None = None) -> SpeedEstimate:
    """The verdict for running a model on a software adapter: "slow" always, "too_slow" under TOO_SLOW_TPS."""
    tps = software_tps(decode_bytes, n_cores)
    if tps < TOO_SLOW_TPS:
        return SpeedEstimate(tps, "too_slow", decode_bytes,
                             f"On this computer's software GPU it would be too slow to use: roughly "
                             f"{human_rate(tps)}.")
    return SpeedEstimate(tps, "slow", decode_bytes,
                         f"It runs on this computer's software GPU, slowly: roughly {human_rate(tps)}.")


SOFTWARE_NOTICE_TITLE = "Running on a software GPU: replies will be slow"


def software_notice(adapter_name: str, n_cores: int | None = None) -> str:
    """The one plain paragraph the app and the CLI show when the chosen adapter is a software one."""
    demo = software_tps(DEMO_DECODE_BYTES, n_cores)
    return (f"Zero-TVM is running on {adapter_name}, a software GPU: the processor does the graphics card's work. "
            f"Expect roughly {human_rate(demo)} from the demo model and far slower replies from bigger models (a "
            f"rough estimate; your processor may do better or worse). For full speed, install your graphics card's "
            f"driver with Vulkan support (Metal on macOS, DirectX 12 on Windows), or pick the card under Settings → "
            f"GPU, then start Zero-TVM again.")
