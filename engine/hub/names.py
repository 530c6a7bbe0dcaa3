"""Validation of every name a Hub server sends before it becomes part of a path: repo ids, commit ids, hashes
and repo file paths. A server (HF_ENDPOINT, a mirror, a proxy) is untrusted input; what fails here is refused
with a message naming the entry, never used.
"""

from __future__ import annotations

import re
import unicodedata
from pathlib import PurePosixPath

from huggingface_hub.errors import HFValidationError
from huggingface_hub.utils import validate_repo_id as hf_validate_repo_id

from engine.hub.errors import DownloadError

SHA256_HEX = re.compile(r"[0-9a-f]{64}")  # an LFS object id
GIT_SHA1_HEX = re.compile(r"[0-9a-f]{40}")  # a git blob id (sha1 of b"blob <size>\0" + content)
COMMIT_HEX = re.compile(r"[0-9a-f]{40}|[0-9a-f]{64}")  # git commit ids: sha1 today, sha256 repositories later
SIZE_ETAG = re.compile(r"size[0-9]{1,16}")  # RemoteFile.etag for a file the Hub gave no hash for

# Repo file paths. A component of at most 200 UTF-8 bytes leaves room for the staging suffix
# ".<20 hex>.part" under the 255-byte name limit of every common filesystem; 1,024 characters and 32 folders
# are far beyond any model repo, and keep a hostile listing from building paths the OS refuses.
MAX_COMPONENT_BYTES = 200
MAX_PATH_CHARS = 1024
MAX_PATH_DEPTH = 32
# Characters Windows refuses in names (the same folder may be opened there), and names it reserves.
_WINDOWS_FORBIDDEN = set('<>:"|?*\\')
_WINDOWS_RESERVED = {"CON", "PRN", "AUX", "NUL", *(f"COM{i}" for i in range(1, 10)), *(f"LPT{i}" for i in range(1, 10))}
# Bidirectional overrides make a shown name differ from the real one.
_BIDI = {chr(c) for c in (*range(0x202A, 0x202F), *range(0x2066, 0x206A), 0x200E, 0x200F, 0x061C)}


def check_repo_id(repo_id) -> str:
    """`repo_id` when it is a Hub repo id ("name" or "owner/name", ASCII letters, digits, '-', '_', '.'),
    else DownloadError. huggingface_hub's own validator decides, plus ASCII only (its regex takes any Unicode
    letter; the Hub does not) and no Windows device name as the folder name."""
    if not isinstance(repo_id, str) or not repo_id:
        raise DownloadError(f"{repo_id!r} is not a Hugging Face repo id (expected owner/name)")
    shown = repo_id if len(repo_id) <= 120 else repo_id[:120] + "…"
    try:
        hf_validate_repo_id(repo_id)
    except HFValidationError:
        raise DownloadError(f"{shown!r} is not a valid Hugging Face repo id: use owner/name with letters, digits, "
                            "'-', '_' or '.' (at most 96 characters, no '--' or '..')") from None
    if not repo_id.isascii():
        raise DownloadError(f"{shown!r} is not a valid Hugging Face repo id: only ASCII letters and digits are "
                            "allowed")
    if repo_id.split("/")[-1].split(".")[0].upper() in _WINDOWS_RESERVED:
        raise DownloadError(f"repo id {repo_id!r} names a reserved device ({repo_id.split('/')[-1]}); download it "
                            "into a folder of your choice instead")
    return repo_id


def check_commit(value, repo_id: str, where: str) -> str:
    """A commit id from the server: 40 or 64 lowercase hex digits."""
    if not isinstance(value, str) or not COMMIT_HEX.fullmatch(value.lower()):
        raise DownloadError(f"{where} gave an invalid commit id {_shown(value)} for repo {repo_id}; is HF_ENDPOINT "
                            "a Hugging Face Hub?")
    return value.lower()


def check_sha256(value, repo_id: str, path: str) -> str:
    if not isinstance(value, str) or not SHA256_HEX.fullmatch(value.lower()):
        raise DownloadError(f"repo {repo_id} lists {path!r} with an invalid sha256 {_shown(value)} (expected 64 "
                            "hex digits); refusing to download it")
    return value.lower()


def check_git_sha1(value, repo_id: str, path: str) -> str:
    if not isinstance(value, str) or not GIT_SHA1_HEX.fullmatch(value.lower()):
        raise DownloadError(f"repo {repo_id} lists {path!r} with an invalid git blob id {_shown(value)} (expected "
                            "40 hex digits); refusing to download it")
    return value.lower()


def is_etag(value: str) -> bool:
    """A RemoteFile.etag that may name a staged file: a hash, or size<digits> for a file without one."""
    return isinstance(value, str) and bool(SHA256_HEX.fullmatch(value) or GIT_SHA1_HEX.fullmatch(value)
                                           or SIZE_ETAG.fullmatch(value))


def traversal_problem(path) -> str | None:
    """Why `path` could leave the folder it is joined to (absolute, '..', a drive, a backslash, NUL), or None.
    Such a name never comes from a real Hub (git refuses them): the listing is hostile."""
    if not isinstance(path, str) or not path:
        return "it is empty or not text"
    if "\0" in path:
        return "it contains a NUL character"
    if "\\" in path:
        return "it contains a backslash"
    p = PurePosixPath(path)
    if p.is_absolute() or path.startswith("/"):
        return "it is an absolute path"
    if re.match(r"[A-Za-z]:", path):
        return "it starts with a drive letter"
    if any(part in ("..", ".") for part in path.split("/")):
        return "it has a '.' or '..' component"
    if "" in path.split("/"):
        return "it has an empty component"
    return None


def name_problem(path: str) -> str | None:
    """Why a repo file path cannot become a file name on every desktop OS, or None. Checked for the files
    actually downloaded (a repo may hold other files whose names only Linux accepts)."""
    if (why := traversal_problem(path)) is not None:
        return why
    if len(path) > MAX_PATH_CHARS:
        return f"it is longer than {MAX_PATH_CHARS} characters"
    parts = path.split("/")
    if len(parts) > MAX_PATH_DEPTH:
        return f"it is nested more than {MAX_PATH_DEPTH} folders deep"
    for part in parts:
        if len(part.encode("utf-8", "surrogatepass")) > MAX_COMPONENT_BYTES:
            return f"a component is longer than {MAX_COMPONENT_BYTES} bytes"
        bad = next((c for c in part if unicodedata.category(c) in ("Cc", "Cs") or c in _BIDI
                    or c in _WINDOWS_FORBIDDEN), None)
        if bad is not None:
            return f"it contains the character U+{ord(bad):04X}"
        if part.endswith((" ", ".")):
            return "a component ends with a space or a dot"
        if part.split(".")[0].upper().rstrip(" ") in _WINDOWS_RESERVED:
            return f"{part!r} is a reserved device name on Windows"
    return None


def check_file_set(paths: list[str], repo_id: str) -> None:
    """Files that would overwrite each other: the same name but for letter case (one file on Windows and
    macOS), or a file that is also a folder of another."""
    seen: dict[str, str] = {}
    for path in paths:
        key = unicodedata.normalize("NFC", path).casefold()
        if key in seen:
            raise DownloadError(f"repo {repo_id} lists both {seen[key]!r} and {path!r}, which are the same file on "
                                "Windows and macOS; refusing to download it")
        seen[key] = path
    for path in paths:
        parts = unicodedata.normalize("NFC", path).casefold().split("/")
        for i in range(1, len(parts)):
            folder = "/".join(parts[:i])
            if folder in seen:
                raise DownloadError(f"repo {repo_id} lists {seen[folder]!r} both as a file and as the folder of "
                                    f"{path!r}; refusing to download it")


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 80 else text[:80] + "…"
