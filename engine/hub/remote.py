"""What the Hub says about a repo (files, sizes, hashes, commit) and where each file's bytes are, through
huggingface_hub; and the translation of its exceptions into plain DownloadErrors."""

from __future__ import annotations

import errno
import fnmatch
import json
import os
import time
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import quote, urljoin, urlparse

from huggingface_hub import constants, get_hf_file_metadata
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    LocalEntryNotFoundError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers, get_session, hf_raise_for_status
from huggingface_hub.utils import httpx as _httpx  # httpx2 on huggingface_hub 2.x, httpx on 1.x

from engine.errors import ZeroTVMError
from engine.hub import names
from engine.hub.errors import DownloadError
from engine.hub.state import MARKER, STAGING

# A few seconds are plenty for metadata; the body read timeout only bounds a stalled connection.
META_TIMEOUT_S = 15.0
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}
# Listings are small (about 300 bytes a file): the caps stop a server that streams an endless one.
MAX_LISTING_BYTES = 32 * 1024**2
MAX_REPO_FILES = 25_000  # the Hub's own advice is under 10,000 files a folder; no model has more
LISTING_TIMEOUT_S = 60.0  # a listing trickling in slower than this is not coming
ERROR_BODY_BYTES = 64 * 1024  # enough for any error message
MAX_FILE_BYTES = 1 << 40  # 1 TiB: beyond the largest single model file; a bigger claim is a hostile listing


@dataclass(frozen=True)
class RemoteFile:
    path: str  # relative, posix
    size: int
    sha256: str | None  # LFS files
    git_sha1: str | None  # other files: the git blob id, sha1(b"blob <size>\0" + content)

    @property
    def etag(self) -> str:
        """The Hub's identity for these bytes: what names a partial file, so bytes of two versions never mix."""
        return self.sha256 or self.git_sha1 or f"size{self.size}"


def endpoint() -> str:
    """HF_ENDPOINT as it is now (huggingface_hub reads it only once, at import), else huggingface_hub's."""
    return (os.environ.get("HF_ENDPOINT") or constants.ENDPOINT).rstrip("/")


def host(ep: str) -> str:
    return urlparse(ep).netloc or ep


def same_origin(url: str, ep: str) -> bool:
    a, b = urlparse(url), urlparse(ep)
    return (a.scheme, a.netloc.lower()) == (b.scheme, b.netloc.lower())


def _wanted(path: str, patterns: list[str] | None) -> bool:
    parts = PurePosixPath(path).parts
    if parts and parts[0].casefold() in (MARKER.casefold(), STAGING.casefold()):  # never overwrite our bookkeeping
        return False
    if patterns is None:  # everything except hidden files and folders: .gitattributes, .github/...
        return not any(part.startswith(".") for part in parts)
    return any(fnmatch.fnmatchcase(path, pat) for pat in patterns)


def raise_for_status(r, deadline: float | None = None) -> None:
    """hf_raise_for_status on a streamed response, reading at most ERROR_BODY_BYTES of an error body
    (huggingface_hub reads all of it: a hostile server could send gigabytes)."""
    if r.status_code < 400:
        hf_raise_for_status(r)  # warning headers
        return
    body = bytearray()
    try:
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) >= ERROR_BODY_BYTES or (deadline is not None and time.monotonic() > deadline):
                break
    except _httpx.HTTPError:  # the error status is what matters
        pass
    headers = [(k, v) for k, v in r.headers.multi_items()
               if k.lower() not in ("content-length", "content-encoding", "transfer-encoding")]
    hf_raise_for_status(_httpx.Response(r.status_code, headers=headers, content=bytes(body[:ERROR_BODY_BYTES]),
                                        request=r.request))


def _get_json(method: str, url: str, token: str | bool, what: str, ep: str, **kw):
    """A JSON answer of at most MAX_LISTING_BYTES, read within LISTING_TIMEOUT_S."""
    headers = build_hf_headers(token=token)
    headers["Accept-Encoding"] = "identity"  # the byte cap counts what the server sends, not a decompressed bomb
    deadline = time.monotonic() + LISTING_TIMEOUT_S
    with get_session().stream(method, url, headers=headers, timeout=_httpx.Timeout(META_TIMEOUT_S), **kw) as r:
        raise_for_status(r, deadline)
        declared = r.headers.get("Content-Length", "")
        if declared.isdigit() and int(declared) > MAX_LISTING_BYTES:
            raise DownloadError(f"{host(ep)} sent a {what} of {int(declared):,} bytes (more than "
                                f"{MAX_LISTING_BYTES:,}); refusing it")
        body = bytearray()
        for chunk in r.iter_bytes():
            body += chunk
            if len(body) > MAX_LISTING_BYTES:
                raise DownloadError(f"{host(ep)} sent a {what} longer than {MAX_LISTING_BYTES:,} bytes; refusing it")
            if time.monotonic() > deadline:
                raise DownloadError(f"{host(ep)} took more than {LISTING_TIMEOUT_S:.0f} s to send the {what}; try "
                                    "again later")
    try:
        return json.loads(bytes(body))
    except (ValueError, RecursionError) as e:  # RecursionError: nesting deeper than the parser's stack
        detail = "nested too deeply" if isinstance(e, RecursionError) else str(e)[:80]
        raise DownloadError(f"{host(ep)} sent a {what} that is not valid JSON ({detail}); is HF_ENDPOINT a "
                            "Hugging Face Hub?") from None


def _size(value, repo_id: str, path: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_FILE_BYTES:
        raise DownloadError(f"repo {repo_id} lists {path!r} with an invalid size {value!r:.40}; refusing to "
                            "download it")
    return value


def _remote_file(entry: dict, path: str, repo_id: str) -> RemoteFile:
    """One listing entry (repo info's siblings or paths-info), every field checked."""
    size = _size(entry.get("size"), repo_id, path)
    lfs = entry.get("lfs")
    if lfs is not None:
        if not isinstance(lfs, dict):
            raise DownloadError(f"repo {repo_id} lists {path!r} with invalid LFS details; refusing to download it")
        sha256 = names.check_sha256(lfs.get("sha256", lfs.get("oid")), repo_id, path)
        if "size" in lfs and _size(lfs["size"], repo_id, path) != size:
            raise DownloadError(f"repo {repo_id} lists {path!r} with two different sizes; refusing to download it")
        return RemoteFile(path, size, sha256, None)
    blob = entry.get("blobId", entry.get("oid"))
    return RemoteFile(path, size, None, None if blob is None else names.check_git_sha1(blob, repo_id, path))


def list_files(repo_id: str, revision: str, patterns: list[str] | None, token: str | bool,
               ep: str) -> tuple[str, list[RemoteFile]]:
    """(commit sha, selected files with sizes and hashes) of `repo_id` at `revision`. Everything the server
    says is checked: the commit id, each name (a name that could leave the folder refuses the whole listing),
    sizes and hashes; the answer is capped in bytes, files and time."""
    url = f"{ep}/api/models/{repo_id}/revision/{quote(revision, safe='')}"
    info = _get_json("GET", url, token, "repo listing", ep, params={"blobs": True})
    if not isinstance(info, dict):
        raise DownloadError(f"{host(ep)} sent a repo listing that is not a JSON object; is HF_ENDPOINT a Hub?")
    if not info.get("sha"):
        raise DownloadError(f"{host(ep)} gave no commit for {repo_id} at {revision}; is HF_ENDPOINT a Hub?")
    commit = names.check_commit(info["sha"], repo_id, host(ep))
    siblings = info.get("siblings") or []
    if not isinstance(siblings, list) or not all(isinstance(s, dict) for s in siblings):
        raise DownloadError(f"{host(ep)} sent a repo listing for {repo_id} without a valid file list")
    if len(siblings) > MAX_REPO_FILES:
        raise DownloadError(f"repo {repo_id} lists {len(siblings):,} files, more than the {MAX_REPO_FILES:,} a "
                            "model download accepts; refusing it")
    for s in siblings:
        why = names.traversal_problem(s.get("rfilename"))
        if why is not None:  # git cannot hold such a name: the server is lying
            raise DownloadError(f"{host(ep)} listed a file {_shown(s.get('rfilename'))} in repo {repo_id} whose "
                                f"name is unsafe ({why}); refusing the whole listing")
    wanted = [s for s in siblings if _wanted(s["rfilename"], patterns)]
    if not wanted:
        what = f"matches {', '.join(patterns)}" if patterns else "can be downloaded"
        raise DownloadError(f"no file in repo {repo_id} at revision {revision} {what}")
    for s in wanted:
        why = names.name_problem(s["rfilename"])
        if why is not None:
            raise DownloadError(f"repo {repo_id} has a file {_shown(s['rfilename'])} that cannot be saved on this "
                                f"computer ({why}); refusing to download it")
    names.check_file_set([s["rfilename"] for s in wanted], repo_id)
    missing = [s["rfilename"] for s in wanted if s.get("size") is None]
    extra: dict[str, dict] = {}
    if missing:  # an older server without sizes in the repo info: ask paths-info for them
        url = f"{ep}/api/models/{repo_id}/paths-info/{quote(commit, safe='')}"
        answer = _get_json("POST", url, token, "file list", ep, data={"paths": missing, "expand": False})
        for f in answer if isinstance(answer, list) else []:
            if isinstance(f, dict) and f.get("type", "file") == "file" and f.get("path") in missing:
                extra[f["path"]] = f
    files = []
    for s in wanted:
        src = extra.get(s["rfilename"], s)
        if src.get("size") is None:
            raise DownloadError(f"{host(ep)} gave no size for {s['rfilename']} in repo {repo_id}")
        files.append(_remote_file(src, s["rfilename"], repo_id))
    return commit, files


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"


def locate(repo_id: str, commit: str, path: str, token: str | bool, ep: str) -> tuple[str, dict[str, str]]:
    """(URL, headers) to GET the file's bytes. The token goes only to the Hub endpoint, never to a CDN."""
    # Not hf_hub_url: it swaps the endpoint into a URL built from constants read at import, which misses when
    # huggingface_hub.constants.ENDPOINT was changed after import.
    url = f"{ep}/{repo_id}/resolve/{quote(commit, safe='')}/{quote(path)}"
    meta = get_hf_file_metadata(url, token=token, timeout=META_TIMEOUT_S, endpoint=ep)
    location = urljoin(url, meta.location)
    scheme = urlparse(location).scheme.lower()
    if scheme not in ("http", "https") or (scheme == "http" and urlparse(ep).scheme.lower() == "https"):
        # Another scheme is no download; https to http would let anyone on the way swap the bytes' source.
        raise DownloadError(f"{host(ep)} sent {path} of repo {repo_id} to {_shown(location[:60])}, which is not a "
                            "secure web address; refusing it")
    headers = build_hf_headers(token=token)
    if not same_origin(location, ep):  # a signed CDN URL
        headers.pop("authorization", None)
        headers.pop("Authorization", None)
    headers["Accept-Encoding"] = "identity"  # sizes and Range offsets are of the raw bytes
    return location, headers


def is_transient(e: BaseException) -> bool:
    """Worth another try: network trouble or a busy server; never 401/403/404 or offline mode."""
    if isinstance(e, OfflineModeIsEnabled):
        return False
    if isinstance(e, HfHubHTTPError):
        return e.response is not None and e.response.status_code in TRANSIENT_STATUS
    return isinstance(e, (_httpx.TransportError, TimeoutError, ConnectionError))


def is_disk_error(e: BaseException) -> bool:
    """An OSError of the local disk or folder (huggingface_hub's HTTP errors and network errors are OSErrors too)."""
    return isinstance(e, OSError) and not isinstance(e, (HfHubHTTPError, ConnectionError, TimeoutError,
                                                         LocalEntryNotFoundError))


def is_connect_error(e: BaseException) -> bool:
    return isinstance(e, (_httpx.ConnectError, _httpx.ConnectTimeout)) and not isinstance(e, OfflineModeIsEnabled)


def translate(e: BaseException, *, repo_id: str, revision: str, ep: str, token_used: bool,
              file: str | None = None) -> ZeroTVMError:
    """A plain DownloadError for anything huggingface_hub or the HTTP client raised."""
    if isinstance(e, ZeroTVMError):
        return e
    where = f"{file} of repo {repo_id}" if file else f"repo {repo_id}"
    token_hint = "run `zerotvm token set`"
    if isinstance(e, OfflineModeIsEnabled):
        return DownloadError(f"offline mode is on (HF_HUB_OFFLINE): cannot download {where}")
    status = getattr(getattr(e, "response", None), "status_code", None)
    if isinstance(e, GatedRepoError) or (status in (401, 403) and not isinstance(e, RepositoryNotFoundError)):
        if token_used:
            if status == 401 and not isinstance(e, GatedRepoError):
                return DownloadError(f"the Hugging Face token was refused (invalid or expired) for {where}: "
                                     f"{token_hint} with a new one")
            return DownloadError(f"your Hugging Face token has no access to {where}: accept the repo's terms "
                                 f"at {ep}/{repo_id} (gated repo) or use a token that can read it")
        return DownloadError(f"{repo_id} needs a Hugging Face token (gated or private repo): {token_hint}")
    if isinstance(e, RevisionNotFoundError):
        return DownloadError(f"no repo {repo_id} at revision {revision} on Hugging Face (no such revision)")
    if isinstance(e, RepositoryNotFoundError):
        if status == 401 and not token_used:  # the Hub answers 401 for both missing and private repos
            return DownloadError(f"no repo {repo_id} at revision {revision} on Hugging Face, or it is private: "
                                 f"if it is, {token_hint}")
        return DownloadError(f"no repo {repo_id} at revision {revision} on Hugging Face")
    if isinstance(e, RemoteEntryNotFoundError) or status == 404:
        return DownloadError(f"{where} is missing on Hugging Face at revision {revision}")
    if isinstance(e, HfHubHTTPError):
        return DownloadError(f"{host(ep)} answered HTTP {status} for {where}; try again later")
    if is_connect_error(e):
        return DownloadError(f"cannot reach {host(ep)} (offline?)")
    if isinstance(e, _httpx.TooManyRedirects):
        return DownloadError(f"{host(ep)} redirected {where} too many times (a redirect loop); try again later")
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    if isinstance(e, (_httpx.TransportError, TimeoutError, ConnectionError)):
        return DownloadError(f"the connection to {host(ep)} failed while downloading {where} ({detail}); "
                             "try again: the download resumes where it stopped")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return DownloadError(f"the disk filled up while downloading {where}; free some space and try again: "
                             "the download resumes where it stopped")
    return DownloadError(f"downloading {where} failed: {type(e).__name__}: {e}")

