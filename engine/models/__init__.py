"""Architectures, one module per Hugging Face model_type (mlx-lm style)."""

from __future__ import annotations

import importlib

from engine.errors import UnsupportedModelError

SUPPORTED = ("phi3", "llama", "qwen3", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
# model_type -> module when they differ: the text-only config types share their model's module.
_MODULES = {"qwen3_5_text": "qwen3_5", "qwen3_5_moe_text": "qwen3_5_moe"}


def model_module(model_type: str | None, where: str = "config"):
    """The module for `model_type` (engine.models.<model_type>) with ModelArgs and spec()."""
    if model_type not in SUPPORTED:
        raise UnsupportedModelError(
            f"{where}: model_type {model_type!r} is not supported (supported: {', '.join(SUPPORTED)})"
        )
    return importlib.import_module(f"engine.models.{_MODULES.get(model_type, model_type)}")
