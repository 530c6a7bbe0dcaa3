"""Phi-3 (model_type "phi3"): fused qkv_proj and gate_up_proj, full RoPE, no bias, untied LM head."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import BaseModelArgs, DenseSpec, quantized, rope_inv_freq


@dataclass
class ModelArgs(BaseModelArgs):
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


def spec(args: ModelArgs) -> DenseSpec:
    heads = args.num_attention_heads
    head_dim = args.head_dim or args.hidden_size // heads
    theta, partial, scaling = args.rope()
    inv_freq, rot = rope_inv_freq(head_dim, theta, partial, scaling)
    names: dict[str, str] = {"norm": "transformer.norm.weight"}
    quantized(names, "embed", "transformer.embd")
    if not args.tie_word_embeddings:
        quantized(names, "lm_head", "lm_head")
    for i in range(args.num_hidden_layers):
        p, c = f"transformer.h.{i}", f"layers.{i}"
        names[f"{c}.attn_norm"] = f"{p}.ln.weight"
        names[f"{c}.mlp_norm"] = f"{p}.post_attention_layernorm.weight"
        quantized(names, f"{c}.qkv", f"{p}.mixer.qkv_proj")
        quantized(names, f"{c}.o", f"{p}.mixer.out_proj")
        quantized(names, f"{c}.gate_up", f"{p}.mlp.gate_up_proj")
        quantized(names, f"{c}.down", f"{p}.mlp.down_proj")
    return DenseSpec(
        dim=args.hidden_size, n_layers=args.num_hidden_layers, n_heads=heads,
        n_kv_heads=args.num_key_value_heads or heads, head_dim=head_dim, ffn_dim=args.intermediate_size,
        vocab=args.vocab_size, eps=args.rms_norm_eps, inv_freq=inv_freq, rot_dim=rot,
        context_length=args.context_window_size or args.max_position_embeddings,
        tied_embeddings=args.tie_word_embeddings, names=names,
    )
