"""The model catalog (resources/models.json) plus models the user added from disk (local_models.json).

Every entry carries what the download and memory-fit code need without opening the model: where it comes
from (repo, pinned revision, file patterns), how big it is, its architecture's dimensions (for the KV cache
and scratch sizes in engine/memfit.py), default sampling, and whether the engine runs it yet. Local models
are read cheaply (config and manifest only) when added and kept in the data folder.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import MISSING, asdict, dataclass, fields
from pathlib import Path

from engine import demo
from engine.errors import ModelFormatError
from engine.formats.files import read_json
from engine.models import format_support
from engine.paths import data_dir, models_dir
from engine.resources import resource_path

FORMATS = ("mlc", "mlx", "gguf", "hf")  # hf: an unconverted checkpoint added from disk
SOURCES = ("huggingface", "pypi", "local")
KEY_RE = re.compile(r"^[a-z0-9][a-z0-9._-]*$")  # doubles as the install folder name
SHA_RE = re.compile(r"^[0-9a-f]{40}$")
LOCAL_FILE = "local_models.json"
DIM_FIELDS = ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "head_dim", "ffn_dim", "vocab_size",
              "kv_layers")


@dataclass
class CatalogEntry:
    key: str
    name: str
    format: str
    architecture: str  # Hugging Face model_type
    source: str
    repo: str | None
    revision: str | None  # a Hub commit sha, or None where it is not known yet
    revision_source: str
    files: list[str]  # file patterns to download
    total_bytes: int | None
    size_source: str
    size_approximate: bool
    weights_bytes: int  # what the weights occupy on the GPU
    largest_tensor_bytes: int  # bounds host RAM while loading (one tensor at a time)
    default_context: int
    max_context: int
    kv_bytes_per_token: int
    dims: dict
    license: str
    generation: dict | None  # temperature / top_k / top_p / min_p
    generation_source: str
    runs: bool
    runs_reason: str | None
    weights_approximate: bool = False  # weights_bytes is an estimate or a third-party figure, not computed
    ram_warning_bytes: int | None = None
    ram_warning: str | None = None
    dims_source: str = ""
    license_source: str = ""
    notes: str = ""
    package: str | None = None
    sha256: str | None = None
    path: str | None = None  # local models only
    file_type: str | None = None  # a GGUF build's general.file_type, as llama-quantize names it (Q4_K_M): memfit's mix

    @property
    def is_local(self) -> bool:
        return self.source == "local"

    @property
    def is_demo(self) -> bool:
        return self.source == "pypi"

    def to_dict(self) -> dict:
        return asdict(self)


# field -> (accepted types, may be None); the dataclass defaults say which ones may be left out.
_TYPES = {
    "key": (str, False), "name": (str, False), "format": (str, False), "architecture": (str, False),
    "source": (str, False), "repo": (str, True), "revision": (str, True), "revision_source": (str, False),
    "files": (list, False), "total_bytes": (int, True), "size_source": (str, False), "size_approximate": (bool, False),
    "weights_bytes": (int, False), "largest_tensor_bytes": (int, False), "default_context": (int, False),
    "max_context": (int, False), "kv_bytes_per_token": (int, False), "dims": (dict, False), "license": (str, False),
    "generation": (dict, True), "generation_source": (str, False), "runs": (bool, False), "runs_reason": (str, True),
    "weights_approximate": (bool, False), "ram_warning_bytes": (int, True), "ram_warning": (str, True),
    "dims_source": (str, False), "license_source": (str, False), "notes": (str, False), "package": (str, True),
    "sha256": (str, True), "path": (str, True), "file_type": (str, True),
}
_REQUIRED = [f.name for f in fields(CatalogEntry) if f.default is MISSING and f.default_factory is MISSING]


def kv_bytes_per_token(dims: dict) -> int:
    """f16 K and V for one position over every layer that keeps a KV cache (hybrids: attention layers only)."""
    return 2 * dims["kv_layers"] * dims["num_kv_heads"] * dims["head_dim"] * 2


def entry_from_dict(raw, where: str) -> CatalogEntry:
    """Validate one entry; errors name `where` (file and entry) and the field at fault."""
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{where}: expected an object")
    label = f"{where} ({raw['key']!r})" if isinstance(raw.get("key"), str) else where

    def bad(name: str, why: str) -> ModelFormatError:
        return ModelFormatError(f"{label}: field '{name}' {why}")

    for name in _REQUIRED:
        if name not in raw:
            raise bad(name, "is missing")
    for name, value in raw.items():
        if name not in _TYPES:
            raise bad(name, "is not a catalog field")
        kind, nullable = _TYPES[name]
        if value is None and nullable:
            continue
        if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
            raise bad(name, f"must be {'null or ' if nullable else ''}{kind.__name__}, got {value!r}")
        if kind is int and value <= 0:
            raise bad(name, f"must be positive, got {value}")
    if not KEY_RE.match(raw["key"]):
        raise bad("key", "must be lowercase letters, digits, '.', '_' or '-' (it names the install folder)")
    if raw["format"] not in FORMATS:
        raise bad("format", f"must be one of {', '.join(FORMATS)}, got {raw['format']!r}")
    if raw["source"] not in SOURCES:
        raise bad("source", f"must be one of {', '.join(SOURCES)}, got {raw['source']!r}")
    if raw["source"] == "huggingface" and not raw["repo"]:
        raise bad("repo", "is required for a Hugging Face model")
    if raw["revision"] is not None and not SHA_RE.match(raw["revision"]):
        raise bad("revision", f"must be a 40-digit commit sha or null, got {raw['revision']!r}")
    if not raw["files"] or not all(isinstance(p, str) and p for p in raw["files"]):
        raise bad("files", "must be a non-empty list of file patterns")
    if not raw["runs"] and not raw["runs_reason"]:
        raise bad("runs_reason", "must say why when 'runs' is false")
    if raw["default_context"] > raw["max_context"]:
        raise bad("default_context", f"({raw['default_context']}) exceeds max_context ({raw['max_context']})")
    _check_dims(raw["dims"], bad)
    if raw.get("file_type") is not None:
        from engine.formats.gguf_mix import FILE_TYPES

        if raw["format"] != "gguf":
            raise bad("file_type", f"is for GGUF builds, not {raw['format']}")
        if raw["file_type"] not in FILE_TYPES:
            raise bad("file_type", f"must be one of {', '.join(FILE_TYPES)}, got {raw['file_type']!r}")
    if raw["kv_bytes_per_token"] != kv_bytes_per_token(raw["dims"]):
        raise bad("kv_bytes_per_token", f"is {raw['kv_bytes_per_token']} but the dims give "
                                        f"2·{raw['dims']['kv_layers']}·{raw['dims']['num_kv_heads']}·"
                                        f"{raw['dims']['head_dim']}·2 = {kv_bytes_per_token(raw['dims'])}")
    if raw["generation"] is not None:
        _check_generation(raw["generation"], bad)
    return CatalogEntry(**raw)


def _check_dims(dims: dict, bad) -> None:
    for name in DIM_FIELDS:
        value = dims.get(name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise bad(f"dims.{name}", f"must be a positive integer, got {value!r}")
    if dims["kv_layers"] > dims["num_layers"]:
        raise bad("dims.kv_layers", "exceeds dims.num_layers")
    for group in ("linear_attention", "moe"):
        if group in dims and not isinstance(dims[group], dict):
            raise bad(f"dims.{group}", "must be an object")


def _check_generation(gen: dict, bad) -> None:
    for name in ("temperature", "top_k", "top_p", "min_p"):
        value = gen.get(name)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0:
            raise bad(f"generation.{name}", f"must be a non-negative number, got {value!r}")


def _read_entries(path: Path, what: str) -> list[CatalogEntry]:
    data = read_json(path, what)
    if not isinstance(data.get("models"), list):
        raise ModelFormatError(f"{path}: field 'models' is missing or not a list")
    entries = [entry_from_dict(raw, f"{path}: models[{i}]") for i, raw in enumerate(data["models"])]
    seen: set[str] = set()
    for i, e in enumerate(entries):
        if e.key in seen:
            raise ModelFormatError(f"{path}: models[{i}]: field 'key' {e.key!r} is used twice")
        seen.add(e.key)
    return entries


def catalog_path() -> Path:
    return resource_path("models.json")


def load_catalog(path: str | os.PathLike | None = None) -> list[CatalogEntry]:
    """The bundled catalog (or `path`), validated; a malformed file raises ModelFormatError naming the field."""
    return _read_entries(Path(path) if path else catalog_path(), "model catalog")


def all_models(catalog: str | os.PathLike | None = None, local: str | os.PathLike | None = None
               ) -> list[CatalogEntry]:
    """Catalog entries, then models added from disk."""
    return load_catalog(catalog) + load_local(local)


def entry(key: str, catalog: str | os.PathLike | None = None, local: str | os.PathLike | None = None
          ) -> CatalogEntry:
    models = all_models(catalog, local)
    for e in models:
        if e.key == key:
            return e
    raise KeyError(f"no model {key!r} in the catalog; known: {', '.join(e.key for e in models)}")


def install_dir(e: CatalogEntry, models: str | os.PathLike | None = None) -> Path:
    """Where a model lives once installed: models_dir()/<key> for Hub models; the models folder itself for
    the demo (engine.demo installs one .gguf file there); the chosen path for local models."""
    if e.is_local:
        return Path(e.path)
    root = Path(models or models_dir())
    return root if e.is_demo else root / e.key


def demo_matches(e: CatalogEntry) -> bool:
    """True when the catalog's demo entry agrees with engine/demo.py."""
    return (e.files == [demo.FILE_NAME] and e.total_bytes == demo.FILE_SIZE and e.sha256 == demo.FILE_SHA256
            and e.package == demo.PACKAGE)


# ---- local models --------------------------------------------------------------------------------

def local_path() -> Path:
    return data_dir() / LOCAL_FILE


def load_local(path: str | os.PathLike | None = None) -> list[CatalogEntry]:
    """Models added from disk. A broken file is moved aside to <name>.bad (never deleted) and reads as none."""
    path = Path(path or local_path())
    if not path.exists():
        return []
    try:
        entries = _read_entries(path, "local model list")
    except ModelFormatError:
        try:
            os.replace(path, path.with_name(path.name + ".bad"))
        except OSError:
            pass
        return []
    return [e for e in entries if e.is_local]


def _save_local(entries: list[CatalogEntry], path: Path) -> None:
    # Atomic: a crash mid-write leaves the old file, never half of a new one.
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps({"schema": 1, "models": [e.to_dict() for e in entries]}, indent=2), encoding="utf-8")
    os.replace(tmp, path)


def add_local(model: str | os.PathLike, path: str | os.PathLike | None = None) -> CatalogEntry:
    """Add a model from disk: a folder with mlc-chat-config.json or config.json, or a .gguf file.

    Reads only its config and manifest/header. Adding the same path again replaces its entry. Errors name
    the file at fault. `path`: the local model list (default: data_dir()/local_models.json).
    """
    from engine.local_models import describe  # the format readers pull in numpy/gguf; only needed here

    new = describe(Path(model).expanduser().resolve())
    list_path = Path(path or local_path())
    kept = [e for e in load_local(list_path) if e.key != new.key]
    _save_local(kept + [new], list_path)
    return new


def remove_local(key: str, path: str | os.PathLike | None = None) -> bool:
    """Forget a model added from disk (its files stay). False when no local model has that key."""
    list_path = Path(path or local_path())
    entries = load_local(list_path)
    kept = [e for e in entries if e.key != key]
    if len(kept) == len(entries):
        return False
    _save_local(kept, list_path)
    return True


def local_key(model: Path) -> str:
    """A stable key for a path: a readable slug plus a short hash, so two folders named alike differ."""
    slug = re.sub(r"[^a-z0-9._-]+", "-", model.stem.lower() if model.is_file() else model.name.lower()).strip("-.")
    digest = hashlib.sha256(str(model).encode()).hexdigest()[:8]
    return f"local-{slug or 'model'}-{digest}"


def supported_runtime(fmt: str, model_type: str) -> str | None:
    """None when the engine runs this format and architecture, else the reason it does not."""
    if fmt == "hf":
        return "an unconverted Hugging Face checkpoint; convert it with `zerotvm convert` first."
    return format_support(model_type, fmt)


def write_generation_defaults(e: CatalogEntry, folder: Path) -> Path | None:
    """Give a downloaded model folder the catalog's sampling defaults as a generation_config.json when the repo
    ships none (MLC builds do not), so the model samples as its card recommends instead of greedily."""
    target = Path(folder) / "generation_config.json"
    if not e.generation or target.exists() or not Path(folder).is_dir():
        return None
    gen = dict(e.generation)
    sampled = gen.get("temperature", 0) > 0
    payload = {"do_sample": sampled, **gen, "_source": "zerotvm catalog: " + e.generation_source}
    if not sampled:
        payload.pop("temperature", None)
    tmp = target.with_name(target.name + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2), encoding="utf-8")
    os.replace(tmp, target)
    return target
