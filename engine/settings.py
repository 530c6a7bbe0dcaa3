"""Chat settings shared by the app and `zerotvm chat`, kept as JSON in the data folder.

A settings file that is missing, unreadable or holds bad values never stops anything: each bad value falls
back to its default and is named in a message (read_settings returns them; load_settings logs them), and the
file is kept as it was: an unreadable one is moved aside to settings.json.bad-<time>, one with bad values is
copied there before anything rewrites it. Only values the settings dialog can show are accepted, so it always
opens.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from engine.errors import ModelFormatError
from engine.formats.files import read_json
from engine.paths import data_dir
from engine.sampling import WINDOW, SamplingParams
from engine.session import POLICIES, ChatSettings

log = logging.getLogger("zerotvm.settings")

MAX_FILE_BYTES = 1024**2  # a system prompt of 100,000 characters and the rest fit many times over
MAX_SYSTEM_CHARS = 100_000
MAX_TOKENS = 1 << 20  # per reply; the dialog shows up to 32,768
MAX_SEED = 2**31 - 1  # the settings dialog's seed box holds a 32-bit signed integer
MAX_RESERVE = 1 << 20


def settings_path() -> Path:
    return data_dir() / "settings.json"


def settings_to_dict(settings: ChatSettings) -> dict:
    out = asdict(settings)
    out["sampling"] = asdict(settings.sampling) if settings.sampling else None
    return out


def _integer(value, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


def _number(value, lo: float, hi: float) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
            and lo <= value <= hi)


# field -> (accepts the value, what a good value is). The ranges are what the engine and the dialog take.
FIELD_RULES = {
    "system": (lambda v: v is None or (isinstance(v, str) and len(v) <= MAX_SYSTEM_CHARS),
               f"text of at most {MAX_SYSTEM_CHARS:,} characters, or null"),
    "thinking": (lambda v: v is None or isinstance(v, bool), "true, false or null"),
    "max_tokens": (lambda v: _integer(v, 1, MAX_TOKENS), f"an integer from 1 to {MAX_TOKENS:,}"),
    "seed": (lambda v: v is None or _integer(v, 0, MAX_SEED), f"an integer from 0 to {MAX_SEED:,}, or null"),
    "context_policy": (lambda v: v in POLICIES, " or ".join(repr(p) for p in POLICIES)),
    "reply_reserve": (lambda v: _integer(v, 0, MAX_RESERVE), f"an integer from 0 to {MAX_RESERVE:,}"),
}
SAMPLING_RULES = {
    "temperature": (lambda v: _number(v, 0, 100), "a number from 0 to 100"),
    "top_k": (lambda v: _integer(v, 0, 2**31 - 1), "an integer of 0 or more"),
    "top_p": (lambda v: _number(v, 1e-9, 1), "a number above 0 and at most 1"),
    "min_p": (lambda v: _number(v, 0, 1), "a number from 0 to 1"),
    "repetition_penalty": (lambda v: _number(v, 1e-9, 100), "a number above 0 and at most 100"),
    "seed": (lambda v: _integer(v, 0, 2**64 - 1), "an integer of 0 or more"),
    "penalty_window": (lambda v: _integer(v, 1, WINDOW), f"an integer from 1 to {WINDOW}"),
}


def _shown(value) -> str:
    text = json.dumps(value) if isinstance(value, (str, int, float, bool, type(None))) else type(value).__name__
    return text if len(text) <= 40 else text[:40] + "…"


def check_settings(data: dict, where: str = "settings") -> tuple[ChatSettings, list[str]]:
    """ChatSettings from a dict, and a sentence for each value that was bad and fell back to its default.
    Unknown keys are ignored (a newer version may have written them)."""
    defaults = ChatSettings()
    values, problems = {}, []
    for name, (ok, want) in FIELD_RULES.items():
        if name not in data:
            continue
        if ok(data[name]):
            values[name] = data[name]
        else:
            problems.append(f"{where}: {name} must be {want}, not {_shown(data[name])}; using "
                            f"{_shown(getattr(defaults, name))}")
    raw = data.get("sampling")
    sampling = None
    if isinstance(raw, dict):
        good = {}
        for name, (ok, want) in SAMPLING_RULES.items():
            if name in raw and ok(raw[name]):
                good[name] = raw[name]
            elif name in raw:
                problems.append(f"{where}: sampling.{name} must be {want}, not {_shown(raw[name])}; using the "
                                "default")
        sampling = SamplingParams(**good)
    elif raw is not None:
        problems.append(f"{where}: sampling must be an object or null, not {_shown(raw)}; using the model's "
                        "recommended sampling")
    return ChatSettings(**values, sampling=sampling), problems


def settings_from_dict(data: dict) -> ChatSettings:
    """Build ChatSettings from a dict, keeping the default for every missing or invalid value."""
    return check_settings(data if isinstance(data, dict) else {})[0]


def read_settings(path: Path | None = None) -> tuple[ChatSettings, list[str]]:
    """The saved settings and what was wrong with the file, in sentences (empty when all was well). A file with
    bad values is copied aside first, an unreadable one moved aside: what the user had is never lost."""
    path = Path(path or settings_path())
    try:
        path.stat()
    except FileNotFoundError:
        return ChatSettings(), []
    except OSError as e:  # a file where a folder should be, no permission on the folder
        return ChatSettings(), [f"{path} cannot be read ({e.strerror or e}); using the default chat settings"]
    try:
        data = read_json(path, "chat settings file", max_bytes=MAX_FILE_BYTES)
    except ModelFormatError as e:  # broken JSON, not UTF-8, too deep, too big, a folder
        why = str(e).removeprefix(f"{path}: ").splitlines()[0][:120]
        kept = _keep_aside(path, move=True)
        return ChatSettings(), [f"{path} could not be read ({why}); it was kept as {kept} and the default chat "
                                "settings are used" if kept else
                                f"{path} could not be read ({why}); the default chat settings are used"]
    settings, problems = check_settings(data, where=str(path))
    if problems:
        kept = _keep_aside(path, move=False)
        if kept:
            problems.append(f"the file as it was is kept as {kept}")
    return settings, problems


def _keep_aside(path: Path, move: bool) -> str | None:
    """settings.json.bad-<time> (a copy, or the file itself moved); reuses an identical earlier copy, so a file
    that stays bad is not copied again at every start. Returns the name, or None if nothing could be written."""
    try:
        data = path.read_bytes()
        for earlier in sorted(path.parent.glob(path.name + ".bad*")):
            if earlier.is_file() and earlier.stat().st_size == len(data) and earlier.read_bytes() == data:
                if move:
                    path.unlink()
                return earlier.name
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target, n = path.with_name(f"{path.name}.bad-{stamp}"), 1
        while target.exists():
            target, n = path.with_name(f"{path.name}.bad-{stamp}-{n}"), n + 1
        if move:
            os.replace(path, target)
        else:
            shutil.copy2(path, target)
        return target.name
    except OSError:  # a read-only folder: the file stays where it is, untouched
        return None


def load_settings(path: Path | None = None) -> ChatSettings:
    """read_settings() for callers that only need the settings; the problems go to the log (and, where
    logging is not set up, to stderr)."""
    settings, problems = read_settings(path)
    for problem in problems:
        log.warning("%s", problem)
    return settings


def save_settings(settings: ChatSettings, path: Path | None = None) -> None:
    """Write atomically (a temporary file renamed over the old one), so a crash never leaves half a file."""
    path = Path(path or settings_path())
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(settings_to_dict(settings), indent=2), encoding="utf-8")
    os.replace(tmp, path)

