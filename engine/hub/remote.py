"""What the Hub says about a repo (files, sizes, hashes, commit) and where each file's bytes are, through
huggingface_hub; and the translation of its exceptions into plain DownloadErrors."""

from __future__ import annotations

import errno
import fnmatch
import os
from dataclasses import dataclass
from pathlib import PurePosixPath
from urllib.parse import quote, urljoin, urlparse

from huggingface_hub import HfApi, constants, get_hf_file_metadata
from huggingface_hub.errors import (
    GatedRepoError,
    HfHubHTTPError,
    OfflineModeIsEnabled,
    RemoteEntryNotFoundError,
    RepositoryNotFoundError,
    RevisionNotFoundError,
)
from huggingface_hub.utils import build_hf_headers
from huggingface_hub.utils import httpx as _httpx  # httpx2 on huggingface_hub 2.x, httpx on 1.x

from engine.errors import ZeroTVMError
from engine.hub.errors import DownloadError
from engine.hub.state import MARKER, STAGING

# A few seconds are plenty for metadata; the body read timeout only bounds a stalled connection.
META_TIMEOUT_S = 15.0
TRANSIENT_STATUS = {408, 429, 500, 502, 503, 504}


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


def _safe_path(path: str, repo_id: str) -> str:
    p = PurePosixPath(path)
    if p.is_absolute() or ".." in p.parts or "\\" in path or not p.parts:
        raise DownloadError(f"repo {repo_id} lists a file with an unsafe path: {path!r}")
    return str(p)


def _wanted(path: str, patterns: list[str] | None) -> bool:
    parts = PurePosixPath(path).parts
    if parts and parts[0] in (MARKER, STAGING):  # a repo file must never overwrite our own bookkeeping
        return False
    if patterns is None:  # everything except hidden files and folders: .gitattributes, .github/...
        return not any(part.startswith(".") for part in parts)
    return any(fnmatch.fnmatchcase(path, pat) for pat in patterns)


def list_files(repo_id: str, revision: str, patterns: list[str] | None, token: str | bool,
               ep: str) -> tuple[str, list[RemoteFile]]:
    """(commit sha, selected files with sizes and hashes) of `repo_id` at `revision`."""
    api = HfApi(endpoint=ep)
    info = api.model_info(repo_id, revision=revision, files_metadata=True, token=token, timeout=META_TIMEOUT_S)
    if not info.sha:
        raise DownloadError(f"{host(ep)} gave no commit for {repo_id} at {revision}; is HF_ENDPOINT a Hub?")
    siblings = [s for s in (info.siblings or []) if _wanted(s.rfilename, patterns)]
    if not siblings:
        what = f"matches {', '.join(patterns)}" if patterns else "can be downloaded"
        raise DownloadError(f"no file in repo {repo_id} at revision {revision} {what}")
    missing = [s.rfilename for s in siblings if s.size is None]
    extra = {}
    if missing:  # an older server without sizes in the repo info: ask paths-info for them
        for f in api.get_paths_info(repo_id, missing, revision=info.sha, token=token):
            if hasattr(f, "size"):
                extra[f.path] = f
    files = []
    for s in siblings:
        src = extra.get(s.rfilename, s)
        if src.size is None:
            raise DownloadError(f"{host(ep)} gave no size for {s.rfilename} in repo {repo_id}")
        lfs = src.lfs
        files.append(RemoteFile(_safe_path(s.rfilename, repo_id), int(src.size),
                                lfs["sha256"].lower() if lfs else None,
                                None if lfs or not src.blob_id else src.blob_id.lower()))
    return info.sha, files


def locate(repo_id: str, commit: str, path: str, token: str | bool, ep: str) -> tuple[str, dict[str, str]]:
    """(URL, headers) to GET the file's bytes. The token goes only to the Hub endpoint, never to a CDN."""
    # Not hf_hub_url: it swaps the endpoint into a URL built from constants read at import, which misses when
    # huggingface_hub.constants.ENDPOINT was changed after import.
    url = f"{ep}/{repo_id}/resolve/{quote(commit, safe='')}/{quote(path)}"
    meta = get_hf_file_metadata(url, token=token, timeout=META_TIMEOUT_S, endpoint=ep)
    location = urljoin(url, meta.location)
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
    detail = (str(e).strip().splitlines() or [type(e).__name__])[0][:160]
    if isinstance(e, (_httpx.TransportError, TimeoutError, ConnectionError)):
        return DownloadError(f"the connection to {host(ep)} failed while downloading {where} ({detail}); "
                             "try again: the download resumes where it stopped")
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return DownloadError(f"the disk filled up while downloading {where}; free some space and try again: "
                             "the download resumes where it stopped")
    return DownloadError(f"downloading {where} failed: {type(e).__name__}: {e}")

