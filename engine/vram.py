"""How much memory a discrete GPU has, where the system says it (wgpu does not): NVIDIA's nvidia-smi, AMD's sysfs.

Used only for the weights budget's auto setting (engine/gpu_budget.py); None whenever it cannot be told for sure
(several cards of different sizes, no tool, an integrated or software adapter), and auto then sets no limit.
"""

from __future__ import annotations

import glob
import shutil
import subprocess
from functools import lru_cache


def adapter_memory(info) -> int | None:
    """Bytes of memory of the adapter `info` (engine.gpu.AdapterInfo), or None when unknown."""
    if info is None or getattr(info, "adapter_type", "") != "DiscreteGPU":
        return None
    name = str(getattr(info, "name", ""))
    if "nvidia" in name.lower() or "geforce" in name.lower() or "quadro" in name.lower():
        return _nvidia(name)
    if "amd" in name.lower() or "radeon" in name.lower():
        return _amd()
    return None


@lru_cache(maxsize=8)
def _nvidia(name: str) -> int | None:
    exe = shutil.which("nvidia-smi")
    if not exe:
        return None
    try:
        out = subprocess.run([exe, "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    sizes = set()
    for line in out.splitlines():
        gpu, _, mib = line.rpartition(",")
        gpu = gpu.strip().lower()
        if gpu and (gpu in name.lower() or name.lower() in gpu):
            try:
                sizes.add(int(float(mib)) * 2**20)
            except ValueError:
                return None
    return sizes.pop() if len(sizes) == 1 else None


@lru_cache(maxsize=1)
def _amd() -> int | None:
    sizes = set()
    for path in glob.glob("/sys/class/drm/card*/device/mem_info_vram_total"):
        try:
            with open(path, encoding="ascii") as f:
                sizes.add(int(f.read().strip()))
        except (OSError, ValueError):
            return None
    return sizes.pop() if len(sizes) == 1 else None
