"""Cooperative cancellation: one CancelToken per request, set from any thread, checked by the engine between
prefill pieces, decode batches and chat-template steps (never by interrupting GPU work already queued)."""

from __future__ import annotations

import threading


class Cancelled(Exception):  # noqa: N818 (a request that was stopped, not an error)
    """The request's CancelToken was set; the engine stopped at its next check with the cache consistent."""


class CancelToken:
    """Thread-safe and one-way: once cancelled it stays cancelled (a new request takes a new token)."""

    def __init__(self) -> None:
        self._event = threading.Event()

    def cancel(self) -> None:
        self._event.set()

    @property
    def cancelled(self) -> bool:
        return self._event.is_set()

    def check(self) -> None:
        """Raise Cancelled when the token is set."""
        if self._event.is_set():
            raise Cancelled

    def wait(self, seconds: float) -> bool:
        """Sleep up to `seconds`, waking early on cancel; True if cancelled."""
        return self._event.wait(seconds)


def check(token: CancelToken | None) -> None:
    if token is not None:
        token.check()
