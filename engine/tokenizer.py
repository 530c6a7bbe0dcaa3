"""Tokenizer on the `tokenizers` library: encode, streaming decode that never splits a UTF-8 character."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HFTokenizer
from tokenizers.decoders import DecodeStream

from engine.errors import ModelFormatError


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_ids: list[int], source: str):
        self.tok, self.eos_ids, self.source = tok, eos_ids, source

    @classmethod
    def from_dir(cls, folder: str | Path) -> Tokenizer:
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelFormatError(f"{folder}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_file(str(path))
        except Exception as e:
            raise ModelFormatError(f"{path}: not a valid tokenizer ({e})") from e
        return cls(tok, _eos_ids(folder, tok), str(path))

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=True)

    def stream(self) -> DecodeStream:
        """A decoder fed one id at a time; `.step(tokenizer.tok, id)` returns text or None (mid-character)."""
        return DecodeStream(skip_special_tokens=True)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text()) if path.exists() else {}
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{path}: not valid JSON ({e})") from e


def _eos_ids(folder: Path, tok: HFTokenizer) -> list[int]:
    """Stop ids from generation_config.json / config files, kept only if the vocabulary has them."""
    ids: list[int] = []
    for name in ("generation_config.json", "config.json", "mlc-chat-config.json"):
        value = _read_json(folder / name).get("eos_token_id")
        ids += value if isinstance(value, list) else [value] if isinstance(value, int) else []
    eos = _read_json(folder / "tokenizer_config.json").get("eos_token")
    eos = eos.get("content") if isinstance(eos, dict) else eos
    if isinstance(eos, str) and tok.token_to_id(eos) is not None:
        ids.append(tok.token_to_id(eos))
    vocab = tok.get_vocab_size(with_added_tokens=True)
    return sorted({i for i in ids if 0 <= i < vocab and tok.id_to_token(i) is not None})
