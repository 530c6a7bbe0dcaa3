"""Pieces shared by the per-architecture files: ModelArgs base, the dense-model spec, RoPE tables."""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import numpy as np

from engine.errors import UnsupportedModelError


@dataclass
class BaseModelArgs:
    @classmethod
    def from_dict(cls, params: dict):
        """Build from config.json-style fields, ignoring the ones this architecture does not use."""
        known = inspect.signature(cls).parameters
        missing = [k for k, p in known.items() if p.default is inspect.Parameter.empty and k not in params]
        if missing:
            raise UnsupportedModelError(f"model config lacks required field(s): {', '.join(missing)}")
        return cls(**{k: v for k, v in params.items() if k in known})


@dataclass
class DenseSpec:
    """What the dense-transformer runtime needs, independent of the checkpoint's naming."""

    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    ffn_dim: int
    vocab: int
    eps: float
    inv_freq: np.ndarray  # f32 [rot_dim / 2]
    rot_dim: int
    context_length: int
    tied_embeddings: bool = False
    qk_norm: bool = False
    # canonical name -> checkpoint name; canonical names: embed, norm, lm_head (unless tied), and
    # layers.{i}.{attn_norm, qkv, o, mlp_norm, gate_up, down, q_norm, k_norm}; quantized ones add
    # .q_weight / .q_scale.
    names: dict[str, str] = field(default_factory=dict)


@dataclass
class DenseArgs(BaseModelArgs):
    """config.json fields shared by the dense decoder families (phi3, llama, qwen3)."""

    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    vocab_size: int
    num_key_value_heads: int | None = None
    head_dim: int | None = None
    rms_norm_eps: float = 1e-5
    rope_theta: float | None = None
    position_embedding_base: float | None = None  # MLC's name for rope_theta
    rope_scaling: dict | None = None
    rope_parameters: dict | None = None  # transformers >= 5 folds theta/scaling in here
    partial_rotary_factor: float = 1.0
    max_position_embeddings: int = 4096
    context_window_size: int | None = None
    tie_word_embeddings: bool = False

    def rope(self) -> tuple[float, float, dict | None]:
        params = self.rope_parameters or {}
        theta = self.rope_theta or self.position_embedding_base or params.get("rope_theta") or 10000.0
        partial = params.get("partial_rotary_factor", self.partial_rotary_factor)
        scaling = self.rope_scaling or (params if params.get("rope_type", "default") != "default" else None)
        return float(theta), float(partial), scaling

    def dense_spec(self, names: dict[str, str], qk_norm: bool = False) -> DenseSpec:
        heads = self.num_attention_heads
        head_dim = self.head_dim or self.hidden_size // heads
        theta, partial, scaling = self.rope()
        inv_freq, rot = rope_inv_freq(head_dim, theta, partial, scaling)
        return DenseSpec(
            dim=self.hidden_size, n_layers=self.num_hidden_layers, n_heads=heads,
            n_kv_heads=self.num_key_value_heads or heads, head_dim=head_dim, ffn_dim=self.intermediate_size,
            vocab=self.vocab_size, eps=self.rms_norm_eps, inv_freq=inv_freq, rot_dim=rot,
            context_length=self.context_window_size or self.max_position_embeddings,
            tied_embeddings=self.tie_word_embeddings, qk_norm=qk_norm, names=names,
        )


def rope_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float = 1.0,
                  rope_scaling: dict | None = None) -> tuple[np.ndarray, int]:
    """Inverse frequencies computed like transformers' default RoPE (float32), and the rotary dim."""
    rot = int(head_dim * partial_rotary_factor)
    exponents = np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot)
    inv = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    kind = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
    if kind in (None, "default"):
        return inv, rot
    if kind == "llama3":
        return _llama3_scaling(inv, rope_scaling), rot
    raise UnsupportedModelError(f"RoPE scaling {kind!r} (config field rope_scaling) is not supported yet")


def _llama3_scaling(inv: np.ndarray, cfg: dict) -> np.ndarray:
    factor = cfg["factor"]
    low, high = cfg.get("low_freq_factor", 1.0), cfg.get("high_freq_factor", 4.0)
    old_ctx = cfg.get("original_max_position_embeddings", 8192)
    wavelen = 2 * np.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return np.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled).astype(np.float32)


def quantized(names: dict[str, str], canonical: str, source: str) -> None:
    names[f"{canonical}.q_weight"] = f"{source}.q_weight"
    names[f"{canonical}.q_scale"] = f"{source}.q_scale"
