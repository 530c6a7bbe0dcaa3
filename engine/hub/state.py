"""What a download leaves on disk, and the checks on it.

    dest/.zerotvm-download.json    the marker: written last, only when every file verified (repo, commit, files)
    dest/.zerotvm-partial/         staging while downloading: state.json, lock, files/<path>.<etag>.part|.ok

Files are staged and only moved into `dest` once all of them verified, so a half-downloaded folder never
holds a model file that the library would list. Nothing here talks to the network.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import os
import re
import shutil
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath

from engine.errors import ModelFormatError
from engine.formats import files
from engine.hub import names
from engine.hub.errors import DownloadCancelled, DownloadError

MARKER = ".zerotvm-download.json"
STAGING = ".zerotvm-partial"
MARKER_FORMAT = 1
HASH_BLOCK = 1 << 20


def staging_dir(dest: Path) -> Path:
    return Path(dest) / STAGING


def staged_path(dest: Path, rel: str, etag: str, suffix: str) -> Path:
    """files/<rel>.<etag prefix>.<part|ok>: a new version of a file never resumes from the old one's bytes.
    rel and etag come from a server: both are checked here too, whatever the caller checked, and the result
    must resolve inside the staging folder."""
    if names.traversal_problem(rel) is not None or not names.is_etag(etag) or suffix not in ("part", "ok"):
        raise DownloadError(f"refusing to stage {rel!r:.80} with etag {etag!r:.80}: not a safe file name")
    path = confined(staging_dir(dest) / "files", f"{rel}.{etag[:20]}.{suffix}")
    if path is None:
        raise DownloadError(f"refusing to stage {rel!r:.80}: it would be written outside {staging_dir(dest)}")
    return path


def staged_name_pattern(name: str) -> re.Pattern:
    """<name>.<etag prefix>.<part|ok>: the staged copies of one file (any version), and nothing else."""
    return re.compile(re.escape(name) + r"\.([0-9a-f]{20}|size[0-9]{1,16})\.(part|ok)")


def confined(root: Path, rel: str) -> Path | None:
    """root/rel when rel is a plain relative path and the result, symlinks resolved, stays inside root."""
    if names.traversal_problem(rel) is not None:
        return None
    path = Path(root) / PurePosixPath(rel)
    try:
        real_root = Path(root).resolve()
        real = path.parent.resolve() / path.name
    except (OSError, RuntimeError):  # a symlink loop
        return None
    if real != real_root and real_root not in real.parents:
        return None
    return path


def write_json_atomic(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def read_json(path: Path) -> dict | None:
    """A state file's JSON object, or None when absent, unreadable or not an object (a torn write)."""
    try:
        return files.read_json(Path(path), "download state", default=None)
    except ModelFormatError:
        return None


def read_marker(dest: Path) -> dict | None:
    """The marker's contents, or None when absent or unreadable (a torn write counts as not installed)."""
    data = read_json(Path(dest) / MARKER)
    if not data or not isinstance(data.get("files"), list):
        return None
    for entry in data["files"]:
        if (not isinstance(entry, dict) or not isinstance(entry.get("path"), str)
                or isinstance(entry.get("size"), bool) or not isinstance(entry.get("size"), int)):
            return None
    return data


def make_marker(repo_id: str, revision: str, commit: str, endpoint: str, files: list[dict]) -> dict:
    now = datetime.datetime.now(datetime.timezone.utc).replace(microsecond=0).isoformat()
    return {"format": MARKER_FORMAT, "repo": repo_id, "revision": revision, "commit": commit, "endpoint": endpoint,
            "date": now, "files": files}


def safe_child(dest: Path, rel: str) -> Path | None:
    """dest/rel when rel is a plain relative path inside dest (a marker is data; never follow one out of the
    folder, through '..' or through a symlinked folder)."""
    return confined(dest, rel) if isinstance(rel, str) else None


def is_installed(dest: Path) -> bool:
    """The marker is there and every file it lists has its recorded size. Cheap: no hashing. While an update
    to a newer commit downloads, the old version stays installed until the final swap."""
    marker = read_marker(dest)
    if marker is None:
        return False
    for entry in marker["files"]:
        path = safe_child(dest, entry.get("path", ""))
        try:
            if path is None or not path.is_file() or path.stat().st_size != entry.get("size"):
                return False
        except OSError:
            return False
    return True


def hash_file(path: Path, cancel: threading.Event | None = None,
              on_bytes: Callable[[int], None] | None = None) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(HASH_BLOCK):
            if cancel is not None and cancel.is_set():
                raise DownloadCancelled(f"checking {path.name} was cancelled")
            h.update(block)
            if on_bytes:
                on_bytes(len(block))
    return h.hexdigest()


def verify_installed(dest: Path, on_progress: Callable[[int, int], None] | None = None,
                     cancel: threading.Event | None = None) -> list[str]:
    """Re-hash every file the marker lists (the "Verify" button). Returns the files that failed (missing,
    wrong size or wrong sha256) after deleting them, so the model no longer looks installed and the next
    download_model call fetches just those. on_progress(bytes hashed, bytes total)."""
    dest = Path(dest)
    marker = read_marker(dest)
    if marker is None:
        raise DownloadError(f"{dest} is not a downloaded model (no {MARKER})")
    total = sum(int(e.get("size") or 0) for e in marker["files"])
    done = 0

    def advance(n: int) -> None:
        nonlocal done
        done += n
        if on_progress:
            on_progress(done, total)

    bad = []
    for entry in marker["files"]:
        rel, size = entry.get("path", ""), entry.get("size")
        path = safe_child(dest, rel)
        if path is None or not path.is_file() or path.stat().st_size != size:
            bad.append(rel)
            advance(int(size or 0))
            continue
        if hash_file(path, cancel, advance) != entry.get("sha256"):
            bad.append(rel)
            path.unlink(missing_ok=True)  # a same-size corrupt file would otherwise still pass is_installed
    return bad


def remove_model(dest: Path) -> None:
    """Delete a downloaded (or partly downloaded) model folder. Refuses any folder without our marker or
    staging folder, a symlink, and a folder whose download is running."""
    from filelock import FileLock, Timeout  # huggingface_hub's own dependency

    dest = Path(dest)
    if not dest.exists() and not dest.is_symlink():
        return
    if dest.is_symlink() or not dest.is_dir():
        raise DownloadError(f"refusing to delete {dest}: it is not a model folder made by a download")
    staging = staging_dir(dest)
    if not (dest / MARKER).is_file() and not staging.is_dir():
        raise DownloadError(f"refusing to delete {dest}: it holds no {MARKER} or {STAGING}, so Zero-TVM did not "
                            "download it")
    if staging.is_dir():
        lock = FileLock(str(staging / "lock"))
        try:
            lock.acquire(timeout=0)
        except Timeout:
            raise DownloadError(f"{dest} is being downloaded right now; cancel the download first") from None
        try:
            (dest / MARKER).unlink(missing_ok=True)  # first: a crash mid-delete never leaves it looking installed
        finally:
            lock.release()
    else:
        (dest / MARKER).unlink(missing_ok=True)
    shutil.rmtree(dest)
