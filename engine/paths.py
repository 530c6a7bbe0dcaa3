"""Where the app keeps its data: models, chats, settings. Plain paths, no Qt (QStandardPaths lives in app/).

Also the one-sentence answers for a data folder that cannot be used (a file, read-only, full, not ours to
write), so the CLI and the app say the same thing instead of a PermissionError traceback.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from pathlib import Path

from engine.errors import ZeroTVMError

APP_NAME = "ZeroTVM"


class DataFolderError(ZeroTVMError):
    """A folder the app must write to cannot be written (a file in the way, read-only, full, no permission)."""


def data_dir() -> Path:
    """ZEROTVM_HOME if set, else the platform's per-user data folder."""
    if os.environ.get("ZEROTVM_HOME"):
        return Path(os.environ["ZEROTVM_HOME"]).expanduser()
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / APP_NAME
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP_NAME
    # The same folder Qt's QStandardPaths.AppLocalDataLocation gives the app (application name APP_NAME).
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / APP_NAME


def models_dir() -> Path:
    """Installed models: one folder (MLC/HF layout) or one .gguf file per model. ZEROTVM_MODELS overrides."""
    if os.environ.get("ZEROTVM_MODELS"):
        return Path(os.environ["ZEROTVM_MODELS"]).expanduser()
    return data_dir() / "models"


def _folder_name(folder: Path) -> str:
    """The folder, and the setting it comes from when that is what the user must change."""
    if os.environ.get("ZEROTVM_HOME") and Path(folder) == data_dir():
        return f"the data folder {folder} (ZEROTVM_HOME)"
    if os.environ.get("ZEROTVM_MODELS") and Path(folder) == models_dir():
        return f"the models folder {folder} (ZEROTVM_MODELS)"
    return f"the folder {folder}"


def describe_os_error(e: OSError, folder: Path, doing: str) -> str:
    """One sentence for an OSError met in `folder` while `doing` something ("download acme/x"): what is wrong
    and what to do."""
    name = _folder_name(folder)
    code = e.errno
    if code in (errno.ENOSPC, getattr(errno, "EDQUOT", -1)):
        return f"cannot {doing}: the disk holding {name} is full; free some space and try again"
    if code == errno.EROFS:
        return f"cannot {doing}: {name} is on a read-only disk; choose a folder on a writable disk"
    if code in (errno.EACCES, errno.EPERM):
        return f"cannot {doing}: no permission to write in {name}; choose a folder you can write to or fix its " \
               "permissions"
    if code in (errno.ENOTDIR, errno.EEXIST) or isinstance(e, (NotADirectoryError, FileExistsError)):
        where = f" ({e.filename})" if e.filename else ""
        return f"cannot {doing}: a file is in the way of {name}{where}; move it or choose another folder"
    return f"cannot {doing}: {e.strerror or e} in {name}"


def ensure_writable(folder: Path, doing: str) -> Path:
    """Create `folder` if needed and prove a file can be written in it; DataFolderError (one sentence) if not."""
    folder = Path(folder)
    problem = writable_problem(folder, doing)
    if problem:
        raise DataFolderError(problem)
    return folder


def writable_problem(folder: Path, doing: str) -> str | None:
    """None when `folder` exists (or was created) and takes a new file, else the sentence saying why not."""
    folder = Path(folder)
    try:
        if folder.exists() and not folder.is_dir():
            raise NotADirectoryError(errno.ENOTDIR, "Not a directory", str(folder))
        folder.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".zerotvm-write-test-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        return describe_os_error(e, folder, doing)
    return None


def data_dir_problem() -> str | None:
    """Why the data folder cannot hold chats and settings right now, or None. Creates it when missing."""
    return writable_problem(data_dir(), "keep chats and settings")


def use_temporary_data_dir() -> Path:
    """For a session whose data folder cannot be used: point ZEROTVM_HOME at a new temporary folder (every later
    write then succeeds, it is just not kept), keep the models folder in view, and return the original data
    folder, from which chats and settings are still read."""
    original = data_dir()
    if not os.environ.get("ZEROTVM_MODELS") and (original / "models").is_dir():
        os.environ["ZEROTVM_MODELS"] = str(original / "models")
    os.environ["ZEROTVM_HOME"] = tempfile.mkdtemp(prefix="zerotvm-session-")
    return original
