"""Host-side plans (constants + grid) for the attention-side kernels."""

from __future__ import annotations

import math

from engine.gpu import fold_grid


def attention_consts(n_heads: int, n_kv_heads: int, head_dim: int, page: int) -> dict:
    """Constants for attention.wgsl: WG must cover head_dim/4 lanes, be a power of two and ≤ 256."""
    if head_dim % 4 or head_dim > 1024:
        raise ValueError(f"head_dim {head_dim} must be a multiple of 4 and at most 1024")
    wg = max(64, 1 << math.ceil(math.log2(head_dim // 4)))
    return dict(WG=min(wg, 256), H=n_heads, KVH=n_kv_heads, HD=head_dim, PAGE=page,
                SCALE=1.0 / math.sqrt(head_dim))


def qkv_fused_plan(dim: int, rope: dict, pairs: int = 4) -> tuple[dict, tuple[int, int]]:
    """qkv_rope_append.wgsl: each workgroup computes `pairs` RoPE pairs (2·pairs rows) of the fused QKV matrix."""
    if dim % 32:
        raise ValueError(f"model dim {dim} must be a multiple of 32 for q4f16_1")
    if pairs % 2 or pairs > rope["WG"]:
        raise ValueError(f"pairs={pairs} must be even and at most WG={rope['WG']}")
    rows = (rope["H"] + 2 * rope["KVH"]) * rope["HD"]
    return dict(rope, K=dim, PAIRS=pairs), fold_grid(-(-rows // (2 * pairs)))
