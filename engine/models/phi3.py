"""Phi-3 (model_type "phi3"): fused qkv_proj and gate_up_proj in the checkpoint itself, rotate-half RoPE, no
bias, untied LM head. MLC names as in mlc-ai/Phi-3-mini-4k-instruct-q4f16_1-MLC; llama.cpp keeps qkv as one
attn_qkv tensor and gate_up as one ffn_up of 2·F rows (some files split them: both are read)."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import DenseArgs, DenseSpec
from engine.models.weights import GgufPart, Weight, matrix, mlc_names, norm

MODEL_TYPES = ("phi3",)
FORMATS = ("mlc", "gguf")
GGUF_ARCH = "phi3"
CONV_TEMPLATE = "phi-3"
HF_IGNORED: tuple[str, ...] = ()


@dataclass
class ModelArgs(DenseArgs):
    rms_norm_eps: float = 1e-5


def spec(args: ModelArgs) -> DenseSpec:
    s = args.dense_spec()
    s.names = mlc_names(weights(s))
    return s


def weights(spec: DenseSpec) -> list[Weight]:
    h, kvh, hd, d, f, v = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim, spec.ffn_dim, spec.vocab
    out = [matrix("embed", (v, d), "transformer.embd", hf="model.embed_tokens.weight",
                  gguf=GgufPart("token_embd.weight", v))]
    for i in range(spec.n_layers):
        m, p, b, c = f"transformer.h.{i}", f"model.layers.{i}", f"blk.{i}", f"layers.{i}"
        out += [
            norm(f"{c}.attn_norm", d, f"{m}.ln.weight", hf=f"{p}.input_layernorm.weight", gguf=f"{b}.attn_norm.weight"),
            matrix(f"{c}.qkv", ((h + 2 * kvh) * hd, d), f"{m}.mixer.qkv_proj", hf=f"{p}.self_attn.qkv_proj.weight",
                   gguf=[GgufPart(f"{b}.attn_qkv.weight", (h + 2 * kvh) * hd),
                         (GgufPart(f"{b}.attn_q.weight", h * hd), GgufPart(f"{b}.attn_k.weight", kvh * hd),
                          GgufPart(f"{b}.attn_v.weight", kvh * hd))]),
            matrix(f"{c}.o", (d, h * hd), f"{m}.mixer.out_proj", hf=f"{p}.self_attn.o_proj.weight",
                   gguf=GgufPart(f"{b}.attn_output.weight", d)),
            norm(f"{c}.mlp_norm", d, f"{m}.post_attention_layernorm.weight",
                 hf=f"{p}.post_attention_layernorm.weight", gguf=f"{b}.ffn_norm.weight"),
            matrix(f"{c}.gate_up", (2 * f, d), f"{m}.mlp.gate_up_proj", hf=f"{p}.mlp.gate_up_proj.weight",
                   gguf=[(GgufPart(f"{b}.ffn_gate.weight", f), GgufPart(f"{b}.ffn_up.weight", f)),
                         GgufPart(f"{b}.ffn_up.weight", 2 * f)]),
            matrix(f"{c}.down", (d, f), f"{m}.mlp.down_proj", hf=f"{p}.mlp.down_proj.weight",
                   gguf=GgufPart(f"{b}.ffn_down.weight", d)),
        ]
    out.append(norm("norm", d, "transformer.norm.weight", hf="model.norm.weight", gguf="output_norm.weight"))
    if not spec.tied_embeddings:
        out.append(matrix("lm_head", (v, d), "lm_head", hf="lm_head.weight", gguf=GgufPart("output.weight", v)))
    return out
