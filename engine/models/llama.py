"""Llama family (model_type "llama", e.g. SmolLM2, Llama 3.2): q/k/v and gate/up fused at conversion."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import DenseArgs, DenseSpec, quantized


@dataclass
class ModelArgs(DenseArgs):
    rms_norm_eps: float = 1e-6


def layer_names(names: dict[str, str], i: int, qkv: str = "qkv_proj") -> None:
    p, c = f"model.layers.{i}", f"layers.{i}"
    names[f"{c}.attn_norm"] = f"{p}.input_layernorm.weight"
    names[f"{c}.mlp_norm"] = f"{p}.post_attention_layernorm.weight"
    quantized(names, f"{c}.qkv", f"{p}.self_attn.{qkv}")
    quantized(names, f"{c}.o", f"{p}.self_attn.o_proj")
    quantized(names, f"{c}.gate_up", f"{p}.mlp.gate_up_proj")
    quantized(names, f"{c}.down", f"{p}.mlp.down_proj")


def global_names(args: DenseArgs) -> dict[str, str]:
    names = {"norm": "model.norm.weight"}
    quantized(names, "embed", "model.embed_tokens")
    if not args.tie_word_embeddings:
        quantized(names, "lm_head", "lm_head")
    return names


def spec(args: ModelArgs) -> DenseSpec:
    names = global_names(args)
    for i in range(args.num_hidden_layers):
        layer_names(names, i)
    return args.dense_spec(names)
