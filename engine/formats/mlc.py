"""Reader for MLC-LLM model folders (q4f16_1 and friends), as written by `mlc_llm convert_weight`.

A folder holds `mlc-chat-config.json`, a manifest (`ndarray-cache.json`, or `tensor-cache.json` from
newer TVM), `params_shard_*.bin` and tokenizer files. The manifest is TVM's tensor cache
(tvm/python/tvm/contrib/tvmjs.py, `dump_tensor_cache`):

    {"metadata": {...},
     "records": [{"dataPath": "params_shard_0.bin", "format": "raw-shard", "nbytes": N, "md5sum": "...",
                  "records": [{"name", "shape", "dtype", "format", "nbytes", "byteOffset"}, ...]}, ...]}

A record's `format` is the cache-wide encode format, so mlc-llm writes "f32-to-bf16" on *every*
record; only float32 records are actually stored as bf16 (uint32 and float16 ones are raw bytes).
Flat records carrying their own `dataPath` are accepted too (zero-tvm's flattenRecords does the same).
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.files import ProgressFn, confined, read_json, shown
from engine.formats.limits import MAX_TENSOR_DIMS

CHAT_CONFIG = "mlc-chat-config.json"
# Preference order; tensor-cache-b16.json (a bf16 re-labelling TVM also writes) is never read.
MANIFESTS = ("ndarray-cache.json", "tensor-cache.json")
TOKENIZER = "tokenizer.json"

_NUMPY_DTYPES = {
    name: np.dtype(name)
    for name in ("float16", "float32", "float64", "int8", "uint8", "int16", "uint16", "int32", "uint32",
                 "int64", "uint64", "bool")
}
_RECORD_FIELDS = ("name", "shape", "dtype", "format", "nbytes", "byteOffset")
_RECORD_FORMATS = ("raw", "f32-to-bf16")


@dataclass(frozen=True)
class Record:
    """One tensor in the manifest, with the shard it lives in resolved."""

    name: str
    shape: tuple[int, ...]
    dtype: str  # manifest dtype: "uint32", "float16", "float32", "bfloat16", ...
    format: str  # "raw" or "f32-to-bf16"
    nbytes: int
    byte_offset: int
    data_path: str  # relative to the model folder
    shard: int  # position of data_path in the manifest's shard order

    @property
    def bf16_stored(self) -> bool:
        # f32-to-bf16 only changes float32 records; raw bfloat16 is bf16 too.
        return (self.format == "f32-to-bf16" and self.dtype == "float32") or self.dtype == "bfloat16"

    @property
    def out_dtype(self) -> np.dtype:
        """The numpy dtype `tensor()` returns (bf16 comes back widened to float32)."""
        return np.dtype(np.float32) if self.bf16_stored else _NUMPY_DTYPES[self.dtype]

    @property
    def stored_itemsize(self) -> int:
        return 2 if self.bf16_stored else _NUMPY_DTYPES[self.dtype].itemsize

    @property
    def end(self) -> int:
        return self.byte_offset + self.nbytes


class MlcCheckpoint:
    """An MLC model folder: config, manifest and shards. Tensors are read by byte range, never a whole shard."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelFormatError(f"{self.path}: model folder not found (or not a folder)")
        self.config_path = self.path / CHAT_CONFIG
        self.config: dict = read_json(self.config_path, f"an MLC model folder needs {CHAT_CONFIG}")

        found = [self.path / m for m in MANIFESTS if (self.path / m).is_file()]
        if not found:
            raise ModelFormatError(f"{self.path}: no tensor manifest (looked for {' or '.join(MANIFESTS)})")
        self.manifest_path = found[0]
        manifest = read_json(self.manifest_path, "the tensor manifest")
        if not isinstance(manifest.get("records"), list):
            raise ModelFormatError(f"{self.manifest_path}: no 'records' list; not an MLC tensor manifest")
        metadata = manifest.get("metadata")
        self.metadata: dict = metadata if isinstance(metadata, dict) else {}
        self._records, shards = _flatten(manifest["records"], self.manifest_path, self.path)
        self.shard_paths = [self.path / s for s in shards]  # in manifest order; Record.shard indexes this

    # -- config -------------------------------------------------------------------------------------

    @property
    def model_type(self) -> str:
        value = self.config.get("model_type")
        if not isinstance(value, str) or not value:
            raise ModelFormatError(f"{self.config_path}: no 'model_type' field; cannot tell the architecture")
        return value

    @property
    def model_config(self) -> dict:
        value = self.config.get("model_config")
        if not isinstance(value, dict):
            raise ModelFormatError(f"{self.config_path}: no 'model_config' object")
        return value

    @property
    def tokenizer_path(self) -> Path:
        path = self.path / TOKENIZER
        if not path.is_file():
            raise ModelFormatError(f"{path}: missing; the model folder has no Hugging Face tokenizer")
        return path

    # -- manifest -----------------------------------------------------------------------------------

    def names(self) -> list[str]:
        """Tensor names in manifest order."""
        return list(self._records)

    def __contains__(self, name: str) -> bool:
        return name in self._records

    def record(self, name: str) -> Record:
        rec = self._records.get(name)
        if rec is None:
            raise ModelFormatError(f"{self.manifest_path}: no tensor '{name}'; {self._suggest(name)}")
        return rec

    def _suggest(self, name: str) -> str:
        if not self._records:
            return "the manifest lists no tensors"
        close = difflib.get_close_matches(name, self._records, n=3, cutoff=0.6)
        some = close or list(self._records)[:5]
        return f"it has {len(self._records)} tensors, {'similar' if close else 'e.g.'}: {', '.join(some)}"

    # -- reading ------------------------------------------------------------------------------------

    def tensor(self, name: str, dtype=None, shape: Iterable[int] | None = None) -> np.ndarray:
        """Read one tensor by byte range; `dtype`/`shape`, when given, are what the caller needs."""
        rec = self.record(name)
        self._check_expected(rec, dtype, shape)
        path = self.shard_paths[rec.shard]
        self._check_shard(path, rec.end, rec.name)
        with _open(path, rec.name) as f:
            return self._read(f, path, rec)

    def load(self, names: Iterable[str] | None = None, on_progress: ProgressFn | None = None
             ) -> Iterator[tuple[str, np.ndarray]]:
        """Yield (name, array) shard by shard, in byte order, one tensor in memory at a time.

        All requested names and shard files are checked before the first tensor is yielded, so a
        broken download fails before anything is uploaded. on_progress counts shards from 0.
        """
        wanted = self.names() if names is None else list(dict.fromkeys(names))
        recs = [self.record(n) for n in wanted]
        by_shard: dict[int, list[Record]] = {}
        for rec in sorted(recs, key=lambda r: (r.shard, r.byte_offset)):
            by_shard.setdefault(rec.shard, []).append(rec)
        for group in by_shard.values():
            last = max(group, key=lambda r: r.end)
            self._check_shard(self.shard_paths[last.shard], last.end, last.name)
        return self._load(list(by_shard.values()), on_progress)

    def _load(self, groups: list[list[Record]], on_progress: ProgressFn | None):
        total = sum(r.nbytes for g in groups for r in g)
        done = 0
        for i, group in enumerate(groups):
            path = self.shard_paths[group[0].shard]
            with _open(path, group[0].name) as f:
                for rec in group:
                    arr = self._read(f, path, rec)
                    done += rec.nbytes
                    yield rec.name, arr
                    del arr  # keep at most one tensor alive here while the caller uploads it
            if on_progress is not None:
                on_progress(i, len(groups), str(path), done, total)

    def _read(self, f, path: Path, rec: Record) -> np.ndarray:
        raw = np.empty(rec.nbytes, np.uint8)
        f.seek(rec.byte_offset)
        got = f.readinto(memoryview(raw))
        if got != rec.nbytes:
            raise ModelFormatError(
                f"{path}: tensor '{rec.name}' needs bytes {rec.byte_offset}..{rec.end} but the file ends early "
                "(truncated download?)"
            )
        if rec.bf16_stored:
            # bf16 is the top half of an f32: widen by shifting into the high 16 bits.
            return (raw.view("<u2").astype(np.uint32) << 16).view(np.float32).reshape(rec.shape)
        return raw.view(rec.out_dtype.newbyteorder("<")).reshape(rec.shape)

    def _check_shard(self, path: Path, end: int, name: str) -> None:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            raise ModelFormatError(f"{path}: shard file missing (needed for tensor '{name}')") from None
        except OSError as e:
            raise ModelFormatError(f"{path}: cannot read the shard ({e.strerror or e})") from None
        if not path.is_file():
            raise ModelFormatError(f"{path}: not a shard file (needed for tensor '{name}')")
        if size < end:
            raise ModelFormatError(
                f"{path}: shard is {size} bytes but tensor '{name}' ends at byte {end} (truncated download?)"
            )

    def _check_expected(self, rec: Record, dtype, shape) -> None:
        if dtype is not None and np.dtype(dtype) != rec.out_dtype:
            raise ModelFormatError(
                f"{self.manifest_path}: tensor '{rec.name}' is {rec.out_dtype.name} {list(rec.shape)}, "
                f"expected {np.dtype(dtype).name}"
            )
        want = None if shape is None else tuple(int(d) for d in shape)
        if want is not None and want != rec.shape:
            raise ModelFormatError(
                f"{self.manifest_path}: tensor '{rec.name}' has shape {list(rec.shape)}, expected {list(want)}"
            )


def _open(path: Path, name: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read the shard for tensor '{name}' ({e.strerror or e})") from None


def _flatten(entries: list, manifest: Path, folder: Path) -> tuple[dict[str, Record], list[str]]:
    """Shard groups and flat records -> {name: Record}, plus shard data paths in first-seen order (each
    checked to stay inside `folder`)."""
    records: dict[str, Record] = {}
    shards: dict[str, int] = {}  # data path -> its position
    for gi, entry in enumerate(entries):
        if not isinstance(entry, dict):
            raise ModelFormatError(f"{manifest}: records[{gi}] is not an object")
        if isinstance(entry.get("records"), list):
            group_path = entry.get("dataPath")
            where = f"records[{gi}] (shard group)"
            if not isinstance(group_path, str):
                raise ModelFormatError(f"{manifest}: {where} has no 'dataPath' field")
            if entry.get("format", "raw-shard") != "raw-shard":
                raise ModelFormatError(f"{manifest}: {where} has format {shown(entry['format'])}, not 'raw-shard'")
            group_nbytes = entry.get("nbytes")
            for ri, raw in enumerate(entry["records"]):
                rec = _record(raw, manifest, f"{where} {shown(group_path)} records[{ri}]", group_path, shards,
                              folder)
                if isinstance(group_nbytes, int) and rec.end > group_nbytes:
                    raise ModelFormatError(
                        f"{manifest}: tensor {shown(rec.name)} ends at byte {rec.end}, past the {group_nbytes}-byte "
                        f"shard {shown(group_path)}"
                    )
                _add(records, rec, manifest)
        else:
            _add(records, _record(entry, manifest, f"records[{gi}]", None, shards, folder), manifest)
    return records, list(shards)


def _add(records: dict[str, Record], rec: Record, manifest: Path) -> None:
    if rec.name in records:
        raise ModelFormatError(f"{manifest}: tensor {shown(rec.name)} is listed twice")
    records[rec.name] = rec


def _record(raw, manifest: Path, where: str, group_path: str | None, shards: dict[str, int], folder: Path
            ) -> Record:
    if not isinstance(raw, dict):
        raise ModelFormatError(f"{manifest}: {where} is not an object")
    if not isinstance(raw.get("name"), str):
        raise ModelFormatError(f"{manifest}: {where} has no 'name' string")
    label = f"tensor {shown(raw['name'])}"
    data_path = raw.get("dataPath", group_path)
    fields = _RECORD_FIELDS if group_path is not None else (*_RECORD_FIELDS, "dataPath")
    for field in fields:
        if field not in raw and not (field == "dataPath" and data_path is not None):
            raise ModelFormatError(f"{manifest}: {label} has no '{field}' field")
    shape, nbytes, offset = raw["shape"], raw["nbytes"], raw["byteOffset"]
    if (not isinstance(shape, list) or len(shape) > MAX_TENSOR_DIMS
            or not all(_whole(d) for d in shape)):
        raise ModelFormatError(f"{manifest}: {label} has a bad 'shape' {shown(shape)} (at most {MAX_TENSOR_DIMS} "
                               "whole numbers ≥ 0)")
    if not all(_whole(v) for v in (nbytes, offset)):
        raise ModelFormatError(f"{manifest}: {label} has a bad 'nbytes'/'byteOffset' ({shown(nbytes)}, "
                               f"{shown(offset)})")
    if not isinstance(data_path, str):
        raise ModelFormatError(f"{manifest}: {label} has a bad 'dataPath' {shown(data_path)}")
    if not isinstance(raw["dtype"], str) or (raw["dtype"] not in _NUMPY_DTYPES and raw["dtype"] != "bfloat16"):
        raise ModelFormatError(f"{manifest}: {label} has unsupported dtype {shown(raw['dtype'])}")
    if not isinstance(raw["format"], str) or raw["format"] not in _RECORD_FORMATS:
        raise ModelFormatError(f"{manifest}: {label} has unknown format {shown(raw['format'])}")
    if data_path not in shards:
        confined(folder, data_path, manifest, "dataPath", f" of {label}")
        shards[data_path] = len(shards)
    rec = Record(
        name=raw["name"], shape=tuple(shape), dtype=raw["dtype"], format=raw["format"], nbytes=nbytes,
        byte_offset=offset, data_path=data_path, shard=shards[data_path],
    )
    expected = math.prod(rec.shape) * rec.stored_itemsize
    if expected != nbytes:
        raise ModelFormatError(
            f"{manifest}: {label} says nbytes={nbytes} but shape {list(shape)} of {raw['dtype']} "
            f"({rec.format}) needs {expected}"
        )
    return rec


def _whole(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0
