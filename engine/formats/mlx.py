"""Reader for MLX checkpoints (what mlx-lm's convert/save write): config, safetensors read by byte range,
and the affine-quantized weights repacked, exactly, into the layouts our kernels read.

A folder holds config.json (a vision-language model nests the language model's settings under
`text_config`), model.safetensors.index.json ({"weight_map": {tensor: shard file}}) or a lone
model.safetensors, and tokenizer files. A shard is an 8-byte little-endian header length, a JSON header
{name: {dtype, shape, data_offsets}} and the data; headers are read by the safetensors package
(engine/formats/files.py) and one tensor's byte range at a time, never a whole shard. Keys under
`language_model.` lose that prefix and every other key of such a checkpoint (the vision tower) is ignored: its shards
are never opened.

A quantized module X is three tensors: X.weight (u32 codes), X.scales and X.biases; it is yielded once,
as X.weight, in a PackedWeight. config.json `quantization` holds the defaults {group_size, bits, mode} and
per-module overrides keyed by module path (mlx-lm writes {"bits": 8} for the MoE router and the
shared-expert gate). Formats (engine/kernels/matmul.py FORMATS; N rows, K columns, G = K/64 groups):

| MLX tensor | tag | arrays | value |
|---|---|---|---|
| affine 4-bit, group 64 | mlx4 | q_weight u32 [..., N, K/8], q_scale f16 [..., N, G, 2] = (s, b) | s·q + b |
| affine 3-bit, MoE expert stacks | mlx3 | q_weight u32 [..., N, 3K/32] as stored (one bitstream per row) | s·q + b |
| affine 2- or 3-bit, other tensors | mlx4 | each code widened to a nibble | s·q + b |
| affine 8-bit | mlx8 | q_weight u32 [..., N, K/4], q_scale f16 [..., N, G, 2] | s·q + b |
| affine 5- or 6-bit | mlx8 | each code widened to a byte | s·q + b |
| unquantized A_log, dt_bias | f32 | weight f32, shape as stored | as stored |
| other unquantized tensors | f16 | weight f16 as stored (norms, conv1d [C, 4, 1], biases, matrices) | as stored |

Stacked experts (`switch_mlp.*`, [E, N, K]) keep E leading. MLX packs each row as one LSB-first bitstream:
code i sits at bits [b·i, b·i + b). At 4 and 8 bits that is exactly our order (code i at bits b·(i % (32/b))
of word i·b/32), so the words are copied as they are. At 3 bits a 64-group is 6 words and a code may
straddle two words. MoE expert stacks stay as stored (tag mlx3): they run only in the decode matvecs
(matvec_int4 / moe_matvec), which read the bitstream where it lies, so Qwen3.6-35B-A3B's 3-bit experts keep
their 3-bit size on the GPU. Any other 3-bit tensor is widened to nibbles (exact; 33% more memory), since
the GEMM and the embedding read 4 and 8 bits only.

Scales and biases (bf16, f16 or f32) become f16: bf16 values in f16's normal range (|v| ≥ 2^-14) convert
exactly, smaller ones round to the nearest f16 subnormal, and a value past f16's range is an error.
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats.files import (
    ProgressFn,
    Tensor,
    confined,
    map_array,
    read_array,
    read_floats,
    read_json,
    safetensors_header,
    shown,
)
from engine.models.weights import Weight
from engine.packed import PackedWeight

CONFIG = "config.json"
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
PREFIX = "language_model."
GROUP = 64  # the group size of the mlx4/mlx8 tags
WIDE = {2: 4, 3: 4, 4: 4, 5: 8, 6: 8, 8: 8}  # stored bits -> the kernel layout's bits
ELEMENTS_PER_PASS = 1 << 22  # bounds the temporaries while widening codes or converting floats
_FLOATS = ("BF16", "F16", "F32")


@dataclass(frozen=True)
class _Plan:
    """What reading one logical weight takes, checked from the headers alone."""

    tensors: tuple[Tensor, ...]  # weight (, scales, biases)
    format: str
    shape: tuple[int, ...]  # logical shape: (..., N, K) for quantized matrices
    bits: int  # stored bits (16/32 for float tensors)


class MlxCheckpoint:
    """An MLX model folder. Opening reads config.json, the index and the headers of the shards it needs."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_dir():
            raise ModelFormatError(f"{self.path}: model folder not found (or not a folder)")
        self.config_path = self.path / CONFIG
        raw = read_json(self.config_path, "an MLX model folder needs it")
        text = raw.get("text_config", {})
        if not isinstance(text, dict):
            raise ModelFormatError(f"{self.config_path}: 'text_config' is not an object")
        # The language model's settings; a VLM's text_config wins over the top level.
        self.config: dict = {k: v for k, v in raw.items() if k != "text_config"} | text
        self._defaults, self._overrides = _quantization(raw, text, self.config_path)

        index = self.path / INDEX
        if index.is_file():
            self.source = index
            weight_map = read_json(index, "the safetensors index").get("weight_map")
            if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
                raise ModelFormatError(f"{index}: no 'weight_map' object of tensor -> shard file")
        elif (self.path / SINGLE).is_file():
            self.source = self.path / SINGLE
            weight_map = {k: SINGLE for k in safetensors_header(self.source)}
        else:
            raise ModelFormatError(f"{self.path}: no {INDEX} or {SINGLE}; not an MLX checkpoint folder")

        # Logical key -> (full key, shard). With a language_model. prefix anywhere, only those keys count.
        prefixed = self._prefix = PREFIX if any(k.startswith(PREFIX) for k in weight_map) else ""
        self._where: dict[str, tuple[str, str]] = {}
        for key, shard in weight_map.items():
            if prefixed and not key.startswith(PREFIX):
                continue
            if not prefixed and key.startswith(("vision_tower.", "model.visual.")):
                continue
            self._where[key[len(PREFIX):] if prefixed else key] = (key, shard)
        by_shard: dict[str, list[tuple[str, str]]] = {}
        for name, (key, shard) in self._where.items():
            by_shard.setdefault(shard, []).append((name, key))
        self._tensors: dict[str, Tensor] = {}
        for shard, entries in by_shard.items():
            first = shown(entries[0][1])
            file = confined(self.path, shard, self.source, "shard path", f" (of tensor {first})")
            if not file.is_file():
                raise ModelFormatError(f"{self.source}: tensor {first} is in shard {shown(shard)}, which is missing")
            header = safetensors_header(file)
            for name, key in entries:
                if key not in header:
                    raise ModelFormatError(f"{file}: {self.source.name} puts tensor {shown(key)} here, but the "
                                           "shard's header does not list it")
                self._tensors[name] = header[key]

    # -- names --------------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """Logical weight names (prefix stripped; a quantized module's scales and biases fold into X.weight)."""
        return [n for n in self._tensors if not self._folded(n)]

    def key(self, name: str) -> str:
        """A weight's full key in its shard (language_model.-prefixed where the checkpoint is)."""
        return self._tensor(name).key

    def _folded(self, name: str) -> bool:
        module, _, leaf = name.rpartition(".")
        return leaf in ("scales", "biases") and f"{module}.weight" in self._tensors

    def _tensor(self, name: str) -> Tensor:
        t = self._tensors.get(name)
        if t is None:
            close = difflib.get_close_matches(name, self._tensors, n=3, cutoff=0.6)
            hint = f"; similar: {', '.join(close)}" if close else ""
            raise ModelFormatError(f"{self.source}: no tensor '{self._prefix}{name}'{hint}")
        return t

    # -- plans --------------------------------------------------------------------------------------

    def _quant(self, module: str) -> dict | None:
        """{bits, group_size, mode} for a module, or None where config.json says it is not quantized."""
        override = self._overrides.get(module)
        if override is False or (override is None and self._defaults is None):
            return None
        return (self._defaults or {}) | (override if isinstance(override, dict) else {})

    def _plan(self, name: str) -> _Plan:
        w = self._tensor(name)
        module = name[: -len(".weight")] if name.endswith(".weight") else None
        if module is None or f"{module}.scales" not in self._tensors:
            return self._float_plan(w, name)
        s, b = self._tensor(f"{module}.scales"), self._tensor(f"{module}.biases")
        q = self._quant(module)
        if q is None:
            raise ModelFormatError(f"{s.path}: tensor '{s.key}' says {module} is quantized, but config.json has "
                                   "no quantization settings for it")
        bits, group, mode = q.get("bits"), q.get("group_size"), q.get("mode", "affine")
        if mode != "affine":
            raise UnsupportedModelError(f"{w.path}: tensor '{w.key}' is quantized in MLX mode '{mode}'; only "
                                        "affine (scale·q + bias) is supported")
        if bits not in WIDE or group != GROUP:
            raise UnsupportedModelError(
                f"{w.path}: tensor '{w.key}' is {bits}-bit with group size {group}; supported: affine "
                f"{', '.join(map(str, WIDE))}-bit with group size {GROUP}")
        if w.dtype != "U32" or s.dtype not in _FLOATS or b.dtype not in _FLOATS:
            raise ModelFormatError(f"{w.path}: quantized tensor '{w.key}' is {w.dtype} with {s.dtype} scales and "
                                   f"{b.dtype} biases; expected U32 codes and BF16/F16/F32 scales and biases")
        if len(w.shape) < 2 or s.shape != b.shape or w.shape[:-1] != s.shape[:-1]:
            raise ModelFormatError(f"{w.path}: tensor '{w.key}' {list(w.shape)}, its scales {list(s.shape)} and "
                                   f"biases {list(b.shape)} do not describe one quantized matrix")
        k = s.shape[-1] * group
        if w.shape[-1] * 32 != k * bits:
            raise ModelFormatError(
                f"{w.path}: tensor '{w.key}' has {w.shape[-1]} u32 words per row, but {k} columns ({s.shape[-1]} "
                f"groups of {group}, from its scales) at {bits} bits need {k * bits / 32:g}: config.json's bit "
                "width does not match the weights (or the tensor is damaged)")
        tag = "mlx4" if WIDE[bits] == 4 else "mlx8"
        if bits == 3 and ".switch_mlp." in name:
            tag = "mlx3"  # expert stacks run only in the decode matvecs, which read 3-bit rows where they lie
        return _Plan((w, s, b), tag, (*w.shape[:-1], k), bits)

    def _float_plan(self, t: Tensor, name: str) -> _Plan:
        if t.dtype not in _FLOATS:
            raise ModelFormatError(f"{t.path}: tensor '{t.key}' is {t.dtype} without scales; expected a float "
                                   "tensor or a quantized weight/scales/biases triple")
        f32 = t.key in self._float32
        return _Plan((t,), "f32" if f32 else "f16", t.shape, 16 if t.dtype in ("BF16", "F16") else 32)

    def formats(self, names: Iterable[str] | None = None) -> dict[str, str]:
        """Logical name -> format tag, from the headers alone (for building pipelines up front)."""
        return {n: self._plan(n).format for n in (self.tensor_names() if names is None else names)}

    def shape(self, name: str) -> tuple[int, ...]:
        """The logical shape of a weight ((..., N, K) for quantized matrices), from the headers alone."""
        return self._plan(name).shape

    # -- reading ------------------------------------------------------------------------------------

    def read(self, name: str) -> PackedWeight:
        """One logical weight in our layout (see the module docstring)."""
        return self._read(self._plan(name))

    def load(self, names: Iterable[str] | None = None, on_progress: ProgressFn | None = None
             ) -> Iterator[tuple[str, PackedWeight]]:
        """Yield (name, PackedWeight), one weight in memory at a time; every name is checked first."""
        wanted = self.tensor_names() if names is None else list(dict.fromkeys(names))
        plans = {n: self._plan(n) for n in wanted}
        return self._load(plans, on_progress)

    def _load(self, plans: dict[str, _Plan], on_progress):
        total = sum(t.nbytes for p in plans.values() for t in p.tensors)
        done = 0
        for i, (name, plan) in enumerate(plans.items()):
            weight = self._read(plan)
            done += sum(t.nbytes for t in plan.tensors)
            yield name, weight
            del weight  # at most one weight alive here while the caller uploads it
            if on_progress is not None:
                on_progress(i, len(plans), str(plan.tensors[0].path), done, total)

    def _read(self, plan: _Plan) -> PackedWeight:
        keys = tuple(t.key for t in plan.tensors)
        if len(plan.tensors) == 1:
            t = plan.tensors[0]
            arr = _to_f16(read_floats(t), t) if plan.format == "f16" else read_floats(t)
            weight = PackedWeight({"weight": arr}, plan.format, plan.shape, keys)
        else:
            w, s, b = plan.tensors
            as_stored = plan.bits == WIDE[plan.bits] or plan.format == "mlx3"
            # Expert stacks kept as stored are mapped, not read: an expert cache reads only the experts it loads.
            codes = map_array(w) if as_stored and ".switch_mlp." in w.key else read_array(w)
            if not as_stored:
                codes = widen_codes(codes.reshape(-1, codes.shape[-1]), plan.bits).reshape(*w.shape[:-1], -1)
            q_scale = np.stack([_to_f16(read_floats(s), s), _to_f16(read_floats(b), b)], axis=-1)
            weight = PackedWeight({"q_weight": codes, "q_scale": q_scale}, plan.format, plan.shape, keys)
        weight.bits = plan.bits
        return weight

    # -- MoE ----------------------------------------------------------------------------------------

    @cached_property
    def table(self) -> list[Weight]:
        """The architecture's weights (engine/models/weights.py) for this config; load_model sets the one it built
        its spec from."""
        from engine.models import model_module

        where = str(self.config_path)
        module = model_module(self.config.get("model_type"), where)
        return module.weights(module.spec(module.ModelArgs.from_dict(self.config, where)))

    @cached_property
    def _float32(self) -> set[str]:
        """Full keys of the tensors the architecture keeps in f32 (Gated DeltaNet's A_log and dt_bias); every other
        float tensor becomes f16."""
        names = {w.mlx[0] for w in self.table if w.dtype == "float32" and w.mlx}
        return {self._where[n][0] for n in names if n in self._where}

    def moe_weights(self, layer: int) -> dict[str, PackedWeight]:
        """A MoE layer's weights keyed by their path under `model.layers.{layer}.mlp.` (for Qwen3.5-MoE: gate,
        switch_mlp.{gate,up,down}_proj, and shared_expert.{gate,up,down}_proj + shared_expert_gate when the config
        has a shared expert), named by the architecture file and checked against its shapes before anything is
        read."""
        where = str(self.config_path)
        table = [w for w in self.table if w.name.startswith(f"layers.{layer}.moe.")]
        if not table:
            raise ModelFormatError(f"{where}: layer {layer} has no mixture-of-experts block")
        prefix, plans = f"model.layers.{layer}.mlp.", {}
        for w in table:
            parts = [self._plan(n) for n in w.mlx]
            first = parts[0]
            joined = (*first.shape[:-2], sum(p.shape[-2] for p in parts), first.shape[-1])
            if joined != w.shape or any(p.shape[:-2] != first.shape[:-2] or p.shape[-1] != first.shape[-1]
                                        for p in parts):
                t = first.tensors[0]
                held = " + ".join(str(list(p.shape)) for p in parts)
                raise ModelFormatError(f"{t.path}: tensor '{t.key}' holds a {held} matrix; config.json implies "
                                       f"{list(w.shape)}" if len(parts) == 1 else
                                       f"{t.path}: tensors {', '.join(repr(p.tensors[0].key) for p in parts)} hold "
                                       f"{held} rows; config.json implies {list(w.shape)} joined")
            plans |= {n.removeprefix(prefix).removesuffix(".weight"): p for n, p in zip(w.mlx, parts, strict=True)}
        return {part: self._read(plan) for part, plan in plans.items()}


# ---- layouts ---------------------------------------------------------------------------------------

def widen_codes(words: np.ndarray, bits: int) -> np.ndarray:
    """MLX rows of `bits`-bit codes (u32 [rows, K·bits/32], one LSB-first bitstream per row) -> our u32 rows
    of 4-bit (bits ≤ 4) or 8-bit codes: code i at bits wide·(i % (32/wide)) of word i·wide/32."""
    rows, per_row = words.shape
    k = per_row * 32 // bits
    out = np.empty((rows, k * WIDE[bits] // 32), np.uint32)
    shifts = np.uint64(bits) * np.arange(8, dtype=np.uint64)
    step = max(1, ELEMENTS_PER_PASS // k)
    for r0 in range(0, rows, step):
        # Eight codes fill exactly `bits` bytes: read them as one little-endian integer, then split it.
        raw = np.ascontiguousarray(words[r0:r0 + step]).view(np.uint8).reshape(-1, k // 8, bits)
        v = np.zeros(raw.shape[:2], np.uint64)
        for j in range(bits):
            v |= raw[..., j].astype(np.uint64) << np.uint64(8 * j)
        codes = (v[..., None] >> shifts) & np.uint64((1 << bits) - 1)  # [rows, K/8, 8]
        if WIDE[bits] == 4:
            nibbles = codes.astype(np.uint32) << (np.uint32(4) * np.arange(8, dtype=np.uint32))
            out[r0:r0 + step] = np.bitwise_or.reduce(nibbles, axis=-1)
        else:
            out[r0:r0 + step] = codes.astype(np.uint8).reshape(len(raw), k).view("<u4")
    return out


def dequantize(weight: PackedWeight) -> np.ndarray:
    """float32 values of a PackedWeight from this reader: scale·q + bias in f32, as mx.dequantize computes it
    with f32 scales (scale·q is exact in f32, so there is one rounding either way)."""
    if "weight" in weight:
        return weight["weight"].astype(np.float32)
    q_weight = weight["q_weight"]
    if weight.format == "mlx3":  # widen the bitstream first, then dequantize as 4-bit
        q_weight = widen_codes(q_weight.reshape(-1, q_weight.shape[-1]), 3).reshape(*q_weight.shape[:-1], -1)
    bits = 4 if weight.format in ("mlx4", "mlx3") else 8
    per_word = 32 // bits
    shifts = np.arange(per_word, dtype=np.uint32) * np.uint32(bits)
    q = ((q_weight[..., None] >> shifts) & np.uint32(2**bits - 1)).astype(np.float32)
    q = q.reshape(*q_weight.shape[:-1], -1, GROUP)  # [..., N, G, 64]
    s = weight["q_scale"].astype(np.float32)
    out = s[..., 0:1] * q + s[..., 1:2]
    return out.reshape(*q_weight.shape[:-1], -1)


# ---- files -----------------------------------------------------------------------------------------

def _quantization(raw: dict, text: dict, where: Path) -> tuple[dict | None, dict]:
    """(defaults {bits, group_size, mode} or None, overrides keyed by module path without the prefix)."""
    q = raw.get("quantization", text.get("quantization", raw.get("quantization_config")))
    if q is None:
        return None, {}
    if not isinstance(q, dict) or "bits" not in q or "group_size" not in q:
        method = q.get("quant_method") if isinstance(q, dict) else None
        raise UnsupportedModelError(f"{where}: 'quantization' is {shown(q if method is None else method)}; "
                                    "expected MLX's {bits, group_size, mode}")
    defaults = _settings(q, where, "quantization")
    overrides = {}
    for key, value in q.items():
        if isinstance(value, dict):
            value = _settings(value, where, f"quantization.{key}")
        if isinstance(value, (dict, bool)):
            overrides[key[len(PREFIX):] if key.startswith(PREFIX) else key] = value
    return defaults, overrides


def _settings(q: dict, where: Path, field: str) -> dict:
    """{bits, group_size, mode} as present in `q`, each of the right type."""
    out = {k: q[k] for k in ("bits", "group_size", "mode") if k in q}
    for k, v in out.items():
        ok = isinstance(v, str) if k == "mode" else isinstance(v, int) and not isinstance(v, bool)
        if not ok:
            raise ModelFormatError(f"{where}: '{field}.{k}' is {shown(v)}, expected "
                                   f"{'a string' if k == 'mode' else 'a whole number'}")
    return out



def _to_f16(arr: np.ndarray, t: Tensor) -> np.ndarray:
    if arr.dtype == np.float16:
        return arr
    out = np.empty(arr.shape, np.float16)
    flat_in, flat_out = arr.reshape(-1), out.reshape(-1)
    for i in range(0, flat_in.size, ELEMENTS_PER_PASS):
        part = flat_in[i:i + ELEMENTS_PER_PASS]
        with np.errstate(over="ignore"):  # reported below, naming the tensor
            half = part.astype(np.float16)
        flat_out[i:i + ELEMENTS_PER_PASS] = half
        bad = np.isinf(half) & np.isfinite(part)
        if bad.any():
            raise ModelFormatError(f"{t.path}: tensor '{t.key}' holds {part[bad][0]:g}, past f16's range "
                                   "(±65504); the kernels read this tensor as f16")
    return out
