"""Llama family (model_type "llama": SmolLM2, Llama 3.x): q/k/v and gate/up fused at conversion, rotate-half
RoPE, no bias. MLC names follow mlc-llm's llama_loader; llama.cpp's converter permutes q/k rows (undone on
reading a GGUF). Runs from MLC folders (convert a Hugging Face checkpoint with `zerotvm convert`) and GGUF files."""

from __future__ import annotations

from dataclasses import dataclass

from engine.models.base import DenseArgs, DenseSpec
from engine.models.weights import GgufPart, Weight, matrix, mlc_names, norm

MODEL_TYPES = ("llama",)  # config.json model_type values this file reads
FORMATS = ("mlc", "gguf")
GGUF_ARCH = "llama"  # general.architecture
CONV_TEMPLATE = "llama-3"  # mlc-chat-config.json conv_template (informational)
HF_IGNORED: tuple[str, ...] = ()  # Hugging Face tensor prefixes that are not part of the text model


@dataclass
class ModelArgs(DenseArgs):
    rms_norm_eps: float = 1e-6


def spec(args: ModelArgs) -> DenseSpec:
    s = args.dense_spec()
    s.names = mlc_names(weights(s))
    return s


def weights(spec: DenseSpec) -> list[Weight]:
    return [*first_weights(spec), *(w for i in range(spec.n_layers) for w in layer_weights(spec, i)),
            *last_weights(spec)]


def first_weights(spec: DenseSpec) -> list[Weight]:
    return [matrix("embed", (spec.vocab, spec.dim), "model.embed_tokens", hf="model.embed_tokens.weight",
                   gguf=GgufPart("token_embd.weight", spec.vocab))]


def last_weights(spec: DenseSpec) -> list[Weight]:
    out = [norm("norm", spec.dim, "model.norm.weight", hf="model.norm.weight", gguf="output_norm.weight")]
    if not spec.tied_embeddings:
        out.append(matrix("lm_head", (spec.vocab, spec.dim), "lm_head", hf="lm_head.weight",
                          gguf=GgufPart("output.weight", spec.vocab)))
    return out


def layer_weights(spec: DenseSpec, i: int, mlc_qkv: tuple[str, ...] = ("qkv_proj", "c_attn"),
                  permuted: bool = True) -> list[Weight]:
    """One layer. `mlc_qkv`: mlc-llm's names for the fused q|k|v weight, the usual one first (builds differ);
    `permuted`: llama.cpp permuted the q/k rows of this architecture's GGUF files for its interleaved RoPE."""
    p, b, c = f"model.layers.{i}", f"blk.{i}", f"layers.{i}"
    h, kvh, hd, d, f = spec.n_heads, spec.n_kv_heads, spec.head_dim, spec.dim, spec.ffn_dim
    return [
        norm(f"{c}.attn_norm", d, f"{p}.input_layernorm.weight", hf=f"{p}.input_layernorm.weight",
             gguf=f"{b}.attn_norm.weight"),
        matrix(f"{c}.qkv", ((h + 2 * kvh) * hd, d), tuple(f"{p}.self_attn.{n}" for n in mlc_qkv),
               hf=[f"{p}.self_attn.{x}_proj.weight" for x in "qkv"],
               gguf=(GgufPart(f"{b}.attn_q.weight", h * hd, h if permuted else None),
                     GgufPart(f"{b}.attn_k.weight", kvh * hd, kvh if permuted else None),
                     GgufPart(f"{b}.attn_v.weight", kvh * hd))),
        matrix(f"{c}.o", (d, h * hd), f"{p}.self_attn.o_proj", hf=f"{p}.self_attn.o_proj.weight",
               gguf=GgufPart(f"{b}.attn_output.weight", d)),
        norm(f"{c}.mlp_norm", d, f"{p}.post_attention_layernorm.weight", hf=f"{p}.post_attention_layernorm.weight",
             gguf=f"{b}.ffn_norm.weight"),
        matrix(f"{c}.gate_up", (2 * f, d), f"{p}.mlp.gate_up_proj",
               hf=[f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"],
               gguf=(GgufPart(f"{b}.ffn_gate.weight", f), GgufPart(f"{b}.ffn_up.weight", f))),
        matrix(f"{c}.down", (d, f), f"{p}.mlp.down_proj", hf=f"{p}.mlp.down_proj.weight",
               gguf=GgufPart(f"{b}.ffn_down.weight", d)),
    ]
