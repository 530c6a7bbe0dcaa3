"""Reader for GGUF files (llama.cpp's format): metadata, a Hugging Face-style config, and the weights
repacked, exactly, into the layouts our kernels read.

The file is memory-mapped through the `gguf` package's GGUFReader; tensors are read a few thousand rows
at a time while being repacked, never the whole file at once. Weights come out under the runtime's
canonical names (engine/transformer.py `expected_tensors`): embed, norm, lm_head (absent when tied) and
layers.N.{attn_norm, mlp_norm, qkv, o, gate_up, down, q_norm, k_norm}; q/k/v rows are fused into qkv
and gate/up rows into gate_up. Each comes as a PackedWeight: a dict of arrays plus its format tag,
which engine.kernels.matmul.format_knobs turns into kernel constants:

| GGUF type | tag | arrays (N rows, K columns, G = K/32 groups) | value |
|---|---|---|---|
| Q4_0 | q4_0 | q_weight u32 [N, K/8], q_scale f16 [N, G] | (q − 8)·d |
| Q4_1 | q4_1 | q_weight u32 [N, K/8], q_scale f16 [N, G, 2] = (d, m) | d·q + m |
| Q8_0 | q8_0 | q_weight u32 [N, K/4], q_scale f16 [N, G] | (u − 128)·d, u = q + 128 |
| F16 | f16 | weight f16 [N, K] or [D] | as stored |
| F32, BF16 | f32 | weight f32 [N, K] or [D] (bf16 widened exactly) | as stored |
| Q2_K … Q6_K, Q5_0, Q5_1 | q2_k … q6_k, q5_0, q5_1 | ggml's blocks as stored (engine/formats/kquant.py) | ggml's |

A fused weight whose tensors differ in type (a Q4_K_M file keeps attn_v in Q6_K in some layers while attn_q/attn_k
are Q4_K) is allowed for qkv only: its tag lists the parts' tags joined by "," and its arrays are keyed
"<part>.<array>" (part 0, 1, 2 = q, k, v); the attention block runs one product per part into the qkv rows.

Nibble order: a GGUF Q4 block is d (and m) then 16 bytes, byte j holding element j in its low nibble
and element j+16 in its high nibble; ours puts element i of a group at bits 4·(i % 8) of word i / 8
(MLC's q4f16_1 order). Q8_0's int8 codes are stored offset by 128 so every integer format is
w = (code − ZERO)·scale for the kernels. Q4_1 keeps (d, m) pairs in one array because the kernels read
the minimum from the scale binding (see engine/kernels/matmul.py for why).

RoPE order: llama.cpp's converter permutes the q/k rows of arch "llama" for its interleaved RoPE
(LlamaModel.permute in convert_hf_to_gguf.py); we undo that here, back to transformers' rotate_half
order. Qwen2/Qwen3 and Phi-3 are converted without a permutation (llama.cpp runs them with NeoX-style
RoPE), so their rows are used as stored.
"""

from __future__ import annotations

import difflib
import math
import os
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats import kquant
from engine.formats.files import ProgressFn, real_number, shown, whole_number
from engine.formats.limits import (
    CONFIG_LIMITS,
    MAX_GGUF_ARRAY,
    MAX_GGUF_ARRAY_DEPTH,
    MAX_GGUF_DIMS,
    MAX_GGUF_KEY,
    MAX_GGUF_KV,
    MAX_GGUF_STRING,
    MAX_GGUF_TENSOR_NAME,
    MAX_GGUF_TENSORS,
    MAX_UNLISTED_COUNT,
)
from engine.models.weights import Weight
from engine.packed import PackedWeight

Q = GGMLQuantizationType
# GGUF tensor types we repack without loss, and the format tag each becomes.
TAGS = {Q.Q4_0: "q4_0", Q.Q4_1: "q4_1", Q.Q8_0: "q8_0", Q.F16: "f16", Q.F32: "f32", Q.BF16: "f32", **kquant.TAGS}
SUPPORTED_TYPES = "Q2_K, Q3_K, Q4_K, Q5_K, Q6_K, Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, F16, F32, BF16"
MIXED_OK = ".qkv"  # the one fused weight whose parts may differ in type (see the module docstring)
CHUNK = 32  # the kernels walk K in 32-element chunks
ROWS_PER_READ = 4096  # rows repacked at a time: bounds the temporaries for a large embedding table


@dataclass(frozen=True)
class _Part:
    """One GGUF tensor feeding a canonical weight; `heads` set = undo llama.cpp's q/k row permutation."""

    name: str
    rows: int | None  # expected rows (None for 1-D)
    cols: int
    heads: int | None = None


class _Truncated(Exception):
    def __init__(self, tensor: str, end: int, size: int):
        super().__init__(tensor, end, size)
        self.tensor, self.end, self.size = tensor, end, size


class _Bad(Exception):
    """A header value past a bound of engine/formats/limits.py, or otherwise impossible; worded for the user."""


_MIN_BYTES = {GGUFValueType.STRING: 8, GGUFValueType.ARRAY: 12}  # smallest encoding of an array element


class _Reader(GGUFReader):
    """GGUFReader that bounds every count and size in the header before acting on it (the stock reader loops
    over whatever count the file claims: 2^40 array elements or 2^31 tensors hang it with memory growing) and
    names the key or tensor at fault, including the tensor whose data runs past the end of a truncated file."""

    def __init__(self, path: Path):
        self._key = "the header"  # what is being read, for messages
        self._depth = 0
        super().__init__(path)

    def _get(self, offset, dtype, count=1, override_order=None):
        end = int(offset) + np.dtype(dtype).itemsize * int(count)
        if int(count) < 0 or end > len(self.data):
            raise _Bad(f"{self._key} runs past the end of the file (to byte {end:,} of {len(self.data):,}); the file "
                       "is truncated or not a GGUF model")
        return super()._get(offset, dtype, count, override_order)

    def _get_str(self, offset):
        n = int(self._get(offset, np.uint64)[0])
        if n > MAX_GGUF_STRING:
            raise _Bad(f"{self._key} holds a string of {n:,} bytes (limit {MAX_GGUF_STRING:,})")
        return super()._get_str(offset)

    def _remaining(self, offset: int) -> int:
        return len(self.data) - int(offset)

    def _build_fields(self, offs, count):
        count = int(count)
        _check_count(count, MAX_GGUF_KV, 13, self._remaining(offs), "the header", "metadata fields")
        for _ in range(count):
            start = offs
            self._key = "a metadata key"
            if int(self._get(offs, np.uint64)[0]) > MAX_GGUF_KEY:
                raise _Bad(f"a metadata key at byte {offs:,} is longer than {MAX_GGUF_KEY:,} bytes")
            key_len, key = self._get_str(offs)
            offs += int(key_len.nbytes + key.nbytes)
            name = bytes(key).decode("utf-8", "replace")
            self._key = f"metadata field '{shown(name, 120)[1:-1]}'"
            raw_type = self._get(offs, np.uint32)
            offs += int(raw_type.nbytes)
            size, parts, idxs, types = self._get_field_parts(offs, raw_type[0])
            self._push_field(ReaderField(start, name, [key_len, key, raw_type, *parts], [i + 3 for i in idxs], types),
                             skip_sum=True)
            offs += size
        self._key = "the tensor table"
        return offs

    def _get_field_parts(self, orig_offs, raw_type):
        if int(raw_type) != GGUFValueType.ARRAY:
            return super()._get_field_parts(orig_offs, raw_type)
        item_type, n = int(self._get(orig_offs, np.uint32)[0]), int(self._get(orig_offs + 4, np.uint64)[0])
        try:
            item = GGUFValueType(item_type)
        except ValueError:
            raise _Bad(f"{self._key} is an array of unknown type {item_type}") from None
        least = _MIN_BYTES.get(item, np.dtype(self.gguf_scalar_to_np.get(item, np.uint8)).itemsize)
        _check_count(n, MAX_GGUF_ARRAY, least, self._remaining(orig_offs + 12), self._key, "array elements")
        if self._depth >= MAX_GGUF_ARRAY_DEPTH:
            raise _Bad(f"{self._key} nests arrays more than {MAX_GGUF_ARRAY_DEPTH} deep")
        self._depth += 1
        try:
            return super()._get_field_parts(orig_offs, raw_type)
        finally:
            self._depth -= 1

    def _build_tensor_info(self, offs, count):
        count = int(count)
        # name length, n_dims, type, offset: 24 bytes at least per tensor
        _check_count(count, MAX_GGUF_TENSORS, 24, self._remaining(offs), "the header", "tensors")
        return super()._build_tensor_info(offs, count)

    def _get_tensor_info_field(self, orig_offs):
        self._key = f"the tensor entry at byte {orig_offs:,}"
        n = int(self._get(orig_offs, np.uint64)[0])
        if n > MAX_GGUF_TENSOR_NAME:
            raise _Bad(f"{self._key} has a name of {n:,} bytes (ggml allows {MAX_GGUF_TENSOR_NAME})")
        dims = int(self._get(orig_offs + 8 + n, np.uint32)[0])
        if dims > MAX_GGUF_DIMS:
            raise _Bad(f"{self._key} has {dims:,} dimensions (ggml allows {MAX_GGUF_DIMS})")
        return super()._get_tensor_info_field(orig_offs)

    def _build_tensors(self, start_offs, fields):
        size = len(self.data)
        for field in fields:
            _, name, _, dims, raw_type, offset = field.parts
            tensor = bytes(name).decode("utf-8", "replace")
            try:
                qtype = GGMLQuantizationType(int(raw_type[0]))
            except ValueError:
                raise _Bad(f"tensor '{tensor}' has unknown type id {int(raw_type[0])}") from None
            block, type_size = GGML_QUANT_SIZES[qtype]
            shape = [int(d) for d in dims]
            if shape and shape[0] % block:
                raise _Bad(f"tensor '{tensor}' ({qtype.name}) has rows of {shape[0]} elements, not a multiple of its "
                           f"{block}-element blocks")
            begin = int(start_offs) + int(offset[0])
            end = begin + math.prod(shape) * type_size // block  # Python ints: a product of dims cannot wrap
            if int(offset[0]) % self.alignment:
                raise _Bad(f"tensor '{tensor}' starts at offset {int(offset[0]):,}, not a multiple of the file's "
                           f"alignment {self.alignment}")
            if end > size:
                raise _Truncated(tensor, end, size)
        super()._build_tensors(start_offs, fields)


def _check_count(n: int, limit: int, least: int, remaining: int, what: str, items: str) -> None:
    """A count from the header, before anything loops over it: within `limit`, and each of the n items taking
    at least `least` bytes, within what is left of the file."""
    if n > limit:
        raise _Bad(f"{what} claims {n:,} {items}, more than any real file has (limit {limit:,})")
    if n * least > remaining:
        raise _Bad(f"{what} lists {n:,} {items} but the file is too short to hold them (truncated download?)")


class GgufCheckpoint:
    """A single-file GGUF model. Opening reads the header only; tensors stay memory-mapped."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)
        if not self.path.is_file():
            raise ModelFormatError(f"{self.path}: GGUF file not found")
        try:
            self._reader = _Reader(self.path)
        except _Truncated as e:
            raise ModelFormatError(
                f"{self.path}: tensor '{e.tensor}' needs bytes up to {e.end} but the file is {e.size} bytes "
                "(truncated download?)"
            ) from None
        except _Bad as e:
            raise ModelFormatError(f"{self.path}: {e}") from None
        except OSError as e:
            raise ModelFormatError(f"{self.path}: cannot read it ({e.strerror or e})") from None
        except Exception as e:  # anything else the gguf package raises on a damaged header
            what = "not a GGUF file (bad magic)" if "magic" in str(e) else \
                f"unreadable GGUF header ({type(e).__name__}: {str(e)[:200]})"
            raise ModelFormatError(f"{self.path}: {what}; the file may be truncated or not a GGUF model") from None
        if self._reader.byte_order != "I":
            raise ModelFormatError(f"{self.path}: big-endian GGUF files are not supported")
        self._tensors = {t.name: t for t in self._reader.tensors}
        if self._field("split.count", 1) != 1:
            raise UnsupportedModelError(
                f"{self.path}: one shard of a split GGUF model; merge the shards first "
                "(llama-gguf-split --merge)"
            )

    # -- metadata -----------------------------------------------------------------------------------

    @cached_property
    def metadata(self) -> dict:
        """Every key/value field as plain Python values (str, int, float, bool, nested lists)."""
        return {k: _decode(f) for k, f in self._reader.fields.items() if not k.startswith("GGUF.")}

    def _field(self, key: str, default=None):
        field = self._reader.fields.get(key)
        return default if field is None else _decode(field)

    def _number(self, key: str, kind: type, default=None, field: str | None = None):
        """A numeric field, checked: an int field must be a whole number within the CONFIG_LIMITS bound of
        `field` (its config.json name), a float field finite and positive."""
        value = self._field(key, default)
        if value is None:
            raise ModelFormatError(f"{self.path}: metadata field '{key}' is missing")
        label = f"metadata field '{key}'"
        if kind is int:
            return whole_number(value, key, self.path, high=CONFIG_LIMITS.get(field, MAX_UNLISTED_COUNT), label=label)
        return real_number(value, key, self.path, low=0.0, low_open=True, label=label)

    @property
    def architecture(self) -> str:
        arch = self._field("general.architecture")
        if not isinstance(arch, str) or not arch:
            raise ModelFormatError(f"{self.path}: metadata field 'general.architecture' is missing or not a string")
        return arch

    @cached_property
    def model_type(self) -> str:
        """The config.json model_type of the architecture file that reads this general.architecture."""
        from engine.models import gguf_model_type

        return gguf_model_type(self.architecture, str(self.path))

    @cached_property
    def config(self) -> dict:
        """The model's hyperparameters under Hugging Face config.json names."""
        model_type, a = self.model_type, f"{self.architecture}."
        dim = self._number(a + "embedding_length", int, field="hidden_size")
        heads = self._number(a + "attention.head_count", int, field="num_attention_heads")
        head_dim = self._number(a + "attention.key_length", int, dim // heads, field="head_dim")
        if self._number(a + "attention.value_length", int, head_dim, field="head_dim") != head_dim:
            raise UnsupportedModelError(f"{self.path}: value_length differs from key_length; not supported")
        embed = self._tensors.get("token_embd.weight")
        if embed is None:
            raise ModelFormatError(f"{self.path}: no tensor 'token_embd.weight'; {self._suggest('token_embd.weight')}")
        if len(embed.shape) != 2:
            raise ModelFormatError(f"{self.path}: tensor 'token_embd.weight' has {len(embed.shape)} dimensions, not 2")
        # GGUF lists dims fastest first: (dim, vocab)
        vocab = whole_number(int(embed.shape[1]), "token_embd.weight rows", self.path, high=CONFIG_LIMITS["vocab_size"])
        if self._field(a + "vocab_size") not in (None, vocab):
            raise ModelFormatError(
                f"{self.path}: metadata field '{a}vocab_size' says {shown(self._field(a + 'vocab_size'))} but "
                f"'token_embd.weight' has {vocab} rows"
            )
        cfg = {
            "model_type": model_type,
            "hidden_size": dim,
            "num_hidden_layers": self._number(a + "block_count", int, field="num_hidden_layers"),
            "num_attention_heads": heads,
            "num_key_value_heads": self._number(a + "attention.head_count_kv", int, heads, "num_key_value_heads"),
            "head_dim": head_dim,
            "intermediate_size": self._number(a + "feed_forward_length", int, field="intermediate_size"),
            "vocab_size": vocab,
            "rms_norm_eps": self._number(a + "attention.layer_norm_rms_epsilon", float),
            "rope_theta": self._number(a + "rope.freq_base", float, 10000.0),
            "max_position_embeddings": self._number(a + "context_length", int, field="max_position_embeddings"),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "rope_scaling": self._rope_scaling(a),
        }
        rope_dim = self._number(a + "rope.dimension_count", int, head_dim, "head_dim")
        if rope_dim != head_dim:
            cfg["partial_rotary_factor"] = rope_dim / head_dim
        original = self._field(a + "rope.scaling.original_context_length")
        if original is not None:
            cfg["original_max_position_embeddings"] = self._number(a + "rope.scaling.original_context_length", int,
                                                                   field="original_max_position_embeddings")
        if self._field(a + "attention.sliding_window"):
            cfg["sliding_window"] = self._number(a + "attention.sliding_window", int, field="sliding_window")
        for token in ("bos", "eos"):
            value = self._field(f"tokenizer.ggml.{token}_token_id")
            if isinstance(value, int) and not isinstance(value, bool) and 0 <= value < vocab:
                cfg[f"{token}_token_id"] = value
        return cfg

    def _rope_scaling(self, a: str) -> dict | None:
        """rope_scaling as transformers spells it, with what llama.cpp applies for this file:

        - Llama 3's scaling survives only as a `rope_freqs.weight` tensor of per-frequency divisors (the llama3
          parameters cannot be recovered from it): {"rope_type": "gguf_freq_factors", "factors": [...]}, inv_freq
          = default inv_freq / factors, as ggml's rope divides θ by them.
        - Phi-3's LongRoPE: `rope_factors_long/short.weight`, the original context and `rope.scaling.attn_factor`,
          which llama.cpp puts on cos/sin as stored (1 when absent; the converter writes transformers' value).
        - `rope.scaling.type` linear or yarn with its factor and original context. For YaRN llama.cpp scales cos/sin
          by 0.1·ln(factor) + 1 times `rope.scaling.attn_factor` (1 when absent), as transformers does.
        """
        attn = self._field(a + "rope.scaling.attn_factor")
        attn = None if attn is None else self._number(a + "rope.scaling.attn_factor", float)
        original = None
        if self._field(a + "rope.scaling.original_context_length") is not None:
            original = self._number(a + "rope.scaling.original_context_length", int,
                                    field="original_max_position_embeddings")
        if "rope_freqs.weight" in self._tensors:
            return {"rope_type": "gguf_freq_factors", "factors": self._small_vector("rope_freqs.weight")}
        if "rope_factors_long.weight" in self._tensors:  # Phi-3 long-context (longrope)
            return {"rope_type": "longrope", "long_factor": self._small_vector("rope_factors_long.weight"),
                    "short_factor": self._small_vector("rope_factors_short.weight"),
                    "original_max_position_embeddings": original or self._number(a + "context_length", int),
                    "attention_factor": 1.0 if attn is None else attn}
        kind = self._field(a + "rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind not in ("linear", "yarn"):
            raise UnsupportedModelError(f"{self.path}: metadata field '{a}rope.scaling.type' is {shown(kind)}; "
                                        "supported: none, linear, yarn")
        scaling = {"rope_type": kind, "factor": self._number(a + "rope.scaling.factor", float)}
        if original is not None:
            scaling["original_max_position_embeddings"] = original
        if kind == "yarn" and attn is not None:
            factor = scaling["factor"]
            scaling["attention_factor"] = (0.1 * math.log(factor) + 1.0 if factor > 1 else 1.0) * attn
        return scaling

    def _small_vector(self, name: str) -> list[float]:
        t = self._tensor(name)
        if t.tensor_type != Q.F32 or len(t.shape) != 1:
            raise ModelFormatError(f"{self.path}: tensor '{name}' should be a 1-D F32 vector, is {t.tensor_type.name}")
        return np.asarray(t.data, np.float32).tolist()

    # -- tensors ------------------------------------------------------------------------------------

    def tensor_names(self) -> list[str]:
        """GGUF tensor names in file order."""
        return list(self._tensors)

    def _tensor(self, name: str):
        t = self._tensors.get(name)
        if t is None:
            raise ModelFormatError(f"{self.path}: no tensor '{name}'; {self._suggest(name)}")
        return t

    def _suggest(self, name: str) -> str:
        if not self._tensors:
            return "the file holds no tensors"
        close = difflib.get_close_matches(name, self._tensors, n=3, cutoff=0.6)
        some = close or list(self._tensors)[:5]
        return f"it has {len(self._tensors)} tensors, {'similar' if close else 'e.g.'}: {', '.join(some)}"

    @cached_property
    def table(self) -> list[Weight]:
        """The architecture's weights (engine/models/weights.py) for this file's config; load_model sets the one it
        built its spec from."""
        from engine.models import model_module

        module = model_module(self.model_type, str(self.path))
        return module.weights(module.spec(module.ModelArgs.from_dict(self.config, f"{self.path} (GGUF metadata)")))

    @cached_property
    def _sources(self) -> dict[str, list[_Part]]:
        """Canonical name -> the GGUF tensors (with expected shapes) it is made of, in row order: of each weight's
        alternatives, the first whose tensors the file holds (the last, to report what is missing, if none)."""
        out = {}
        for w in self.table:
            if not w.gguf:
                continue
            parts = next((alt for alt in w.gguf if all(p.name in self._tensors for p in alt)), w.gguf[-1])
            out[w.name] = [_Part(p.name, p.rows, w.shape[-1], p.heads) for p in parts]
        for name in self._tensors:  # biases would be silently dropped: refuse instead
            if name.startswith("blk.") and name.endswith(".bias"):
                raise UnsupportedModelError(f"{self.path}: tensor '{name}': bias terms are not supported")
        return out

    def canonical_names(self) -> list[str]:
        """The names `load` yields, in order."""
        return list(self._sources)

    def formats(self) -> dict[str, str]:
        """Canonical name -> format tag, from the tensor headers alone (for building pipelines up front)."""
        return {name: self._check(name) for name in self._sources}

    def runtime_formats(self) -> dict[str, str]:
        """formats() as the runtime runs them: F32/BF16 matrices on the f16 kernels (the only unquantized variant)."""
        return {name: ",".join("f16" if t == "f32" else t for t in tag.split(","))
                for name, tag in self.formats().items()}

    def _check(self, name: str) -> str:
        """Check one canonical weight's tensors (present, supported type, expected shape, one format); its tag."""
        parts = self._sources.get(name)
        if parts is None:
            close = difflib.get_close_matches(name, self._sources, n=3)
            raise ModelFormatError(
                f"{self.path}: no weight '{name}'; this {self.architecture} model has {len(self._sources)} weights, "
                + (f"similar: {', '.join(close)}" if close else f"e.g. {', '.join(list(self._sources)[:5])}")
            )
        tags = {}
        for part in parts:
            t = self._tensor(part.name)
            tag = TAGS.get(t.tensor_type)
            if tag is None:
                raise UnsupportedModelError(
                    f"{self.path}: tensor '{part.name}' is {t.tensor_type.name}, which we cannot run (i-quants and "
                    f"ternary types are not supported); supported types: {SUPPORTED_TYPES}. Use a build of the model "
                    "in one of them, e.g. a Q4_K_M file, or re-quantize: `llama-quantize model-f16.gguf out.gguf "
                    "Q4_K_M`"
                )
            want = (part.cols,) if part.rows is None else (part.rows, part.cols)
            found = tuple(int(d) for d in reversed(t.shape))
            if found != want:
                raise ModelFormatError(
                    f"{self.path}: tensor '{part.name}' has shape {list(found)}, metadata implies {list(want)}"
                )
            if part.rows is None and tag not in ("f16", "f32"):
                raise ModelFormatError(f"{self.path}: tensor '{part.name}' is a vector stored as {t.tensor_type.name}; "
                                       "norm weights must be F32, F16 or BF16")
            if part.rows is not None and part.cols % CHUNK:
                raise ModelFormatError(f"{self.path}: tensor '{part.name}' rows have {part.cols} elements, "
                                       f"not a multiple of {CHUNK}")
            tags[part.name] = (tag, t.tensor_type.name)
        if len({tag for tag, _ in tags.values()}) > 1:
            if name.endswith(MIXED_OK) and len(parts) > 1:
                return ",".join(tag for tag, _ in tags.values())
            listed = ", ".join(f"'{n}' ({ty})" for n, (_, ty) in tags.items())
            raise ModelFormatError(
                f"{self.path}: {name} fuses {listed}; these fused tensors must share one quantization type"
            )
        return next(iter(tags.values()))[0]

    def load(self, names: Iterable[str] | None = None, on_progress: ProgressFn | None = None
             ) -> Iterator[tuple[str, PackedWeight]]:
        """Yield (canonical name, PackedWeight), one weight in memory at a time.

        Every requested weight is checked (tensors present, types supported, shapes as the config says)
        before the first is yielded. on_progress(index, count, path, bytes_done, bytes_total) runs after
        each weight, counting GGUF tensor bytes.
        """
        wanted = self.canonical_names() if names is None else list(dict.fromkeys(names))
        tags = {name: self._check(name) for name in wanted}
        return self._load(wanted, tags, on_progress)

    def _load(self, wanted, tags, on_progress):
        nbytes = {n: sum(int(self._tensors[p.name].n_bytes) for p in self._sources[n]) for n in wanted}
        total, done = sum(nbytes.values()), 0
        for i, name in enumerate(wanted):
            weight = self._read(name, tags[name])
            done += nbytes[name]
            yield name, weight
            del weight  # keep at most one weight alive here while the caller uploads it
            if on_progress is not None:
                on_progress(i, len(wanted), str(self.path), done, total)

    def _read(self, name: str, tag: str) -> PackedWeight:
        parts = self._sources[name]
        if parts[0].rows is None:  # a norm vector
            return PackedWeight({"weight": _float_rows(self._tensors[parts[0].name])}, tag, (parts[0].cols,),
                                (parts[0].name,))
        rows, cols = sum(p.rows for p in parts), parts[0].cols
        sources = tuple(p.name for p in parts)
        if "," in tag:  # parts of different types: each packed apart, keyed by its index
            out = {}
            for j, (part, part_tag) in enumerate(zip(parts, tag.split(","), strict=True)):
                out |= {f"{j}.{key}": arr for key, arr in self._read_rows([part], part_tag).items()}
            return PackedWeight(out, tag, (rows, cols), sources)
        return PackedWeight(self._read_rows(parts, tag), tag, (rows, cols), sources)

    def _read_rows(self, parts: list[_Part], tag: str) -> dict[str, np.ndarray]:
        """The rows of `parts` (one type, `tag`) joined in order, in our layout."""
        rows, cols = sum(p.rows for p in parts), parts[0].cols
        out = _empty(tag, rows, cols)
        first = 0
        for part in parts:
            t = self._tensors[part.name]
            dest = np.arange(first, first + part.rows)
            if part.heads:
                dest = first + unpermute_index(part.rows, part.heads)
            for r0 in range(0, part.rows, ROWS_PER_READ):
                r1 = min(r0 + ROWS_PER_READ, part.rows)
                for key, arr in self._pack(t, tag, r0, r1, cols).items():
                    out[key][dest[r0:r1]] = arr
            first += part.rows
        return out

    def _pack(self, t, tag: str, r0: int, r1: int, cols: int) -> dict[str, np.ndarray]:
        if not kquant.is_ktag(tag):
            return pack_rows(t.tensor_type, t.data[r0:r1])
        try:
            return kquant.pack_rows(tag, t.data[r0:r1], cols, f"tensor '{t.name}'")
        except ValueError as e:  # damaged blocks (non-finite scales): worded by pack_rows, naming the tensor
            raise ModelFormatError(f"{self.path}: {e}") from None


# ---- layouts ---------------------------------------------------------------------------------------

def _empty(tag: str, rows: int, cols: int) -> dict[str, np.ndarray]:
    if kquant.is_ktag(tag):
        return kquant.empty(tag, rows, cols)
    groups = cols // 32
    if tag == "q4_0":
        return {"q_weight": np.empty((rows, cols // 8), np.uint32), "q_scale": np.empty((rows, groups), np.float16)}
    if tag == "q4_1":
        return {"q_weight": np.empty((rows, cols // 8), np.uint32),
                "q_scale": np.empty((rows, groups, 2), np.float16)}
    if tag == "q8_0":
        return {"q_weight": np.empty((rows, cols // 4), np.uint32), "q_scale": np.empty((rows, groups), np.float16)}
    return {"weight": np.empty((rows, cols), np.float16 if tag == "f16" else np.float32)}


def _f16(raw: np.ndarray) -> np.ndarray:
    """[..., 2k] bytes -> [..., k] little-endian f16."""
    return np.ascontiguousarray(raw).view("<f2")


def _nibbles_to_ours(qs: np.ndarray) -> np.ndarray:
    """GGUF Q4 nibbles [rows, G, 16] (byte j = element j | element j+16 << 4) -> u32 [rows, G·4] in our
    order (element i at bits 4·(i % 8) of word i / 8, i.e. our byte t = element 2t | element 2t+1 << 4)."""
    even, odd = qs[..., 0::2], qs[..., 1::2]  # GGUF bytes 2u and 2u+1
    ours = np.empty_like(qs)
    ours[..., :8] = (even & 0x0F) | (odd << 4)  # elements 2u, 2u+1 from the low nibbles
    ours[..., 8:] = (even >> 4) | (odd & 0xF0)  # elements 16+2u, 17+2u from the high nibbles
    return ours.reshape(qs.shape[0], -1).view("<u4")


def pack_rows(qtype: GGMLQuantizationType, raw: np.ndarray) -> dict[str, np.ndarray]:
    """Rows of one GGUF tensor as the reader maps them (bytes for quantized types) -> our arrays."""
    rows = raw.shape[0]
    if qtype == Q.Q4_0:  # block: d f16, 16 bytes of nibbles
        b = np.asarray(raw).reshape(rows, -1, 18)
        return {"q_weight": _nibbles_to_ours(b[..., 2:]), "q_scale": _f16(b[..., :2]).reshape(rows, -1)}
    if qtype == Q.Q4_1:  # block: d f16, m f16, 16 bytes of nibbles
        b = np.asarray(raw).reshape(rows, -1, 20)
        return {"q_weight": _nibbles_to_ours(b[..., 4:]), "q_scale": _f16(b[..., :4])}
    if qtype == Q.Q8_0:  # block: d f16, 32 int8; flipping the sign bit stores q + 128 as a byte
        b = np.asarray(raw).reshape(rows, -1, 34)
        codes = np.ascontiguousarray(b[..., 2:] ^ np.uint8(0x80)).reshape(rows, -1)
        return {"q_weight": codes.view("<u4"), "q_scale": _f16(b[..., :2]).reshape(rows, -1)}
    return {"weight": _float_rows_of(qtype, raw)}


def _float_rows_of(qtype: GGMLQuantizationType, raw: np.ndarray) -> np.ndarray:
    if qtype == Q.BF16:  # the reader maps bf16 as bytes; bf16 is the top half of an f32
        return (np.ascontiguousarray(raw).view("<u2").astype(np.uint32) << 16).view(np.float32)
    return np.array(raw, np.float16 if qtype == Q.F16 else np.float32)


def _float_rows(t) -> np.ndarray:
    return _float_rows_of(t.tensor_type, t.data)


def unpermute_index(rows: int, heads: int) -> np.ndarray:
    """dest[r]: the transformers (rotate_half) row of GGUF row r of a llama q or k matrix.

    llama.cpp's permute(w, n) = w.reshape(n, 2, hd/2, ...).swapaxes(1, 2): within a head, HF row
    j·hd/2 + i lands at GGUF row 2i + j. Rows are independent, so this works on packed data as is.
    """
    hd = rows // heads
    r = np.arange(rows)
    head, within = r // hd, r % hd
    return head * hd + (within % 2) * (hd // 2) + within // 2


def dequantize(weight: PackedWeight) -> np.ndarray:
    """float32 values of a PackedWeight, computed the way ggml does (so Q4_1's d·q + m rounds alike)."""
    if "," in weight.format:  # a qkv of parts in different types
        parts = [PackedWeight({k.partition(".")[2]: v for k, v in weight.items() if k.partition(".")[0] == str(j)},
                              tag, (), ()) for j, tag in enumerate(weight.format.split(","))]
        return np.concatenate([dequantize(p) for p in parts])
    if kquant.is_ktag(weight.format):
        return kquant.dequantize(weight.format, weight)
    if "weight" in weight:
        return weight["weight"].astype(np.float32)
    bits = 8 if weight.format == "q8_0" else 4
    q_weight = weight["q_weight"]
    rows, per_word = q_weight.shape[0], 32 // bits
    shifts = (np.arange(per_word, dtype=np.uint32) * bits)
    q = ((q_weight[..., None] >> shifts) & np.uint32(2**bits - 1)).reshape(rows, -1, 32).astype(np.float32)
    scale = weight["q_scale"].astype(np.float32).reshape(rows, -1, 2 if weight.format == "q4_1" else 1)
    if weight.format == "q4_1":
        out = scale[..., :1] * q + scale[..., 1:]
    else:
        out = (q - (8 if weight.format == "q4_0" else 128)) * scale
    return out.reshape(rows, -1)


# ---- metadata values -------------------------------------------------------------------------------

def _decode(field):
    """A ReaderField's value as Python data. Walks the raw parts so nested arrays keep their nesting
    (ReaderField.contents flattens them); strings keep undecodable bytes via surrogateescape."""
    # Key/value fields are [key length, key, value type, value parts...]; the GGUF.* header ones are bare.
    start = 0 if field.name.startswith("GGUF.") else 3
    return _walk(field.parts, start, field.types[0])[0]


def _walk(parts, i, vtype):
    if vtype == GGUFValueType.STRING:
        return bytes(parts[i + 1]).decode("utf-8", "surrogateescape"), i + 2
    if vtype == GGUFValueType.ARRAY:
        itype, n = GGUFValueType(int(parts[i][0])), int(parts[i + 1][0])
        i += 2
        if itype not in (GGUFValueType.STRING, GGUFValueType.ARRAY):  # one part per element
            items = parts[i:i + n]
            return (np.concatenate(items).tolist() if n else []), i + n
        out = []
        for _ in range(n):
            item, i = _walk(parts, i, itype)
            out.append(item)
        return out, i
    value = parts[i][0].item()
    if vtype == GGUFValueType.FLOAT32:
        value = _short_float(value)
    return value, i + 1


def _short_float(value: float) -> float:
    # An f32 field read as a double shows 1e-5 as 9.99999974738e-06; keep the shortest decimal that
    # rounds to the same f32, as config.json had it.
    return float(str(np.float32(value)))
