"""Qwen3 (model_type "qwen3"): the Llama layout plus per-head q/k RMSNorm before RoPE; mlc-llm names the fused
q|k|v weight `c_attn` (some builds `qkv_proj`); llama.cpp stores q/k unpermuted (NeoX-style RoPE).
Qwen3-4B: GQA 32/8 heads × 128, θ = 1e6, LM head tied to the embedding."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models import llama
from engine.models.base import DenseArgs, DenseSpec
from engine.models.weights import Weight, mlc_names, norm

MODEL_TYPES = ("qwen3",)
FORMATS = ("mlc", "gguf")
GGUF_ARCH = "qwen3"
CONV_TEMPLATE = "qwen2"
HF_IGNORED: tuple[str, ...] = ()


@dataclass
class ModelArgs(DenseArgs):
    rms_norm_eps: float = 1e-6
    tie_word_embeddings: bool = True


def spec(args: ModelArgs) -> DenseSpec:
    s = args.dense_spec(qk_norm=True)
    s.names = mlc_names(weights(s))
    return s


def weights(spec: DenseSpec) -> list[Weight]:
    out = llama.first_weights(spec)
    for i in range(spec.n_layers):
        p, b, c = f"model.layers.{i}.self_attn", f"blk.{i}", f"layers.{i}"
        out += llama.layer_weights(spec, i, mlc_qkv=("c_attn", "qkv_proj"), permuted=False)
        out += [norm(f"{c}.{x}_norm", spec.head_dim, f"{p}.{x}_norm.weight", hf=f"{p}.{x}_norm.weight",
                     gguf=f"{b}.attn_{x}_norm.weight") for x in "qk"]
    return out + llama.last_weights(spec)
