"""Where the app keeps its data: models, chats, settings. Plain paths, no Qt (QStandardPaths lives in app/)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

APP_NAME = "ZeroTVM"


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
