"""Installed models: what is in the models folder, and which one to use when none is named."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from engine import demo
from engine.paths import models_dir


@dataclass(frozen=True)
class InstalledModel:
    name: str
    path: Path  # an MLC/HF folder or a .gguf file
    is_demo: bool = False


def installed_models(folder: Path | None = None) -> list[InstalledModel]:
    """Models under `folder` (default: the models folder): MLC folders (mlc-chat-config.json) and .gguf
    files, at the top level or one folder down (a downloaded repo). Partial downloads are not listed."""
    root = Path(folder or models_dir())
    if not root.is_dir():
        return []
    found = []
    for entry in sorted(root.iterdir()):
        candidates = [entry] + (sorted(entry.iterdir()) if entry.is_dir() else [])
        for path in candidates:
            if path.is_file() and path.suffix.lower() == ".gguf":
                is_demo = path.name == demo.FILE_NAME
                if is_demo and not demo.is_installed(path.parent):
                    continue  # a damaged or partial demo file
                found.append(InstalledModel(demo.TITLE if is_demo else path.stem, path, is_demo))
            elif path.is_dir() and (path / "mlc-chat-config.json").is_file():
                found.append(InstalledModel(path.name, path))
    return found


def default_model(folder: Path | None = None) -> InstalledModel | None:
    """The first installed model that is not the demo, else the demo, else None."""
    models = installed_models(folder)
    return next((m for m in models if not m.is_demo), models[0] if models else None)
