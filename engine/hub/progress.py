"""DownloadProgress and the tracker that throttles it (at most ~10 calls a second, plus one per finished file)."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

MIN_INTERVAL_S = 0.1
SPEED_TAU_S = 3.0  # smoothing time constant: speed follows a change in rate within a few seconds


@dataclass(frozen=True)
class DownloadProgress:
    file: str  # repo-relative path of the file being fetched
    file_done: int
    file_total: int
    done: int  # bytes of all selected files, including those already present before this call
    total: int
    speed: float  # bytes/s received in this call, smoothed; 0 until known
    eta_s: float | None  # None until the speed is known
    files_done: int
    files_total: int


class Tracker:
    def __init__(self, callback: Callable[[DownloadProgress], None] | None, total: int, files_total: int,
                 done: int, files_done: int, clock: Callable[[], float] = time.monotonic):
        self.callback, self.total, self.files_total = callback, total, files_total
        self.base_done, self.files_done = done, files_done  # bytes and count of finished files
        self.file, self.file_done, self.file_total = "", 0, 0
        self.received = 0  # network bytes this call: what speed is measured on
        self.speed: float | None = None
        self.clock = clock
        self._last_emit = -math.inf
        self._last_sample: tuple[float, int] | None = None
        self._first_sample = (0.0, 0)

    def start_file(self, name: str, size: int, have: int) -> None:
        self.file, self.file_total, self.file_done = name, size, have
        self._emit(force=False)

    def advance(self, n: int) -> None:
        self.file_done += n
        self.received += n
        self._emit(force=False)

    def set_file_done(self, n: int) -> None:
        """The file's bytes were reset (server ignored a Range, or a corrupt copy was deleted)."""
        self.file_done = n
        self._emit(force=False)

    def finish_file(self) -> None:
        self.base_done += self.file_total
        self.files_done += 1
        self.file_done = self.file_total
        self._emit(force=True, finished=True)

    def _sample_speed(self, now: float) -> None:
        if self._last_sample is None:
            self._first_sample = self._last_sample = (now, self.received)
            return
        t0, r0 = self._last_sample
        dt = now - t0
        if dt < 0.05:
            return
        t_first, r_first = self._first_sample
        if now - t_first < SPEED_TAU_S:  # warm-up: the plain average so far, not an average dragged to 0
            self.speed = (self.received - r_first) / (now - t_first)
        else:  # then a moving average weighted by elapsed time, so the call rate does not change it
            alpha = 1.0 - math.exp(-dt / SPEED_TAU_S)
            self.speed += alpha * ((self.received - r0) / dt - self.speed)
        self._last_sample = (now, self.received)

    def _emit(self, force: bool, finished: bool = False) -> None:
        now = self.clock()
        self._sample_speed(now)
        if self.callback is None or (not force and now - self._last_emit < MIN_INTERVAL_S):
            return
        self._last_emit = now
        done = self.base_done if finished else self.base_done + self.file_done
        speed = self.speed or 0.0
        eta = (self.total - done) / speed if speed > 0 else (0.0 if done >= self.total else None)
        self.callback(DownloadProgress(self.file, self.file_done, self.file_total, done, self.total, speed, eta,
                                       self.files_done, self.files_total))
