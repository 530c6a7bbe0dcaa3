"""Architectures, one module per Hugging Face model_type (mlx-lm style)."""

from __future__ import annotations

import importlib

from engine.errors import UnsupportedModelError

SUPPORTED = ("phi3", "llama", "qwen3")


def model_module(model_type: str | None, where: str = "config"):
    """The module for `model_type` (engine.models.<model_type>) with ModelArgs and spec()."""
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    return importlib.import_module(f"engine.models.{model_type}")
