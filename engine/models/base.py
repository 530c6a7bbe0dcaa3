"""Pieces shared by the per-architecture files: ModelArgs base, the specs the runtime builds from, RoPE tables."""

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


# The blocks a layer is made of, as the runtime names them: its token mixer and its feed-forward block.
ATTENTION, GATED_ATTENTION, GATED_DELTANET = "attention", "gated_attention", "gated_deltanet"
MLP, MOE = "mlp", "moe"
MIXERS, FFNS = (ATTENTION, GATED_ATTENTION, GATED_DELTANET), (MLP, MOE)


@dataclass
class DenseSpec:
    """What the runtime needs to build a model, independent of the checkpoint's naming."""

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
    # .q_weight / .q_scale. An architecture's spec() fills in its MLC names; loaders of other formats replace them.
    names: dict[str, str] = field(default_factory=dict)
    # Per layer (mixer, ffn), from MIXERS and FFNS: which blocks the runtime builds for it. Empty: attention + MLP.
    layer_blocks: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        if not self.layer_blocks:
            self.layer_blocks = ((ATTENTION, MLP),) * self.n_layers
        self.layer_blocks = tuple(tuple(b) for b in self.layer_blocks)
        if len(self.layer_blocks) != self.n_layers or any(m not in MIXERS or f not in FFNS
                                                           for m, f in self.layer_blocks):
            raise ValueError(f"layer_blocks must give one (mixer, ffn) of {MIXERS} x {FFNS} per layer "
                             f"({self.n_layers}), got {self.layer_blocks}")


LINEAR, FULL = "linear_attention", "full_attention"  # Qwen3.5's layer_types entries


@dataclass
class HybridSpec(DenseSpec):
    """DenseSpec plus the Gated DeltaNet side; n_heads/n_kv_heads/head_dim describe the attention layers."""

    layer_types: tuple[str, ...] = ()  # per layer: LINEAR (GDN) or FULL (gated attention)
    gdn_k_heads: int = 0
    gdn_v_heads: int = 0
    gdn_k_dim: int = 0
    gdn_v_dim: int = 0
    conv_kernel: int = 4
    norm_offset: float = 0.0  # added to zero-centred norm weights at run time (0.0: the +1 is baked in)
    # Mixture-of-experts MLPs (Qwen3.5-MoE / Qwen3.6, engine/models/qwen3_5_moe.py); none: dense MLPs everywhere.
    moe_layers: tuple[int, ...] = ()
    n_experts: int = 0
    top_k: int = 0
    moe_ffn_dim: int = 0  # per routed expert
    shared_ffn_dim: int = 0  # 0: no shared expert
    norm_topk_prob: bool = True
    attn_layers: tuple[int, ...] = field(init=False, default=())

    def __post_init__(self) -> None:
        self.attn_layers = tuple(i for i, t in enumerate(self.layer_types) if t == FULL)
        if not self.layer_blocks:  # from layer_types and moe_layers unless the architecture declared them
            moe = set(self.moe_layers)
            self.layer_blocks = tuple((GATED_ATTENTION if t == FULL else GATED_DELTANET, MOE if i in moe else MLP)
                                      for i, t in enumerate(self.layer_types))
        super().__post_init__()

    @property
    def conv_dim(self) -> int:  # q | k | v channels of in_proj_qkv, all through the conv
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim


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

    def dense_spec(self, qk_norm: bool = False) -> DenseSpec:
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
            tied_embeddings=self.tie_word_embeddings, qk_norm=qk_norm,
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
