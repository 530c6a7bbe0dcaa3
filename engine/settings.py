"""Chat settings shared by the app and `zerotvm chat`, kept as JSON in the data folder.

A settings file that is missing, unreadable or holds bad values never stops anything: each bad value falls
back to its default, and a broken file is kept aside (settings.json.bad) rather than overwritten unseen.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, fields
from pathlib import Path

from engine.paths import data_dir
from engine.sampling import SamplingParams
from engine.session import ChatSettings


def settings_path() -> Path:
    return data_dir() / "settings.json"


def settings_to_dict(settings: ChatSettings) -> dict:
    out = asdict(settings)
    out["sampling"] = asdict(settings.sampling) if settings.sampling else None
    return out


def settings_from_dict(data: dict) -> ChatSettings:
    """Build ChatSettings from a dict, keeping the default for every missing or invalid value."""
    settings = ChatSettings()
    for f in fields(ChatSettings):
        if f.name not in data or f.name == "sampling":
            continue
        try:
            candidate = ChatSettings(**{**asdict(settings), "sampling": settings.sampling, f.name: data[f.name]})
        except (TypeError, ValueError):
            continue
        settings = candidate
    raw = data.get("sampling")
    if isinstance(raw, dict):
        known = {f.name for f in fields(SamplingParams)}
        try:
            settings.sampling = SamplingParams(**{k: v for k, v in raw.items() if k in known})
        except (TypeError, ValueError):
            pass
    return settings


def load_settings(path: Path | None = None) -> ChatSettings:
    path = Path(path or settings_path())
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return ChatSettings()
    except (OSError, ValueError):
        try:
            os.replace(path, path.with_name(path.name + ".bad"))
        except OSError:
            pass
        return ChatSettings()
    return settings_from_dict(data if isinstance(data, dict) else {})


def save_settings(settings: ChatSettings, path: Path | None = None) -> None:
    """Write atomically (a temporary file renamed over the old one), so a crash never leaves half a file."""
    path = Path(path or settings_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings_to_dict(settings), indent=2), encoding="utf-8")
    os.replace(tmp, path)
