"""Qwen3.5 dense hybrid (model_type "qwen3_5", whose config nests the text model in text_config, or
"qwen3_5_text"): Gated DeltaNet linear-attention layers interleaved with gated full-attention layers
(every `full_attention_interval`-th), partial RoPE, zero-centred RMSNorms. Qwen3.5-4B: 32 layers (24 GDN
+ 8 attention), attention 16/4 heads × 256 with 64 rotary dims, GDN 16 key / 32 value heads × 128.

Names are mlc-ai's Qwen3.5-4B-q4f16_1-MLC build (mlc-llm's qwen35_loader): self_attn.c_attn = q_proj
(per head [Q | gate]) ++ k_proj ++ v_proj; linear_attn.{in_proj_qkv, in_proj_z, in_proj_a, in_proj_b,
out_proj} quantized, A_log / dt_bias f32, conv1d_weight f16 [conv_dim, 1, K], norm.weight f16.
Norm convention: mlc-llm bakes the zero-centred norms' +1 into input/post-attention/final/q/k norm weights
(not into linear_attn.norm, whose gated norm is a plain weight), and so does engine/convert.py; such
checkpoints run with norm_offset 0.0. A checkpoint with raw (zero-centred) weights sets norm_offset 1.0.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import UnsupportedModelError
from engine.models.base import DenseArgs, DenseSpec, quantized
from engine.models.llama import global_names

LINEAR, FULL = "linear_attention", "full_attention"


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

    @property
    def conv_dim(self) -> int:  # q | k | v channels of in_proj_qkv, all through the conv
        return 2 * self.gdn_k_heads * self.gdn_k_dim + self.gdn_v_heads * self.gdn_v_dim


@dataclass
class ModelArgs(DenseArgs):
    rms_norm_eps: float = 1e-6
    partial_rotary_factor: float = 0.25  # transformers' default for Qwen3.5 configs that omit it
    linear_num_key_heads: int = 16
    linear_num_value_heads: int = 32
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    linear_conv_kernel_dim: int = 4
    layer_types: list[str] | None = None
    full_attention_interval: int = 4
    attn_output_gate: bool = True
    hidden_act: str = "silu"

    @classmethod
    def from_dict(cls, params: dict):
        """Flat (qwen3_5_text, mlc-llm) or nested (qwen3_5: text_config) configs; the top-level
        tie_word_embeddings wins, as transformers' Qwen3_5ForConditionalGeneration reads it there."""
        text = params.get("text_config")
        if isinstance(text, dict):
            merged = {**params, **text}
            if "tie_word_embeddings" in params:
                merged["tie_word_embeddings"] = params["tie_word_embeddings"]
            params = merged
        return super().from_dict(params)

    def kinds(self) -> tuple[str, ...]:
        n = self.num_hidden_layers
        kinds = tuple(self.layer_types or (FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                           for i in range(n)))
        if len(kinds) != n or set(kinds) - {LINEAR, FULL}:
            raise UnsupportedModelError(f"layer_types must list {n} of {LINEAR!r} / {FULL!r}, got {list(kinds)}")
        return kinds


def spec(args: ModelArgs) -> HybridSpec:
    if not args.attn_output_gate:
        raise UnsupportedModelError("Qwen3.5 without attn_output_gate is not supported (every build gates)")
    if args.hidden_act != "silu":
        raise UnsupportedModelError(f"hidden_act {args.hidden_act!r} is not supported (silu only)")
    if args.linear_num_value_heads % args.linear_num_key_heads:
        raise UnsupportedModelError("linear_num_value_heads must be a multiple of linear_num_key_heads")
    kinds = args.kinds()
    names = global_names(args)
    for i, kind in enumerate(kinds):
        p, c = f"model.layers.{i}", f"layers.{i}"
        names[f"{c}.attn_norm"] = f"{p}.input_layernorm.weight"
        names[f"{c}.mlp_norm"] = f"{p}.post_attention_layernorm.weight"
        quantized(names, f"{c}.gate_up", f"{p}.mlp.gate_up_proj")
        quantized(names, f"{c}.down", f"{p}.mlp.down_proj")
        if kind == FULL:
            quantized(names, f"{c}.c_attn", f"{p}.self_attn.c_attn")
            quantized(names, f"{c}.o", f"{p}.self_attn.o_proj")
            names[f"{c}.q_norm"] = f"{p}.self_attn.q_norm.weight"
            names[f"{c}.k_norm"] = f"{p}.self_attn.k_norm.weight"
            continue
        g = f"{p}.linear_attn"
        for proj in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
            quantized(names, f"{c}.{proj}", f"{g}.{proj}")
        quantized(names, f"{c}.out", f"{g}.out_proj")
        names[f"{c}.A_log"] = f"{g}.A_log"
        names[f"{c}.dt_bias"] = f"{g}.dt_bias"
        names[f"{c}.conv1d"] = f"{g}.conv1d_weight"
        names[f"{c}.gdn_norm"] = f"{g}.norm.weight"
    dense = args.dense_spec(names, qk_norm=True)
    return HybridSpec(
        **{f: getattr(dense, f) for f in DenseSpec.__dataclass_fields__}, layer_types=kinds,
        gdn_k_heads=args.linear_num_key_heads, gdn_v_heads=args.linear_num_value_heads,
        gdn_k_dim=args.linear_key_head_dim, gdn_v_dim=args.linear_value_head_dim,
        conv_kernel=args.linear_conv_kernel_dim,
    )


def mlx_layout(spec: HybridSpec) -> tuple[dict[str, list[str]], dict[str, str]]:
    """mlx-lm's names (qwen3_5.py, prefix stripped) for an MLX checkpoint: (canonical matrix -> the MLX weights
    whose rows it joins, in order; canonical tensor -> its MLX tensor). q_proj's rows are per head [Q | gate],
    so q_proj ++ k_proj ++ v_proj is the c_attn matrix of the MLC builds; norms carry their +1 (norm_offset 0)."""
    matrices = {"embed": ["model.embed_tokens.weight"]}
    if not spec.tied_embeddings:
        matrices["lm_head"] = ["lm_head.weight"]
    tensors = {"norm": "model.norm.weight"}
    for i, kind in enumerate(spec.layer_types):
        p, c = f"model.layers.{i}", f"layers.{i}"
        tensors[f"{c}.attn_norm"] = f"{p}.input_layernorm.weight"
        tensors[f"{c}.mlp_norm"] = f"{p}.post_attention_layernorm.weight"
        matrices[f"{c}.gate_up"] = [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"]
        matrices[f"{c}.down"] = [f"{p}.mlp.down_proj.weight"]
        if kind == FULL:
            matrices[f"{c}.c_attn"] = [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"]
            matrices[f"{c}.o"] = [f"{p}.self_attn.o_proj.weight"]
            tensors[f"{c}.q_norm"] = f"{p}.self_attn.q_norm.weight"
            tensors[f"{c}.k_norm"] = f"{p}.self_attn.k_norm.weight"
            continue
        g = f"{p}.linear_attn"
        for proj in ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b"):
            matrices[f"{c}.{proj}"] = [f"{g}.{proj}.weight"]
        matrices[f"{c}.out"] = [f"{g}.out_proj.weight"]
        tensors |= {f"{c}.A_log": f"{g}.A_log", f"{c}.dt_bias": f"{g}.dt_bias", f"{c}.conv1d": f"{g}.conv1d.weight",
                    f"{c}.gdn_norm": f"{g}.norm.weight"}
    return matrices, tensors

