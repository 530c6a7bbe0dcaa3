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


def catalog_state(e, models: Path | None = None) -> tuple[str, Path]:
    """("installed" | "partial" | "-" | "local" | "missing", the path load_model takes) for a catalog entry. A partial
    or unverified download is never "installed"."""
    from engine.catalog import install_dir

    folder = install_dir(e, models)
    if e.is_demo:
        return ("installed" if demo.is_installed(folder) else "-"), demo.demo_path(folder)
    if e.is_local:
        return ("local" if folder.exists() else "missing"), folder
    from engine.hub.state import is_installed, staging_dir

    return ("installed" if is_installed(folder) else "partial" if staging_dir(folder).exists() else "-"), folder


def find_entry(name: str):
    """The catalog (or local) entry whose key is `name`, or whose installed path is `name`; None if neither."""
    from engine.catalog import all_models, install_dir

    entries = all_models()
    hit = next((e for e in entries if e.key == name), None)
    if hit is not None or not Path(name).exists():
        return hit
    target = Path(name).resolve()
    for e in entries:
        folder = install_dir(e)
        paths = {folder, demo.demo_path(folder)} if e.is_demo else {folder}
        if any(p.resolve() == target for p in paths):
            return e
    return None


def resolve_model(name: str) -> Path:
    """What load_model takes for a MODEL argument: a file or folder as is, or a catalog key's installed copy.
    Raises ZeroTVMError in one sentence saying what to do when it is neither."""
    from engine.catalog import all_models
    from engine.errors import ZeroTVMError

    path = Path(name).expanduser()
    if path.exists():
        return path
    e = next((e for e in all_models() if e.key == name), None)
    if e is None:
        raise ZeroTVMError(f"there is no model file, folder or catalog key called {name!r}; run `zerotvm models` "
                           "to see the keys, or give the path of a model folder or .gguf file")
    state, where = catalog_state(e)
    if state in ("installed", "local"):
        return where
    if e.is_local:
        raise ZeroTVMError(f"{e.name} was added from {where}, which is no longer there; put it back, or run "
                           f"`zerotvm remove {e.key}` to forget it")
    how = "zerotvm install-demo" if e.is_demo else f"zerotvm download {e.key}"
    more = " (its download stopped part way; the same command resumes it)" if state == "partial" else ""
    raise ZeroTVMError(f"{e.name} is not downloaded yet{more}; run `{how}` first")
