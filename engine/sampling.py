"""Token sampling: parameters and a float64 numpy reference of what the GPU sampler draws from.

The GPU side is engine/blocks/sampler.py: greedy argmax, or shaders/sample_penalty.wgsl (keeps the window of recent
ids and applies the repetition penalty in place) then shaders/sample.wgsl (temperature, top-k, top-p, min-p in
transformers' order, then a seeded draw), appended to a token's compute pass. Nothing is read back per token.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from pathlib import Path

import numpy as np

from engine.kernels import uniform_struct

WINDOW = 1024  # capacity of the GPU window of recent ids (the penalty looks at up to this many)
NO_TOKEN = 0xFFFFFFFF  # an empty window slot
MIN_P_OFF = 3.0e38  # min_p_gap that keeps everything

# What transformers' GenerationConfig assumes for keys a generation_config.json leaves out.
_HF_DEFAULTS = {"do_sample": False, "temperature": 1.0, "top_k": 50, "top_p": 1.0, "min_p": 0.0,
                "repetition_penalty": 1.0}


@dataclass
class SamplingParams:
    """temperature 0 = greedy; top_k 0, top_p 1.0, min_p 0.0, repetition_penalty 1.0 = off.

    The penalty applies to the distinct ids among the last `penalty_window` ids fed to the model (HF applies
    it to the whole context; the two agree while the context fits the window).
    """

    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int = 0
    penalty_window: int = 256

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def number(name: str) -> float:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
            return float(value)

        def integer(name: str, lo: int, hi: int) -> None:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or not lo <= value <= hi:
                raise ValueError(f"{name} must be an integer in [{lo}, {hi}], got {value!r}")

        if number("temperature") < 0:
            raise ValueError(f"temperature must be >= 0 (0 = greedy), got {self.temperature}")
        if not 0 < number("top_p") <= 1:
            raise ValueError(f"top_p must be in (0, 1] (1 = off), got {self.top_p}")
        if not 0 <= number("min_p") <= 1:
            raise ValueError(f"min_p must be in [0, 1] (0 = off), got {self.min_p}")
        if number("repetition_penalty") <= 0:
            raise ValueError(f"repetition_penalty must be > 0 (1 = off), got {self.repetition_penalty}")
        integer("top_k", 0, 2**31 - 1)
        integer("seed", 0, 2**64 - 1)
        integer("penalty_window", 1, WINDOW)

    @classmethod
    def from_generation_config(cls, source, **overrides) -> SamplingParams:
        """Defaults from a model's generation_config.json (its folder, the file, or the parsed dict), read the
        way transformers reads it: missing keys take GenerationConfig's defaults and do_sample false means
        greedy. A folder without the file gives transformers' defaults (greedy). `overrides` win."""
        unknown = set(overrides) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown sampling parameter(s): {', '.join(sorted(unknown))}")
        cfg = source if isinstance(source, dict) else _read_generation_config(os.fspath(source))
        value = {k: (d if cfg.get(k) is None else cfg[k]) for k, d in _HF_DEFAULTS.items()}
        try:
            kwargs = dict(
                temperature=float(value["temperature"]) if value["do_sample"] else 0.0,
                top_k=int(value["top_k"]), top_p=float(value["top_p"]), min_p=float(value["min_p"]),
                repetition_penalty=float(value["repetition_penalty"]),
            )
        except (TypeError, ValueError) as e:
            raise ValueError(f"generation config has a non-numeric sampling value: {e}") from e
        return cls(**{**kwargs, **overrides})

    def pack(self, vocab: int) -> np.ndarray:
        """The SampleParams uniform (shaders/sample_params.wgsl), its fields set by name."""
        self.validate()
        return uniform_struct("sample_params", "SampleParams").pack(
            inv_temp=min(1.0 / self.temperature, 1e30) if self.temperature > 0 else 0.0,  # finite even for tiny T
            top_k=self.top_k if self.top_k < vocab else 0,  # k >= vocab keeps everything
            top_p=self.top_p, min_p_gap=-math.log(self.min_p) if self.min_p > 0 else MIN_P_OFF,
            penalty=self.repetition_penalty, window=self.penalty_window,
            seed_lo=self.seed & 0xFFFFFFFF, seed_hi=self.seed >> 32)


def _read_generation_config(path: str) -> dict:
    from engine.formats.files import read_json

    if os.path.isdir(path):
        return read_json(Path(path) / "generation_config.json", "the generation config", default={})
    return read_json(Path(path), "the generation config")


def reference_probs(logits, params: SamplingParams, history=()) -> np.ndarray:
    """float64 probabilities the GPU sampler draws from, following transformers' processors in order.

    Ties: top-k keeps every token equal to the k-th largest; top-p keeps a token iff the mass strictly
    above it is < top_p (so equal logits are kept or dropped together).
    """
    x = np.asarray(logits, np.float64).copy()
    vocab = len(x)
    if params.repetition_penalty != 1.0:
        ids = np.unique(np.asarray(history, np.int64)[-params.penalty_window:])
        ids = ids[(ids >= 0) & (ids < vocab)]
        r = params.repetition_penalty
        x[ids] = np.where(x[ids] < 0, x[ids] * r, x[ids] / r)
    if params.temperature == 0:
        probs = np.zeros(vocab)
        probs[int(np.argmax(x))] = 1.0
        return probs
    s = x / params.temperature
    keep = np.ones(vocab, bool)
    if 0 < params.top_k < vocab:
        keep &= s >= np.sort(s)[-params.top_k]
    w = np.exp(s - s.max())
    if params.top_p < 1.0:
        wk = np.where(keep, w, 0.0)
        values, inverse = np.unique(s, return_inverse=True)  # ascending distinct values
        group = np.bincount(inverse, weights=wk, minlength=len(values))
        above = np.cumsum(group[::-1])[::-1] - group  # mass strictly above each distinct value
        keep &= above[inverse] < params.top_p * wk.sum()
    if params.min_p > 0:
        keep &= w >= params.min_p  # w of the best token is 1
    probs = np.where(keep, w, 0.0)
    return probs / probs.sum()
