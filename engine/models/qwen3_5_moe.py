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

import dataclasses
from dataclasses import dataclass

from engine.errors import UnsupportedModelError
from engine.models import qwen3_5
from engine.models.base import quantized
from engine.models.qwen3_5 import HybridSpec


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
    def from_dict(cls, params: dict):
        # A MoE-only config has no intermediate_size (the dense MLP width); 0 unless some layer is dense.
        return super().from_dict({"intermediate_size": 0, **params})

    def moe_layers(self) -> tuple[int, ...]:
        skip, step = set(self.mlp_only_layers or ()), max(1, self.decoder_sparse_step)
        return tuple(i for i in range(self.num_hidden_layers)
                     if self.num_experts > 0 and i not in skip and (i + 1) % step == 0)


def spec(args: ModelArgs) -> HybridSpec:
    moe = args.moe_layers()
    if moe and not 1 <= args.num_experts_per_tok <= args.num_experts:
        raise UnsupportedModelError(f"num_experts_per_tok={args.num_experts_per_tok} with num_experts="
                                    f"{args.num_experts}: need 1 ≤ top-k ≤ experts")
    if len(moe) < args.num_hidden_layers and args.intermediate_size <= 0:
        raise UnsupportedModelError("some layers have a dense MLP (mlp_only_layers / decoder_sparse_step) but the "
                                    "config has no intermediate_size")
    base = qwen3_5.spec(args)
    names, shared = base.names, args.shared_expert_intermediate_size
    for i in moe:
        p, c = f"model.layers.{i}.mlp", f"layers.{i}"
        for key in ("q_weight", "q_scale"):
            del names[f"{c}.gate_up.{key}"], names[f"{c}.down.{key}"]
        quantized(names, f"{c}.moe.router", f"{p}.gate")
        quantized(names, f"{c}.moe.gate_up", f"{p}.moe_gate_up_proj")
        quantized(names, f"{c}.moe.down", f"{p}.moe_down_proj")
        if shared:
            quantized(names, f"{c}.moe.shared_gate_up", f"{p}.shared_expert.gate_up_proj")
            quantized(names, f"{c}.moe.shared_down", f"{p}.shared_expert.down_proj")
            quantized(names, f"{c}.moe.shared_gate", f"{p}.shared_expert_gate")
    return dataclasses.replace(base, moe_layers=moe, n_experts=args.num_experts, top_k=args.num_experts_per_tok,
                               moe_ffn_dim=args.moe_intermediate_size, shared_ffn_dim=shared,
                               norm_topk_prob=args.norm_topk_prob)


def mlx_layout(spec: HybridSpec) -> tuple[dict[str, list[str]], dict[str, str]]:
    """qwen3_5.mlx_layout with mlx-lm's MoE names (switch_mlp stacks [E, N, K]; gate then up rows per expert)."""
    matrices, tensors = qwen3_5.mlx_layout(spec)
    for i in spec.moe_layers:
        p, c = f"model.layers.{i}.mlp", f"layers.{i}"
        del matrices[f"{c}.gate_up"], matrices[f"{c}.down"]
        matrices[f"{c}.moe.router"] = [f"{p}.gate.weight"]
        matrices[f"{c}.moe.gate_up"] = [f"{p}.switch_mlp.gate_proj.weight", f"{p}.switch_mlp.up_proj.weight"]
        matrices[f"{c}.moe.down"] = [f"{p}.switch_mlp.down_proj.weight"]
        if spec.shared_ffn_dim:
            matrices[f"{c}.moe.shared_gate_up"] = [f"{p}.shared_expert.gate_proj.weight",
                                                   f"{p}.shared_expert.up_proj.weight"]
            matrices[f"{c}.moe.shared_down"] = [f"{p}.shared_expert.down_proj.weight"]
            matrices[f"{c}.moe.shared_gate"] = [f"{p}.shared_expert_gate.weight"]
    return matrices, tensors

