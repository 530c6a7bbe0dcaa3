"""App preferences that are not chat settings (those live in engine/settings.py, shared with `zerotvm chat`)."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from engine.errors import ModelFormatError
from engine.formats.files import read_json

THEMES = ("system", "light", "dark")
MAX_PREFS_BYTES = 1 << 20  # a handful of short fields; anything bigger is not ours


@dataclass
class AppPrefs:
    theme: str = "system"
    adapter: str = ""  # "" = automatic; else an adapter index or name (ZEROTVM_ADAPTER semantics)
    models_dir: str = ""  # "" = the default models folder
    offline: bool = False  # forbid all network use (no downloads)
    context: int = 0  # context window to load models with; 0 = the model's default
    last_model: str = ""  # catalog key or local path loaded last time
    exact_decode: bool = False  # f32 activations in decode (slower); the default rounds them to int8 per layer
    gpu_weights: str = "auto"  # the weights budget as typed (engine/gpu_budget.py: bytes, 12G, 8192M, or auto)
    software_notice_shown: list = field(default_factory=list)  # adapters (AdapterInfo.key) told they are software

    def validate(self) -> None:
        if self.theme not in THEMES:
            raise ValueError(f"theme must be one of {THEMES}")
        if not isinstance(self.context, int) or self.context < 0:
            raise ValueError("context must be a non-negative integer")
        from engine.gpu_budget import parse_size

        parse_size(self.gpu_weights, "GPU weights budget")  # a ValueError naming the setting
        if not all(isinstance(k, str) for k in self.software_notice_shown):
            raise ValueError("software_notice_shown must be a list of adapter names")


def load_prefs(path: Path) -> AppPrefs:
    """Each bad or missing value falls back to its default; an unreadable file (too big, too deep, not JSON,
    not an object) is kept aside as .bad, never overwritten by the defaults saved later."""
    try:
        data = read_json(path, "the app preferences", default=None, max_bytes=MAX_PREFS_BYTES)
    except (ModelFormatError, OSError):
        try:
            os.replace(path, path.with_name(path.name + ".bad"))
        except OSError:
            pass
        return AppPrefs()
    if data is None:
        return AppPrefs()
    prefs = AppPrefs()
    for f in fields(AppPrefs):
        if isinstance(data, dict) and f.name in data and type(data[f.name]) is type(getattr(prefs, f.name)):
            candidate = AppPrefs(**{**asdict(prefs), f.name: data[f.name]})
            try:
                candidate.validate()
            except ValueError:
                continue
            prefs = candidate
    return prefs


def save_prefs(prefs: AppPrefs, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(asdict(prefs), indent=2), encoding="utf-8")
    os.replace(tmp, path)
