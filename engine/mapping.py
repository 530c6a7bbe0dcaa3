"""Buffer mappings for a streamed decode's per-layer round trips (engine/blocks/expert_cache.py), in two flavours with
one interface: map, wait, a view of the bytes, unmap.

- ThreadMap: wgpu-py's map_async, waited for through its poll thread (a Python promise, a poll token and a thread
  wake-up per mapping).
- PolledMap: wgpuBufferMapAsync with one callback per buffer that sets a flag, waited for by non-blocking device
  polls on the calling thread (a blocking poll only after SPIN_SECONDS), so the wait ends within a poll of the GPU
  finishing. A token has 40 such waits, so their wake-up latency is on its critical path.

A PolledMap's buffer is mapped and unmapped only through it (wgpu-py's own map state is never used for it).
"""

from __future__ import annotations

import time

import numpy as np
import wgpu

from engine.errors import GpuError

try:
    from wgpu.backends.wgpu_native._api import ffi as _ffi
    from wgpu.backends.wgpu_native._api import lib as _lib
except (ImportError, AttributeError):  # another wgpu-py layout: only ThreadMap
    _ffi = _lib = None

# A pending PolledMap stays referenced here until its callback runs: wgpu-native calls it at some later poll (with an
# error status when the buffer was destroyed first), which must never find the callback freed.
_PENDING: set = set()
SPIN_SECONDS = 0.002  # then a blocking poll: a long wait (a big upload ahead of it) does not burn a core throughout
WAITS = ("thread", "polled")


def polled_available() -> bool:
    return _lib is not None and hasattr(_lib, "wgpuBufferMapAsync")


def buffer_map(gpu, buf, wait: str):
    """The mapping of `buf` the way `wait` says ("thread" or "polled"; polled falls back to thread where wgpu-py's
    internals are not reachable)."""
    if wait not in WAITS:
        raise ValueError(f"mapping wait must be one of {', '.join(WAITS)}, got {wait!r}")
    if wait == "polled" and polled_available():
        return PolledMap(gpu, buf)
    return ThreadMap(gpu, buf)


def _mode(mode) -> int:
    return int(wgpu.MapMode.READ if mode == "READ_NOSYNC" else mode)


class ThreadMap:
    """wgpu-py's mapping (map_async; the wait goes through Gpu.wait_map)."""

    def __init__(self, gpu, buf):
        self.gpu, self.buf, self._promise = gpu, buf, None

    def map(self, mode, offset: int, size: int) -> None:
        """Ask for the mapping; it lands once the GPU work queued before it is done. "READ_NOSYNC": wgpu-py's read
        mode without the empty submit it otherwise makes first (the copy into the buffer was submitted already)."""
        self._promise = self.buf.map_async(mode, offset, size)

    def mapped_now(self) -> None:
        """The buffer was made mapped (mapped_at_creation)."""
        self._promise = None

    def wait(self) -> None:
        if self._promise is not None:
            promise, self._promise = self._promise, None
            self.gpu.wait_map(promise)

    def view(self, offset: int, size: int, writable: bool) -> np.ndarray | None:
        """The mapped bytes as u8 (None where wgpu-py cannot lend a writable view: the caller writes through
        write_mapped then)."""
        if not writable:
            return np.frombuffer(self.buf.read_mapped(offset, size, copy=False), np.uint8)
        get = getattr(self.buf, "_experimental_get_mapped_range", None)
        if get is None:
            return None
        try:
            view = np.frombuffer(get(offset, size), np.uint8)
        except (TypeError, ValueError, RuntimeError):
            return None
        return view if view.flags.writeable else None

    def write(self, data: np.ndarray, offset: int) -> None:
        self.buf.write_mapped(data, offset)

    def unmap(self) -> None:
        self.buf.unmap()


class PolledMap:
    """wgpu-native's mapping of one buffer, waited for by polling the device on the calling thread."""

    def __init__(self, gpu, buf):
        self.gpu, self.buf = gpu, buf
        self._device = gpu.device._internal
        self.status: int | None = None  # the callback's WGPUMapAsyncStatus; None while pending
        self.message = ""
        self._callback = _ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)", self._landed)
        self._info = _ffi.new("WGPUBufferMapCallbackInfo *")
        self._info.mode = _lib.WGPUCallbackMode_AllowProcessEvents
        self._info.callback = self._callback
        self._pending = False

    def _landed(self, status, message, _user1, _user2) -> None:
        if status != _lib.WGPUMapAsyncStatus_Success and message.data != _ffi.NULL:
            self.message = _ffi.string(message.data, message.length).decode("utf-8", "replace")
        self.status = int(status)
        _PENDING.discard(self)

    def map(self, mode, offset: int, size: int) -> None:
        self.status, self.message, self._pending = None, "", True
        _PENDING.add(self)
        _lib.wgpuBufferMapAsync(self.buf._internal, _mode(mode), offset, size, self._info[0])

    def mapped_now(self) -> None:
        self._pending = False

    def wait(self) -> None:
        if not self._pending:
            return
        poll, device, null = _lib.wgpuDevicePoll, self._device, _ffi.NULL
        deadline = time.perf_counter() + SPIN_SECONDS
        while self.status is None:
            poll(device, False, null)
            if self.status is None and time.perf_counter() > deadline:
                poll(device, True, null)  # waits for the newest submission, which holds (or follows) this one
        self._pending = False
        if self.status != _lib.WGPUMapAsyncStatus_Success:
            raise GpuError(f"could not map {self.buf.label or 'a buffer'} ({self.status}): {self.message}")

    def view(self, offset: int, size: int, writable: bool) -> np.ndarray:
        get = _lib.wgpuBufferGetMappedRange if writable else _lib.wgpuBufferGetConstMappedRange
        ptr = get(self.buf._internal, offset, size)
        if ptr == _ffi.NULL:
            raise GpuError(f"{self.buf.label or 'a buffer'}: mapped range {offset}+{size} not available")
        view = np.frombuffer(_ffi.buffer(ptr, size), np.uint8)
        if not writable:
            view.flags.writeable = False
        return view

    def write(self, data: np.ndarray, offset: int) -> None:
        raw = np.ascontiguousarray(data).reshape(-1).view(np.uint8)
        self.view(offset, raw.size, True)[:] = raw

    def unmap(self) -> None:
        _lib.wgpuBufferUnmap(self.buf._internal)
