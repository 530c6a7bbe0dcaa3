"""SIGTERM and SIGINT (a session ending, `kill`, Ctrl+C in the terminal) close the window the way its close button
does: the reply stops, prefs and chats are saved, the worker threads end, and the app exits with status 0.

Qt's event loop runs no Python code by itself, so a Python signal handler would wait for the next Qt event;
signal.set_wakeup_fd writes the signal's number into a socket that a QSocketNotifier watches, which wakes the
loop at once.
"""

from __future__ import annotations

import logging
import signal
import socket

from PySide6.QtCore import QObject, QSocketNotifier
from PySide6.QtWidgets import QApplication, QWidget

log = logging.getLogger("zerotvm.app")
SIGNALS = tuple(s for s in (getattr(signal, "SIGTERM", None), signal.SIGINT) if s is not None)


class SignalCloser(QObject):
    """Installed for the life of the event loop; `restore()` puts the previous handlers back."""

    def __init__(self, app: QApplication, window: QWidget):
        super().__init__(app)
        self.app, self.window = app, window
        self._reader, self._writer = socket.socketpair()
        for end in (self._reader, self._writer):
            end.setblocking(False)
        self._previous_fd = signal.set_wakeup_fd(self._writer.fileno())
        self._previous = {s: signal.signal(s, self._note) for s in SIGNALS}
        self._notifier = QSocketNotifier(self._reader.fileno(), QSocketNotifier.Type.Read, self)
        self._notifier.activated.connect(self._wake)

    def _note(self, _signum, _frame) -> None:
        """A Python-level handler, so the signal neither kills the process (SIGTERM's default) nor raises
        KeyboardInterrupt somewhere in Qt code (SIGINT's); _wake, woken by the same signal, does the work."""

    def _wake(self) -> None:
        try:
            data = self._reader.recv(64)
        except OSError:
            return
        if not data:
            return
        name = signal.Signals(data[-1]).name if data[-1] in set(SIGNALS) else str(data[-1])
        log.info("received %s: closing the window", name)
        self.window.close()  # closeEvent: stop, save, end the worker threads
        self.app.quit()

    def restore(self) -> None:
        self._notifier.setEnabled(False)
        signal.set_wakeup_fd(self._previous_fd)
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        self._reader.close()
        self._writer.close()
