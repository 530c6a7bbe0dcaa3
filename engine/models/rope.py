"""RoPE tables for every rope_scaling variant we run: default, linear, llama3 (config.json or a GGUF rope_freqs
tensor), YaRN and LongRoPE (Phi-3's longrope / su), computed as transformers' modeling_rope_utils does (float32).

A table is the inverse frequencies of the rotary pairs plus `scale`, the attention factor YaRN and LongRoPE put
on cos and sin (both q and k, so scores grow by scale²); the kernels take it as ROPE_SCALE (shaders/rope.wgsl).

LongRoPE has two factor lists. transformers picks per forward call: the long factors once the sequence passes
original_max_position_embeddings, the short ones before, so keys cached with the short factors are attended by
queries rotated with the long ones. llama.cpp picks once, at load, from the configured context (n_ctx above the
original context: long). We take llama.cpp's rule, `Rope.at(context)`, so every cached key and every query use one
table: within the original context both rules give the short factors, and for a whole sequence longer than it
both give the long ones (tests/test_rope.py shows both agreements and transformers' cache drift).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats.files import real_number, shown, whole_number
from engine.formats.limits import CONFIG_LIMITS

# rope_type names as configs spell them (su: LongRoPE's first name; gguf_freq_factors: a GGUF rope_freqs tensor).
VARIANTS = ("default", "linear", "llama3", "yarn", "longrope", "su", "gguf_freq_factors")


@dataclass(frozen=True)
class Rope:
    inv_freq: np.ndarray  # f32 [rot_dim / 2]: LongRoPE's short factors applied, every other variant's only table
    rot_dim: int
    scale: float = 1.0  # multiplies cos and sin
    long_inv_freq: np.ndarray | None = None  # LongRoPE beyond the original context
    original_context: int = 0  # LongRoPE: a context past this many tokens takes the long factors

    def at(self, context: int) -> np.ndarray:
        """The table a runtime holding `context` tokens uses (see the module docstring for the rule)."""
        if self.long_inv_freq is not None and context > self.original_context:
            return self.long_inv_freq
        return self.inv_freq


def default_inv_freq(rot: int, theta: float) -> np.ndarray:
    """1 / θ^(2i / rot) in float32, as transformers computes it (int64 arange cast to f32, then the power)."""
    exponents = np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot)
    return (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)


def rope_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float = 1.0,
                  rope_scaling: dict | None = None, where: str = "model config") -> tuple[np.ndarray, int]:
    """(inverse frequencies, rotary dim) for a model whose context stays within its original one."""
    rope = rope_table(head_dim, theta, partial_rotary_factor, rope_scaling, where=where)
    return rope.inv_freq, rope.rot_dim


def rope_table(head_dim: int, theta: float, partial_rotary_factor: float = 1.0, rope_scaling: dict | None = None,
               max_position_embeddings: int | None = None, original_max_position_embeddings: int | None = None,
               where: str = "model config") -> Rope:
    """The RoPE table of a config. `max_position_embeddings` / `original_max_position_embeddings` are the config's
    top-level fields, which YaRN and LongRoPE fall back on (as transformers does) when rope_scaling omits them."""
    rot = int(head_dim * partial_rotary_factor)
    if rot < 2 or rot % 2:
        raise UnsupportedModelError(f"{where}: the rotary dimension head_dim × partial_rotary_factor = {rot} must be "
                                    "even and at least 2")
    inv = default_inv_freq(rot, theta)
    if rope_scaling is None:
        return Rope(inv, rot)
    if not isinstance(rope_scaling, dict):
        raise ModelFormatError(f"{where}: 'rope_scaling' is {shown(rope_scaling)}, expected a JSON object or null")
    kind = rope_scaling.get("rope_type") or rope_scaling.get("type") or "default"
    if kind not in VARIANTS:
        raise UnsupportedModelError(f"{where}: RoPE scaling {shown(kind)} (rope_scaling) is not supported; supported: "
                                    f"{', '.join(VARIANTS[:5])}")
    c = _Fields(rope_scaling, where)
    original = c.whole("original_max_position_embeddings", original_max_position_embeddings
                       or max_position_embeddings)
    if kind == "default":
        return Rope(inv, rot)
    if kind == "linear":  # positions divided by factor: the same as dividing the frequencies
        return Rope((inv / np.float32(c.real("factor", None, low=1.0))).astype(np.float32), rot)
    if kind == "llama3":
        return Rope(_llama3(inv, c, original or 8192), rot)
    if kind == "gguf_freq_factors":
        return Rope((inv / c.factors("factors", rot)).astype(np.float32), rot)
    if kind == "yarn":
        return _yarn(inv, rot, theta, c, original, max_position_embeddings)
    return _longrope(rot, theta, c, original, max_position_embeddings)


class _Fields:
    """rope_scaling fields, each checked (finite, in range) and named in errors."""

    def __init__(self, raw: dict, where: str):
        self.raw, self.where = raw, where

    def real(self, key: str, default, low: float = 0.0, low_open: bool = True) -> float:
        value = self.raw.get(key)
        if value is None:
            value = default
        if value is None:
            raise ModelFormatError(f"{self.where}: rope_scaling needs '{key}'")
        return real_number(value, f"rope_scaling.{key}", self.where, low=low, low_open=low_open)

    def whole(self, key: str, default) -> int | None:
        value = self.raw.get(key)
        if value is None:
            value = default
        if value is None:
            return None
        return whole_number(value, f"rope_scaling.{key}", self.where, high=CONFIG_LIMITS[
            "original_max_position_embeddings"])

    def factors(self, key: str, rot: int) -> np.ndarray:
        value = self.raw.get(key)
        ok = isinstance(value, list) and len(value) == rot // 2 and all(
            isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0 for v in value)
        if not ok:
            raise ModelFormatError(f"{self.where}: 'rope_scaling.{key}' must list {rot // 2} positive numbers (one per "
                                   f"rotary pair), got {shown(value)}")
        return np.asarray(value, np.float32)


def _llama3(inv: np.ndarray, c: _Fields, original: int) -> np.ndarray:
    """Llama 3.1's scaling: low frequencies divided by factor, high ones kept, a smooth blend between."""
    factor = c.real("factor", None, low=1.0, low_open=False)
    low = c.real("low_freq_factor", 1.0)
    high = c.real("high_freq_factor", 4.0, low=low)
    wavelen = np.float32(2 * math.pi) / inv
    scaled = np.where(wavelen > np.float32(original / low), inv / np.float32(factor), inv).astype(np.float32)
    smooth = ((np.float32(original) / wavelen - np.float32(low)) / np.float32(high - low)).astype(np.float32)
    blended = (1 - smooth) * scaled / np.float32(factor) + smooth * scaled
    medium = ~(wavelen < np.float32(original / high)) & ~(wavelen > np.float32(original / low))
    return np.where(medium, blended, scaled).astype(np.float32)


def _mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn(inv: np.ndarray, rot: int, theta: float, c: _Fields, original: int | None, max_pos: int | None) -> Rope:
    """YaRN: each pair's frequency blends the original (fast pairs) and the interpolated one (slow pairs) over a
    ramp between the pairs that turn beta_fast and beta_slow times within the original context; cos and sin are
    scaled by the attention factor (0.1·ln(factor) + 1 unless the config gives it)."""
    if original is None:
        raise ModelFormatError(f"{c.where}: YaRN needs rope_scaling.original_max_position_embeddings")
    if c.raw.get("factor") is None and max_pos is None:
        raise ModelFormatError(f"{c.where}: YaRN needs rope_scaling.factor")
    factor = c.real("factor", (max_pos or 0) / original, low=0.0)
    attention = c.raw.get("attention_factor")
    if attention is None:
        mscale, mscale_all = c.raw.get("mscale"), c.raw.get("mscale_all_dim")
        if mscale and mscale_all:
            attention = _mscale(factor, c.real("mscale", None)) / _mscale(factor, c.real("mscale_all_dim", None))
        else:
            attention = _mscale(factor)
    attention = real_number(attention, "rope_scaling.attention_factor", c.where, low=0.0, low_open=True)
    beta_fast, beta_slow = c.real("beta_fast", 32.0), c.real("beta_slow", 1.0)
    truncate = c.raw.get("truncate", True)

    def correction_dim(rotations: float) -> float:
        return rot * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rot - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    ramp = np.clip((np.arange(rot // 2, dtype=np.float32) - np.float32(low)) / np.float32(high - low), 0, 1)
    extrapolation = (1 - ramp).astype(np.float32)  # 1: keep the original frequency
    pos_freqs = (np.float32(theta) ** (np.arange(0, rot, 2).astype(np.float32) / np.float32(rot))).astype(np.float32)
    interpolated = (1.0 / (np.float32(factor) * pos_freqs)).astype(np.float32)
    original_freq = (1.0 / pos_freqs).astype(np.float32)
    blended = interpolated * (1 - extrapolation) + original_freq * extrapolation
    return Rope(blended.astype(np.float32), rot, scale=attention)


def _longrope(rot: int, theta: float, c: _Fields, original: int | None, max_pos: int | None) -> Rope:
    """LongRoPE: per-pair divisors (short within the original context, long beyond) and an attention factor
    √(1 + ln(factor) / ln(original)) unless the config gives it, factor = max_position / original by default."""
    if original is None:
        raise ModelFormatError(f"{c.where}: LongRoPE needs original_max_position_embeddings")
    short, long = c.factors("short_factor", rot), c.factors("long_factor", rot)
    factor = c.raw.get("factor")
    factor = c.real("factor", None, low=0.0) if factor is not None else (max_pos or original) / original
    attention = c.raw.get("attention_factor")
    if attention is None:
        attention = 1.0 if factor <= 1 else math.sqrt(1 + math.log(factor) / math.log(original))
    attention = real_number(attention, "rope_scaling.attention_factor", c.where, low=0.0, low_open=True)
    shape = np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot)
    powers = (np.float32(theta) ** shape).astype(np.float32)
    return Rope((1.0 / (short * powers)).astype(np.float32), rot, scale=attention,
                long_inv_freq=(1.0 / (long * powers)).astype(np.float32), original_context=original)
