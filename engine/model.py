"""load_model(): a checkpoint (MLC q4f16_1 folder, MLX folder or .gguf file) → a Model on the GPU with its tokenizer."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.gpu import Gpu
from engine.models import format_support, model_module
from engine.models.base import DenseSpec
from engine.models.weights import mlc_names, mlx_sources
from engine.runtime_options import RuntimeOptions
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from engine.tokenizer_loader import load_tokenizer
from engine.transformer import Transformer, expected_tensors

ProgressFn = Callable[[int, int, str, int, int], None]  # shard index, shards, path, bytes done, bytes total

# What llama.cpp samples with when a GGUF carries no sampling metadata: GGUF files are made for it.
LLAMA_CPP_SAMPLING = dict(temperature=0.8, top_k=40, top_p=0.95, min_p=0.05)
_GGUF_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                       "penalty_repeat": "repetition_penalty"}


class Model:
    def __init__(self, runtime: Transformer, tokenizer: Tokenizer | None, path: Path, model_type: str,
                 default_sampling: SamplingParams | None = None):
        self.runtime, self.tokenizer, self.path, self.model_type = runtime, tokenizer, path, model_type
        self.default_sampling = default_sampling or SamplingParams()

    def logits(self, ids) -> np.ndarray:
        """Teacher-forced f32 logits [T, vocab] for `ids` from an empty cache."""
        self.runtime.reset()
        return self.runtime.logits(ids)

    def generate(self, prompt: str | list[int], max_tokens: int = 256, sampling: SamplingParams | None = None,
                 **stream):
        """Stream a completion of raw text or token ids (no chat template; see engine.session for chats); `stream`:
        stream_generate's other keywords (cancel, progress, batch, reuse)."""
        from engine.generate import stream_generate

        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ModelFormatError(f"{self.path}: no tokenizer.json, pass token ids instead of text")
            prompt = self.tokenizer.encode(prompt)
        return stream_generate(self, list(prompt), max_tokens, sampling or self.default_sampling, **stream)


def load_model(path: str | Path, gpu: Gpu | None = None, max_context: int | None = None,
               on_progress: ProgressFn | None = None, options: RuntimeOptions | None = None, **option_fields) -> Model:
    """Load an MLC q4f16_1 folder, an MLX folder or a .gguf file. How it runs: `options` (RuntimeOptions), with
    `max_context` and any RuntimeOptions field given by keyword on top. `on_progress(shard, shards, path, done,
    total)` follows the reading; an exception raised from it cancels the load (the GPU memory taken so far is
    released with the half-built runtime). Reads local files only: no network call is made (or allowed) here."""
    from engine.hub.offline import no_network

    if max_context is not None:
        option_fields["max_context"] = max_context
    options = RuntimeOptions.of(options, **option_fields)
    with no_network():
        return _load(Path(path), gpu, on_progress, options)


def _load(path: Path, gpu, on_progress, options: RuntimeOptions) -> Model:
    if path.suffix.lower() == ".gguf":
        return _load_gguf(path, gpu, on_progress, options)
    from engine.formats.mlc import CHAT_CONFIG, MlcCheckpoint

    if gguf := _folder_gguf(path, CHAT_CONFIG):  # a catalog GGUF build, downloaded into its own folder
        return _load_gguf(gguf, gpu, on_progress, options, sampling_dir=path)

    if path.is_dir() and not (path / CHAT_CONFIG).exists() and (path / "config.json").is_file():
        return _load_mlx(path, gpu, on_progress, options)

    ckpt = MlcCheckpoint(path)
    spec, table = _architecture(ckpt.model_type, ckpt.model_config, str(ckpt.config_path))
    spec.names = mlc_names(table, present=ckpt.__contains__)  # of its MLC names, the ones this build uses
    runtime = _runtime(spec, gpu, ckpt.load(list(spec.names.values()), on_progress), options)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return Model(runtime, tokenizer, path, ckpt.model_type, SamplingParams.from_generation_config(path))


def _architecture(model_type, config: dict, where: str) -> tuple[DenseSpec, list]:
    """(spec, weight table) from the architecture file of `model_type` (engine/models/)."""
    module = model_module(model_type, where=where)
    spec = module.spec(module.ModelArgs.from_dict(config, where))
    return spec, module.weights(spec)


def _runtime(spec: DenseSpec, gpu, weights, options: RuntimeOptions, **kw) -> Transformer:
    """The runtime for `spec`, its RoPE table fixed for the context it will hold (LongRoPE picks its short or long
    factors here, once, so every cached key and every query share one table: engine/models/rope.py)."""
    spec.use_context(options.max_context or spec.context_length)
    return Transformer(gpu or Gpu(), spec, weights, options=options, **kw)


def _folder_gguf(path: Path, chat_config: str) -> Path | None:
    """The one .gguf file of a folder that holds no MLC or Hugging Face config (None otherwise)."""
    if not path.is_dir() or (path / chat_config).exists() or (path / "config.json").exists():
        return None
    found = [p for p in path.iterdir() if p.suffix.lower() == ".gguf" and p.is_file()]
    if len(found) > 1:
        raise ModelFormatError(f"{path}: holds {len(found)} .gguf files ({', '.join(p.name for p in found[:4])}); "
                               "pass the one to load")
    return found[0] if found else None


def _load_gguf(path: Path, gpu, on_progress, options: RuntimeOptions, sampling_dir: Path | None = None) -> Model:
    """`sampling_dir`: the folder a catalog build was downloaded into; its generation_config.json (the catalog's
    defaults, engine.catalog.write_generation_defaults) wins over the file's general.sampling.* keys."""
    from engine.formats.gguf import GgufCheckpoint

    ckpt = GgufCheckpoint(path)
    cfg = ckpt.config
    spec, ckpt.table = _architecture(cfg["model_type"], cfg, f"{path} (GGUF metadata)")
    formats = ckpt.runtime_formats()
    try:
        spec.names = {c: c for c in expected_tensors(spec, formats)}
    except UnsupportedModelError as e:  # e.g. a qkv of mixed types whose parts cannot be bound apart
        raise UnsupportedModelError(f"{path}: {e}") from None
    # Before the upload, so a broken tokenizer fails fast; a file without one runs on token ids only.
    tokenizer = load_tokenizer(path) if "tokenizer.ggml.model" in ckpt.metadata else None
    runtime = _runtime(spec, gpu, _flatten(ckpt.load(on_progress=on_progress), formats), options, formats=formats)
    sampling = _gguf_sampling(ckpt.metadata)
    if sampling_dir is not None and (sampling_dir / "generation_config.json").is_file():
        sampling = SamplingParams.from_generation_config(sampling_dir)
    return Model(runtime, tokenizer, path, cfg["model_type"], sampling)


def _load_mlx(path: Path, gpu, on_progress, options: RuntimeOptions) -> Model:
    """An MLX folder (config.json with `quantization`, safetensors): per-matrix formats, read by byte range."""
    from engine.formats import mlx_layout
    from engine.formats.mlx import MlxCheckpoint

    ckpt = MlxCheckpoint(path)
    model_type = ckpt.config.get("model_type")
    model_module(model_type, where=str(ckpt.config_path))
    if "quantization" not in ckpt.config and "quantization_config" not in ckpt.config:
        raise ModelFormatError(f"{ckpt.config_path}: no 'quantization' field, so not an MLX model; an unconverted "
                               "Hugging Face checkpoint runs after `zerotvm convert`")
    reason = format_support(model_type, "mlx")
    if reason:
        raise UnsupportedModelError(f"{ckpt.config_path}: {reason}")
    spec, ckpt.table = _architecture(model_type, ckpt.config, str(ckpt.config_path))
    matrices, tensors = mlx_sources(ckpt.table)
    formats, spec.names = mlx_layout.plan(ckpt, matrices, tensors)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    weights = mlx_layout.stream(ckpt, matrices, tensors, spec.names, on_progress)
    runtime = _runtime(spec, gpu, weights, options, formats=formats)
    return Model(runtime, tokenizer, path, model_type, SamplingParams.from_generation_config(path))


def _flatten(weights, formats: dict[str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """(canonical name, PackedWeight) → (canonical tensor name, array) as the runtime takes them."""
    for name, packed in weights:
        if list(packed) == ["weight"] and len(packed.shape) == 1:
            yield name, packed["weight"]
            continue
        tags = formats[name].split(",")
        for key, arr in packed.items():
            part, _, array = key.rpartition(".")  # "weight", or "<part>.weight" in a matrix of mixed formats
            if array == "weight" and tags[int(part or 0)] == "f16" and arr.dtype != np.float16:
                arr = arr.astype(np.float16)
            yield f"{name}.{key}", arr


def _gguf_sampling(metadata: dict) -> SamplingParams:
    """general.sampling.* keys when the file has them (llama.cpp writes them from generation_config)."""
    found = {ours: metadata[f"general.sampling.{key}"] for key, ours in _GGUF_SAMPLING_KEYS.items()
             if f"general.sampling.{key}" in metadata}
    try:
        return SamplingParams(**{**LLAMA_CPP_SAMPLING, **found})
    except (TypeError, ValueError):
        return SamplingParams(**LLAMA_CPP_SAMPLING)
