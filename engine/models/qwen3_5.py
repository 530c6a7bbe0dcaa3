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

from dataclasses import dataclass

from engine.errors import UnsupportedModelError
from engine.formats.files import shown
from engine.models.base import FULL, GATED_ATTENTION, GATED_DELTANET, LINEAR, MLP, MOE, DenseArgs, HybridSpec
from engine.models.weights import NORM, PARAM, Weight, matrix, mlc_names, norm

MODEL_TYPES = ("qwen3_5", "qwen3_5_text")
FORMATS = ("mlc", "mlx")
GGUF_ARCH = None
CONV_TEMPLATE = "qwen2"
HF_IGNORED = ("model.visual.", "mtp.")  # the vision tower and the multi-token-prediction head
ZERO_CENTRED_OFFSET = 1.0  # y = x̂·(1 + w): converting bakes the 1 into the weight, as mlc-llm does

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
    def from_dict(cls, params: dict, where: str = "model config"):
        """Flat (qwen3_5_text, mlc-llm) or nested (qwen3_5: text_config) configs; the top-level
        tie_word_embeddings wins, as transformers' Qwen3_5ForConditionalGeneration reads it there."""
        text = params.get("text_config") if isinstance(params, dict) else None
        if isinstance(text, dict):
            merged = {**params, **text}
            if "tie_word_embeddings" in params:
                merged["tie_word_embeddings"] = params["tie_word_embeddings"]
            params = merged
        return super().from_dict(params, where)

    def kinds(self) -> tuple[str, ...]:
        n = self.num_hidden_layers
        kinds = tuple(self.layer_types or (FULL if (i + 1) % self.full_attention_interval == 0 else LINEAR
                                           for i in range(n)))
        if len(kinds) != n or set(kinds) - {LINEAR, FULL}:
            raise UnsupportedModelError(f"{self.source}: layer_types must list {n} of {LINEAR!r} / {FULL!r}, got "
                                        f"{shown(list(kinds))}")
        return kinds


def spec(args: ModelArgs) -> HybridSpec:
    check(args)
    s = hybrid_spec(args)
    s.names = mlc_names(weights(s))
    return s


def check(args: ModelArgs) -> None:
    """What the runtime cannot run, refused naming the config."""
    where = args.source
    if not args.attn_output_gate:
        raise UnsupportedModelError(f"{where}: Qwen3.5 without attn_output_gate is not supported (every build gates)")
    if args.hidden_act != "silu":
        raise UnsupportedModelError(f"{where}: hidden_act {shown(args.hidden_act)} is not supported (silu only)")
    if args.linear_num_value_heads % args.linear_num_key_heads:
        raise UnsupportedModelError(f"{where}: linear_num_value_heads must be a multiple of linear_num_key_heads")


def hybrid_spec(args: ModelArgs, **moe) -> HybridSpec:
    """The spec of `args`, with the MoE fields `moe` (engine/models/qwen3_5_moe.py) when given. Full-attention
    layers run gated attention, linear ones Gated DeltaNet; layers in moe_layers a MoE block, the rest an MLP."""
    dense, kinds, moe_layers = args.dense_spec(qk_norm=True), args.kinds(), set(moe.get("moe_layers", ()))
    blocks = tuple((GATED_ATTENTION if kind == FULL else GATED_DELTANET, MOE if i in moe_layers else MLP)
                   for i, kind in enumerate(kinds))
    return HybridSpec(
        **{f: getattr(dense, f) for f in ("dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "ffn_dim", "vocab",
                                          "eps", "inv_freq", "rot_dim", "context_length", "tied_embeddings",
                                          "qk_norm")},
        layer_blocks=blocks, layer_types=kinds, gdn_k_heads=args.linear_num_key_heads,
        gdn_v_heads=args.linear_num_value_heads, gdn_k_dim=args.linear_key_head_dim,
        gdn_v_dim=args.linear_value_head_dim, conv_kernel=args.linear_conv_kernel_dim, **moe,
    )


def weights(spec: HybridSpec) -> list[Weight]:
    out = [first_weight(spec)]
    for i in range(spec.n_layers):
        out += mixer_weights(spec, i) + mlp_weights(spec, i)
    return out + last_weights(spec)


def first_weight(spec: HybridSpec) -> Weight:
    return matrix("embed", (spec.vocab, spec.dim), "model.embed_tokens", hf="model.embed_tokens.weight",
                  mlx="model.embed_tokens.weight")


def last_weights(spec: HybridSpec) -> list[Weight]:
    out = [norm("norm", spec.dim, "model.norm.weight", hf="model.norm.weight", mlx="model.norm.weight",
                hf_offset=ZERO_CENTRED_OFFSET)]
    if not spec.tied_embeddings:
        out.append(matrix("lm_head", (spec.vocab, spec.dim), "lm_head", hf="lm_head.weight", mlx="lm_head.weight"))
    return out


def mixer_weights(spec: HybridSpec, i: int) -> list[Weight]:
    """A layer's two norms and its mixer: gated attention (FULL) or Gated DeltaNet (LINEAR). In MLX, q_proj's rows
    are per head [Q | gate], so q_proj ++ k_proj ++ v_proj is the MLC builds' c_attn; MLX norms carry their +1."""
    p, c, d = f"model.layers.{i}", f"layers.{i}", spec.dim
    out = [norm(f"{c}.attn_norm", d, f"{p}.input_layernorm.weight", hf=f"{p}.input_layernorm.weight",
                mlx=f"{p}.input_layernorm.weight", hf_offset=ZERO_CENTRED_OFFSET),
           norm(f"{c}.mlp_norm", d, f"{p}.post_attention_layernorm.weight", hf=f"{p}.post_attention_layernorm.weight",
                mlx=f"{p}.post_attention_layernorm.weight", hf_offset=ZERO_CENTRED_OFFSET)]
    if spec.layer_types[i] == FULL:
        a, h, kvh, hd = f"{p}.self_attn", spec.n_heads, spec.n_kv_heads, spec.head_dim
        projections = [f"{a}.{x}_proj.weight" for x in "qkv"]
        return out + [
            matrix(f"{c}.c_attn", ((2 * h + 2 * kvh) * hd, d), (f"{a}.c_attn", f"{a}.qkv_proj"), hf=projections,
                   mlx=projections),
            matrix(f"{c}.o", (d, h * hd), f"{a}.o_proj", hf=f"{a}.o_proj.weight", mlx=f"{a}.o_proj.weight"),
            *(norm(f"{c}.{x}_norm", hd, f"{a}.{x}_norm.weight", hf=f"{a}.{x}_norm.weight", mlx=f"{a}.{x}_norm.weight",
                   hf_offset=ZERO_CENTRED_OFFSET) for x in "qk"),
        ]
    g, vh, vd = f"{p}.linear_attn", spec.gdn_v_heads, spec.gdn_v_dim
    rows = {"in_proj_qkv": spec.conv_dim, "in_proj_z": vh * vd, "in_proj_a": vh, "in_proj_b": vh}
    out += [matrix(f"{c}.{x}", (n, d), f"{g}.{x}", hf=f"{g}.{x}.weight", mlx=f"{g}.{x}.weight")
            for x, n in rows.items()]
    return out + [
        matrix(f"{c}.out", (d, vh * vd), f"{g}.out_proj", hf=f"{g}.out_proj.weight", mlx=f"{g}.out_proj.weight"),
        Weight(f"{c}.A_log", PARAM, (vh,), (f"{g}.A_log",), hf=(f"{g}.A_log",), mlx=(f"{g}.A_log",), dtype="float32"),
        Weight(f"{c}.dt_bias", PARAM, (vh,), (f"{g}.dt_bias",), hf=(f"{g}.dt_bias",), mlx=(f"{g}.dt_bias",),
               dtype="float32"),
        Weight(f"{c}.conv1d", PARAM, (spec.conv_dim, 1, spec.conv_kernel), (f"{g}.conv1d_weight",),
               hf=(f"{g}.conv1d.weight",), mlx=(f"{g}.conv1d.weight",)),
        # The gated norm y = x̂·w·silu(z) is a plain weight: no +1.
        Weight(f"{c}.gdn_norm", NORM, (spec.gdn_v_dim,), (f"{g}.norm.weight",), hf=(f"{g}.norm.weight",),
               mlx=(f"{g}.norm.weight",)),
    ]


def mlp_weights(spec: HybridSpec, i: int) -> list[Weight]:
    p, c, d, f = f"model.layers.{i}.mlp", f"layers.{i}", spec.dim, spec.ffn_dim
    up = [f"{p}.gate_proj.weight", f"{p}.up_proj.weight"]
    return [matrix(f"{c}.gate_up", (2 * f, d), f"{p}.gate_up_proj", hf=up, mlx=up),
            matrix(f"{c}.down", (d, f), f"{p}.down_proj", hf=f"{p}.down_proj.weight", mlx=f"{p}.down_proj.weight")]
