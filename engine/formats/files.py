"""Reading untrusted model files: bounded JSON, confined paths, safetensors headers and tensor byte ranges.

Every format reader goes through here, so a name read from a file never becomes a path outside the model
folder, a size never allocates past engine/formats/limits.py, and every failure is a ModelFormatError that
names the file (and the field or tensor) in one sentence.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path, PurePosixPath, PureWindowsPath

import numpy as np

from engine.errors import ModelFormatError
from engine.formats.limits import (
    MAX_JSON_BYTES,
    MAX_JSON_DEPTH,
    MAX_SAFETENSORS_HEADER,
    MAX_TENSOR_DIMS,
    MAX_TEXT_BYTES,
)

# on_progress(part index, parts, path, bytes done, bytes total): a reader's load() calls it after each shard or
# weight it finishes.
ProgressFn = Callable[[int, int, str, int, int], None]
_REQUIRED = object()
# A JSON string literal (brackets inside strings do not nest); the unrolled form never backtracks.
_STRING = re.compile(r'"[^"\\]*(?:\\.[^"\\]*)*"', re.S)


def shown(value, limit: int = 80) -> str:
    """repr() of a value from a file, cut short: an error message must not echo megabytes."""
    text = repr(value)
    return text if len(text) <= limit else text[:limit] + "…"


# -- bounded reads ----------------------------------------------------------------------------------------

def read_bytes(path: Path, max_bytes: int, what: str = "file") -> bytes:
    """A whole (small) file, refused past max_bytes before it is read."""
    try:
        if path.is_dir():
            raise ModelFormatError(f"{path}: is a folder, expected a {what}")
        size = path.stat().st_size
        if size > max_bytes:
            raise ModelFormatError(f"{path}: {size:,} bytes, more than a {what} can be ({max_bytes:,} bytes)")
        with open(path, "rb") as f:
            data = f.read(size + 1)  # not max_bytes + 1: read() allocates what it is asked for up front
        if len(data) > max_bytes:
            raise ModelFormatError(f"{path}: grew past {max_bytes:,} bytes while being read")
        return data
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read it ({e.strerror or e})") from None


def read_text(path: Path, what: str = "text file", max_bytes: int = MAX_TEXT_BYTES) -> str:
    try:
        return read_bytes(path, max_bytes, what).decode("utf-8-sig")
    except UnicodeDecodeError as e:
        raise ModelFormatError(f"{path}: not UTF-8 text (byte {e.start})") from None


def read_json(path: Path, what: str = "JSON file", *, default=_REQUIRED, kind: type | None = dict,
              max_bytes: int = MAX_JSON_BYTES):
    """A JSON file's value; `default` when the file is absent (else an error naming it), `kind` the type the
    top level must have (None: any). Size and nesting depth are bounded before parsing."""
    if not path.exists() and not path.is_symlink():
        if default is not _REQUIRED:
            return default
        raise ModelFormatError(f"{path}: missing ({what})")
    return parse_json(read_text(path, what, max_bytes), str(path), kind)


def parse_json(text: str, where: str, kind: type | None = dict):
    """json.loads with the depth bounded first, so deep nesting is an error naming `where`, not RecursionError."""
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise ModelFormatError(f"{where}: JSON nested {depth} levels deep; real files nest a few levels "
                               f"(limit {MAX_JSON_DEPTH})")
    try:
        value = json.loads(text)
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and int strings past Python's digit limit
        raise ModelFormatError(f"{where}: not valid JSON ({str(e)[:200]})") from None
    if kind is not None and not isinstance(value, kind):
        raise ModelFormatError(f"{where}: expected a JSON {_KIND_NAMES.get(kind, kind.__name__)} at the top level, "
                               f"found {_KIND_NAMES.get(type(value), type(value).__name__)}")
    return value


_KIND_NAMES = {dict: "object", list: "array", str: "string", int: "number", float: "number", bool: "boolean",
               type(None): "null"}


def json_depth(text: str) -> int:
    """The deepest bracket nesting of JSON text, strings ignored (an upper bound for malformed text)."""
    if text.count("[") + text.count("{") <= MAX_JSON_DEPTH:
        return 0  # too few brackets to pass the limit: skip the scan
    bare = np.frombuffer(_STRING.sub("", text).encode("utf-8", "surrogatepass"), np.uint8)
    opens = (bare == ord("[")) | (bare == ord("{"))
    steps = opens.astype(np.int8) - ((bare == ord("]")) | (bare == ord("}")))
    steps = steps[steps != 0]
    return int(np.cumsum(steps, dtype=np.int64).max(initial=0))


# -- paths named inside files -----------------------------------------------------------------------------

def confined(folder: Path, name, where: Path | str, what: str = "path", note: str = "") -> Path:
    """folder / name for a relative path read from a file (a shard in an index, a manifest's dataPath),
    refused unless it names something inside `folder`: no absolute path, drive, `..` or backslash, and no
    folder on the way that is a link leading out. The file itself may be a link (the Hugging Face cache's
    snapshot folders link every file into blobs/), since a name cannot create one."""
    text = name if isinstance(name, str) else None
    bad = (text is None or not text or "\0" in text or "\\" in text or ":" in text
           or PurePosixPath(text).is_absolute() or PureWindowsPath(text).is_absolute() or PureWindowsPath(text).drive
           or ".." in PurePosixPath(text).parts)
    path = folder / text if not bad else None
    if path is not None:
        try:
            inside = path.parent.resolve().is_relative_to(folder.resolve())
        except (OSError, RuntimeError):  # a link loop
            inside = False
        bad = not inside
    if bad:
        raise ModelFormatError(f"{where}: the {what} {shown(name)}{note} is not a relative path inside the model "
                               f"folder {folder}; refusing to read it")
    return path


# -- safetensors ------------------------------------------------------------------------------------------

# Bits per element of every safetensors dtype (the format's own list), and numpy's dtype where numpy has one.
_BITS = {"BOOL": 8, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8, "F8_E8M0": 8, "F8_E4M3FNUZ": 8,
         "F8_E5M2FNUZ": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
         "C64": 64, "F64": 64, "I64": 64, "U64": 64, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6}
NUMPY_DTYPES = {"BF16": "<u2", "F16": "<f2", "F32": "<f4", "F64": "<f8", "U8": "u1", "I8": "i1", "U16": "<u2",
                "I16": "<i2", "U32": "<u4", "I32": "<i4", "U64": "<u8", "I64": "<i8", "BOOL": "?"}


@dataclass(frozen=True)
class Tensor:
    """One tensor of a safetensors file: its key, dtype, shape and absolute byte range in `path`."""

    key: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int
    path: Path


def safetensors_header(path: Path) -> dict[str, Tensor]:
    """A safetensors file's tensors, in file order. The `safetensors` package parses and validates the header
    (bounded length, known dtypes, shape × dtype = byte span with overflow checks, spans contiguous and covering
    the file exactly); the byte ranges follow from that order."""
    from safetensors import SafetensorError, safe_open

    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            head = f.read(8)
    except OSError as e:
        raise ModelFormatError(f"{path}: cannot read it ({e.strerror or e})") from None
    n = int.from_bytes(head, "little") if len(head) == 8 else -1
    if n < 2 or n > min(size - 8, MAX_SAFETENSORS_HEADER):
        raise ModelFormatError(f"{path}: not a safetensors file, or truncated ({size:,} bytes; its first 8 bytes "
                               "do not give a header length that fits)")
    try:
        with safe_open(str(path), framework="numpy") as f:
            entries = [(key, f.get_slice(key)) for key in f.offset_keys()]
            entries = [(key, s.get_dtype(), tuple(s.get_shape())) for key, s in entries]
    except (SafetensorError, OSError, ValueError, TypeError) as e:
        detail = str(e).removeprefix("Error while deserializing header: ")[:300]
        message = _cut_tensor(path, n, size) or f"{path}: not a valid safetensors file: {detail}"
        raise ModelFormatError(message) from None
    out, offset = {}, 8 + n
    for key, dtype, shape in entries:
        if dtype not in _BITS:
            raise ModelFormatError(f"{path}: tensor {shown(key)} has dtype {shown(dtype)}, unknown to this reader")
        if len(shape) > MAX_TENSOR_DIMS:
            raise ModelFormatError(f"{path}: tensor {shown(key)} has {len(shape)} dimensions (at most "
                                   f"{MAX_TENSOR_DIMS})")
        nbytes = math.prod(shape) * _BITS[dtype] // 8
        out[key] = Tensor(key, dtype, shape, offset, nbytes, path)
        offset += nbytes
    if offset != size:  # the package checks this; a mismatch here would mean we misread its spans
        raise ModelFormatError(f"{path}: tensor data ends at byte {offset:,} but the file has {size:,} bytes")
    return out


def _cut_tensor(path: Path, n: int, size: int) -> str | None:
    """For a header the package refused: the message naming the first tensor whose bytes lie past the end of
    the file (a truncated download, the usual case), or None."""
    try:
        with open(path, "rb") as f:
            f.seek(8)
            header = parse_json(f.read(n).decode("utf-8"), str(path))
        spans = sorted((int(v["data_offsets"][1]), k) for k, v in header.items() if k != "__metadata__")
    except (ModelFormatError, OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return None
    cut = next(((end, key) for end, key in spans if 8 + n + end > size), None)
    if cut is None:
        return None
    return (f"{path}: tensor {shown(cut[1])} needs bytes up to {8 + n + cut[0]} but the file is {size} bytes "
            "(truncated download?)")


def read_array(t: Tensor) -> np.ndarray:
    """A tensor's values read from its byte range, shaped (bf16 comes back as its raw u16 bits)."""
    if t.dtype not in NUMPY_DTYPES:
        raise ModelFormatError(f"{t.path}: tensor '{t.key}' is {t.dtype}, which this engine cannot read")
    dtype = np.dtype(NUMPY_DTYPES[t.dtype])
    count = t.nbytes // dtype.itemsize
    try:
        with open(t.path, "rb") as f:
            f.seek(t.offset)
            arr = np.fromfile(f, dtype, count)
    except OSError as e:
        raise ModelFormatError(f"{t.path}: cannot read tensor '{t.key}' ({e.strerror or e})") from None
    if arr.size != count:
        raise ModelFormatError(f"{t.path}: tensor '{t.key}' ends past the end of the file (truncated?)")
    return arr.reshape(t.shape)


def map_array(t: Tensor) -> np.ndarray:
    """A tensor memory-mapped read-only from its byte range (pages are read as they are touched: a MoE model's expert
    stacks, of which an expert cache reads a few experts at a time). The header check covered the file's size."""
    if t.dtype not in NUMPY_DTYPES:
        raise ModelFormatError(f"{t.path}: tensor '{t.key}' is {t.dtype}, which this engine cannot read")
    try:
        return np.memmap(t.path, np.dtype(NUMPY_DTYPES[t.dtype]), "r", offset=t.offset, shape=t.shape)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{t.path}: cannot map tensor '{t.key}' ({e})") from None


def read_floats(t: Tensor) -> np.ndarray:
    """A float tensor: bf16 widened exactly to f32 (bf16 is the top half of an f32), f16/f32/f64 as stored."""
    arr = read_array(t)
    if t.dtype == "BF16":
        return (arr.astype(np.uint32) << 16).view(np.float32)
    return arr


# -- numbers read from configs and headers ----------------------------------------------------------------

def whole_number(value, field: str, where: Path | str, low: int = 1, high: int | None = None,
                 label: str | None = None) -> int:
    """A config/header count as an int, refused (naming the file and field) unless it is a whole number in
    [low, high]; high defaults to the field's CONFIG_LIMITS entry. 32.0 is accepted as 32; 1e9 layers is not."""
    from engine.formats.limits import CONFIG_LIMITS, MAX_UNLISTED_COUNT

    high = CONFIG_LIMITS.get(field, MAX_UNLISTED_COUNT) if high is None else high
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and float(value).is_integer() and low <= value <= high
    if not ok:
        raise ModelFormatError(f"{where}: {label or repr(field)} is {shown(value)}, expected a whole number from "
                               f"{low} to {high:,}")
    return int(value)


def real_number(value, field: str, where: Path | str, low: float = -math.inf, high: float = math.inf,
                low_open: bool = False, label: str | None = None) -> float:
    """A config/header number as a float, refused unless finite and in [low, high] ((low, high] if low_open)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) \
        and (value > low if low_open else value >= low) and value <= high
    if not ok:
        span = f"{'(' if low_open else '['}{low:g}, {high:g}]"
        raise ModelFormatError(f"{where}: {label or repr(field)} is {shown(value)}, expected a finite number in {span}")
    return float(value)
