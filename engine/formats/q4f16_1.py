"""MLC's q4f16_1 weight format in pure numpy: symmetric int4, one f16 scale per 32 elements along K.

Layout (see docs/ENGINE.md): q_weight u32 [N, K/8], element k of a row is nibble
(word[k/8] >> 4*(k%8)) & 15; q_scale f16 [N, K/32]; w = (q - 7) * scale.
"""

from __future__ import annotations

import numpy as np

GROUP = 32  # elements sharing one scale
PACK = 8  # nibbles per u32 word
_SHIFTS = np.arange(PACK, dtype=np.uint32) * 4


def quantize_q4f16_1(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Float weights [N, K] -> (q_weight u32 [N, K/8], q_scale f16 [N, K/32]).

    scale = max|w| / 7 over each group of 32, stored f16; q = clamp(round(w / scale) + 7, 0, 14) with the
    stored (f16) scale, numpy's round-half-to-even; an all-zero group gets scale 0 and q = 7.
    """
    w = np.asarray(w)
    if w.ndim != 2 or w.shape[1] % GROUP:
        raise ValueError(f"q4f16_1 needs a 2-D weight with K a multiple of {GROUP}, got shape {w.shape}")
    n, k = w.shape
    groups = w.astype(np.float32).reshape(n, k // GROUP, GROUP)
    scale = (np.abs(groups).max(axis=2).astype(np.float64) / 7.0).astype(np.float16)
    # Quantize with the scale as stored, so dequantization sees the same step it was rounded against.
    step = scale.astype(np.float32)[..., None]
    with np.errstate(divide="ignore", invalid="ignore"):
        q = np.where(step > 0, np.round(groups / step), 0.0) + 7
    q = np.clip(q, 0, 14).astype(np.uint32).reshape(n, k // PACK, PACK)
    q_weight = np.bitwise_or.reduce(q << _SHIFTS, axis=2).astype(np.uint32)
    return q_weight, scale


def dequantize_q4f16_1(q_weight: np.ndarray, q_scale: np.ndarray) -> np.ndarray:
    """(q_weight u32 [N, K/8], q_scale f16 [N, K/32]) -> float32 [N, K]; exact, (q - 7)·scale fits f32."""
    q_weight = np.asarray(q_weight, dtype=np.uint32)
    n, words = q_weight.shape
    k = words * PACK
    if q_scale.shape != (n, k // GROUP):
        raise ValueError(f"q_scale shape {q_scale.shape} does not match q_weight {q_weight.shape}")
    q = ((q_weight[..., None] >> _SHIFTS) & 15).reshape(n, k // GROUP, GROUP).astype(np.float32)
    return ((q - 7) * q_scale.astype(np.float32)[..., None]).reshape(n, k)
