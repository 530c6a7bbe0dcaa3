"""Describe a model on disk as a CatalogEntry, reading only its config and manifest or header (never weights).

Supported shapes: an MLC folder (mlc-chat-config.json + manifest), a .gguf file, or a folder with a Hugging
Face config.json (an MLX or unconverted checkpoint, listed but marked as not runnable). Errors name the file.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from engine.catalog import CatalogEntry, kv_bytes_per_token, local_key, supported_runtime
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats.files import read_json, whole_number
from engine.formats.mlc import CHAT_CONFIG
from engine.models import model_module, supported
from engine.models.base import DenseSpec

GENERATION_KEYS = ("temperature", "top_k", "top_p", "min_p")
_GGUF_SAMPLING = {"temperature": "general.sampling.temp", "top_k": "general.sampling.top_k",
                  "top_p": "general.sampling.top_p", "min_p": "general.sampling.min_p"}


def describe(path: Path) -> CatalogEntry:
    if path.is_file() and path.suffix.lower() == ".gguf":
        return _gguf(path)
    if path.is_dir() and (path / CHAT_CONFIG).is_file():
        return _mlc(path)
    if path.is_dir() and (path / "config.json").is_file():
        return _hf(path)
    if not path.exists():
        raise ModelFormatError(f"{path}: not found")
    raise ModelFormatError(f"{path}: not a model: expected a folder with {CHAT_CONFIG} or config.json, "
                           "or a .gguf file")


def _entry(path: Path, fmt: str, model_type: str, dims: dict, context: int, weights: int, largest: int,
           total: int, **extra) -> CatalogEntry:
    reason = supported_runtime(fmt, model_type)
    # Default to at most 8192 tokens: a 128k window's KV cache would not fit most GPUs; the full one stays choosable.
    return CatalogEntry(
        key=local_key(path), name=path.stem if path.is_file() else path.name, format=fmt, architecture=model_type,
        source="local", repo=None, revision=None, revision_source="a local model: no Hub revision",
        files=[path.name], total_bytes=total, size_source="sizes of the files on disk", size_approximate=False,
        weights_bytes=weights, largest_tensor_bytes=largest, default_context=min(context, 8192),
        max_context=context, kv_bytes_per_token=kv_bytes_per_token(dims), dims=dims,
        runs=reason is None, runs_reason=reason, path=str(path), **extra,
    )


def _spec_dims(spec: DenseSpec) -> dict:
    return dict(hidden_size=spec.dim, num_layers=spec.n_layers, num_heads=spec.n_heads, num_kv_heads=spec.n_kv_heads,
                head_dim=spec.head_dim, ffn_dim=spec.ffn_dim, vocab_size=spec.vocab,
                kv_layers=len(getattr(spec, "attn_layers", ())) or spec.n_layers,  # hybrids: attention layers only
                tied_embeddings=spec.tied_embeddings)


def _spec(model_type: str, config: dict, where: str) -> DenseSpec:
    module = model_module(model_type, where=where)
    return module.spec(module.ModelArgs.from_dict(config, where))


def _gguf(path: Path) -> CatalogEntry:
    from engine.formats.gguf import GgufCheckpoint
    from engine.model import LLAMA_CPP_SAMPLING
    from engine.transformer import expected_tensors

    ckpt = GgufCheckpoint(path)
    cfg = ckpt.config  # raises, naming the file, for an architecture we cannot run
    spec = _spec(cfg["model_type"], cfg, f"{path} (general.architecture)")
    formats = ckpt.runtime_formats()
    try:
        tensors = expected_tensors(spec, formats)
    except UnsupportedModelError as e:  # e.g. a qkv of mixed types whose parts cannot be bound apart
        raise UnsupportedModelError(f"{path}: {e}") from None
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in tensors.values()]
    meta = ckpt.metadata
    # What engine/model.py samples with: the file's keys over llama.cpp's defaults.
    found = {k: meta[key] for k, key in _GGUF_SAMPLING.items() if key in meta}
    generation = {k: v for k, v in {**LLAMA_CPP_SAMPLING, **found}.items() if k in GENERATION_KEYS}
    return _entry(
        path, "gguf", cfg["model_type"], _spec_dims(spec), cfg["max_position_embeddings"], sum(sizes), max(sizes),
        path.stat().st_size, license=str(meta.get("general.license") or "unknown"),
        generation=generation,
        generation_source="the file's general.sampling.* keys (llama.cpp's defaults where it has none)",
        dims_source="the GGUF header",
    )


def _mlc(path: Path) -> CatalogEntry:
    from engine.formats.mlc import MlcCheckpoint

    ckpt = MlcCheckpoint(path)
    model_type, cfg = ckpt.model_type, ckpt.model_config
    where = str(ckpt.config_path)
    if model_type in supported():
        dims = _spec_dims(_spec(model_type, cfg, where))
    else:
        dims = _config_dims(cfg, where)
    records = [ckpt.record(n).nbytes for n in ckpt.names()]
    context = cfg.get("context_window_size") or ckpt.config.get("context_window_size") or \
        cfg.get("max_position_embeddings") or 4096
    context = whole_number(context, "context_window_size", where)
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    return _entry(path, "mlc", model_type, dims, context, sum(records), max(records, default=1), total,
                  license="unknown", dims_source=where, **_generation(path))


def _hf(path: Path) -> CatalogEntry:
    where = path / "config.json"
    cfg = read_json(where, "the model config")
    if isinstance(cfg.get("text_config"), dict):  # multimodal checkpoints nest the language model's config
        cfg = {**cfg, **cfg["text_config"]}
    model_type = cfg.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ModelFormatError(f"{where}: no 'model_type' field; cannot tell the architecture")
    shards = [f.stat().st_size for f in path.glob("*.safetensors")]
    if not shards:
        raise ModelFormatError(f"{path}: no *.safetensors weights next to config.json")
    fmt = "mlx" if isinstance(cfg.get("quantization"), dict) else "hf"
    total = sum(f.stat().st_size for f in path.iterdir() if f.is_file())
    context = whole_number(cfg.get("max_position_embeddings") or 4096, "max_position_embeddings", where)
    # Safetensors file sizes stand in for the weights: nothing here knows how they would be laid out on the GPU.
    return _entry(path, fmt, model_type, _config_dims(cfg, str(where)), context, sum(shards), max(shards), total,
                  license=str(cfg.get("license") or "unknown"), dims_source=str(where), weights_approximate=True,
                  **_generation(path))


def _config_dims(cfg: dict, where: str) -> dict:
    """Dimensions from config.json-style fields, for architectures the engine does not run (sizes only)."""
    def need(*names):
        for name in names:
            if cfg.get(name) is not None:
                return whole_number(cfg[name], name, where)
        raise ModelFormatError(f"{where}: field '{names[0]}' is missing; expected a positive whole number")

    def optional(name, default):
        return default if cfg.get(name) is None else whole_number(cfg[name], name, where)

    hidden, heads, layers = need("hidden_size"), need("num_attention_heads"), need("num_hidden_layers")
    kv_layers = layers
    if isinstance(cfg.get("layer_types"), list):  # hybrids: only full-attention layers keep a KV cache
        kv_layers = sum(t == "full_attention" for t in cfg["layer_types"][:layers]) or layers
    elif cfg.get("full_attention_interval") is not None:
        kv_layers = layers // optional("full_attention_interval", 1)
    return dict(hidden_size=hidden, num_layers=layers, num_heads=heads,
                num_kv_heads=optional("num_key_value_heads", heads), head_dim=optional("head_dim", hidden // heads),
                ffn_dim=need("intermediate_size", "moe_intermediate_size"), vocab_size=need("vocab_size"),
                kv_layers=kv_layers, tied_embeddings=bool(cfg.get("tie_word_embeddings", False)))


def _generation(path: Path) -> dict:
    """Sampling defaults as the runtime will read them: generation_config.json, greedy without one."""
    from engine.sampling import SamplingParams

    source = path / "generation_config.json"
    try:
        params = SamplingParams.from_generation_config(path)
    except (OSError, ValueError) as e:
        raise ModelFormatError(f"{source}: {e}") from None
    return dict(generation={k: getattr(params, k) for k in GENERATION_KEYS},
                generation_source=str(source) if source.is_file() else "no generation_config.json: greedy")
