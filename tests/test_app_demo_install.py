"""The app's download thread installs the demo model through engine.demo (tests/hub_server.py stands in for PyPI):
the progress it hands the window, the finished signal, a failure as one dialog sentence, and a cancel that ends a
download stalled on a silent connection at once."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("PySide6", reason="the app's download worker is a Qt object")

from app.downloads import DownloadWorker  # noqa: E402
from engine import catalog, demo  # noqa: E402
from tests.helpers import DEMO_TEST_MEMBER  # noqa: E402

pytestmark = pytest.mark.app


def _run(worker, models):
    seen = {"progress": [], "finished": [], "failed": [], "cancelled": []}
    worker.progress.connect(seen["progress"].append)
    worker.finished.connect(lambda *a: seen["finished"].append(a))
    worker.failed.connect(lambda *a: seen["failed"].append(a))
    worker.cancelled.connect(lambda *a: seen["cancelled"].append(a))
    e = next(x for x in catalog.load_catalog() if x.is_demo)
    worker.start(e.to_dict(), str(models))  # on this thread: the signals arrive directly
    return e, seen


def test_the_window_gets_download_then_extract_progress_and_the_installed_path(demo_server, tmp_path):
    e, seen = _run(DownloadWorker(), tmp_path)
    assert seen["failed"] == [] and seen["finished"] == [(e.key, str(tmp_path / demo.FILE_NAME))]
    assert (tmp_path / demo.FILE_NAME).read_bytes() == DEMO_TEST_MEMBER
    stages = [p["file"] for p in seen["progress"]]
    assert stages[0] == f"{demo.FILE_NAME} (download)" and stages[-1] == f"{demo.FILE_NAME} (extract)"
    last = seen["progress"][-1]
    assert last["key"] == e.key and last["done"] == last["total"] == demo.FILE_SIZE


def test_a_failed_download_is_one_dialog_sentence(demo_server, tmp_path):
    demo_server.faults.corrupt[demo_server.file_name] = 1
    e, seen = _run(DownloadWorker(), tmp_path)
    ((key, title, message),) = seen["failed"]
    assert key == e.key and "failed its checksum" in message and "\n" not in message
    assert seen["finished"] == [] and not demo.is_installed(tmp_path)


def test_cancel_from_the_gui_thread_ends_a_stalled_download_at_once(demo_server, tmp_path):
    demo_server.faults.stall[demo_server.file_name] = (100_000, 10.0)
    worker = DownloadWorker()
    threading.Timer(0.5, worker.cancel).start()
    started = time.monotonic()
    e, seen = _run(worker, tmp_path)
    assert seen["cancelled"] == [(e.key,)] and seen["failed"] == []
    assert time.monotonic() - started < 2.0 and not demo.is_installed(tmp_path)
