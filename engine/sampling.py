"""Token sampling: parameters, the GPU sampler's host side, and a float64 numpy reference.

The GPU path is two dispatches appended to a token's compute pass: shaders/sample_penalty.wgsl (keeps the
window of recent ids and applies the repetition penalty in place) and shaders/sample.wgsl (temperature,
top-k, top-p, min-p in transformers' order, then a seeded draw). Nothing is read back per token.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields

import numpy as np

from engine.gpu import UNIFORM, Gpu, Recorder

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
        """The 32-byte SampleParams uniform (shaders/sample_params.wgsl)."""
        self.validate()
        out = np.zeros(8, np.uint32)
        f = out.view(np.float32)
        f[0] = min(1.0 / self.temperature, 1e30) if self.temperature > 0 else 0.0  # finite even for tiny T
        out[1] = self.top_k if self.top_k < vocab else 0  # k >= vocab keeps everything
        f[2] = self.top_p
        f[3] = -math.log(self.min_p) if self.min_p > 0 else MIN_P_OFF
        f[4] = self.repetition_penalty
        out[5] = self.penalty_window
        out[6], out[7] = self.seed & 0xFFFFFFFF, self.seed >> 32
        return out


def _read_generation_config(path: str) -> dict:
    if os.path.isdir(path):
        path = os.path.join(path, "generation_config.json")
        if not os.path.exists(path):
            return {}
    with open(path, encoding="utf-8") as f:
        try:
            cfg = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON: {e}") from e
        except RecursionError:  # deeper than the JSON parser's stack
            raise ValueError(f"{path} is not valid JSON: nested too deeply") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} does not hold a JSON object")
    return cfg


ARGMAX_WG = 256
ARGMAX_SLICE = 2048  # logits per first-pass workgroup: ~8 a thread; 74 workgroups for a 151,936 vocabulary


def argmax_plan(vocab: int) -> tuple[dict, dict | None, int]:
    """(argmax.wgsl constants, argmax_parts.wgsl constants or None, first-pass workgroups): a vocabulary of more
    than two slices is reduced in two passes."""
    parts = -(-vocab // ARGMAX_SLICE)
    if parts <= 2:
        return dict(WG=ARGMAX_WG, VOCAB=vocab, PARTS=0), None, 0
    slice_ = -(-vocab // parts)
    return (dict(WG=ARGMAX_WG, VOCAB=vocab, PARTS=parts),
            dict(WG=ARGMAX_WG, VOCAB=vocab, PARTS=parts, SLICE=slice_), parts)


class GpuArgmax:
    """Greedy decoding's token pick: the largest logit of row 0 into tokens[0] and ring[step.out_index]."""

    def __init__(self, gpu: Gpu, vocab: int, logits, tokens, ring, step):
        final, first, self.parts = argmax_plan(vocab)
        self.steps = []  # (pipeline, bind group, workgroups)
        src = logits
        if first:
            src = gpu.buffer("argmax-parts", 8 * self.parts)
            pipe = gpu.pipeline("argmax_parts", first)
            self.steps.append((pipe, gpu.bind(pipe, [logits, src], "argmax-parts"), self.parts))
        pipe = gpu.pipeline("argmax", final)
        self.steps.append((pipe, gpu.bind(pipe, [src, tokens, ring, step], "argmax"), 1))

    def record(self, rec: Recorder) -> None:
        for pipe, bg, groups in self.steps:
            rec.dispatch(pipe, bg, groups)


class GpuSampler:
    """Replaces the argmax dispatch: penalty + sampling kernels, bound once to the runtime's buffers.

    `logits` row 0 is sampled; `tokens[0..n_tokens)` are the ids fed in this forward (appended to the penalty
    window) and tokens[0] receives the sampled id; `ring[step.out_index]` too.
    """

    def __init__(self, gpu: Gpu, vocab: int, logits, tokens, ring, step, wg: int = 256, cap: int = 512):
        shared = 20 * cap + 20 * wg + 12  # sample.wgsl's workgroup memory
        if wg & (wg - 1) or shared > gpu.limits["max-compute-workgroup-storage-size"]:
            raise ValueError(f"sampler wg={wg} (a power of two) and cap={cap} need {shared} bytes of workgroup "
                             f"memory; this GPU has {gpu.limits['max-compute-workgroup-storage-size']}")
        self.gpu, self.vocab = gpu, vocab
        self.params = gpu.buffer("sample-params", 32, UNIFORM)
        self.window = gpu.upload("sample-window", np.full(WINDOW, NO_TOKEN, np.uint32))
        self.p_penalty = gpu.pipeline("sample_penalty", dict(WG=64, VOCAB=vocab, WINDOW=WINDOW))
        self.p_sample = gpu.pipeline("sample", dict(WG=wg, VOCAB=vocab, CAP=cap))
        self.bg_penalty = gpu.bind(self.p_penalty, [logits, tokens, self.window, self.params, step], "penalty")
        self.bg_sample = gpu.bind(self.p_sample, [logits, tokens, ring, step, self.params], "sample")
        self.set_params(SamplingParams())

    def set_params(self, params: SamplingParams) -> None:
        self.gpu.write(self.params, params.pack(self.vocab))

    def set_history(self, ids) -> None:
        """Rewrite the window from the ids at positions 0..len(ids)-1. The penalty kernel keeps it current on
        every forward that records the sampler; call this after rolling the context back (truncate) or after
        forwards that did not record it."""
        ids = np.asarray(ids, np.uint32)
        window = np.full(WINDOW, NO_TOKEN, np.uint32)
        pos = np.arange(max(0, len(ids) - WINDOW), len(ids))
        window[pos % WINDOW] = ids[pos]
        self.gpu.write(self.window, window)

    def record(self, rec: Recorder, draws: int = 1) -> None:
        """Append penalty + sampling; `draws` > 1 samples ring[out_index + j] independently (for tests)."""
        if not 1 <= draws <= 65535:
            raise ValueError(f"draws must be in [1, 65535], got {draws}")
        rec.dispatch(self.p_penalty, self.bg_penalty, 1)
        rec.dispatch(self.p_sample, self.bg_sample, draws)


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
