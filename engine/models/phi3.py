"""Phi-3 (model_type "phi3"): fused qkv_proj and gate_up_proj, rotate-half RoPE, no bias, untied LM head."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import DenseArgs, DenseSpec, quantized


@dataclass
class ModelArgs(DenseArgs):
    rms_norm_eps: float = 1e-5


def spec(args: ModelArgs) -> DenseSpec:
    """MLC names as in mlc-ai/Phi-3-mini-4k-instruct-q4f16_1-MLC."""
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
    return args.dense_spec(names)
