"""Qwen3.5-MoE / Qwen3.6 (model_type "qwen3_5_moe", whose config nests the text model in text_config, or
"qwen3_5_moe_text", transformers' Qwen3_5MoeForCausalLM): the Qwen3.5 hybrid (engine/models/qwen3_5.py) with
mixture-of-experts MLPs. Qwen3.6-35B-A3B: 40 layers (30 GDN + 10 attention), 256 experts of 512, top-8
renormalised, one shared expert of 512 gated by sigmoid(shared_expert_gate·x).

A layer's MLP is a MoE block unless mlp_only_layers lists it or decoder_sparse_step skips it (the Qwen2-MoE
convention mlx-lm's Qwen3-Next follows; transformers' Qwen3.5-MoE config has neither: every layer is MoE).
Names: MLC folders from engine/convert.py follow mlc-llm's Qwen2-MoE loader (mlp.gate, mlp.moe_gate_up_proj
[E, 2F, D] with each expert's gate rows then up rows, mlp.moe_down_proj [E, D, F], mlp.shared_expert.gate_up_proj,
mlp.shared_expert.down_proj, mlp.shared_expert_gate); MLX checkpoints use mlx-lm's switch_mlp names.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedModelError
from engine.models import qwen3_5
from engine.models.base import HybridSpec
from engine.models.weights import EXPERTS, Weight, matrix, mlc_names

MODEL_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")
FORMATS = ("mlc", "mlx")
GGUF_ARCH = None
CONV_TEMPLATE = "qwen2"
HF_IGNORED = qwen3_5.HF_IGNORED


@dataclass
class ModelArgs(qwen3_5.ModelArgs):
    num_experts: int = 256  # transformers' Qwen3_5MoeTextConfig defaults
    num_experts_per_tok: int = 8
    moe_intermediate_size: int = 512
    shared_expert_intermediate_size: int = 512
    norm_topk_prob: bool = True  # absent from transformers' config, whose router always renormalises
    decoder_sparse_step: int = 1
    mlp_only_layers: list[int] | None = None

    @classmethod
    def from_dict(cls, params: dict, where: str = "model config"):
        # A MoE-only config has no intermediate_size (the dense MLP width); 0 unless some layer is dense.
        return super().from_dict({"intermediate_size": 0, **params} if isinstance(params, dict) else params, where)

    def moe_layers(self) -> tuple[int, ...]:
        skip, step = set(self.mlp_only_layers or ()), max(1, self.decoder_sparse_step)
        return tuple(i for i in range(self.num_hidden_layers)
                     if self.num_experts > 0 and i not in skip and (i + 1) % step == 0)


def spec(args: ModelArgs) -> HybridSpec:
    moe = args.moe_layers()
    if moe and not 1 <= args.num_experts_per_tok <= args.num_experts:
        raise UnsupportedModelError(f"{args.source}: num_experts_per_tok={args.num_experts_per_tok} with num_experts="
                                    f"{args.num_experts}: need 1 ≤ top-k ≤ experts")
    if len(moe) < args.num_hidden_layers and args.intermediate_size <= 0:
        raise UnsupportedModelError(f"{args.source}: some layers have a dense MLP (mlp_only_layers / "
                                    "decoder_sparse_step) but the config has no intermediate_size")
    qwen3_5.check(args)
    s = qwen3_5.hybrid_spec(args, moe_layers=moe, n_experts=args.num_experts, top_k=args.num_experts_per_tok,
                            moe_ffn_dim=args.moe_intermediate_size, shared_ffn_dim=args.shared_expert_intermediate_size,
                            norm_topk_prob=args.norm_topk_prob)
    s.names = mlc_names(weights(s))
    return s


def weights(spec: HybridSpec) -> list[Weight]:
    out = [qwen3_5.first_weight(spec)]
    moe = set(spec.moe_layers)
    for i in range(spec.n_layers):
        out += qwen3_5.mixer_weights(spec, i) + (moe_weights(spec, i) if i in moe else qwen3_5.mlp_weights(spec, i))
    return out + qwen3_5.last_weights(spec)


def moe_weights(spec: HybridSpec, i: int) -> list[Weight]:
    """A MoE layer: the router, the routed experts' stacks and the shared expert. Hugging Face checkpoints hold one
    tensor per expert ("{e}") or, from transformers 5, one [E, N, K] tensor per projection."""
    p, c, d, e, f = f"model.layers.{i}.mlp", f"layers.{i}.moe", spec.dim, spec.n_experts, spec.moe_ffn_dim
    out = [
        matrix(f"{c}.router", (e, d), f"{p}.gate", hf=f"{p}.gate.weight", mlx=f"{p}.gate.weight"),
        Weight(f"{c}.gate_up", EXPERTS, (e, 2 * f, d), (f"{p}.moe_gate_up_proj",),
               hf=(f"{p}.experts.{{e}}.gate_proj.weight", f"{p}.experts.{{e}}.up_proj.weight"),
               hf_fused=f"{p}.experts.gate_up_proj",
               mlx=(f"{p}.switch_mlp.gate_proj.weight", f"{p}.switch_mlp.up_proj.weight")),
        Weight(f"{c}.down", EXPERTS, (e, d, f), (f"{p}.moe_down_proj",), hf=(f"{p}.experts.{{e}}.down_proj.weight",),
               hf_fused=f"{p}.experts.down_proj", mlx=(f"{p}.switch_mlp.down_proj.weight",)),
    ]
    s = spec.shared_ffn_dim
    if s:
        up = [f"{p}.shared_expert.gate_proj.weight", f"{p}.shared_expert.up_proj.weight"]
        out += [matrix(f"{c}.shared_gate_up", (2 * s, d), f"{p}.shared_expert.gate_up_proj", hf=up, mlx=up),
                matrix(f"{c}.shared_down", (d, s), f"{p}.shared_expert.down_proj",
                       hf=f"{p}.shared_expert.down_proj.weight", mlx=f"{p}.shared_expert.down_proj.weight"),
                matrix(f"{c}.shared_gate", (1, d), f"{p}.shared_expert_gate", hf=f"{p}.shared_expert_gate.weight",
                       mlx=f"{p}.shared_expert_gate.weight")]
    return out
