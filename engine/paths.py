"""Where the app keeps its data: models, chats, settings. Plain paths, no Qt (QStandardPaths lives in app/).

The program chooses folders through choose_data_dir / choose_models_dir (the app's --data-dir and its Settings); the
user's environment (ZEROTVM_HOME, ZEROTVM_MODELS) applies where the program chose nothing. Nothing here writes the
environment.

Also the one-sentence answers for a data folder that cannot be used (a file, read-only, full, not ours to
write), so the CLI and the app say the same thing instead of a PermissionError traceback.
"""

from __future__ import annotations

import errno
import os
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from engine.errors import ZeroTVMError

APP_NAME = "ZeroTVM"


class DataFolderError(ZeroTVMError):
    """A folder the app must write to cannot be written (a file in the way, read-only, full, no permission)."""


@dataclass
class _Choice:
    folder: Path | None = None
    setting: str = ""  # where the choice comes from, named in sentences about the folder ("--data-dir")


# The program's choices; `session_models`: the models folder of a session moved to a temporary data folder.
_data = _Choice()
_models = _Choice()
_session_models = _Choice()


def choose_data_dir(folder: str | Path | None, setting: str = "") -> None:
    """Keep data in `folder` from now on (None: ZEROTVM_HOME or the platform's folder again). `setting` names where
    the choice comes from in sentences about the folder."""
    _data.folder, _data.setting = (Path(folder).expanduser() if folder else None), setting


def choose_models_dir(folder: str | Path | None, setting: str = "") -> None:
    """Look for and install models in `folder` from now on (None: ZEROTVM_MODELS or the default again)."""
    _models.folder, _models.setting = (Path(folder).expanduser() if folder else None), setting


def reset_choices() -> None:
    """Forget every folder the program chose (tests; a fresh session)."""
    for choice in (_data, _models, _session_models):
        choice.folder, choice.setting = None, ""


def data_dir() -> Path:
    """The chosen data folder, else ZEROTVM_HOME if set, else the platform's per-user data folder."""
    if _data.folder:
        return _data.folder
    if os.environ.get("ZEROTVM_HOME"):
        return Path(os.environ["ZEROTVM_HOME"]).expanduser()
    if sys.platform == "win32":
        return Path(os.environ.get("LOCALAPPDATA") or Path.home() / "AppData" / "Local") / APP_NAME
    if sys.platform == "darwin":
        return Path.home() / "Library" / "Application Support" / APP_NAME
    # The same folder Qt's QStandardPaths.AppLocalDataLocation gives the app (application name APP_NAME).
    return Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share") / APP_NAME


def models_dir() -> Path:
    """Installed models: one folder (MLC/HF layout) or one .gguf file per model. The chosen folder, else
    ZEROTVM_MODELS, else the data folder's `models`."""
    if _models.folder:
        return _models.folder
    if os.environ.get("ZEROTVM_MODELS"):
        return Path(os.environ["ZEROTVM_MODELS"]).expanduser()
    if _session_models.folder:
        return _session_models.folder
    return data_dir() / "models"


def _folder_name(folder: Path) -> str:
    """The folder, and the setting it comes from when that is what the user must change."""
    folder = Path(folder)
    for what, choice, env in (("data", _data, "ZEROTVM_HOME"), ("models", _models, "ZEROTVM_MODELS")):
        if folder != (data_dir() if what == "data" else models_dir()):
            continue
        setting = (choice.setting if choice.folder else env if os.environ.get(env) else "")
        if setting:
            return f"the {what} folder {folder} ({setting})"
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
    """For a session whose data folder cannot be used: choose a new temporary data folder (every later write then
    succeeds, it is just not kept), keep the models folder in view, and return the original data folder, from
    which chats and settings are still read."""
    original = data_dir()
    if (original / "models").is_dir():
        _session_models.folder = original / "models"
    choose_data_dir(tempfile.mkdtemp(prefix="zerotvm-session-"))
    return original
