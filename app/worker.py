"""The engine worker: one QThread that owns the wgpu device and the loaded model for the app's lifetime.

Requests arrive as queued slot calls (load, reply, unload) and run one at a time on the worker thread;
results leave as signals carrying plain data (str, int, float, dict, list), so the GUI thread never
touches the GPU and never waits on it. `stop()` is the one method the GUI calls directly: it only sets an
event that the generation loop checks between tokens.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.errors import describe_error

log = logging.getLogger("zerotvm.app")


class Stopped(Exception):
    """Raised inside the loader's progress callback when the user cancels a load."""


class EngineWorker(QObject):
    # Loading: part index, parts, bytes done, bytes total; then the model's facts, or an error.
    load_progress = Signal(int, int, float, float, str)  # part, parts, bytes done, total, the file being read
    loaded = Signal(dict)
    unloaded = Signal()
    # Replies carry the request id the GUI chose, so late signals of a stopped request are recognisable.
    reply_delta = Signal(int, str, str)  # request, thinking text, answer text
    reply_done = Signal(int, dict)  # request, stats (finish_reason, tokens, tok/s, ttft, context, dropped)
    failed = Signal(int, str, str)  # request (0 = load), title, message in plain words

    def __init__(self, adapter: str | None = None):
        super().__init__()
        self._stop = threading.Event()
        self._adapter = adapter
        self.gpu_weights = "auto"  # the Settings entry as typed; the window sets it before each load
        self._gpu = None
        self.model = None

    # ---- called from the GUI thread directly ---------------------------------------------------
    def stop(self) -> None:
        """Stop the running reply or load at the next token/tensor (thread-safe)."""
        self._stop.set()

    # ---- slots, run on the worker thread ---------------------------------------------------------
    @Slot(str, int, bool)
    def load(self, path: str, context: int, exact_decode: bool = False) -> None:
        from engine.model import load_model
        from engine.runtime_options import RuntimeOptions

        self._stop.clear()
        try:
            self._release()

            def progress(part: int, parts: int, path: str, done: int, total: int) -> None:
                if self._stop.is_set():
                    raise Stopped
                self.load_progress.emit(part, parts, float(done), float(total), Path(path).name)

            started = time.perf_counter()
            options = RuntimeOptions(max_context=context or None, q8_decode=not exact_decode,
                                     gpu_weights=self._gpu_weights())
            self.model = load_model(path, gpu=self._device(), on_progress=progress, options=options)
            self.loaded.emit(self._facts(time.perf_counter() - started))
            log.info("model loaded: %s", path)  # .ci/run waits for this line in the log
        except Stopped:
            self._release()
            self.unloaded.emit()
        except Exception as e:  # every failure becomes a dialog in plain words, details in the log
            log.exception("loading %s failed", path)
            self._release()
            self.failed.emit(0, *describe_error(e, what="load the model"))

    @Slot(int, list, dict)
    def reply(self, request: int, messages: list, settings: dict) -> None:
        """Answer the last user message of `messages` (a regenerate or an edit is the same request: the
        cache keeps the longest common prefix with what it holds)."""
        from engine.chat import TemplateCancelled, render_cancel
        from engine.session import ChatSession
        from engine.settings import settings_from_dict

        self._stop.clear()
        if self.model is None:
            self.failed.emit(request, "No model loaded", "Pick a model and load it before sending a message.")
            return
        last = None
        events = None
        try:
            with render_cancel(self._stop.is_set):  # Stop and close also end a chat template still rendering
                chat = ChatSession(self.model, settings_from_dict(settings), [dict(m) for m in messages])
                events = chat.regenerate()
            for event in events:
                last = event
                if event.thinking or event.answer:
                    self.reply_delta.emit(request, event.thinking, event.answer)
                if self._stop.is_set():
                    break
            stats = _stats(last, stopped=self._stop.is_set())
            from engine.gpu_budget import hit_rate_line

            stats["experts"] = hit_rate_line(self.model.runtime)  # the expert cache so far (None when not streaming)
            self.reply_done.emit(request, stats)
        except TemplateCancelled:
            self.reply_done.emit(request, _stats(None, stopped=True))
        except Exception as e:
            log.exception("reply %d failed", request)
            self.failed.emit(request, *describe_error(e, what="answer"))
        finally:
            if events is not None:
                events.close()  # settles the cache at what was emitted
            pass

    @Slot()
    def unload(self) -> None:
        self._release()
        self.unloaded.emit()

    @Slot()
    def shutdown(self) -> None:
        """Free the model and the device on the worker thread, then end the thread's event loop."""
        self._release()
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
        from engine.gpu_budget import from_env, parse_size

        return parse_size(self.gpu_weights, "GPU weights budget") if self.gpu_weights != "auto" else from_env()

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


class WorkerThread:
    """Owns the QThread and the worker living in it; `close()` shuts both down (call it in `finally`)."""

    def __init__(self, adapter: str | None = None):
        self.thread = QThread()
        self.thread.setObjectName("engine-worker")
        self.worker = EngineWorker(adapter)
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def close(self, timeout_ms: int = 30000) -> bool:
        if not self.thread.isRunning():
            return True
        self.worker.stop()
        # Queued behind any running request; that request sees the stop event within a token.
        from PySide6.QtCore import QMetaObject, Qt

        QMetaObject.invokeMethod(self.worker, "shutdown", Qt.ConnectionType.QueuedConnection)
        return self.thread.wait(timeout_ms)
