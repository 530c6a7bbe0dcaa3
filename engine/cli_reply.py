"""A reply on the terminal for `zerotvm generate` and `chat`: the prompt's reading progress on stderr, thinking on
stderr, the answer on stdout, and Ctrl-C as a Stop (the engine ends at its next piece or token with the cache
consistent; a second Ctrl-C interrupts at once)."""

from __future__ import annotations

import signal
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from engine.cancel import CancelToken
from engine.humanize import human_duration

SHOW_AFTER_S = 1.0  # a prompt read faster than this shows no progress
LINE_EVERY_S = 5.0  # without a terminal, progress is a line at most this often


@contextmanager
def ctrl_c_cancels(token: CancelToken) -> Iterator[None]:
    """Inside the block the first Ctrl-C cancels `token` instead of raising; the second raises KeyboardInterrupt."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def handler(_signum, _frame):
        if token.cancelled:
            raise KeyboardInterrupt
        token.cancel()

    previous = signal.signal(signal.SIGINT, handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class PrefillMeter:
    """"reading your message… 120/480 tokens · 35 tok/s" on stderr while a prompt longer than about a second is
    read: one line rewritten in place on a terminal, a line every few seconds otherwise."""

    def __init__(self, stream=None):
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.state: tuple[int, int, float] | None = None
        self.started = time.monotonic()
        self.shown = False
        self.last_line = 0.0
        self._lock = threading.Lock()
        self._timer = threading.Timer(SHOW_AFTER_S, self._show)  # a first piece can take longer than a second
        self._timer.daemon = True
        self._timer.start()

    def update(self, done: int, total: int, seconds: float) -> None:
        with self._lock:
            self.state = (done, total, seconds)
        if time.monotonic() - self.started >= SHOW_AFTER_S:
            self._show()

    def _show(self) -> None:
        with self._lock:
            if self.state is None or self.state[0] >= self.state[1] and self.state[1]:
                return
            done, total, seconds = self.state
            now = time.monotonic()
            if not self.tty and self.shown and now - self.last_line < LINE_EVERY_S:
                return
            text = f"reading your message… {done}/{total} tokens"
            if done and seconds > 0:
                rate = done / seconds
                text += f" · {rate:.0f} tok/s · about {human_duration((total - done) / rate)} left"
            print(f"\r{text}\033[K" if self.tty else text, end="" if self.tty else "\n", file=self.stream, flush=True)
            self.shown, self.last_line = True, now

    def finish(self) -> None:
        """The first token arrived (or the reply ended): the progress line makes way."""
        self._timer.cancel()
        with self._lock:
            if self.shown and self.tty:
                print("\r\033[K", end="", file=self.stream, flush=True)
            self.state = None


def print_reply(events) -> object:
    """Stream a ChatSession reply: progress and thinking to stderr (dimmed on a terminal), the answer to stdout;
    returns the last event with a response (None if there was none)."""
    dim, end = ("\033[2m", "\033[0m") if sys.stderr.isatty() else ("", "")
    meter = PrefillMeter()
    last, thinking = None, False
    try:
        for e in events:
            if e.progress is not None:
                meter.update(e.progress.done, e.progress.total, e.progress.seconds)
                continue
            meter.finish()
            if e.thinking:
                print(f"{dim}{e.thinking}{end}", end="", file=sys.stderr, flush=True)
                thinking = True
            if e.answer:
                if thinking:
                    print(file=sys.stderr)
                    thinking = False
                print(e.answer, end="", flush=True)
            last = e
    finally:
        meter.finish()
        if last is not None:
            print()
    return last


def print_completion(responses) -> object:
    """Stream a raw completion (stream_generate with progress) to stdout; returns the last response."""
    meter = PrefillMeter()
    last = None
    try:
        for r in responses:
            if not hasattr(r, "text"):  # a PrefillProgress
                meter.update(r.done, r.total, r.seconds)
                continue
            meter.finish()
            print(r.text, end="", flush=True)
            last = r
    finally:
        meter.finish()
        if last is not None:
            print()
    return last
