"""Offline mode: set_offline(True) (the app's setting), ZEROTVM_OFFLINE=1 or HF_HUB_OFFLINE=1 (the user's
environment) makes downloads refuse; no_network() keeps a block of code (the model load path) from reaching the Hub
through huggingface_hub."""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Iterator
from contextlib import contextmanager

_TRUE = {"1", "true", "yes", "on"}
_local = threading.local()
_hook_lock = threading.Lock()
_chosen = threading.Event()  # set: the program turned offline mode on (set_offline), whatever the environment says


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in _TRUE


def set_offline(on: bool) -> None:
    """The program's own offline switch (the app's Settings); off leaves the environment's switches in force."""
    if on:
        _chosen.set()
    else:
        _chosen.clear()


def offline_reason() -> str | None:
    """Why downloads are refused right now, or None when they may go ahead."""
    if _chosen.is_set():
        return "set in Settings"
    if _env_true("ZEROTVM_OFFLINE"):
        return "ZEROTVM_OFFLINE=1"
    constants = sys.modules.get("huggingface_hub.constants")
    # huggingface_hub reads HF_HUB_OFFLINE once at import; the variable may have been set after that.
    if _env_true("HF_HUB_OFFLINE") or (constants is not None and getattr(constants, "HF_HUB_OFFLINE", False)):
        return "HF_HUB_OFFLINE=1"
    if getattr(_local, "depth", 0):
        return "no_network() is active"
    return None


def offline() -> bool:
    """True when downloads must refuse (set_offline(True), ZEROTVM_OFFLINE=1, HF_HUB_OFFLINE=1, or inside
    no_network())."""
    return offline_reason() is not None


def _install_hook() -> None:
    """Make huggingface_hub's per-request offline check also honour no_network() in the calling thread."""
    try:
        from huggingface_hub import constants  # cheap: the package itself loads lazily
    except ImportError:
        return
    with _hook_lock:
        original = constants.is_offline_mode
        if getattr(original, "_zerotvm_hook", False):
            return

        def is_offline_mode() -> bool:
            return bool(getattr(_local, "depth", 0)) or original()

        is_offline_mode._zerotvm_hook = True  # type: ignore[attr-defined]
        constants.is_offline_mode = is_offline_mode


@contextmanager
def no_network() -> Iterator[None]:
    """Inside the block, huggingface_hub requests made from this thread raise OfflineModeIsEnabled and
    download_model refuses. Other threads (a download running in the background) are not affected:
    a process-wide HF_HUB_OFFLINE would make a concurrent download fail mid-way. Nests.
    """
    _install_hook()
    _local.depth = getattr(_local, "depth", 0) + 1
    try:
        yield
    finally:
        _local.depth -= 1
