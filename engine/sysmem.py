"""Total and available RAM from the operating system, without psutil.

Linux: /proc/meminfo (MemAvailable is the kernel's own estimate of what can be allocated without swapping).
macOS: sysctl hw.memsize for the total; vm_stat's free + inactive + speculative + purgeable pages for what is
available (inactive and purgeable pages are reclaimed on demand, as Activity Monitor counts them).
Windows: GlobalMemoryStatusEx (ullTotalPhys / ullAvailPhys). Anything that fails gives None, never an error.
"""

from __future__ import annotations

import re
import subprocess
import sys
from dataclasses import dataclass


@dataclass(frozen=True)
class SystemMemory:
    total_bytes: int | None
    available_bytes: int | None
    source: str = ""


def parse_meminfo(text: str) -> SystemMemory:
    """/proc/meminfo values are in kB (KiB). Old kernels (< 3.14) lack MemAvailable: free + cached then."""
    kb = {m[1]: int(m[2]) * 1024 for m in re.finditer(r"^(\w+):\s+(\d+)\s*kB", text, re.M)}
    total = kb.get("MemTotal")
    available = kb.get("MemAvailable")
    if available is None and "MemFree" in kb:
        available = kb["MemFree"] + kb.get("Cached", 0) + kb.get("Buffers", 0)
    return SystemMemory(total, available, "/proc/meminfo")


def parse_vm_stat(text: str, total: int | None = None) -> SystemMemory:
    """macOS `vm_stat` output ("page size of N bytes", then "Pages free: 123." lines)."""
    m = re.search(r"page size of (\d+) bytes", text)
    page = int(m[1]) if m else 4096
    pages = {k.strip().lower(): int(v) for k, v in re.findall(r"^([^:\n]+):\s+(\d+)\.?$", text, re.M)}
    keys = ("pages free", "pages inactive", "pages speculative", "pages purgeable")
    if "pages free" not in pages:
        return SystemMemory(total, None, "vm_stat")
    return SystemMemory(total, sum(pages.get(k, 0) for k in keys) * page, "sysctl hw.memsize + vm_stat")


def system_memory() -> SystemMemory:
    try:
        if sys.platform.startswith("linux"):
            with open("/proc/meminfo", encoding="ascii") as f:
                return parse_meminfo(f.read())
        if sys.platform == "darwin":
            return _macos()
        if sys.platform == "win32":
            return _windows()
    except (OSError, ValueError, subprocess.SubprocessError):
        pass
    return SystemMemory(None, None, "unknown")


def _macos() -> SystemMemory:
    run = dict(capture_output=True, text=True, timeout=5, check=True)
    total = int(subprocess.run(["sysctl", "-n", "hw.memsize"], **run).stdout.strip())
    return parse_vm_stat(subprocess.run(["vm_stat"], **run).stdout, total)


def _windows() -> SystemMemory:
    import ctypes

    class MEMORYSTATUSEX(ctypes.Structure):
        _fields_ = [("dwLength", ctypes.c_ulong), ("dwMemoryLoad", ctypes.c_ulong),
                    ("ullTotalPhys", ctypes.c_ulonglong), ("ullAvailPhys", ctypes.c_ulonglong),
                    ("ullTotalPageFile", ctypes.c_ulonglong), ("ullAvailPageFile", ctypes.c_ulonglong),
                    ("ullTotalVirtual", ctypes.c_ulonglong), ("ullAvailVirtual", ctypes.c_ulonglong),
                    ("ullAvailExtendedVirtual", ctypes.c_ulonglong)]

    status = MEMORYSTATUSEX()
    status.dwLength = ctypes.sizeof(MEMORYSTATUSEX)
    if not ctypes.windll.kernel32.GlobalMemoryStatusEx(ctypes.byref(status)):
        return SystemMemory(None, None, "GlobalMemoryStatusEx failed")
    return SystemMemory(status.ullTotalPhys, status.ullAvailPhys, "GlobalMemoryStatusEx")
