"""The engine worker: one QThread that owns the wgpu device and the loaded model for the app's lifetime.

Requests arrive as queued slot calls (load, reply, unload) and run one at a time on the worker thread;
results leave as signals carrying plain data (str, int, float, dict, list), so the GUI thread never
touches the GPU and never waits on it. Each load and reply carries its own CancelToken (engine/cancel.py), made
by the GUI: Stop cancels that token only, so it reaches a request still queued and never a later one; the
engine checks it between tensors, prefill pieces and tokens. `close()` is the one method the GUI calls
directly: it cancels whatever runs and refuses whatever is still queued.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.errors import describe_error
from engine.cancel import Cancelled, CancelToken

log = logging.getLogger("zerotvm.app")
_PARKED: list = []  # devices left at close with GPU work possibly queued: dropping one waits for that work


class EngineWorker(QObject):
    # Loading: part index, parts, bytes done, bytes total; then the model's facts, or an error.
    load_progress = Signal(int, int, float, float, str)  # part, parts, bytes done, total, the file being read
    loaded = Signal(dict)
    unloaded = Signal()
    # Replies carry the request id the GUI chose, so late signals of a stopped request are recognisable.
    reply_progress = Signal(int, int, int, float)  # request, prompt tokens read, of total, seconds so far
    reply_delta = Signal(int, str, str)  # request, thinking text, answer text
    reply_done = Signal(int, dict)  # request, stats (finish_reason, tokens, tok/s, ttft, context, dropped)
    failed = Signal(int, str, str)  # request (0 = load), title, message in plain words

    def __init__(self, adapter: str | None = None):
        super().__init__()
        self._closing = threading.Event()
        self._running: CancelToken | None = None  # the token of the load or reply running now
        self.parked = False  # shutdown left the device parked (see shutdown)
        self._adapter = adapter
        self.gpu_weights = "auto"  # the Settings entry as typed; the window sets it before each load
        self._gpu = None
        self.model = None

    # ---- called from the GUI thread directly ---------------------------------------------------
    def close(self) -> None:
        """Cancel the running request and every queued one (thread-safe): the window is closing."""
        self._closing.set()
        running = self._running
        if running is not None:
            running.cancel()

    # ---- slots, run on the worker thread ---------------------------------------------------------
    @Slot(str, int, bool, object)
    def load(self, path: str, context: int, exact_decode: bool, token: CancelToken) -> None:
        from engine.model import load_model
        from engine.runtime_options import RuntimeOptions

        self._running = token
        if self._closing.is_set():  # set before or after _running: either way this load sees it
            token.cancel()
        try:
            self._release()

            def progress(part: int, parts: int, path: str, done: int, total: int) -> None:
                token.check()  # Cancel or close: the half-built runtime frees what it took
                self.load_progress.emit(part, parts, float(done), float(total), Path(path).name)

            token.check()
            started = time.perf_counter()
            options = RuntimeOptions(max_context=context or None, q8_decode=not exact_decode,
                                     gpu_weights=self._gpu_weights())
            self.model = load_model(path, gpu=self._device(), on_progress=progress, options=options)
            token.check()
            self.loaded.emit(self._facts(time.perf_counter() - started))
            log.info("model loaded: %s", path)  # .ci/run waits for this line in the log
        except Cancelled:
            self._release()
            self.unloaded.emit()
        except Exception as e:  # every failure becomes a dialog in plain words, details in the log
            log.exception("loading %s failed", path)
            self._release()
            self.failed.emit(0, *describe_error(e, what="load the model"))
        finally:
            self._running = None

    @Slot(int, list, dict, object)
    def reply(self, request: int, messages: list, settings: dict, token: CancelToken) -> None:
        """Answer the last user message of `messages` (a regenerate or an edit is the same request: the
        cache keeps the longest common prefix with what it holds). Nothing of a cancelled request is emitted
        after its token is set, except its reply_done."""
        from engine.session import ChatSession
        from engine.settings import settings_from_dict

        self._running = token
        if self._closing.is_set():  # set before or after _running: either way this request sees it
            token.cancel()
        if token.cancelled:  # stopped while queued
            self._running = None
            self.reply_done.emit(request, _stats(None, stopped=True))
            return
        if self.model is None:
            self._running = None
            self.failed.emit(request, "No model loaded", "Pick a model and load it before sending a message.")
            return
        last = None
        events = None
        try:
            chat = ChatSession(self.model, settings_from_dict(settings), [dict(m) for m in messages],
                               cancel=token, progress=True)
            events = chat.regenerate()
            for event in events:
                if token.cancelled:
                    break
                if event.progress is not None:
                    p = event.progress
                    self.reply_progress.emit(request, p.done, p.total, p.seconds)
                    continue
                last = event
                if event.thinking or event.answer:
                    self.reply_delta.emit(request, event.thinking, event.answer)
            stats = _stats(last, stopped=token.cancelled)
            from engine.gpu_budget import hit_rate_line

            stats["experts"] = hit_rate_line(self.model.runtime)  # the expert cache so far (None when not streaming)
            self.reply_done.emit(request, stats)
        except Cancelled:
            self.reply_done.emit(request, _stats(last, stopped=True))
        except Exception as e:
            log.exception("reply %d failed", request)
            self.failed.emit(request, *describe_error(e, what="answer"))
        finally:
            self._running = None
            if events is not None:
                events.close()  # settles the cache at what was emitted

    @Slot()
    def unload(self) -> None:
        self._release()
        self.unloaded.emit()

    @Slot()
    def shutdown(self) -> None:
        """End the thread's event loop. The model's buffers go now; the device is parked, not dropped: dropping it
        waits for GPU work a stopped request left queued (seconds on a software adapter), and the process is
        about to exit anyway (app/main.py ends it without waiting)."""
        self._release()
        if self._gpu is not None:
            _PARKED.append(self._gpu)
            self.parked = True
        self._gpu = None
        QThread.currentThread().quit()

    # ---- helpers -----------------------------------------------------------------------------------
    def _device(self):
        if self._gpu is None:
            from engine.gpu import Gpu

            self._gpu = Gpu(self._adapter or None)
        return self._gpu

    def _release(self) -> None:
        self.model = None  # buffers go with the last reference

    def _gpu_weights(self) -> int | None:
        """The weights budget: the Settings entry (set by the window before a load), else ZEROTVM_GPU_WEIGHTS."""
        from engine.gpu_budget import setting_budget

        return setting_budget(self.gpu_weights)

    def _facts(self, seconds: float) -> dict:
        from engine.gpu_budget import streaming_line

        m = self.model
        tok = m.tokenizer
        template = "\n".join(t.source for t in tok.chat_templates.values()) if tok else ""
        return {
            "path": str(m.path), "name": Path(m.path).name, "model_type": m.model_type,
            "context": m.runtime.max_context, "load_seconds": seconds,
            "thinking": "enable_thinking" in template, "chat": bool(tok and tok.chat_templates),
            "sampling": dict(vars(m.default_sampling)),
            "adapter": self._gpu.info.summary(), "int8_decode": m.runtime.arithmetic.int8,
            "experts": streaming_line(m.runtime),  # None unless routed experts stream from RAM
        }


def _stats(event, stopped: bool) -> dict:
    if event is None:
        return {"finish_reason": "stopped" if stopped else "empty", "tokens": 0}
    r = event.response
    return {
        "finish_reason": "stopped" if stopped and r.finish_reason is None else r.finish_reason,
        "tokens": r.generation_tokens, "tps": r.generation_tps, "ttft": r.ttft_s, "prompt_tokens": r.prompt_tokens,
        "prompt_reused": r.prompt_reused, "context_used": r.context_used, "context_limit": r.context_limit,
        "dropped_turns": event.dropped_turns,
    }


_STRAGGLERS: list = []  # threads that did not end within close()'s wait: kept alive until the process exits


def keep_until_exit(thread_owner) -> None:
    """A QThread destroyed while running aborts the process: a thread that outlived close() is kept referenced."""
    _STRAGGLERS.append(thread_owner)


class WorkerThread:
    """Owns the QThread and the worker living in it; `close()` shuts both down (call it in `finally`)."""

    def __init__(self, adapter: str | None = None):
        self.thread = QThread()
        self.thread.setObjectName("engine-worker")
        self.worker = EngineWorker(adapter)
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def close(self, timeout_ms: int = 1500) -> bool:
        """Cancel everything, let the thread end and wait at most `timeout_ms`; False if it had not ended (it is
        then kept alive, never destroyed while running, and the app exits without it)."""
        if not self.thread.isRunning():
            return True
        self.worker.close()
        # Queued behind the running request, which sees its cancelled token at its next piece or token.
        from PySide6.QtCore import QMetaObject, Qt

        QMetaObject.invokeMethod(self.worker, "shutdown", Qt.ConnectionType.QueuedConnection)
        if self.thread.wait(max(0, int(timeout_ms))):
            return True
        log.warning("the engine worker was still busy %d ms after close", timeout_ms)
        keep_until_exit(self)
        return False
