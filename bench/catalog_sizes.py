"""Qwen3.6-35B-A3B MLX download sizes, derived from the real tensor list (resources/models.json cites this).

Text tensors: the architecture file's own weight table (engine/models/qwen3_5_moe.py) for Qwen3.6-35B-A3B's config,
each stored as mlx-lm writes it: affine matrices at `bits` (the router and the shared-expert gate at 8, mlx-lm's
predicate; routed experts at 3 in the q3exp build) as u32 codes plus bf16 scales and biases per 64 columns, every
other tensor bf16. Vision tower (kept, unread, in the shards): Qwen3.5's ViT (depth 27, width 1152, MLP 4304,
patch 16 × 16 × 2 frames × 3 channels, 2304 position embeddings, a 2 × 2 merger into the 2048-wide text model),
all bf16 as mlx-vlm leaves it. Shard headers and the index add a few hundred KB.

    python3 bench/catalog_sizes.py
"""

from __future__ import annotations

import numpy as np

from engine.models import model_module
from engine.models.weights import EXPERTS, MATRIX

QWEN36 = dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
              num_key_value_heads=2, head_dim=256, vocab_size=248320, rms_norm_eps=1e-6, tie_word_embeddings=False,
              linear_num_value_heads=32, linear_num_key_heads=16, linear_key_head_dim=128, linear_value_head_dim=128,
              linear_conv_kernel_dim=4, full_attention_interval=4, max_position_embeddings=262144,
              num_experts=256, num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
              norm_topk_prob=True,
              rope_parameters=dict(rope_type="default", rope_theta=10000000.0, partial_rotary_factor=0.25))
BF16 = 2


def quantized_bytes(n: int, k: int, bits: int, group: int = 64) -> int:
    """u32 codes plus a bf16 scale and bias per group."""
    return n * k * bits // 8 + 2 * BF16 * n * (k // group)


def text_bytes(expert_bits: int, config: dict = QWEN36) -> tuple[int, int]:
    """(all text tensors, the routed experts among them) in bytes, for Qwen3.6-35B-A3B's config (or another
    qwen3_5_moe text config: the tests check the rule against a checkpoint mlx-lm wrote)."""
    module = model_module("qwen3_5_moe")
    spec = module.spec(module.ModelArgs.from_dict(config))
    total = experts = 0
    for w in module.weights(spec):
        if w.kind in (MATRIX, EXPERTS):
            *lead, n, k = w.shape
            bits = 8 if w.name.endswith((".router", ".shared_gate")) else expert_bits if w.kind == EXPERTS else 4
            b = int(np.prod(lead or [1])) * quantized_bytes(n, k, bits)
            experts += b if w.kind == EXPERTS else 0
        else:
            b = int(np.prod(w.shape)) * BF16
        total += b
    return total, experts


def vision_bytes(depth=27, width=1152, mlp=4304, patch=16, frames=2, channels=3, positions=2304, merge=2,
                 out=2048) -> int:
    block = (2 * 2 * width + 3 * width * width + 3 * width + width * width + width
             + 2 * width * mlp + mlp + width)  # 2 LayerNorms, qkv, proj, fc1, fc2 (weights and biases)
    merged = width * merge * merge
    merger = 2 * width + merged * merged + merged + out * merged + out
    stem = width * channels * frames * patch * patch + width + positions * width
    return BF16 * (stem + depth * block + merger)


if __name__ == "__main__":
    vision = vision_bytes()
    for name, bits in (("4-bit", 4), ("3-bit experts", 3)):
        text, experts = text_bytes(bits)
        print(f"{name}: text {text / 1e9:.3f} GB (routed experts {experts / 1e9:.3f} GB), vision {vision / 1e9:.3f} "
              f"GB, download {(text + vision) / 1e9:.3f} GB")
