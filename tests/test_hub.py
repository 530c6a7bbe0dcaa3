"""engine.hub: downloads from a local Hub stand-in (tests/hub_server.py); no test reaches the internet."""

from __future__ import annotations

import collections
import hashlib
import json
import threading
import time

import keyring
import pytest
from huggingface_hub import HfApi, constants
from huggingface_hub.errors import OfflineModeIsEnabled
from huggingface_hub.utils import close_session

from engine.errors import ZeroTVMError
from engine.hub import download, offline, state, token
from engine.hub.download import (
    DownloadCancelled,
    DownloadError,
    DownloadProgress,
    download_model,
    is_installed,
    remove_model,
    verify_installed,
)
from engine.hub.errors import TokenError
from engine.hub.progress import Tracker
from tests.helpers import HUB_BIG as BIG
from tests.helpers import HUB_FILES as FILES
from tests.helpers import HUB_REPO as REPO
from tests.helpers import HUB_TOKEN as TOKEN
from tests.helpers import no_connections
from tests.hub_server import HubServer

WANTED = {"config.json", "tokenizer.json", "model.safetensors"}


def installed_bytes(dest) -> dict[str, bytes]:
    return {p: (dest / p).read_bytes() for p in WANTED}


def served(server: HubServer, file: str) -> int:
    """Body bytes of `file` the server sent or started to send (from the Range start to the end)."""
    return sum(len(FILES[file]) - (r.range_start or 0) for r in server.gets(file))


# --- the happy path ---------------------------------------------------------------------------------------------

def test_download_verifies_marks_installed_and_skips_junk(hub, tmp_path):
    dest = tmp_path / "models" / "tiny"
    calls: list[DownloadProgress] = []
    t0 = time.monotonic()
    assert download_model(REPO, dest=dest, on_progress=calls.append) == dest
    elapsed = time.monotonic() - t0

    assert installed_bytes(dest) == {p: FILES[p] for p in WANTED}
    assert not (dest / ".gitattributes").exists() and not (dest / ".github").exists()
    assert not (dest / state.STAGING).exists()
    marker = json.loads((dest / state.MARKER).read_text())
    assert marker["repo"] == REPO and marker["revision"] == "main" and marker["commit"] == hub.repos[REPO].commit
    assert {f["path"]: (f["size"], f["sha256"]) for f in marker["files"]} == {
        p: (len(FILES[p]), hashlib.sha256(FILES[p]).hexdigest()) for p in WANTED}
    assert is_installed(dest) and verify_installed(dest) == []

    # Throttled: about 10 a second, plus one per finished file; the last one says everything is done.
    assert len(calls) <= 10 * elapsed + 3 + 2
    last = calls[-1]
    assert last.done == last.total == sum(len(FILES[p]) for p in WANTED)
    assert last.files_done == last.files_total == 3
    finals = [c for c in calls if c.file_done == c.file_total and c.file_total]
    assert {c.file for c in finals} == WANTED
    assert all(b.done >= a.done for a, b in zip(calls, calls[1:], strict=False))

    assert all(r.auth is None for r in hub.requests)  # no token stored: anonymous
    # A second call finds it installed: one listing request, no bytes.
    n = len(hub.requests)
    download_model(REPO, dest=dest)
    assert [r.path for r in hub.requests[n:]] == [f"/api/models/{REPO}/revision/main"]


def test_file_patterns_select_files(hub, tmp_path):
    dest = download_model(REPO, dest=tmp_path / "m", files=["*.json"])
    assert sorted(p.name for p in dest.iterdir() if not p.name.startswith(".")) == ["config.json", "tokenizer.json"]
    assert is_installed(dest)
    with pytest.raises(DownloadError, match=r"no file in repo acme/tiny-model at revision main matches \*\.gguf"):
        download_model(REPO, dest=tmp_path / "n", files=["*.gguf"])


def test_sizes_from_paths_info_when_repo_info_has_none(hub, tmp_path):
    hub.faults.no_sizes = True
    dest = download_model(REPO, dest=tmp_path / "m")
    assert installed_bytes(dest) == {p: FILES[p] for p in WANTED}
    assert any("/paths-info/" in r.path for r in hub.requests)


def test_progress_tracker_throttles_and_smooths_speed():
    now = [0.0]
    calls: list[DownloadProgress] = []
    tracker = Tracker(calls.append, total=12_000_000, files_total=2, done=2_000_000, files_done=1,
                      clock=lambda: now[0])
    tracker.start_file("big.bin", 10_000_000, have=0)
    for _ in range(800):  # 8 s at 1 MB/s, in 10 KB chunks every 10 ms
        now[0] += 0.01
        tracker.advance(10_000)
    assert 75 <= len(calls) <= 82  # about 10 a second, not 800
    assert abs(calls[5].speed - 1e6) < 1e5  # right from the start (warm-up average)
    assert abs(calls[-1].speed - 1e6) < 1e4
    assert calls[-1].done >= 9_900_000 and abs(calls[-1].eta_s - (12e6 - calls[-1].done) / 1e6) < 0.05
    now[0] += 0.001
    tracker.finish_file()  # always reported, however soon
    last = calls[-1]
    assert (last.file_done, last.done, last.files_done) == (10_000_000, 12_000_000, 2)


# --- resume -----------------------------------------------------------------------------------------------------

def test_dropped_connection_resumes_from_partial_bytes(hub, tmp_path):
    hub.faults.drop_after["model.safetensors"] = 1_000_000
    dest = download_model(REPO, dest=tmp_path / "m")
    gets = hub.gets("model.safetensors")
    assert [g.range_start for g in gets] == [None, 1_000_000]
    assert hashlib.sha256((dest / "model.safetensors").read_bytes()).hexdigest() == hashlib.sha256(BIG).hexdigest()
    assert is_installed(dest)


def test_restart_resumes_a_partial_left_by_an_earlier_process(hub, tmp_path):
    dest = tmp_path / "m"
    hub.faults.drop_after["model.safetensors"] = 1_200_000
    with pytest.raises(DownloadError, match=r"connection to 127\.0\.0\.1:\d+ failed .*resumes where it stopped"):
        download_model(REPO, dest=dest, retries=0)
    assert not is_installed(dest) and not (dest / "model.safetensors").exists()
    assert not (dest / "config.json").exists()  # staged files are not in place until all of them verified
    partial = next((dest / state.STAGING).rglob("model.safetensors.*.part"))
    assert partial.stat().st_size == 1_200_000

    close_session()  # a new process: no connection, no memory of the first attempt
    download_model(REPO, dest=dest)
    assert hub.gets("model.safetensors")[-1].range_start == 1_200_000
    assert served(hub, "model.safetensors") == len(BIG) + (len(BIG) - 1_200_000)  # first try + the rest
    assert installed_bytes(dest)["model.safetensors"] == BIG and is_installed(dest)


def test_server_that_ignores_range_still_gives_a_correct_file(hub, tmp_path):
    hub.faults.drop_after["model.safetensors"] = 700_000
    hub.faults.ignore_range = True
    dest = download_model(REPO, dest=tmp_path / "m")
    assert installed_bytes(dest)["model.safetensors"] == BIG and is_installed(dest)


def test_transient_server_errors_are_retried_then_reported(hub, tmp_path):
    hub.faults.status["config.json"] = [503, 502]
    dest = download_model(REPO, dest=tmp_path / "m")
    assert is_installed(dest)
    hub.faults.status["tokenizer.json"] = [503] * 10
    with pytest.raises(DownloadError, match=r"answered HTTP 503 for tokenizer\.json of repo acme/tiny-model"):
        download_model(REPO, dest=tmp_path / "n", retries=2)
    assert len(hub.gets("tokenizer.json")) == 1 + 3  # the first download, then 1 try + 2 retries


def test_expired_cdn_link_is_fetched_again_not_reported_as_a_token_problem(hub, tmp_path):
    hub.faults.status["model.safetensors"] = [403]  # the CDN refuses its signed URL once
    dest = download_model(REPO, dest=tmp_path / "m")
    assert is_installed(dest)
    heads = [r for r in hub.requests if r.method == "HEAD" and r.file == "model.safetensors"]
    assert len(heads) == 2 and len(hub.gets("model.safetensors")) == 2


# --- integrity --------------------------------------------------------------------------------------------------

def test_corrupted_bytes_are_detected_and_fetched_again(hub, tmp_path):
    hub.faults.corrupt["model.safetensors"] = 1  # LFS: sha256
    hub.faults.corrupt["config.json"] = 1  # not LFS: git blob sha1
    dest = download_model(REPO, dest=tmp_path / "m")
    assert installed_bytes(dest) == {p: FILES[p] for p in WANTED}
    assert len(hub.gets("model.safetensors")) == 2 and len(hub.gets("config.json")) == 2


def test_corruption_that_persists_fails_naming_the_file(hub, tmp_path):
    hub.faults.corrupt["model.safetensors"] = 99
    dest = tmp_path / "m"
    with pytest.raises(DownloadError, match=r"model\.safetensors of repo acme/tiny-model failed its integrity "
                                            r"check 3 times \(sha256 "):
        download_model(REPO, dest=dest)
    assert not is_installed(dest) and not list((dest / state.STAGING).rglob("model.safetensors.*"))


def test_verify_finds_a_damaged_file_and_download_repairs_only_it(hub, tmp_path):
    dest = download_model(REPO, dest=tmp_path / "m")
    damaged = bytearray(BIG)
    damaged[12345] ^= 1
    (dest / "model.safetensors").write_bytes(bytes(damaged))
    assert is_installed(dest)  # same size: the cheap check cannot tell
    seen = []
    assert verify_installed(dest, on_progress=lambda d, t: seen.append((d, t))) == ["model.safetensors"]
    assert seen[-1][0] == seen[-1][1]
    assert not is_installed(dest)
    n = len(hub.gets("model.safetensors")) + len(hub.gets("config.json"))
    download_model(REPO, dest=dest)
    assert len(hub.gets("model.safetensors")) + len(hub.gets("config.json")) == n + 1
    assert is_installed(dest) and verify_installed(dest) == []


def test_new_commit_fetches_changed_files_and_drops_stale_ones(hub, tmp_path):
    dest = download_model(REPO, dest=tmp_path / "m")
    files = dict(FILES)
    files["config.json"] = b'{"model_type": "llama", "hidden_size": 128}\n'
    del files["tokenizer.json"]
    hub.repos[REPO].update(files)
    big_gets = len(hub.gets("model.safetensors"))
    download_model(REPO, dest=dest)
    assert (dest / "config.json").read_bytes() == files["config.json"]
    assert not (dest / "tokenizer.json").exists()
    assert len(hub.gets("model.safetensors")) == big_gets  # unchanged bytes are not fetched again
    assert json.loads((dest / state.MARKER).read_text())["commit"] == hub.repos[REPO].commit
    assert is_installed(dest)


# --- access and errors ------------------------------------------------------------------------------------------

def test_gated_repo_needs_the_keyring_token(hub, tmp_path, memory_keyring):
    hub.add_repo("acme/gated", FILES, gated=True)
    dest = tmp_path / "g"
    with pytest.raises(DownloadError, match=r"acme/gated needs a Hugging Face token \(gated or private repo\): "
                                            r"run `zerotvm token set`"):
        download_model("acme/gated", dest=dest)
    assert not dest.exists()  # refused before any byte was written

    keyring.set_password("zerotvm", "huggingface-token", TOKEN)  # keyring's own API
    download_model("acme/gated", dest=dest)
    assert is_installed(dest)
    hub_reqs = [r for r in hub.requests if r.server == "hub" and "acme/gated" in r.path]
    assert hub_reqs[-1].auth == f"Bearer {TOKEN}"
    assert all(r.auth is None for r in hub.requests if r.server == "cdn")  # never sent to the CDN

    with pytest.raises(DownloadError, match="needs a Hugging Face token"):  # token=False: anonymous
        download_model("acme/gated", dest=tmp_path / "anon", token=False)
    with pytest.raises(DownloadError, match=r"token was refused \(invalid or expired\)"):
        download_model("acme/gated", dest=tmp_path / "bad", token="hf_wrong")


def test_private_repo_without_token(hub, tmp_path):
    hub.add_repo("acme/private", FILES, private=True)
    with pytest.raises(DownloadError, match=r"no repo acme/private at revision main on Hugging Face, or it is "
                                            r"private: if it is, run `zerotvm token set`"):
        download_model("acme/private", dest=tmp_path / "p")
    assert is_installed(download_model("acme/private", dest=tmp_path / "p", token=TOKEN))


def test_missing_repo_and_revision(hub, tmp_path):
    with pytest.raises(DownloadError, match=r"^no repo acme/nope at revision main on Hugging Face$"):
        download_model("acme/nope", dest=tmp_path / "x")
    with pytest.raises(DownloadError, match=r"no repo acme/tiny-model at revision v9 on Hugging Face"):
        download_model(REPO, "v9", dest=tmp_path / "x")
    assert not (tmp_path / "x").exists()


def test_unreachable_hub_and_dns_failure(hub, tmp_path, monkeypatch):
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match=rf"^cannot reach 127\.0\.0\.1:{port} \(offline\?\)$"):
        download_model(REPO, dest=tmp_path / "x", endpoint=f"http://127.0.0.1:{port}")
    assert time.monotonic() - t0 < 5  # no backoff when the very first request cannot connect

    with no_connections() as attempts:  # DNS fails as it does offline
        with pytest.raises(DownloadError, match=r"^cannot reach huggingface\.co \(offline\?\)$"):
            download_model(REPO, dest=tmp_path / "x", endpoint="https://huggingface.co")
    assert attempts == ["huggingface.co"]
    assert not (tmp_path / "x").exists()


def test_not_enough_disk_space_writes_nothing(hub, tmp_path, monkeypatch):
    usage = collections.namedtuple("usage", "total used free")
    monkeypatch.setattr(download.shutil, "disk_usage", lambda path: usage(10**12, 10**12 - 50_000_000, 50_000_000))
    dest = tmp_path / "m"
    with pytest.raises(DownloadError, match=r"not enough disk space at .*: need 0\.\d\d GB more, 0\.05 GB free"):
        download_model(REPO, dest=dest)
    assert not dest.exists() and not hub.gets("model.safetensors")


def test_errors_are_zerotvm_errors():
    assert issubclass(DownloadError, ZeroTVMError) and issubclass(DownloadCancelled, ZeroTVMError)
    assert issubclass(TokenError, ZeroTVMError)


# --- cancel -----------------------------------------------------------------------------------------------------

def _download_in_thread(dest, cancel, calls):
    box = {}

    def run():
        try:
            box["result"] = download_model(REPO, dest=dest, cancel=cancel, on_progress=calls.append)
        except BaseException as e:  # noqa: B036 - handed to the test thread
            box["error"] = e
        box["t"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def _wait_for(predicate, timeout=10.0):
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.01)


def test_cancel_on_a_slow_server_then_resume(hub, tmp_path):
    hub.faults.chunk_delay_s = 0.02  # ~800 KB/s: the 2.5 MB file takes about 3 s
    dest, cancel, calls = tmp_path / "m", threading.Event(), []
    thread, box = _download_in_thread(dest, cancel, calls)
    _wait_for(lambda: any(c.file == "model.safetensors" and c.file_done > 200_000 for c in calls))
    t0 = time.monotonic()
    cancel.set()
    thread.join(5)
    assert isinstance(box.get("error"), DownloadCancelled), box
    assert box["t"] - t0 < 1.0
    assert "resumes where it stopped" in str(box["error"])
    assert not is_installed(dest) and not (dest / "model.safetensors").exists()
    part = next((dest / state.STAGING).rglob("model.safetensors.*.part")).stat().st_size
    assert 0 < part < len(BIG)
    assert any(c.speed > 0 and c.eta_s is not None and c.eta_s > 0 for c in calls)

    hub.faults.chunk_delay_s = 0
    download_model(REPO, dest=dest)
    assert hub.gets("model.safetensors")[-1].range_start == part
    assert installed_bytes(dest)["model.safetensors"] == BIG and is_installed(dest)


def test_cancel_while_the_connection_is_silent(hub, tmp_path):
    hub.faults.stall["model.safetensors"] = (300_000, 30.0)  # the server goes quiet mid-file
    dest, cancel, calls = tmp_path / "m", threading.Event(), []
    thread, box = _download_in_thread(dest, cancel, calls)
    _wait_for(lambda: hub.gets("model.safetensors"))
    time.sleep(0.5)  # the first 300 KB came at once; now it is blocked in a read with no data coming
    t0 = time.monotonic()
    cancel.set()
    thread.join(5)
    assert isinstance(box.get("error"), DownloadCancelled), box
    assert box["t"] - t0 < 1.0  # the read was woken up, not left to time out (READ_TIMEOUT_S)
    assert not is_installed(dest)
    assert next((dest / state.STAGING).rglob("model.safetensors.*.part")).stat().st_size >= 300_000


def test_cancel_while_waiting_for_the_repo_listing(hub, tmp_path):
    hub.faults.api_delay_s = 10.0
    dest, cancel, calls = tmp_path / "m", threading.Event(), []
    thread, box = _download_in_thread(dest, cancel, calls)
    _wait_for(lambda: any(r.path.startswith("/api/models/") for r in hub.requests))
    t0 = time.monotonic()
    cancel.set()
    thread.join(5)
    assert isinstance(box.get("error"), DownloadCancelled), box
    assert box["t"] - t0 < 1.0 and not dest.exists()


# --- offline ----------------------------------------------------------------------------------------------------

def test_zerotvm_offline_refuses_without_touching_the_network(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTVM_OFFLINE", "1")
    assert offline.offline()
    n = len(hub.requests)
    with no_connections() as attempts:
        with pytest.raises(DownloadError, match=r"^offline mode is on \(ZEROTVM_OFFLINE=1\): cannot download"):
            download_model(REPO, dest=tmp_path / "m")
    assert attempts == [] and len(hub.requests) == n and not (tmp_path / "m").exists()


def test_hf_hub_offline_refuses(hub, tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(DownloadError, match=r"offline mode is on \(HF_HUB_OFFLINE=1\)"):
        download_model(REPO, dest=tmp_path / "m")
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # as huggingface_hub read it at import
    with pytest.raises(DownloadError, match="offline mode is on"):
        download_model(REPO, dest=tmp_path / "m")


def test_no_network_blocks_huggingface_hub_in_this_thread_only(hub, tmp_path):
    api = HfApi(endpoint=hub.endpoint)
    other = {}
    with offline.no_network():
        with offline.no_network():  # nests
            assert offline.offline_reason() == "no_network() is active"
        with pytest.raises(OfflineModeIsEnabled):
            api.model_info(REPO)
        with pytest.raises(DownloadError, match="offline mode is on"):
            download_model(REPO, dest=tmp_path / "m")
        # A download running in another thread (the app's background download) is not affected.
        t = threading.Thread(target=lambda: other.update(sha=api.model_info(REPO).sha))
        t.start()
        t.join(10)
    assert other["sha"] == hub.repos[REPO].commit
    assert not offline.offline()
    assert api.model_info(REPO).sha == hub.repos[REPO].commit


# --- folders ----------------------------------------------------------------------------------------------------

def test_remove_model_only_removes_our_folders(hub, tmp_path):
    mine = tmp_path / "own-stuff"
    mine.mkdir()
    (mine / "notes.txt").write_text("keep me")
    with pytest.raises(DownloadError, match="refusing to delete"):
        remove_model(mine)
    assert (mine / "notes.txt").exists()
    with pytest.raises(DownloadError, match="is not empty and was not made by a Zero-TVM download"):
        download_model(REPO, dest=mine)

    dest = download_model(REPO, dest=tmp_path / "m")
    with pytest.raises(DownloadError, match="already holds repo acme/tiny-model"):
        download_model("acme/other", dest=dest)
    remove_model(dest)
    assert not dest.exists()

    partial = tmp_path / "partial"
    hub.faults.drop_after["model.safetensors"] = 500_000
    with pytest.raises(DownloadError):
        download_model(REPO, dest=partial, retries=0)
    from filelock import FileLock

    with FileLock(str(partial / state.STAGING / "lock")):  # as a download running in another process holds it
        with pytest.raises(DownloadError, match="is being downloaded right now"):
            remove_model(partial)
        with pytest.raises(DownloadError, match="already being downloaded"):
            download_model(REPO, dest=partial)
    remove_model(partial)
    assert not partial.exists()
    remove_model(tmp_path / "never-existed")  # nothing to do


# --- token ------------------------------------------------------------------------------------------------------

def test_token_set_get_clear(memory_keyring):
    assert token.get_token() is None
    token.set_token(f"  {TOKEN}\n")
    assert token.get_token() == TOKEN
    assert memory_keyring.passwords == {("zerotvm", "huggingface-token"): TOKEN}
    with pytest.raises(TokenError, match="empty"):
        token.set_token("   ")
    with pytest.raises(TokenError, match="spaces"):
        token.set_token("hf_abc def")
    assert token.resolve_token(None) == TOKEN and token.resolve_token(True) == TOKEN
    assert token.resolve_token(False) is False and token.resolve_token("hf_x") == "hf_x"
    token.clear_token()
    token.clear_token()  # twice is fine
    assert token.get_token() is None


def test_token_without_a_keyring_backend_says_use_hf_token(monkeypatch):
    from keyring.backends import fail

    previous = keyring.get_keyring()
    keyring.set_keyring(fail.Keyring())
    try:
        with pytest.raises(TokenError, match="cannot store the Hugging Face token.*HF_TOKEN environment variable") as e:
            token.set_token(TOKEN)
        assert TOKEN not in str(e.value)
        assert token.get_token() is None
        token.clear_token()
        monkeypatch.setenv("HF_TOKEN", "hf_from_env")
        assert token.resolve_token(None) == "hf_from_env"
    finally:
        keyring.set_keyring(previous)


def test_token_never_appears_in_logs_or_errors(hub, tmp_path, caplog):
    import logging

    caplog.set_level(logging.DEBUG)
    hub.add_repo("acme/gated", FILES, gated=True)
    hub.faults.drop_after["model.safetensors"] = 100_000
    download_model("acme/gated", dest=tmp_path / "g", token=TOKEN)
    with pytest.raises(DownloadError) as e:
        download_model("acme/nope", dest=tmp_path / "x", token=TOKEN)
    assert TOKEN not in caplog.text and TOKEN not in str(e.value)
