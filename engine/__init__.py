"""Zero-TVM engine: Qt-free GPU inference on hand-written WGSL kernels."""

from __future__ import annotations

import re
from pathlib import Path

DIST_NAME = "zerotvm-desktop"  # pyproject's [project] name; its `version` is the one source of the version
_VERSION = re.compile(r'^version\s*=\s*["\']([^"\']+)["\']', re.M)
_version: str | None = None


def pyproject_version(path: str | Path) -> str | None:
    """The `version` of pyproject.toml's [project] table (a line parse: tomllib is 3.11+), or None."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError:
        return None
    project = re.search(r"^\[project\]\s*$(.*?)(?=^\[|\Z)", text, re.M | re.S)
    found = _VERSION.search(project.group(1)) if project else None
    return found.group(1) if found else None


def get_version() -> str:
    """The installed distribution's version; when it is not installed (a source tree, a frozen app that bundles
    pyproject.toml), the version in pyproject.toml next to shaders/ and resources/."""
    global _version
    if _version is None:
        from importlib import metadata

        try:
            _version = metadata.version(DIST_NAME)
        except metadata.PackageNotFoundError:
            from engine.resources import root

            _version = pyproject_version(root() / "pyproject.toml") or "0+unknown"
    return _version


def __getattr__(name: str):
    if name == "__version__":  # computed on first use, so `import engine` stays light
        return get_version()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def load_model(*args, **kwargs):
    """See engine.model.load_model (imported lazily so `import engine` stays light)."""
    from engine.model import load_model as _load

    return _load(*args, **kwargs)
