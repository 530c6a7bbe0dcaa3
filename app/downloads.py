"""Downloads on their own QThread (network, never the GPU): Hub models through engine.hub, the demo through
engine.demo. Progress leaves as plain dicts; cancel() is called directly from the GUI thread."""

from __future__ import annotations

import logging
import threading
import time

from PySide6.QtCore import QObject, QThread, Signal, Slot

from app.errors import describe_error

log = logging.getLogger("zerotvm.app")


class DownloadWorker(QObject):
    progress = Signal(dict)  # key, file, done, total, speed, eta_s, files_done, files_total
    finished = Signal(str, str)  # key, path to load
    cancelled = Signal(str)
    failed = Signal(str, str, str)  # key, title, message
    managed = Signal(str, str, list)  # key, action ("verify" / "remove"), files that failed verification

    def __init__(self):
        super().__init__()
        self._cancel = threading.Event()

    def cancel(self) -> None:
        self._cancel.set()

    @Slot(dict, str)
    def start(self, entry: dict, models_dir: str) -> None:
        """Download a catalog entry (as CatalogEntry.to_dict()) into the models folder."""
        from engine.catalog import CatalogEntry, install_dir

        self._cancel.clear()
        e = CatalogEntry(**entry)
        folder = install_dir(e, models_dir or None)
        try:
            if e.is_demo:
                path = self._demo(e, folder)
            else:
                path = self._hub(e, folder)
            self.finished.emit(e.key, str(path))
        except Exception as err:
            from engine.hub.errors import DownloadCancelled

            if isinstance(err, DownloadCancelled):
                self.cancelled.emit(e.key)
                return
            log.exception("download of %s failed", e.key)
            self.failed.emit(e.key, *describe_error(err, what=f"download {e.name}"))

    @Slot(dict, str, str)
    def manage(self, entry: dict, models_dir: str, action: str) -> None:
        """Verify (re-hash against the Hub) or remove an installed model, off the GUI thread: both touch GBs."""
        from engine import demo
        from engine.catalog import CatalogEntry, install_dir
        from engine.hub.state import remove_model, verify_installed

        e = CatalogEntry(**entry)
        folder = install_dir(e, models_dir or None)
        try:
            bad = []
            if action == "verify":
                bad = verify_installed(folder)
            elif e.is_demo:
                demo.demo_path(folder).unlink(missing_ok=True)
            else:
                remove_model(folder)
            self.managed.emit(e.key, action, bad)
        except Exception as err:
            log.exception("%s of %s failed", action, e.key)
            self.failed.emit(e.key, *describe_error(err, what=f"{action} {e.name}"))

    def _demo(self, e, folder):
        from engine import demo
        from engine.hub.errors import DownloadCancelled

        started, last = time.monotonic(), [0.0]

        def progress(stage: str, done: int, total: int) -> None:
            if self._cancel.is_set():
                raise DownloadCancelled(f"download of {e.name} cancelled")
            now = time.monotonic()
            if now - last[0] < 0.1 and done < total:
                return
            last[0] = now
            speed = done / max(now - started, 1e-6)
            self.progress.emit({"key": e.key, "file": f"{demo.FILE_NAME} ({stage})", "file_done": done,
                                "file_total": total, "done": done, "total": total,
                                "speed": speed, "eta_s": (total - done) / speed if speed else None,
                                "files_done": 0, "files_total": 1})

        return demo.install_demo(folder, on_progress=progress, cancel=self._cancel)

    def _hub(self, e, folder):
        from engine.hub.download import download_model

        def progress(p) -> None:
            self.progress.emit({"key": e.key, "file": p.file, "file_done": p.file_done, "file_total": p.file_total,
                                "done": p.done, "total": p.total, "speed": p.speed, "eta_s": p.eta_s,
                                "files_done": p.files_done, "files_total": p.files_total})

        from engine.catalog import write_generation_defaults

        path = download_model(e.repo, e.revision or "main", folder, files=e.files, on_progress=progress,
                              cancel=self._cancel)
        write_generation_defaults(e, path)
        return path


class DownloadThread:
    def __init__(self):
        self.thread = QThread()
        self.thread.setObjectName("downloads")
        self.worker = DownloadWorker()
        self.worker.moveToThread(self.thread)
        self.thread.start()

    def close(self, timeout_ms: int = 10000) -> bool:
        """Cancel, end the thread and wait at most `timeout_ms`; False if it had not ended (it is then kept alive,
        never destroyed while running: the app exits without it)."""
        self.worker.cancel()
        self.thread.quit()
        if self.thread.wait(max(0, int(timeout_ms))):
            return True
        from app.worker import keep_until_exit

        log.warning("the download thread was still busy %d ms after close", timeout_ms)
        keep_until_exit(self)
        return False
