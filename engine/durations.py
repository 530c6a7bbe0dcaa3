"""Durations as people read them: "0.4 s", "12 s", "1 min 34 s", "2 h 5 min" (never "94149 ms")."""

from __future__ import annotations


def human_duration(seconds: float) -> str:
    s = max(0.0, float(seconds))
    if s < 10:
        return f"{s:.1f} s"
    whole = int(round(s))
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        return f"{whole // 60} min {whole % 60} s" if whole % 60 else f"{whole // 60} min"
    return f"{whole // 3600} h {whole % 3600 // 60} min" if whole % 3600 // 60 else f"{whole // 3600} h"
