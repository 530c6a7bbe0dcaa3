"""download_model(): a Hugging Face repo (or the files of it that match some patterns) into a folder, resumable,
verified, cancellable, with throttled progress.

huggingface_hub lists the repo (sizes, LFS sha256, commit), builds the URLs and auth headers, answers the HEAD
that finds each file's bytes (the token never follows a redirect to a CDN) and owns the HTTP session (TLS
verification, proxies, its offline switch). The bytes we stream ourselves: hf_hub_download (2.x) writes to a
per-process temporary file that it deletes on any failure, so it cannot resume after a cancel or a restart,
and it reads 10 MB at a time, too coarse for progress and cancel. Nothing counts as installed until every
file matched its size and hash and the marker is written (see state.py for the layout).
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import re
import shutil
import socket
import threading
import time
from pathlib import Path, PurePosixPath

from huggingface_hub.utils import get_session
from huggingface_hub.utils import httpx as _httpx  # httpx2 on huggingface_hub 2.x

from engine.hub import names, remote, state
from engine.hub.errors import DownloadCancelled, DownloadError
from engine.hub.offline import offline_reason
from engine.hub.progress import DownloadProgress, Tracker
from engine.hub.remote import RemoteFile
from engine.hub.state import is_installed, remove_model, verify_installed
from engine.hub.token import resolve_token
from engine.paths import describe_os_error, models_dir

__all__ = ["download_model", "default_dest", "is_installed", "verify_installed", "remove_model",
           "DownloadProgress", "DownloadError", "DownloadCancelled"]

log = logging.getLogger(__name__)

# Free space wanted beyond the missing bytes: 5% of them + 200 MB, for the filesystem and whatever else writes.
DISK_MARGIN_FRACTION = 0.05
DISK_MARGIN_BYTES = 200 * 1024**2
BACKOFF_BASE_S = 1.0  # waits 1, 2, 4, 8... s between failed attempts that received nothing
BACKOFF_MAX_S = 30.0
VERIFY_ATTEMPTS = 3  # a file whose hash does not match is fetched again twice, then the download fails
# Per file, a budget that bytes arriving never reset: a server that cuts every answer short, or trickles,
# ends in an error instead of a loop. 16 requests plus one per 4 MiB lets a flaky line drop a 10 GB file
# 2,500 times; the time allows 10 minutes or an average of 32 KB/s, whichever is longer.
FILE_REQUESTS_BASE = 16
FILE_REQUEST_CREDIT_BYTES = 4 * 1024**2
FILE_TIME_FLOOR_S = 600.0
FILE_MIN_RATE = 32 * 1024
RANGE_RESTARTS = 1  # a server that ignores Range (or answers the wrong range) gets one clean restart per file
READ_TIMEOUT_S = 30.0  # a connection silent this long is dropped and resumed
CANCEL_POLL_S = 0.1


def default_dest(repo_id: str) -> Path:
    """models_dir()/<repo name>, the folder the library lists."""
    return models_dir() / names.check_repo_id(repo_id).split("/")[-1]


class _Incomplete(ConnectionError):
    """The body ended early or the server answered a Range oddly: resume with a fresh request."""


class _FileBudget:
    """Requests and wall time one file may use in one download_model call (see FILE_REQUESTS_BASE)."""

    def __init__(self, rf: RemoteFile, repo_id: str):
        self.rf, self.repo_id = rf, repo_id
        self.max_requests = FILE_REQUESTS_BASE + rf.size // FILE_REQUEST_CREDIT_BYTES
        self.started = time.monotonic()
        self.seconds = max(FILE_TIME_FLOOR_S, rf.size / FILE_MIN_RATE)
        self.requests = 0
        self.range_restarts = 0

    def remaining_s(self) -> float:
        return self.started + self.seconds - time.monotonic()

    def request(self, have: int) -> None:
        if self.requests >= self.max_requests:
            raise DownloadError(f"gave up on {self.rf.path} of repo {self.repo_id} after {self.requests} requests "
                                f"({have:,} of {self.rf.size:,} bytes): the server keeps ending the transfer early; "
                                "try again later (the download resumes where it stopped)")
        self.check_time(have)
        self.requests += 1

    def check_time(self, have: int) -> None:
        if self.remaining_s() < 0:
            from engine.humanize import human_duration

            took = human_duration(self.seconds)
            raise DownloadError(f"gave up on {self.rf.path} of repo {self.repo_id} after {took} ({have:,} of "
                                f"{self.rf.size:,} bytes): the server is too slow; try again later (the download "
                                "resumes where it stopped)")


def _check_folder(dest: Path, repo_id: str) -> None:
    """Only ever write into a new/empty folder or one that a download of the same repo made."""
    if dest.is_symlink() or (dest.exists() and not dest.is_dir()):
        raise DownloadError(f"cannot download {repo_id} into {dest}: it exists and is not a folder")
    if not dest.is_dir():
        return
    for holder in (state.read_marker(dest), state.read_json(state.staging_dir(dest) / "state.json")):
        if holder and holder.get("repo") and str(holder["repo"]).lower() != repo_id.lower():
            raise DownloadError(f"{dest} already holds repo {holder['repo']}; remove it or choose another folder "
                                f"for {repo_id}")
    ours = (dest / state.MARKER).is_file() or state.staging_dir(dest).is_dir()
    if not ours and any(dest.iterdir()):
        raise DownloadError(f"{dest} is not empty and was not made by a Zero-TVM download; choose an empty or "
                            "new folder")


def _free_space_at(path: Path) -> tuple[Path, int]:
    probe = path
    while not probe.exists() and probe.parent != probe:
        probe = probe.parent
    return probe, shutil.disk_usage(probe).free


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB"


def _shutdown(response) -> None:
    """Wake a read blocked on a silent socket (close() from another thread would not)."""
    try:
        stream = response.extensions.get("network_stream")
        sock = stream.get_extra_info("socket") if stream is not None else None
        if sock is not None:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)  # the plain socket's method, also for TLS sockets
    except Exception:  # best effort: the chunk loop still sees the cancel at the next chunk or timeout
        pass


class _Job:
    def __init__(self, repo_id: str, revision: str, dest: Path, ep: str, token: str | bool, retries: int,
                 cancel: threading.Event | None):
        self.repo_id, self.revision, self.dest, self.ep = repo_id, revision, dest, ep
        self.token, self.retries, self.cancel = token, max(0, int(retries)), cancel
        self.commit = ""
        self.tracker: Tracker | None = None
        self.received = 0  # bytes received by this job: tells a failed attempt that made progress
        self.budget: _FileBudget | None = None  # of the file being fetched
        self._response = None
        self._located: dict[str, tuple[str, dict[str, str]]] = {}

    # --- cancel -------------------------------------------------------------------------------------------------
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()

    def check_cancel(self) -> None:
        if self.cancelled():
            raise DownloadCancelled(f"download of {self.repo_id} cancelled; it resumes where it stopped next time")

    def watch_cancel(self, finished: threading.Event) -> None:
        while not finished.wait(CANCEL_POLL_S):
            if self.cancelled():
                response = self._response
                if response is not None:
                    _shutdown(response)

    def interruptible(self, fn):
        """fn() (a metadata request) in a helper thread, so a cancel returns at once even while it waits on a
        silent network; an abandoned request ends by itself within its timeout."""
        if self.cancel is None:
            return fn()
        box: dict = {}
        done = threading.Event()

        def run():
            try:
                box["value"] = fn()
            except BaseException as e:  # handed to the waiting thread
                box["error"] = e
            finally:
                done.set()

        threading.Thread(target=run, daemon=True, name="zerotvm-hub-request").start()
        while not done.wait(CANCEL_POLL_S):
            self.check_cancel()
        if "error" in box:
            raise box["error"]
        return box["value"]

    # --- retry --------------------------------------------------------------------------------------------------
    def retrying(self, fn, file: str | None = None, fail_fast_on_connect: bool = False):
        """fn() with bounded retries on network errors and 408/429/5xx; the count of failures in a row restarts
        whenever bytes arrived (a file's _FileBudget bounds the total). Backoff waits wake up on cancel. An
        OSError of the disk is not retried: download_model names the folder."""
        failures = 0
        while True:
            self.check_cancel()
            before = self.received
            try:
                return fn()
            except (DownloadError, DownloadCancelled):
                raise
            except Exception as e:
                if remote.is_disk_error(e):
                    raise
                error = e
            self.check_cancel()  # a cancel that broke the connection is a cancel, not a network error
            progressed = self.received > before
            failures = 1 if progressed else failures + 1
            if (not remote.is_transient(error) or failures > self.retries
                    or (fail_fast_on_connect and remote.is_connect_error(error))):
                raise remote.translate(error, repo_id=self.repo_id, revision=self.revision, ep=self.ep,
                                       token_used=bool(self.token), file=file) from error
            delay = 0.0 if progressed else min(BACKOFF_MAX_S, BACKOFF_BASE_S * 2 ** (failures - 1))
            if self.budget is not None and file is not None:
                delay = max(0.0, min(delay, self.budget.remaining_s()))
            log.info("retrying %s of %s in %.1f s after %s", file or "listing", self.repo_id, delay,
                     type(error).__name__)
            if self.cancel is not None:
                self.cancel.wait(delay)
            else:
                time.sleep(delay)

    # --- one file -----------------------------------------------------------------------------------------------
    def locate(self, rf: RemoteFile) -> tuple[str, dict[str, str]]:
        return self.interruptible(lambda: remote.locate(self.repo_id, self.commit, rf.path, self.token, self.ep))

    def fetch(self, rf: RemoteFile) -> None:
        part = state.staged_path(self.dest, rf.path, rf.etag, "part")
        ok = state.staged_path(self.dest, rf.path, rf.etag, "ok")
        part.parent.mkdir(parents=True, exist_ok=True)
        # Staged copies of other versions of this file, and nothing else (part.parent is inside staging: checked).
        stale = state.staged_name_pattern(PurePosixPath(rf.path).name)
        for other in os.listdir(part.parent):
            if stale.fullmatch(other) and other not in (part.name, ok.name) and (part.parent / other).is_file():
                (part.parent / other).unlink(missing_ok=True)
        self.budget = _FileBudget(rf, self.repo_id)
        problem = ""
        for attempt in range(1, VERIFY_ATTEMPTS + 1):
            self._open_hashes(rf, part)
            self.tracker.start_file(rf.path, rf.size, self.have)
            while self.have < rf.size:
                self.retrying(lambda: self._stream(rf, part), file=rf.path)
            problem = self._check(rf)
            if not problem:
                os.replace(part, ok)
                self.tracker.finish_file()
                return
            log.warning("%s of %s: %s (attempt %d), fetching it again", rf.path, self.repo_id, problem, attempt)
            part.unlink(missing_ok=True)
            self.tracker.set_file_done(0)
        raise DownloadError(f"{rf.path} of repo {self.repo_id} failed its integrity check {VERIFY_ATTEMPTS} times "
                            f"({problem}); the bad copy was deleted, try again later")

    def _open_hashes(self, rf: RemoteFile, part: Path) -> None:
        """Hash whatever a previous attempt, cancel or process left in `part`, so only new bytes are fetched."""
        self.sha256 = hashlib.sha256()
        self.sha1 = hashlib.sha1(b"blob %d\0" % rf.size) if rf.git_sha1 else None
        self.have = part.stat().st_size if part.is_file() else 0
        if self.have > rf.size or not part.is_file():
            part.write_bytes(b"")  # also gives an empty file its (empty) copy
            self.have = 0
        if self.have:
            with open(part, "rb") as f:
                while block := f.read(state.HASH_BLOCK):
                    self.check_cancel()
                    self._hash(block)

    def _hash(self, block: bytes) -> None:
        self.sha256.update(block)
        if self.sha1 is not None:
            self.sha1.update(block)

    def _reset(self, rf: RemoteFile, part: Path) -> None:
        part.write_bytes(b"")
        self.sha256 = hashlib.sha256()
        self.sha1 = hashlib.sha1(b"blob %d\0" % rf.size) if rf.git_sha1 else None
        self.have = 0
        self.tracker.set_file_done(0)

    def _stream(self, rf: RemoteFile, part: Path) -> None:
        self.budget.request(self.have)
        url, headers = self._located.pop(rf.path, None) or self.locate(rf)  # signed URLs expire: fresh each try
        if self.have:
            headers = {**headers, "Range": f"bytes={self.have}-"}
        timeout = _httpx.Timeout(READ_TIMEOUT_S, connect=remote.META_TIMEOUT_S)
        with get_session().stream("GET", url, headers=headers, timeout=timeout) as r:
            self._response = r
            try:
                self._read_body(r, rf, part)
            finally:
                self._response = None

    def _read_body(self, r, rf: RemoteFile, part: Path) -> None:
        if r.status_code in (401, 403, 410) and not remote.same_origin(str(r.url), self.ep):
            # A CDN refusing its signed URL (expired during a long stall): the next try asks the Hub for a new one.
            raise _Incomplete(f"the download link for {rf.path} expired (HTTP {r.status_code})")
        if r.status_code == 416:  # our partial is not a prefix the server recognises: start over
            self._range_restart(rf, part, "refused to resume (HTTP 416)")
            raise _Incomplete(f"HTTP 416 for {rf.path}")
        remote.raise_for_status(r, time.monotonic() + max(0.0, self.budget.remaining_s()))
        if self.have and r.status_code == 200:  # the server ignored Range and sends the whole file
            self._range_restart(rf, part, "ignored a request to resume (answered with the whole file)")
        elif r.status_code == 206:
            problem = _range_problem(r.headers.get("Content-Range", ""), self.have, rf.size)
            if problem:
                self._range_restart(rf, part, f"answered a request to resume with {problem}")
                raise _Incomplete(f"{rf.path}: asked for bytes from {self.have}: {problem}")
        elif r.status_code != 200:
            raise _Incomplete(f"{rf.path}: HTTP {r.status_code} instead of the file's bytes")
        with open(part, "ab") as f:
            for chunk in r.iter_bytes():
                self.check_cancel()
                self.budget.check_time(self.have)
                chunk = chunk[: rf.size - self.have]  # never more than the listed size
                f.write(chunk)
                self._hash(chunk)
                self.have += len(chunk)
                self.received += len(chunk)
                self.tracker.advance(len(chunk))
                if self.have >= rf.size:
                    break
        if self.have < rf.size:
            raise _Incomplete(f"{rf.path}: the connection closed at {self.have} of {rf.size} bytes")

    def _range_restart(self, rf: RemoteFile, part: Path, what: str) -> None:
        """Start the file over from byte 0, once; a server that does it again cannot resume: refuse."""
        if self.budget.range_restarts >= RANGE_RESTARTS:
            raise DownloadError(f"{remote.host(self.ep)} {what} again for {rf.path} of repo {self.repo_id}, after a "
                                "clean restart; it cannot resume downloads reliably, try again later")
        self.budget.range_restarts += 1
        log.warning("%s %s for %s; restarting the file from its first byte", remote.host(self.ep), what, rf.path)
        self._reset(rf, part)

    def _check(self, rf: RemoteFile) -> str:
        size = os.path.getsize(state.staged_path(self.dest, rf.path, rf.etag, "part"))
        if size != rf.size:
            return f"size {size} instead of {rf.size}"
        if rf.sha256 and self.sha256.hexdigest() != rf.sha256:
            return f"sha256 {self.sha256.hexdigest()[:12]}… instead of {rf.sha256[:12]}…"
        if rf.git_sha1 and self.sha1.hexdigest() != rf.git_sha1:
            return f"git blob sha1 {self.sha1.hexdigest()[:12]}… instead of {rf.git_sha1[:12]}…"
        return ""


def _range_problem(content_range: str, start: int, size: int) -> str:
    """'' when a 206's Content-Range is exactly bytes start-(size-1)/size (or /*), else what is wrong."""
    m = re.fullmatch(r"bytes (\d+)-(\d+)/(\d+|\*)", content_range.strip())
    if not m:
        return f"an unreadable Content-Range {content_range[:60]!r}"
    first, last, total = int(m[1]), int(m[2]), m[3]
    if first != start or last < first or last >= size or (total != "*" and int(total) != size):
        return f"the wrong bytes (Content-Range {content_range[:60]!r}, expected bytes {start}- of {size})"
    return ""


def download_model(repo_id: str, revision: str = "main", dest: Path | str | None = None,
                   files: list[str] | None = None, on_progress=None, cancel: threading.Event | None = None,
                   token: str | bool | None = None, retries: int = 4, endpoint: str | None = None) -> Path:
    """Download `repo_id` at `revision` into `dest` (default: default_dest(repo_id)) and return `dest`.

    files: glob patterns of the repo files to fetch (None: all but .gitattributes and hidden folders).
    on_progress(DownloadProgress): at most ~10 calls a second, plus one per finished file.
    cancel: set it from any thread; raises DownloadCancelled within about a second and keeps the partial files.
    token: None/True = the keyring token, else HF_TOKEN; a string = that token; False = anonymous.
    retries: attempts again after a network error or 408/429/5xx (restarting whenever bytes arrive).
    endpoint: the Hub to use (default: HF_ENDPOINT as it is now, else huggingface.co).
    Raises DownloadError (a ZeroTVMError) with a plain message, or DownloadCancelled.
    """
    names.check_repo_id(repo_id)
    if not isinstance(revision, str) or not revision or len(revision) > 256 or not revision.isprintable():
        raise DownloadError(f"{revision!r:.80} is not a revision (a branch, tag or commit id)")
    reason = offline_reason()
    if reason:
        raise DownloadError(f"offline mode is on ({reason}): cannot download {repo_id}")
    dest = Path(dest).expanduser() if dest else default_dest(repo_id)
    try:
        _check_folder(dest, repo_id)
        ep = (endpoint or remote.endpoint()).rstrip("/")
        job = _Job(repo_id, revision, dest, ep, resolve_token(token), retries, cancel)
        finished = threading.Event()
        if cancel is not None:
            threading.Thread(target=job.watch_cancel, args=(finished,), daemon=True, name="zerotvm-cancel").start()
        try:
            return _download(job, files, on_progress)
        finally:
            finished.set()
    except OSError as e:  # the disk or the folder (network errors arrive translated): one sentence, no traceback
        if not remote.is_disk_error(e):
            raise
        raise DownloadError(describe_os_error(e, dest, f"download {repo_id}")
                            + ("; the download resumes where it stopped" if e.errno == errno.ENOSPC else "")) from e


def _download(job: _Job, patterns: list[str] | None, on_progress) -> Path:
    dest, repo_id = job.dest, job.repo_id
    job.commit, listed = job.retrying(
        lambda: job.interruptible(lambda: remote.list_files(repo_id, job.revision, patterns, job.token, job.ep)),
        fail_fast_on_connect=True)
    old = state.read_marker(dest)
    old_entries = {e.get("path"): e for e in (old or {}).get("files", [])}
    if (old and old.get("commit") == job.commit and set(old_entries) == {f.path for f in listed}
            and is_installed(dest)):
        if on_progress:
            total = sum(f.size for f in listed)
            on_progress(DownloadProgress("", 0, 0, total, total, 0.0, 0.0, len(listed), len(listed)))
        return dest

    # Per file: already in place (same bytes per the old marker), staged and verified, or to fetch.
    in_place, staged, needed = [], [], []
    for f in listed:
        e, target = old_entries.get(f.path), dest / f.path
        if e and e.get("etag") == f.etag and target.is_file() and target.stat().st_size == f.size:
            in_place.append(f)
        elif (ok := state.staged_path(dest, f.path, f.etag, "ok")).is_file() and ok.stat().st_size == f.size:
            staged.append(f)
        else:
            needed.append(f)

    def present(f: RemoteFile) -> int:
        part = state.staged_path(dest, f.path, f.etag, "part")
        return min(part.stat().st_size, f.size) if part.is_file() else 0

    missing = sum(f.size - present(f) for f in needed)
    want = missing + int(missing * DISK_MARGIN_FRACTION) + DISK_MARGIN_BYTES if missing else 0
    where, free = _free_space_at(dest)
    if want > free:
        raise DownloadError(f"not enough disk space at {where}: need {_gb(want - free)} more, {_gb(free)} free "
                            f"({_gb(missing)} to download plus a margin of 5% + 200 MB)")
    if needed:  # before any byte is written: a gated repo's metadata is public, its files are not
        first = needed[0]
        job._located[first.path] = job.retrying(lambda: job.locate(first), file=first.path,
                                                fail_fast_on_connect=True)

    from filelock import FileLock, Timeout  # huggingface_hub's own dependency

    staging = state.staging_dir(dest)
    staging.mkdir(parents=True, exist_ok=True)
    lock = FileLock(str(staging / "lock"))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        raise DownloadError(f"{dest} is already being downloaded by another window or process") from None
    try:
        state.write_json_atomic(staging / "state.json",
                                {"repo": repo_id, "revision": job.revision, "commit": job.commit})
        done_bytes = sum(f.size for f in in_place + staged)
        job.tracker = Tracker(on_progress, sum(f.size for f in listed), len(listed), done_bytes,
                              len(in_place) + len(staged))
        for f in needed:
            job.check_cancel()
            job.fetch(f)
        entries = _finish(job, listed, in_place, old_entries)
    finally:
        lock.release()
    shutil.rmtree(staging, ignore_errors=True)
    log.info("downloaded %s at %s (%d files) into %s", repo_id, job.commit[:12], len(entries), dest)
    return dest


def _finish(job: _Job, listed: list[RemoteFile], in_place: list[RemoteFile], old_entries: dict) -> list[dict]:
    """Swap the verified files in, drop files of an older version that are no longer wanted, write the marker."""
    dest = job.dest
    (dest / state.MARKER).unlink(missing_ok=True)  # from here until the new marker, it is not installed
    entries = []
    keep = {f.path for f in in_place}
    for f in listed:
        target = state.confined(dest, f.path)
        if target is None:
            raise DownloadError(f"refusing to place {f.path} of repo {job.repo_id}: it would land outside {dest}")
        if f.path in keep:
            sha256 = old_entries[f.path]["sha256"]
        else:
            ok = state.staged_path(dest, f.path, f.etag, "ok")
            # LFS files were checked against the Hub's sha256; others were checked by git blob sha1 (small).
            sha256 = f.sha256 or state.hash_file(ok)
            target.parent.mkdir(parents=True, exist_ok=True)
            os.replace(ok, target)
        entries.append({"path": f.path, "size": f.size, "sha256": sha256, "etag": f.etag})
    for rel in set(old_entries) - {f.path for f in listed}:
        stale = state.safe_child(dest, rel)
        if stale is not None and stale.is_file():
            stale.unlink()
    state.write_json_atomic(dest / state.MARKER,
                            state.make_marker(job.repo_id, job.revision, job.commit, job.ep, entries))
    return entries
