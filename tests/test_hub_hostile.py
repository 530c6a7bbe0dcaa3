"""engine.hub against a hostile or broken server (tests/hub_server.py faults): every name it sends is checked
before it becomes a path, every retry and listing is bounded, and a folder that cannot be written gives one
sentence. Each test is a regression test for an attack of issue 16; nothing here leaves 127.0.0.1."""

from __future__ import annotations

import errno
import os
import re
import time

import pytest

from engine.hub import download, names, remote, state
from engine.hub.download import DownloadError, download_model, is_installed
from tests import hub_server
from tests.helpers import HUB_BIG as BIG
from tests.helpers import HUB_FILES as FILES
from tests.helpers import HUB_REPO as REPO

LFS_FILE = "model.safetensors"


def tree(root) -> set[str]:
    """Every path under root, relative: what a test compares to prove nothing was written outside `dest`."""
    return {str(p.relative_to(root)) for p in root.rglob("*")}


def patch_sibling(server, path: str, **changes):
    """Rewrite the listing entry of `path` (or add one) in the repo info the server sends."""
    def patch(info: dict) -> dict:
        siblings = [s for s in info["siblings"] if s["rfilename"] != path]
        entry = next((s for s in info["siblings"] if s["rfilename"] == path), {"rfilename": path, "size": 3})
        for key, value in changes.items():
            if isinstance(value, dict) and isinstance(entry.get(key), dict):
                entry = {**entry, key: {**entry[key], **value}}
            else:
                entry = {**entry, key: value}
        return {**info, "siblings": siblings + [entry]}

    server.faults.listing_patch = patch


# --- names and hashes from the server ---------------------------------------------------------------------------

@pytest.mark.parametrize("sha", ["../../../../canary", "../" * 12 + "tmp/x", "/tmp/zerotvm-canary", "ab" * 31,
                                 "g" * 64, "A" * 63, 12345, None])
def test_a_hostile_lfs_hash_never_becomes_a_path(hub, tmp_path, sha):
    patch_sibling(hub, LFS_FILE, lfs={"sha256": sha})
    before = tree(tmp_path)
    with pytest.raises(DownloadError, match=r"lists 'model\.safetensors' with an invalid sha256"):
        download_model(REPO, dest=tmp_path / "m")
    assert tree(tmp_path) == before  # refused while listing: nothing written at all


@pytest.mark.parametrize("blob", ["../../canary", "0" * 39, "0" * 41, "z" * 40, ["a"]])
def test_a_hostile_git_blob_id_is_refused(hub, tmp_path, blob):
    patch_sibling(hub, "config.json", blobId=blob)
    with pytest.raises(DownloadError, match=r"lists 'config\.json' with an invalid git blob id"):
        download_model(REPO, dest=tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("sha", ["../../x", "", "1" * 39, None, 7])
def test_a_hostile_commit_id_is_refused(hub, tmp_path, sha):
    hub.faults.listing_patch = lambda info: {**info, "sha": sha}
    with pytest.raises(DownloadError, match=r"invalid commit id|gave no commit"):
        download_model(REPO, dest=tmp_path / "m")
    assert not (tmp_path / "m").exists()


@pytest.mark.parametrize("name", ["../escape.json", "a/../../escape.json", "/etc/passwd", "C:/Windows/x.json",
                                  "c:x.json", "a\\..\\b.json", "a/./b.json", "a//b.json", "nul\0.json", ""])
@pytest.mark.parametrize("patterns", [None, ["*"]])
def test_a_listing_with_a_traversal_name_is_refused_whole(hub, tmp_path, name, patterns):
    """Such a name never comes from a real Hub (git refuses it), so the whole listing is refused, whether or not
    the entry was selected; before, '../x' was skipped only because it starts with a dot."""
    patch_sibling(hub, name, size=3, blobId="0" * 40)
    before = tree(tmp_path)
    with pytest.raises(DownloadError, match=r"listed a file .* whose name is unsafe .*refusing the whole listing"):
        download_model(REPO, dest=tmp_path / "m", files=patterns)
    assert tree(tmp_path) == before


@pytest.mark.parametrize("name, why", [
    ("con.json", "reserved device name"), ("sub/AUX", "reserved device name"), ("bad\x07bell.json", "U+0007"),
    ("what?.json", "U+003F"), ("trailing.", "ends with a space or a dot"), ("rtl\u202egnp.exe", "U+202E"),
    ("x" * 201 + ".json", "longer than 200 bytes"), ("/".join(["d"] * 33) + ".json", "more than 32 folders"),
])
def test_a_wanted_file_whose_name_no_desktop_accepts_is_refused_by_name(hub, tmp_path, name, why):
    patch_sibling(hub, name, size=3, blobId="0" * 40)
    saved = rf"has a file .* that cannot be saved on this computer \(.*{re.escape(why)}"
    with pytest.raises(DownloadError, match=saved):
        download_model(REPO, dest=tmp_path / "m", files=["*"])
    # The same name in a file that is not selected does not stop the download (a repo may hold Linux-only names).
    dest = download_model(REPO, dest=tmp_path / "n", files=["*.json", "*.safetensors"] if "json" not in name
                          else ["tokenizer.json", "*.safetensors"])
    assert is_installed(dest)


def test_names_that_collide_on_windows_or_macos_are_refused(hub, tmp_path):
    patch_sibling(hub, "CONFIG.json", size=3, blobId="0" * 40)
    with pytest.raises(DownloadError, match=r"lists both 'CONFIG\.json' and 'config\.json'|lists both 'config\.json' "
                                            r"and 'CONFIG\.json'"):
        download_model(REPO, dest=tmp_path / "m", files=["*.json"])
    patch_sibling(hub, "config.json/inner.json", size=3, blobId="0" * 40)
    with pytest.raises(DownloadError, match=r"lists 'config\.json' both as a file and as the folder of"):
        download_model(REPO, dest=tmp_path / "m", files=["*.json", "*/*"])


@pytest.mark.parametrize("size", [-1, 2**60, "12", True, 1.5, None])
def test_a_hostile_size_is_refused(hub, tmp_path, size):
    patch_sibling(hub, "config.json", size=size)
    if size is None:  # no size at all: asked from paths-info, which this server answers right
        assert is_installed(download_model(REPO, dest=tmp_path / "m"))
        return
    with pytest.raises(DownloadError, match=r"lists 'config\.json' with an invalid size"):
        download_model(REPO, dest=tmp_path / "m")


def test_lfs_size_that_disagrees_with_the_file_size_is_refused(hub, tmp_path):
    patch_sibling(hub, LFS_FILE, lfs={"size": 5})
    with pytest.raises(DownloadError, match=r"lists 'model\.safetensors' with two different sizes"):
        download_model(REPO, dest=tmp_path / "m")


@pytest.mark.parametrize("repo_id", ["../etc", "acme/..", "a/b/c", "acme--x/y", "acme/x.git", "ünï/cödé", "/abs",
                                     "acme/con", "", "acme/" + "x" * 100])
def test_repo_ids_are_checked_before_any_request(hub, tmp_path, repo_id):
    n = len(hub.requests)
    with pytest.raises(DownloadError, match=r"repo id|reserved device"):
        download_model(repo_id, dest=tmp_path / "m")
    with pytest.raises(DownloadError):
        download.default_dest(repo_id)
    assert len(hub.requests) == n and not (tmp_path / "m").exists()


def test_staged_paths_refuse_hostile_parts_whoever_calls(tmp_path):
    for rel, etag in [("../x", "a" * 64), ("a", "../../" + "a" * 58), ("a", "size../1"), ("/abs", "a" * 40)]:
        with pytest.raises(DownloadError, match="not a safe file name"):
            state.staged_path(tmp_path, rel, etag, "part")
    outside = tmp_path / "outside"
    outside.mkdir()
    (state.staging_dir(tmp_path / "m") / "files").mkdir(parents=True)
    (state.staging_dir(tmp_path / "m") / "files" / "sub").symlink_to(outside)  # a link planted in our staging
    with pytest.raises(DownloadError, match="outside"):
        state.staged_path(tmp_path / "m", "sub/x.bin", "a" * 64, "part")
    assert state.safe_child(tmp_path / "m", ".zerotvm-partial/files/sub/x") is None


def test_stale_version_clean_up_deletes_only_staged_copies_of_that_file(hub, tmp_path):
    dest = tmp_path / "m"
    files = state.staging_dir(dest) / "files"
    files.mkdir(parents=True)
    (dest / state.MARKER.replace(".json", "-x.json")).write_text("x")
    keep = {"config.json.notes.txt": b"mine", "config.json.abc.part": b"not an etag", "other.json.0123.ok": b"x",
            "config.json." + "0" * 20 + ".part.bak": b"x"}
    for name, data in keep.items():
        (files / name).write_bytes(data)
    stale = files / ("config.json." + "1" * 20 + ".part")  # an older version's partial: the one to delete
    stale.write_bytes(b"old")
    download_model(REPO, dest=dest)
    assert not stale.exists()
    # Staging is removed after success; what it held besides our staged copies is... removed with it. So check
    # the clean-up step itself on a download that stops before the end:
    files.mkdir(parents=True)
    for name, data in keep.items():
        (files / name).write_bytes(data)
    stale.write_bytes(b"old")
    hub.repos[REPO].update({**FILES, "config.json": b'{"changed": 1}\n'})
    hub.faults.status_always["config.json"] = 404  # the changed file: cleaned up, then its fetch fails
    with pytest.raises(DownloadError):
        download_model(REPO, dest=dest, retries=0)
    assert not stale.exists()
    assert {p.name: p.read_bytes() for p in files.iterdir() if p.name in keep} == keep


# --- retry and time budgets -------------------------------------------------------------------------------------

def test_a_server_that_cuts_every_answer_short_is_given_up_on(hub, tmp_path):
    """8,730 requests in 40 s were seen before: progress reset the failure count. Now a file has
    FILE_REQUESTS_BASE + size // FILE_REQUEST_CREDIT_BYTES requests, whatever arrives."""
    hub.faults.cut_every[LFS_FILE] = 20_000
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match=r"gave up on model\.safetensors of repo acme/tiny-model after 16 requests "
                                            r"\(320,000 of 2,500,000 bytes\).*resumes where it stopped"):
        download_model(REPO, dest=tmp_path / "m")
    assert len(hub.gets(LFS_FILE)) == download.FILE_REQUESTS_BASE == 16
    assert time.monotonic() - t0 < 20
    hub.faults.cut_every.clear()
    assert is_installed(download_model(REPO, dest=tmp_path / "m"))  # and the next call resumes


def test_a_server_that_ignores_range_and_cuts_short_gets_one_clean_restart(hub, tmp_path):
    hub.faults.ignore_range = True
    hub.faults.cut_every[LFS_FILE] = 300_000
    with pytest.raises(DownloadError, match=r"ignored a request to resume \(answered with the whole file\) again for "
                                            r"model\.safetensors of repo acme/tiny-model, after a clean restart"):
        download_model(REPO, dest=tmp_path / "m")
    gets = hub.gets(LFS_FILE)
    assert [g.range_start for g in gets] == [None, 300_000, 300_000]  # first try, the restart, then refused


def test_a_wrong_content_range_is_never_appended(hub, tmp_path):
    hub.faults.wrong_range = True
    hub.faults.drop_after[LFS_FILE] = 400_000  # once: the resume gets a Content-Range one byte off
    dest = download_model(REPO, dest=tmp_path / "m")
    assert (dest / LFS_FILE).read_bytes() == BIG
    assert [g.range_start for g in hub.gets(LFS_FILE)] == [None, 400_000, None]  # restarted from byte 0
    hub.faults.cut_every[LFS_FILE] = 400_000
    with pytest.raises(DownloadError, match=r"answered a request to resume with the wrong bytes \(Content-Range "
                                            r"'bytes 400001-2499999/2500000', expected bytes 400000- of 2500000\)"):
        download_model(REPO, dest=tmp_path / "n")


@pytest.mark.parametrize("header, ok", [
    ("bytes 5-9/10", True), ("bytes 5-9/*", True), ("bytes 4-9/10", False), ("bytes 5-10/11", False),
    ("bytes 5-9/11", False), ("bytes 5-4/10", False), ("bytes */10", False), ("", False), ("items 5-9/10", False),
])
def test_content_range_check(header, ok):
    assert (download._range_problem(header, 5, 10) == "") is ok


def test_a_server_that_answers_500_forever_is_bounded(hub, tmp_path):
    hub.faults.status_always["config.json"] = 500
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match=r"answered HTTP 500 for config\.json of repo acme/tiny-model; try again"):
        download_model(REPO, dest=tmp_path / "m", retries=3)
    assert len(hub.gets("config.json")) == 4 and time.monotonic() - t0 < 10


@pytest.mark.slow
def test_a_trickling_server_hits_the_time_budget(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(download, "FILE_TIME_FLOOR_S", 1.0)
    monkeypatch.setattr(download, "FILE_MIN_RATE", 10**9)  # so the budget is the 1 s floor
    hub.faults.trickle_s = 0.02  # 50 bytes a second, each read well inside READ_TIMEOUT_S
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match=r"gave up on \S+ of repo acme/tiny-model after 1(\.\d)? s .* the server is "
                                            r"too slow"):
        download_model(REPO, dest=tmp_path / "m")
    assert time.monotonic() - t0 < 5


def test_a_body_longer_than_the_file_is_cut_at_its_size(hub, tmp_path):
    hub.faults.flood_files.add(LFS_FILE)  # the bytes, then garbage without end and without a Content-Length
    dest = download_model(REPO, dest=tmp_path / "m")
    assert (dest / LFS_FILE).read_bytes() == BIG and is_installed(dest)
    _wait_for_floods(hub, 1)
    assert hub.flood_sent[0] < hub_server.FLOOD_BYTES // 4


# --- listings and error bodies ----------------------------------------------------------------------------------

def test_an_endless_listing_is_capped(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "MAX_LISTING_BYTES", 4 * 1024**2)
    hub.faults.flood_listing = True
    with pytest.raises(DownloadError, match=r"sent a repo listing longer than 4,194,304 bytes; refusing it"):
        download_model(REPO, dest=tmp_path / "m")
    _wait_for_floods(hub, 1)
    assert hub.flood_sent[0] < hub_server.FLOOD_BYTES // 2
    assert not (tmp_path / "m").exists()


def test_listing_caps_count_files_and_nesting(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(remote, "MAX_REPO_FILES", 4)
    with pytest.raises(DownloadError, match=r"lists 5 files, more than the 4 a model download accepts"):
        download_model(REPO, dest=tmp_path / "m")
    monkeypatch.setattr(remote, "MAX_REPO_FILES", 25_000)
    for raw, why in [(b'{"sha": ' + b"[" * 100_000 + b"]" * 100_000 + b"}", "nested too deeply"),
                     (b"\x89PNG not json", "'utf-8' codec can't decode"), (b'["a list"]', None)]:
        hub.faults.listing_raw = raw
        with pytest.raises(DownloadError, match=rf"sent a repo listing that is not (valid JSON \({why}|a JSON object)"):
            download_model(REPO, dest=tmp_path / "m")


def test_an_endless_error_body_is_not_read_to_the_end(hub, tmp_path):
    hub.faults.flood_errors = True
    hub.faults.status_always["config.json"] = 500
    with pytest.raises(DownloadError, match=r"answered HTTP 500 for config\.json"):
        download_model(REPO, dest=tmp_path / "m", retries=1)
    _wait_for_floods(hub, 2)
    assert all(sent < hub_server.FLOOD_BYTES // 4 for sent in hub.flood_sent), hub.flood_sent  # it hung up early


def _wait_for_floods(server, n: int) -> None:
    """The server notes a flood's size when the client hangs up; wait (bounded) until it did."""
    end = time.monotonic() + 10
    while len(server.flood_sent) < n and time.monotonic() < end:
        time.sleep(0.01)
    assert len(server.flood_sent) >= n


def test_redirects_to_other_schemes_and_loops_are_refused(hub, tmp_path):
    hub.faults.redirect["config.json"] = "file:///etc/passwd"
    with pytest.raises(DownloadError, match=r"sent config\.json of repo acme/tiny-model to 'file:///etc/passwd', "
                                            r"which is not a secure web address"):
        download_model(REPO, dest=tmp_path / "m")
    hub.faults.redirect["config.json"] = f"/{REPO}/resolve/main/config.json"  # to itself, forever
    t0 = time.monotonic()
    with pytest.raises(DownloadError, match=r"redirected config\.json of repo acme/tiny-model too many times \(a "
                                            r"redirect loop\)"):
        download_model(REPO, dest=tmp_path / "m")
    assert time.monotonic() - t0 < 10


# --- the disk ---------------------------------------------------------------------------------------------------

def test_a_file_in_the_way_of_the_models_folder_is_one_sentence(hub, tmp_path):
    (tmp_path / "models").write_text("not a folder")
    with pytest.raises(DownloadError, match=r"^cannot download acme/tiny-model: a file is in the way of the folder "):
        download_model(REPO, dest=tmp_path / "models" / "m")


@pytest.mark.parametrize("code, sentence", [
    (errno.EACCES, r"no permission to write in the folder .*; choose a folder you can write to"),
    (errno.EROFS, r"the folder .* is on a read-only disk; choose a folder on a writable disk"),
    (errno.ENOSPC, r"the disk holding the folder .* is full; free some space and try again; the download resumes"),
])
def test_a_read_only_or_full_disk_is_one_sentence(hub, tmp_path, monkeypatch, code, sentence):
    """Simulated (the tests may run as root, which no chmod stops): the OSError a write raises there."""
    real_open = open

    def failing_open(path, mode="r", *args, **kwargs):
        if "a" in mode or "w" in mode:
            raise OSError(code, os.strerror(code), str(path))
        return real_open(path, mode, *args, **kwargs)

    monkeypatch.setattr(download, "open", failing_open, raising=False)
    with pytest.raises(DownloadError, match=rf"^cannot download acme/tiny-model: {sentence}"):
        download_model(REPO, dest=tmp_path / "m")


def test_names_module_accepts_what_real_repos_hold():
    for ok in ["config.json", "model-00001-of-00004.safetensors", "onnx/model_q4.onnx", "tokenizer.model",
               "Qwen3 4B (final)/model.gguf", "日本語/モデル.bin", "a.b.c/d-e_f.json"]:
        assert names.name_problem(ok) is None, ok
    for ok in ["acme/tiny-model", "Qwen/Qwen3-0.6B", "gpt2", "mlx-community/Llama-3.2-1B-Instruct-4bit"]:
        assert names.check_repo_id(ok) == ok
