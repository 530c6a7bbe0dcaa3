"""What decode speed to expect on a software adapter (the processor doing the GPU's work: lavapipe, WARP...).

Decode reads every weight a token uses once, so its speed is about (bytes the adapter streams per second) / (bytes
read per token). A software adapter streams what its processor cores can dequantize and multiply; the figure below
is measured (BENCH.md, "Software adapter") and scaled by the cores this machine has. It is a rough estimate and is
always presented as one: the real speed depends on the processor and on what else it is doing. Once the app has
decoded a reply on the adapter, the rate it measured (weight bytes per second, speeds.json in the data folder)
replaces the estimate.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

from engine.humanize import human_rate

# The demo model's decode on Mesa lavapipe (2 cores shared with other jobs), as weight bytes a second a core, rounded
# down to stay conservative: the measurement is in BENCH.md (software adapter, issue 15).
SOFTWARE_BYTES_PER_S_PER_CORE = 200e6
MAX_CORES = 16  # lavapipe's threads stop scaling once memory bandwidth, not arithmetic, is the limit
TOO_SLOW_TPS = 0.5  # below this a 200-token answer takes more than six minutes: not worth loading
DEMO_DECODE_BYTES = 96_506_496  # the demo model's weights (SmolLM2-135M Q4_1: tied embeddings, all read per token)
SPEEDS_FILE = "speeds.json"  # adapter key -> weight bytes/s a real decode reached there
MIN_MEASURED_TOKENS = 16  # fewer decoded tokens say more about the first token's cost than about the rate


@dataclass(frozen=True)
class SpeedEstimate:
    tokens_per_s: float
    level: str  # "slow" | "too_slow"
    decode_bytes: int  # weight bytes one token reads
    message: str
    measured: bool = False  # from a decode measured on this adapter, not the per-core estimate


def cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # macOS and Windows have no affinity call
        return max(1, os.cpu_count() or 1)


def software_tps(decode_bytes: int, n_cores: int | None = None, rate: float | None = None) -> float:
    """Decode tokens/s on a software adapter for a model reading `decode_bytes` of weights per token: from `rate`
    (weight bytes/s measured on this adapter) when known, else roughly from the cores."""
    if not rate:
        rate = SOFTWARE_BYTES_PER_S_PER_CORE * min(MAX_CORES, n_cores or cores())
    return rate / max(1, decode_bytes)


def software_speed(decode_bytes: int, n_cores: int | None = None, rate: float | None = None) -> SpeedEstimate:
    """The verdict for running a model on a software adapter: "slow" always, "too_slow" under TOO_SLOW_TPS."""
    tps = software_tps(decode_bytes, n_cores, rate)
    how = "from the speed measured on this computer" if rate else "a rough estimate"
    if tps < TOO_SLOW_TPS:
        return SpeedEstimate(tps, "too_slow", decode_bytes,
                             f"On this computer's software GPU it would be too slow to use: roughly "
                             f"{human_rate(tps)} ({how}).", bool(rate))
    return SpeedEstimate(tps, "slow", decode_bytes,
                         f"It runs on this computer's software GPU, slowly: roughly {human_rate(tps)} ({how}).",
                         bool(rate))


def _speeds_path(folder: Path | None) -> Path:
    from engine.paths import data_dir

    return Path(folder or data_dir()) / SPEEDS_FILE


def _read_speeds(path: Path) -> dict:
    from engine.errors import ZeroTVMError
    from engine.formats.files import read_json

    try:
        data = read_json(path, "measured speeds", default={}, max_bytes=1 << 20)
    except (ZeroTVMError, OSError):  # damaged: start again; it only refines an estimate
        return {}
    return {k: v for k, v in data.items() if isinstance(v, (int, float)) and math.isfinite(v) and v > 0}


def measured_rate(adapter_key: str, folder: Path | None = None) -> float | None:
    """Weight bytes/s a decode reached on this adapter (the latest reply long enough to say), or None."""
    return _read_speeds(_speeds_path(folder)).get(adapter_key)


def record_decode(adapter_key: str, decode_bytes: int, tokens: int, tokens_per_s: float,
                  folder: Path | None = None) -> float | None:
    """Remember the rate of a finished reply (too short a one is ignored); returns the rate kept, or None. A file
    that cannot be written is not an error: the estimate stands."""
    if tokens < MIN_MEASURED_TOKENS or not decode_bytes or not tokens_per_s > 0 or not math.isfinite(tokens_per_s):
        return None
    path = _speeds_path(folder)
    speeds = _read_speeds(path)
    speeds[adapter_key] = rate = float(decode_bytes) * tokens_per_s
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(speeds, indent=1), encoding="utf-8")
        os.replace(tmp, path)
    except OSError:
        return None
    return rate


SOFTWARE_NOTICE_TITLE = "Running on a software GPU: replies will be slow"


def software_notice(adapter_name: str, n_cores: int | None = None, rate: float | None = None) -> str:
    """The one plain paragraph the app and the CLI show when the chosen adapter is a software one (`rate`: the
    measured weight bytes/s there, when known)."""
    demo = software_tps(DEMO_DECODE_BYTES, n_cores, rate)
    how = "measured on this computer" if rate else "a rough estimate; your processor may do better or worse"
    return (f"Zero-TVM is running on {adapter_name}, a software GPU: the processor does the graphics card's work. "
            f"Expect roughly {human_rate(demo)} from the demo model and far slower replies from bigger models "
            f"({how}). For full speed, install your graphics card's driver with Vulkan support (Metal on macOS, "
            f"DirectX 12 on Windows), or pick the card under Settings → GPU, then start Zero-TVM again.")
