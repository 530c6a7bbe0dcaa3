"""load_model(): a checkpoint folder → a Model on the GPU with its tokenizer."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np

from engine.errors import ModelFormatError
from engine.gpu import Gpu
from engine.models import model_module
from engine.tokenizer import Tokenizer
from engine.transformer import DenseTransformer

ProgressFn = Callable[[int, int, str, int, int], None]  # shard index, shards, path, bytes done, bytes total


class Model:
    def __init__(self, runtime: DenseTransformer, tokenizer: Tokenizer | None, path: Path, model_type: str):
        self.runtime, self.tokenizer, self.path, self.model_type = runtime, tokenizer, path, model_type

    def logits(self, ids) -> np.ndarray:
        """Teacher-forced f32 logits [T, vocab] for `ids` from an empty cache."""
        self.runtime.reset()
        return self.runtime.logits(ids)

    def generate(self, prompt: str | list[int], max_tokens: int = 256):
        from engine.generate import stream_generate

        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ModelFormatError(f"{self.path}: no tokenizer.json, pass token ids instead of text")
            prompt = self.tokenizer.encode(prompt)
        return stream_generate(self, list(prompt), max_tokens)


def load_model(path: str | Path, gpu: Gpu | None = None, max_context: int | None = None,
               on_progress: ProgressFn | None = None, **runtime_options) -> Model:
    """Load an MLC q4f16_1 folder; runtime_options go to DenseTransformer (prefill_chunk, split_keys)."""
    from engine.formats.mlc import MlcCheckpoint

    path = Path(path)
    ckpt = MlcCheckpoint(path)
    module = model_module(ckpt.model_type, where=str(path / "mlc-chat-config.json"))
    args = module.ModelArgs.from_dict(ckpt.model_config)
    spec = module.spec(args)
    gpu = gpu or Gpu()
    needed = _needed_names(spec)
    runtime = DenseTransformer(gpu, spec, ckpt.load(needed, on_progress), max_context,
                               **runtime_options)
    tokenizer = Tokenizer.from_dir(path) if (path / "tokenizer.json").exists() else None
    return Model(runtime, tokenizer, path, ckpt.model_type)


def _needed_names(spec) -> list[str]:
    return list(spec.names.values())
