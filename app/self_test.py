"""`zerotvm-chat --self-test`: the app's engine path without a window. The demo model is set up first (with
progress on stderr), then the worker thread loads it and answers one question, exactly as for the window."""

from __future__ import annotations

import sys

from PySide6.QtCore import QCoreApplication, QObject, QTimer, Signal, Slot

from engine.cancel import CancelToken

QUESTION = "What is the capital of France?"
TIMEOUT_MS = 600_000


class _Driver(QObject):
    """Lives in the main thread, so the worker's signals reach its slots there (queued)."""

    load = Signal(str, int, bool, object)  # path, context, exact decode, CancelToken (as the window's request_load)
    reply = Signal(int, list, dict, object)

    def __init__(self, app):
        super().__init__()
        self.app, self.answer, self.rc = app, [], 1

    @Slot(dict)
    def loaded(self, facts: dict) -> None:
        from engine.humanize import human_duration

        print(f"loaded in {human_duration(facts['load_seconds'])} on {facts['adapter']}", file=sys.stderr)
        self.reply.emit(1, [{"role": "user", "content": QUESTION}],
                        {"max_tokens": 32, "sampling": {"temperature": 0.0}, "seed": 0}, CancelToken())

    @Slot(int, str, str)
    def delta(self, _request: int, _thinking: str, answer: str) -> None:
        self.answer.append(answer)

    @Slot(int, dict)
    def done(self, _request: int, stats: dict) -> None:
        text = "".join(self.answer).strip()
        print(f"Q: {QUESTION}\nA: {text}")
        print(f"[{stats.get('tokens')} tokens, {stats.get('tps', 0):.1f} tok/s]", file=sys.stderr)
        self.rc = 0 if text else 1
        self.app.quit()

    @Slot(int, str, str)
    def failed(self, _request: int, title: str, message: str) -> None:
        print(f"self-test failed: {title}: {message}", file=sys.stderr)
        self.app.quit()


def run_self_test() -> int:
    from app.worker import WorkerThread
    from engine import demo
    from engine.errors import ZeroTVMError

    app = QCoreApplication.instance() or QCoreApplication(["zerotvm-chat"])

    def progress(stage: str, done: int, total: int) -> None:
        print(f"\r{stage} {done / 2**20:.1f}/{total / 2**20:.1f} MiB", end="", file=sys.stderr, flush=True)

    try:
        path = demo.install_demo(on_progress=progress)
    except ZeroTVMError as e:
        print(f"\nself-test failed: {e}", file=sys.stderr)
        return 1
    print(f"\nmodel: {path}", file=sys.stderr)
    engine = WorkerThread()
    driver = _Driver(app)
    w = engine.worker
    driver.load.connect(w.load)
    driver.reply.connect(w.reply)
    w.loaded.connect(driver.loaded)
    w.reply_delta.connect(driver.delta)
    w.reply_done.connect(driver.done)
    w.failed.connect(driver.failed)
    QTimer.singleShot(0, lambda: driver.load.emit(str(path), 512, False, CancelToken()))
    QTimer.singleShot(TIMEOUT_MS, app.quit)
    try:
        app.exec()
    finally:
        engine.close(timeout_ms=30_000)  # not closing a window: let the worker finish and free the device
    return driver.rc
