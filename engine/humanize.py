"""Numbers as people read them: durations, sizes and token rates, shared by the CLI and the app."""

from __future__ import annotations


def human_duration(seconds: float | None) -> str:
    """"850 ms", "3.2 s", "42 s", "1 min 34 s", "2 h 5 min"; "unknown" for None or a negative value."""
    if seconds is None or seconds != seconds or seconds < 0:  # None, NaN or negative
        return "unknown"
    if seconds < 0.9995:  # rounds to at most 999 ms
        return f"{round(seconds * 1000)} ms"
    if seconds < 9.95:
        return f"{seconds:.1f} s"
    whole = round(seconds)
    if whole < 60:
        return f"{whole} s"
    if whole < 3600:
        minutes, secs = divmod(whole, 60)
        return f"{minutes} min" + (f" {secs} s" if secs else "")
    hours, minutes = divmod(round(seconds / 60), 60)
    return f"{hours} h" + (f" {minutes} min" if minutes else "")


def human_rate(tokens_per_s: float) -> str:
    """A decode speed: "12 tokens/s", "2.1 tokens/s", or "one token every 7 s" below one a second."""
    if tokens_per_s >= 9.95:
        return f"{tokens_per_s:.0f} tokens/s"
    if tokens_per_s >= 0.95:
        return f"{tokens_per_s:.1f} tokens/s"
    if tokens_per_s <= 0:
        return "no measurable speed"
    return f"one token every {human_duration(1 / tokens_per_s)}"
