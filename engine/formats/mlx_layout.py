"""An MLX checkpoint (engine/formats/mlx.py) streamed as the runtime's canonical tensors.

The architecture file's weight table (engine/models/weights.py mlx_sources) names, for each canonical matrix, the
MLX weights whose rows it joins (q_proj ++ k_proj ++ v_proj = c_attn, gate_proj ++ up_proj = gate_up; expert stacks
join along each expert's rows), and for every other canonical tensor its MLX tensor. Everything is planned from the
headers first, so a missing tensor, a bit width that config.json gets wrong or a truncated shard fails before any
upload, naming the file and tensor; then weights are read one at a time, at most one matrix's parts in memory.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats.files import ProgressFn
from engine.formats.mlx import MlxCheckpoint
from engine.packed import PackedWeight


def _keys(tag: str) -> tuple[str, ...]:
    return ("weight",) if tag == "f16" else ("q_weight", "q_scale")


def plan(ckpt: MlxCheckpoint, matrices: dict[str, list[str]], tensors: dict[str, str]
         ) -> tuple[dict[str, str], dict[str, str]]:
    """(canonical matrix -> format tag, canonical tensor -> the label the stream yields it under)."""
    formats, names = {}, {}
    for c, sources in matrices.items():
        tags = {s: ckpt.formats([s])[s] for s in sources}
        tags = {s: "f16" if t == "f32" else t for s, t in tags.items()}  # float matrices run as f16
        shapes = {s: ckpt.shape(s) for s in sources}
        first = sources[0]
        for s in sources[1:]:
            if tags[s] != tags[first] or shapes[s][:-2] != shapes[first][:-2] or shapes[s][-1] != shapes[first][-1]:
                raise UnsupportedModelError(
                    f"{ckpt.source}: '{ckpt.key(first)}' ({tags[first]}, {list(shapes[first])}) and '{ckpt.key(s)}' "
                    f"({tags[s]}, {list(shapes[s])}) run as one matrix and must share their format and input size")
        formats[c] = tags[first]
        label = " + ".join(ckpt.key(s) for s in sources)
        names |= {f"{c}.{key}": f"{label} [{key}]" for key in _keys(tags[first])}
    names |= {c: ckpt.key(src) for c, src in tensors.items()}
    return formats, names


def stream(ckpt: MlxCheckpoint, matrices: dict[str, list[str]], tensors: dict[str, str], names: dict[str, str],
           on_progress: ProgressFn | None = None) -> Iterator[tuple[str, np.ndarray]]:
    """(label from plan(), array) for every canonical tensor, in the order of `matrices` then `tensors`."""
    loaded = ckpt.load([s for sources in matrices.values() for s in sources] + list(tensors.values()), on_progress)
    for c, sources in matrices.items():
        parts = [next(loaded)[1] for _ in sources]
        for key, arr in _join(parts).items():
            yield names[f"{c}.{key}"], arr
        del parts
    for c in tensors:
        arr = next(loaded)[1]["weight"]
        if arr.ndim == 3:  # MLX's Conv1d kernel [C, K, 1] -> PyTorch's [C, 1, K] (depthwise: the same bytes)
            arr = np.ascontiguousarray(np.moveaxis(arr, 2, 1))
        yield names[c], arr


def _join(parts: list[PackedWeight]) -> dict[str, np.ndarray]:
    """One matrix from its parts' rows (axis -2 of the logical shape: each expert's rows in a stack). Memory-mapped
    expert codes join lazily (RowJoin), so an expert cache never copies a whole stack."""
    axis = len(parts[0].shape) - 2
    out = {k: (_rows(parts, k, axis) if len(parts) > 1 else parts[0][k]) for k in parts[0]}
    if "weight" in out and out["weight"].dtype != np.float16:
        with np.errstate(over="ignore"):
            half = out["weight"].astype(np.float16)
        if not np.isfinite(half).all():
            raise ModelFormatError(f"tensor '{parts[0].sources[0]}': a value is past f16's range (±65504)")
        out["weight"] = half
    return out


def _rows(parts: list[PackedWeight], key: str, axis: int):
    arrays = [p[key] for p in parts]
    if axis == 1 and all(isinstance(a, np.memmap) for a in arrays):
        return RowJoin(arrays)
    return np.concatenate(arrays, axis=axis)


class RowJoin:
    """Expert stacks [E, N_i, W] joined along their rows without a copy: np.asarray joins them (the resident
    upload), and the expert cache reads its `parts` an expert at a time."""

    ndim = 3

    def __init__(self, parts: list[np.ndarray]):
        first = parts[0]
        self.parts, self.dtype = parts, first.dtype
        self.shape = (first.shape[0], sum(p.shape[1] for p in parts), first.shape[2])
        self.nbytes = sum(p.nbytes for p in parts)

    def __array__(self, dtype=None, copy=None):
        out = np.concatenate(self.parts, axis=1)
        return out if dtype is None else out.astype(dtype)
