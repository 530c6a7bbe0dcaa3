"""Locate bundled data (shaders/, resources/) from a source checkout or a frozen app."""

from __future__ import annotations

import sys
from pathlib import Path


def root() -> Path:
    """The folder holding shaders/ and resources/: the PyInstaller bundle dir or the repo root."""
    frozen = getattr(sys, "_MEIPASS", None)
    return Path(frozen) if frozen else Path(__file__).resolve().parent.parent


def shader_path(name: str) -> Path:
    return root() / "shaders" / f"{name}.wgsl"


def resource_path(*parts: str) -> Path:
    return root().joinpath("resources", *parts)
