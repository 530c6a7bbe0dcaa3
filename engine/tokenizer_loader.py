"""Which reader builds a model's tokenizer: a folder's tokenizer files (engine/tokenizer.py) or a GGUF file's
metadata (engine/formats/gguf_tokenizer.py). Here, so that the tokenizer and the GGUF reader import neither
each other nor the other's format."""

from __future__ import annotations

from pathlib import Path

from engine.errors import ModelFormatError
from engine.tokenizer import Tokenizer


def load_tokenizer(path: str | Path) -> Tokenizer:
    """A model folder's tokenizer, or a .gguf file's (built from its metadata)."""
    path = Path(path)
    if path.suffix.lower() == ".gguf":
        from engine.formats.gguf_tokenizer import read_tokenizer

        return Tokenizer.from_parts(*read_tokenizer(path))
    if not path.is_dir():
        raise ModelFormatError(f"{path}: not a model folder")
    return Tokenizer.from_dir(path)
