"""SIGTERM / SIGINT close the app like its close button: the event loop wakes at once, closeEvent saves the prefs,
main() returns 0 and the previous handlers are back. Sent to this process only once the app's handler is in place
(a default SIGTERM would end the test run)."""

from __future__ import annotations

import os
import signal

import pytest

pytestmark = pytest.mark.app


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT], ids=["SIGTERM", "SIGINT"])
def test_a_signal_closes_the_window_cleanly(tmp_path, monkeypatch, caplog, signum):
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app import main as app_main
    from app.signals import SignalCloser
    from app.window import MainWindow

    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ZEROTVM_MODELS", raising=False)
    monkeypatch.setattr(app_main, "_adapters", lambda: [])
    caplog.set_level("INFO", logger="zerotvm.app")
    before = signal.getsignal(signum)
    seen = {}

    def send(tries=[0]):  # noqa: B006 - a counter shared by the retries
        handler = signal.getsignal(signum)
        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if not windows or not isinstance(getattr(handler, "__self__", None), SignalCloser):
            tries[0] += 1
            if tries[0] < 200:
                QTimer.singleShot(100, send)
            return
        seen["window"] = windows[0]
        os.kill(os.getpid(), signum)

    QApplication.instance() or QApplication([])
    QTimer.singleShot(100, send)
    bound = QTimer(singleShot=True, interval=30_000)  # the signal did not end the loop: the test fails, not hangs
    bound.timeout.connect(lambda: seen.setdefault("timed_out", True))
    bound.timeout.connect(QApplication.instance().quit)
    bound.start()
    try:
        rc = app_main.main(["--no-auto-setup"])
    finally:
        bound.stop()
    assert "window" in seen and "timed_out" not in seen
    assert rc == 0 and not seen["window"].isVisible()
    assert (tmp_path / "home" / app_main.PREFS_FILE).is_file()  # closeEvent ran
    assert f"received {signal.Signals(signum).name}: closing the window" in caplog.messages
    assert signal.getsignal(signum) == before
    seen["window"].deleteLater()
