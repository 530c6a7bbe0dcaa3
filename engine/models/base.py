"""Pieces shared by the per-architecture files: ModelArgs base, the dense-model spec, RoPE tables."""

from __future__ import annotations

from dataclasses import MISSING, dataclass, field, fields

import numpy as np

from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats.files import real_number, shown, whole_number
from engine.formats.limits import CONFIG_LIMITS, CONFIG_MAY_BE_ZERO


@dataclass
class BaseModelArgs:
    source: str = field(default="model config", init=False, repr=False, compare=False)  # for error messages

    @classmethod
    def from_dict(cls, params: dict, where: str = "model config"):
        """Build from config.json-style fields, ignoring the ones this architecture does not use. Every field
        it uses is checked against its annotation (and whole numbers against engine/formats/limits.py) first,
        so a hostile or damaged config is an error naming `where` and the field, never a hang or a TypeError."""
        if not isinstance(params, dict):
            raise ModelFormatError(f"{where}: the model config is not a JSON object")
        known = {f.name: f for f in fields(cls) if f.init}
        missing = [k for k, f in known.items()
                   if f.default is MISSING and f.default_factory is MISSING and k not in params]
        if missing:
            raise UnsupportedModelError(f"{where}: model config lacks required field(s): {', '.join(missing)}")
        args = cls(**{k: checked_field(k, v, str(known[k].type), where) for k, v in params.items() if k in known})
        args.source = where
        return args


def checked_field(name: str, value, annotation: str, where: str):
    """`value` if it has the type `annotation` names ("int | None", "list[str] | None", ...), bounded."""
    if value is None and "None" in annotation:
        return None
    kind = annotation.split("|")[0].strip()
    if kind == "int":
        return whole_number(value, name, where, low=0 if name in CONFIG_MAY_BE_ZERO else 1)
    if kind == "float":
        return real_number(value, name, where)
    if kind.startswith("list"):
        if not isinstance(value, list) or len(value) > CONFIG_LIMITS["num_hidden_layers"]:
            raise ModelFormatError(f"{where}: '{name}' is {shown(value)}, expected a list of at most "
                                   f"{CONFIG_LIMITS['num_hidden_layers']} entries")
        item = kind[5:-1]
        return [checked_field(f"{name}[{i}]", v, item, where) if item != "int" else
                whole_number(v, f"{name}[{i}]", where, low=0, high=CONFIG_LIMITS["num_hidden_layers"])
                for i, v in enumerate(value)]
    expected = {"bool": bool, "str": str, "dict": dict}.get(kind)
    if expected is None:
        raise TypeError(f"ModelArgs field {name!r} has an annotation the config checker does not know: {annotation}")
    if not isinstance(value, expected):
        raise ModelFormatError(f"{where}: '{name}' is {shown(value)}, expected a {_TYPE_WORDS[kind]}")
    return value


_TYPE_WORDS = {"bool": "boolean (true or false)", "str": "string", "dict": "JSON object"}


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
        theta = real_number(theta, "rope_theta", self.source, low=0.0, low_open=True)
        partial = real_number(partial, "partial_rotary_factor", self.source, low=0.0, high=1.0, low_open=True)
        return theta, partial, scaling

    def dense_spec(self, names: dict[str, str], qk_norm: bool = False) -> DenseSpec:
        heads, where = self.num_attention_heads, self.source
        kv_heads = self.num_key_value_heads or heads
        if heads % kv_heads:
            raise UnsupportedModelError(f"{where}: num_attention_heads ({heads}) is not a multiple of "
                                        f"num_key_value_heads ({kv_heads})")
        if self.head_dim is None and self.hidden_size % heads:
            raise UnsupportedModelError(f"{where}: hidden_size ({self.hidden_size}) is not a multiple of "
                                        f"num_attention_heads ({heads}) and there is no head_dim")
        head_dim = self.head_dim or self.hidden_size // heads
        real_number(self.rms_norm_eps, "rms_norm_eps", where, low=0.0, high=1.0, low_open=True)
        theta, partial, scaling = self.rope()
        inv_freq, rot = rope_inv_freq(head_dim, theta, partial, scaling, where)
        return DenseSpec(
            dim=self.hidden_size, n_layers=self.num_hidden_layers, n_heads=heads,
            n_kv_heads=kv_heads, head_dim=head_dim, ffn_dim=self.intermediate_size,
            vocab=self.vocab_size, eps=self.rms_norm_eps, inv_freq=inv_freq, rot_dim=rot,
            context_length=self.context_window_size or self.max_position_embeddings,
            tied_embeddings=self.tie_word_embeddings, qk_norm=qk_norm, names=names,
        )


def rope_inv_freq(head_dim: int, theta: float, partial_rotary_factor: float = 1.0,
                  rope_scaling: dict | None = None, where: str = "model config") -> tuple[np.ndarray, int]:
    """Inverse frequencies computed like transformers' default RoPE (float32), and the rotary dim."""
    rot = int(head_dim * partial_rotary_factor)
    if rot < 2 or rot % 2:
        raise UnsupportedModelError(f"{where}: the rotary dimension head_dim × partial_rotary_factor = {rot} must be "
                                    "even and at least 2")
    exponents = np.arange(0, rot, 2, dtype=np.int64).astype(np.float32) / np.float32(rot)
    inv = (1.0 / (np.float32(theta) ** exponents)).astype(np.float32)
    if rope_scaling is not None and not isinstance(rope_scaling, dict):
        raise ModelFormatError(f"{where}: 'rope_scaling' is {shown(rope_scaling)}, expected a JSON object or null")
    kind = (rope_scaling or {}).get("rope_type") or (rope_scaling or {}).get("type")
    if kind in (None, "default"):
        return inv, rot
    if kind == "llama3":
        return _llama3_scaling(inv, rope_scaling, where), rot
    raise UnsupportedModelError(f"{where}: RoPE scaling {shown(kind)} (config field rope_scaling) is not supported yet")


def _llama3_scaling(inv: np.ndarray, cfg: dict, where: str) -> np.ndarray:
    factor = real_number(cfg.get("factor"), "rope_scaling.factor", where, low=1.0)
    low = real_number(cfg.get("low_freq_factor", 1.0), "rope_scaling.low_freq_factor", where, low=0, low_open=True)
    high = real_number(cfg.get("high_freq_factor", 4.0), "rope_scaling.high_freq_factor", where, low=low,
                       low_open=True)
    old_ctx = whole_number(cfg.get("original_max_position_embeddings", 8192),
                           "rope_scaling.original_max_position_embeddings", where, high=CONFIG_LIMITS[
                               "original_max_position_embeddings"])
    wavelen = 2 * np.pi / inv
    smooth = (old_ctx / wavelen - low) / (high - low)
    scaled = np.where(wavelen > old_ctx / low, inv / factor, inv)
    mid = (wavelen <= old_ctx / low) & (wavelen >= old_ctx / high)
    return np.where(mid, (1 - smooth) * scaled / factor + smooth * scaled, scaled).astype(np.float32)


def quantized(names: dict[str, str], canonical: str, source: str) -> None:
    names[f"{canonical}.q_weight"] = f"{source}.q_weight"
    names[f"{canonical}.q_scale"] = f"{source}.q_scale"
