"""Hugging Face safetensors checkpoint -> MLC q4f16_1 model folder, the layout `mlc_llm convert_weight`
and `gen_config` write (params_shard_*.bin, ndarray-cache.json, mlc-chat-config.json, tokenizer files).

Every linear weight (embedding and LM head included) becomes `<name>.q_weight` u32 [N, K/8] and
`<name>.q_scale` f16 [N, K/32]; norm weights become f16 (zero-centred ones with their +1 baked in, as
mlc-llm does for Qwen3.5); Qwen3.5's GDN gate parameters stay float32 (stored as bf16 "f32-to-bf16"
records, like mlc-llm's) and its conv kernel f16. Qwen3.5-MoE's routed experts become one stacked q4f16_1
matrix per layer and projection ([E, N, K/8] words, [E, N, K/32] scales). Tensors are read, converted and
written one at a time (an expert stack as a whole), so host memory peaks near the largest of them. Usage:

    python -m engine.convert HF_DIR OUT_DIR
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError, UnsupportedModelError, ZeroTVMError
from engine.formats.files import Tensor, confined, read_floats, read_json, safetensors_header, shown
from engine.formats.q4f16_1 import GROUP, quantize_q4f16_1
from engine.models import model_module
from engine.models.weights import EXPERTS, MATRIX, NORM

QUANTIZATIONS = ("q4f16_1",)
SHARD_CAP = 32 << 20  # TVM's dump_tensor_cache default (shard_cap_mb=32)
ALIGN = 256  # record offsets stay bindable at WebGPU's minStorageBufferOffsetAlignment
MANIFEST = "ndarray-cache.json"
CHAT_CONFIG = "mlc-chat-config.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "merges.txt",
                   "added_tokens.json", "special_tokens_map.json")
# Copied beside the tokenizer but not listed in tokenizer_files (transformers 5 keeps the template apart).
EXTRA_FILES = ("generation_config.json", "chat_template.jinja", "chat_template.json")
IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)  # buffers some old checkpoints saved; recomputed at load
NESTED_TEXT = "model.language_model."  # where multimodal checkpoints (Qwen3_5ForConditionalGeneration) keep it
# mlc-chat-config fields taken from generation_config.json, then config.json, then mlc's system default.
_GENERATION_DEFAULTS = {
    "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2, "temperature": 1.0, "presence_penalty": 0.0,
    "frequency_penalty": 0.0, "repetition_penalty": 1.0, "top_p": 1.0,
}

ConvertProgress = Callable[[int, int, str], None]  # (tensors done, tensors total, MLC name)


@dataclass
class _Param:
    target: str  # the MLC name
    sources: list[str]  # Hugging Face tensors, rows joined in order
    kind: str  # engine/models/weights.py: MATRIX, EXPERTS, NORM or PARAM
    dtype: str = "float16"  # NORM/PARAM: stored dtype
    offset: float = 0.0  # added before storing (the baked +1 of a zero-centred norm)
    experts: int = 0  # sources are per expert (experts × parts, expert-major); 0: not per expert
    fused: str = ""  # EXPERTS: the one [E, N, K] tensor that may stand for the per-expert ones

    @property
    def quantized(self) -> bool:
        return self.kind in (MATRIX, EXPERTS)

    @property
    def stacked(self) -> bool:  # an expert stack [E, N, K]
        return self.kind == EXPERTS

    @property
    def raw_dtype(self):
        """The dtype of an unquantized target, None for a quantized one."""
        return None if self.quantized else np.dtype(self.dtype)


def convert_hf_to_mlc(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, quantization: str = "q4f16_1",
                      context_window_size: int | None = None, shard_cap_bytes: int = SHARD_CAP,
                      on_progress: ConvertProgress | None = None) -> Path:
    """Convert the Hugging Face folder `hf_dir` into an MLC folder at `out_dir`; returns `out_dir`.

    Previous MLC files in out_dir (manifests, params_shard_*.bin) are replaced; the manifest is written
    last, so an interrupted conversion leaves a folder MlcCheckpoint refuses instead of a mixed one.
    """
    hf_dir, out_dir = Path(hf_dir), Path(out_dir)
    if quantization not in QUANTIZATIONS:
        raise ZeroTVMError(f"quantization {quantization!r} is not supported (supported: {', '.join(QUANTIZATIONS)})")
    if not hf_dir.is_dir():
        raise ModelFormatError(f"{hf_dir}: Hugging Face model folder not found")
    config_path = hf_dir / "config.json"
    config = _text_config(read_json(config_path, "the model config"))
    model_type = config.get("model_type")
    if not isinstance(model_type, str):
        raise ModelFormatError(f"{config_path}: no 'model_type' field")
    # The architecture file (engine/models/) checks every field the runtime reads (types, bounds, heads, RoPE)
    # before anything is read or written, and names every tensor.
    module = model_module(model_type, where=str(config_path))
    spec = module.spec(module.ModelArgs.from_dict(config, str(config_path)))
    weights = _HfWeights(hf_dir)
    params = _plan(spec, module.weights(spec))
    for p in params:  # multimodal checkpoints nest the text model one level down
        p.sources = [_nested(n, weights) for n in p.sources]
        _fused_experts(p, weights)
    _check_sources(params, weights, module.HF_IGNORED, config)

    out_dir.mkdir(parents=True, exist_ok=True)
    if out_dir.resolve() == hf_dir.resolve():
        raise ModelFormatError(f"{out_dir}: the output folder must differ from the Hugging Face folder")
    for name in ("ndarray-cache.json", "tensor-cache.json", "tensor-cache-b16.json"):
        (out_dir / name).unlink(missing_ok=True)

    writer = _ShardWriter(out_dir, shard_cap_bytes)
    n_params = 0
    for done, param in enumerate(params, 1):
        w = _gather(param, weights)
        n_params += w.size
        if param.quantized:
            q_weight, q_scale = quantize_q4f16_1(w.reshape(-1, w.shape[-1]))  # a stack: every expert's rows
            q_weight, q_scale = q_weight.reshape(*w.shape[:-1], -1), q_scale.reshape(*w.shape[:-1], -1)
            if not np.isfinite(q_scale).all():
                raise ModelFormatError(f"{_where(param, weights)}: a weight is too large for an f16 scale")
            writer.add(f"{param.target}.q_weight", q_weight)
            writer.add(f"{param.target}.q_scale", q_scale)
        else:
            raw = (w + np.float32(param.offset)).astype(param.raw_dtype)
            if not np.isfinite(raw).all():
                raise ModelFormatError(f"{_where(param, weights)}: value outside the {raw.dtype} range")
            writer.add(param.target, raw)
        del w
        if on_progress is not None:
            on_progress(done, len(params), param.target)
    shards = writer.finish()

    metadata = {"ParamSize": writer.count, "ParamBytes": writer.payload_bytes,
                "BitsPerParam": writer.payload_bytes * 8.0 / max(n_params, 1)}
    tokenizer_files = _copy_tokenizer(hf_dir, out_dir)
    _write_json(out_dir / CHAT_CONFIG,
                _chat_config(hf_dir, config, model_type, quantization, context_window_size, tokenizer_files,
                             module.CONV_TEMPLATE))
    _write_json(out_dir / MANIFEST, {"metadata": metadata, "records": shards})
    return out_dir


# -- plan ---------------------------------------------------------------------------------------------


def _text_config(config: dict) -> dict:
    """A multimodal config's text_config flattened to the top (keeping the top-level model_type and
    tie_word_embeddings, which transformers' *ForConditionalGeneration reads)."""
    text = config.get("text_config")
    if not isinstance(text, dict):
        return config
    top = {k: config[k] for k in ("model_type", "tie_word_embeddings") if k in config}
    return {**text, **top}


def _plan(spec, table) -> list[_Param]:
    """What to write, in the table's order: one MLC tensor (or q_weight/q_scale pair) per weight."""
    params = []
    for w in table:
        per_expert = any("{e}" in n for n in w.hf)
        experts = spec.n_experts if per_expert else 0
        sources = [n.format(e=e) for e in range(experts) for n in w.hf] if per_expert else list(w.hf)
        params.append(_Param(w.mlc[0], sources, w.kind, w.dtype, w.hf_offset, experts, w.hf_fused))
    return params


def _fused_experts(param: _Param, weights: _HfWeights) -> None:
    """Read an expert stack from the checkpoint's one [E, N, K] tensor when it has no per-expert tensors."""
    if not param.experts or param.sources[0] in weights.index:
        return
    fused = _nested(param.fused, weights)
    if fused in weights.index:
        param.sources, param.experts = [fused], 0


def _nested(name: str, weights: _HfWeights) -> str:
    if name not in weights.index and name.startswith("model.") and NESTED_TEXT + name[6:] in weights.index:
        return NESTED_TEXT + name[6:]
    return name


def _check_sources(params: list[_Param], weights: _HfWeights, ignored: tuple[str, ...], config: dict) -> None:
    """Every planned source exists, and every checkpoint tensor is used (a dropped weight is a wrong model)."""
    used: set[str] = set()
    for p in params:
        for name in p.sources:
            if name not in weights.index:
                raise ModelFormatError(f"{weights.describe()}: tensor '{name}' (needed for {p.target}) not found")
            used.add(name)
        _check_shapes(p, weights)
    tied_head = "lm_head.weight" if config.get("tie_word_embeddings") else None
    extra = [n for n in weights.index if n not in used and n != tied_head and not n.endswith(IGNORED_SUFFIXES)
             and not n.startswith(ignored)]
    if extra:
        file = weights.index[extra[0]].path.name
        raise UnsupportedModelError(
            f"{file}: tensor '{extra[0]}' has no MLC mapping for model_type {config.get('model_type')!r}"
            + (f" ({len(extra) - 1} more)" if len(extra) > 1 else "")
        )


def _check_shapes(param: _Param, weights: _HfWeights) -> None:
    """Checked from the headers before anything is written, so a bad checkpoint fails fast."""
    shapes = [weights.index[n].shape for n in param.sources]
    for name in param.sources:
        path, dtype, shape = weights.index[name].path, weights.index[name].dtype, weights.index[name].shape
        if dtype not in _HfWeights.DTYPES:
            raise ModelFormatError(f"{path}: tensor '{name}' has dtype {dtype}; expected F32, F16 or BF16")
        dims = 3 if param.stacked and not param.experts else 2
        if param.quantized and (len(shape) != dims or shape[-1] % GROUP):
            raise ModelFormatError(
                f"{path}: tensor '{name}' has shape {list(shape)}; q4f16_1 needs a {dims}-D weight whose K "
                f"(input dim) is a multiple of {GROUP}"
            )
        if param.kind == NORM and len(shape) != 1:
            raise ModelFormatError(f"{path}: tensor '{name}' has shape {list(shape)}; a norm weight is 1-D")
    if param.quantized and len({s[-1] for s in shapes}) > 1:
        raise ModelFormatError(f"{_where(param, weights)}: fused weights differ in K ({shapes})")


def _gather(param: _Param, weights: _HfWeights) -> np.ndarray:
    parts = [weights.read(n) for n in param.sources]
    if param.experts:  # per expert: its parts' rows joined, then the experts stacked
        per = len(parts) // param.experts
        return np.stack([np.concatenate(parts[e * per:(e + 1) * per], axis=0) for e in range(param.experts)])
    # Row concatenation (q, k, v rows; gate then up rows) is what the fused kernels index into.
    return parts[0] if len(parts) == 1 else np.concatenate(parts, axis=0)


def _where(param: _Param, weights: _HfWeights) -> str:
    return f"{weights.index[param.sources[0]].path}: tensor '{', '.join(param.sources)}'"


# -- reading Hugging Face safetensors -------------------------------------------------------------------


class _HfWeights:
    """Tensor index over single or sharded safetensors; reads one tensor at a time by byte range
    (engine/formats/files.py: headers through the safetensors package, bf16 widened by our small reader)."""

    DTYPES = ("F32", "F16", "F64", "BF16")

    def __init__(self, hf_dir: Path):
        self.hf_dir = hf_dir
        index_path = hf_dir / "model.safetensors.index.json"
        if index_path.is_file():
            weight_map = read_json(index_path, "the safetensors index").get("weight_map")
            if not isinstance(weight_map, dict):
                raise ModelFormatError(f"{index_path}: no 'weight_map' object")
            self.files = []
            for name, shard in weight_map.items():
                file = confined(hf_dir, shard, index_path, "shard path", f" (of tensor {shown(name)})")
                if file not in self.files:
                    self.files.append(file)
            for f in self.files:
                if not f.is_file():
                    raise ModelFormatError(f"{f}: listed in {index_path.name} but missing")
        else:
            self.files = sorted(hf_dir.glob("*.safetensors"))
        if not self.files:
            raise ModelFormatError(f"{hf_dir}: no *.safetensors weights (only safetensors checkpoints convert)")
        self.index: dict[str, Tensor] = {}
        for f in self.files:
            self.index |= safetensors_header(f)

    def describe(self) -> str:
        return ", ".join(f.name for f in self.files) if len(self.files) <= 3 else f"{self.hf_dir}/*.safetensors"

    def read(self, name: str) -> np.ndarray:
        """The tensor as float32 (exact for f32/f16/bf16 sources)."""
        return read_floats(self.index[name]).astype(np.float32, copy=False)


# -- writing the MLC folder ------------------------------------------------------------------------------


class _ShardWriter:
    """Appends records to params_shard_{i}.bin, starting a new shard when the next record would pass the cap."""

    def __init__(self, out_dir: Path, cap: int):
        self.out_dir, self.cap = out_dir, cap
        self.groups: list[dict] = []
        self.count = 0
        self.payload_bytes = 0
        self._file = None
        self._md5 = None
        self._pos = 0

    def add(self, name: str, arr: np.ndarray) -> None:
        data = np.ascontiguousarray(arr, dtype=arr.dtype.newbyteorder("<"))
        if arr.dtype == np.float32:  # "f32-to-bf16": the record keeps dtype float32, the bytes are bf16
            data = _bf16_bytes(data)
        offset = -(-self._pos // ALIGN) * ALIGN
        if self._file is not None and self._pos > 0 and offset + data.nbytes > self.cap:
            self._close()
            offset = 0
        if self._file is None:
            self._open()
        self._write(b"\0" * (offset - self._pos))
        self._write(memoryview(data).cast("B"))
        # mlc-llm tags every record with the cache-wide encode format; only float32 data would be bf16.
        self.groups[-1]["records"].append({
            "name": name, "shape": list(arr.shape), "dtype": arr.dtype.name, "format": "f32-to-bf16",
            "nbytes": data.nbytes, "byteOffset": offset,
        })
        self.count += 1
        self.payload_bytes += data.nbytes

    def finish(self) -> list[dict]:
        self._close()
        # Drop shards left over from an earlier, larger conversion into the same folder.
        stale = len(self.groups)
        while (self.out_dir / f"params_shard_{stale}.bin").exists():
            (self.out_dir / f"params_shard_{stale}.bin").unlink()
            stale += 1
        return self.groups

    def _open(self) -> None:
        path = f"params_shard_{len(self.groups)}.bin"
        self._file = open(self.out_dir / path, "wb")
        self._md5, self._pos = hashlib.md5(), 0
        self.groups.append({"dataPath": path, "format": "raw-shard", "nbytes": 0, "records": []})

    def _write(self, data) -> None:
        self._file.write(data)
        self._md5.update(data)
        self._pos += len(data)

    def _close(self) -> None:
        if self._file is None:
            return
        self._file.close()
        self.groups[-1]["nbytes"] = self._pos
        self.groups[-1]["md5sum"] = self._md5.hexdigest()
        self._file = None


def _bf16_bytes(x: np.ndarray) -> np.ndarray:
    """float32 -> the upper 16 bits, rounded to nearest even (TVM's f32-to-bf16 encoding)."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype("<u2")


def _chat_config(hf_dir: Path, config: dict, model_type: str, quantization: str, context: int | None,
                 tokenizer_files: list[str], conv_template: str) -> dict:
    ctx = int(context or config.get("max_position_embeddings") or 4096)
    prefill = min(ctx, 2048)
    model_config = dict(config)
    # MLC's own field names next to the HF ones, so either kind of reader finds them.
    heads = config.get("num_attention_heads")
    if config.get("head_dim") is None and heads:
        model_config["head_dim"] = config["hidden_size"] // heads
    theta = config.get("rope_theta") or (config.get("rope_parameters") or {}).get("rope_theta")
    if theta is not None:
        model_config.setdefault("position_embedding_base", theta)
    model_config.update(context_window_size=ctx, prefill_chunk_size=prefill, tensor_parallel_shards=1)
    generation = {}
    if (hf_dir / "generation_config.json").is_file():
        generation = read_json(hf_dir / "generation_config.json", "the generation config")
    sampling = {k: generation.get(k, config.get(k)) for k in _GENERATION_DEFAULTS}
    sampling = {k: default if sampling[k] is None else sampling[k] for k, default in _GENERATION_DEFAULTS.items()}
    vocab = config.get("vocab_size")
    return {
        "version": "0.1.0",
        "model_type": model_type,
        "quantization": quantization,
        "model_config": model_config,
        "vocab_size": vocab,
        "context_window_size": ctx,
        "sliding_window_size": -1,
        "prefill_chunk_size": prefill,
        "attention_sink_size": -1,
        "tensor_parallel_shards": 1,
        "pipeline_parallel_stages": 1,
        "active_vocab_size": vocab,
        **sampling,
        "tokenizer_files": tokenizer_files,
        "conv_template": conv_template,
    }


def _copy_tokenizer(hf_dir: Path, out_dir: Path) -> list[str]:
    copied = []
    for name in TOKENIZER_FILES + EXTRA_FILES:
        if (hf_dir / name).is_file():
            shutil.copyfile(hf_dir / name, out_dir / name)
            if name in TOKENIZER_FILES:
                copied.append(name)
    return copied


def _write_json(path: Path, data: dict) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(data, f, indent=2)
    os.replace(tmp, path)  # readers never see a half-written manifest


# -- command line ---------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m engine.convert",
                                     description="Convert a Hugging Face safetensors model to MLC q4f16_1.")
    parser.add_argument("hf_dir", help="folder with config.json and *.safetensors")
    parser.add_argument("out_dir", help="output MLC folder (created if missing)")
    parser.add_argument("--quantization", default="q4f16_1", choices=QUANTIZATIONS)
    parser.add_argument("--context-window", type=int, default=None, help="default: max_position_embeddings")
    parser.add_argument("--shard-mb", type=int, default=SHARD_CAP >> 20, help="shard size cap in MiB")
    args = parser.parse_args(argv)

    def show(done: int, total: int, name: str) -> None:
        print(f"\r[{done}/{total}] {name}".ljust(80), end="" if done < total else "\n", flush=True)

    try:
        out = convert_hf_to_mlc(args.hf_dir, args.out_dir, args.quantization, args.context_window,
                                args.shard_mb << 20, show)
    except ZeroTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
