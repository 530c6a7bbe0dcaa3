"""Qwen3 (model_type "qwen3"): Llama layout plus per-head q/k RMSNorm before RoPE; mlc-llm names the
fused q|k|v weight `c_attn`. Qwen3-4B: GQA 32/8 heads × 128, θ = 1e6, LM head tied to the embedding."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import DenseArgs, DenseSpec
from engine.models.llama import global_names, layer_names


@dataclass
class ModelArgs(DenseArgs):
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True


def spec(args: ModelArgs) -> DenseSpec:
    names = global_names(args)
    for i in range(args.num_hidden_layers):
        layer_names(names, i, qkv="c_attn")
        names[f"layers.{i}.q_norm"] = f"model.layers.{i}.self_attn.q_norm.weight"
        names[f"layers.{i}.k_norm"] = f"model.layers.{i}.self_attn.k_norm.weight"
    return args.dense_spec(names, qk_norm=True)
