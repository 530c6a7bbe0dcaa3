"""The MoE block's decode token when the residual norms ride in the matvecs (engine/blocks/residual.py): three
dispatches a layer where the unfused token runs the add + norm, router, top-k, gate_up, quantize_q8, down, combine
and the next add + norm.
  1. moe_router_norm: the router logits (f32) from the mixer's new residual, normed on the fly as add_rms_norm would
  2. moe_gate_up_q8: the top-k in every workgroup; gate_up of every slot on the norm's int8 row (matvec_q8_norm's,
     without 1/rms), each 32 outputs written in int8 for down
  3. moe_down_q8: down of every slot, their weighted sum, the residual add and the next norm's int8 row (the last
     layer: the sum into delta, for the final add + norm)
Taken where every MoE layer's experts run as one int8 stack per matrix (4-bit; or MLX 3-bit with the 4-bit shared
expert stored after it, "mixed"). Streamed experts (engine/blocks/expert_cache.py) add moe_router's top-k after 1,
whose ids the host reads back to fill the cache; 2 then reads the experts' cache slots from the slot ids it wrote and
keeps its own route's weights, so a streamed token computes what the resident one does, bit for bit."""

from __future__ import annotations

from engine.kernels.matmul import FORMATS, format_knobs, norm_pack_layout
from engine.kernels.moe import (
    MOE_DOWN_Q8,
    MOE_GATE_UP_Q8,
    MOE_ROUTER_NORM,
    decode_pack_layout,
    down_q8_plan,
    gate_up_q8_plan,
    router_norm_plan,
)


def _stack(block, i: int, stack: str) -> dict:
    """Keyword arguments of a fused pass over layer i's stack ("gate_up" or "down"): experts in it, the mixed layout's
    offsets, the format's knobs."""
    experts, mixed = block.stack_experts(i), (0, 0)
    if block.mixed[i]:
        experts, mixed = block.E + 1, block._mixed_layout(i, stack)[:2]
    return dict(experts=experts, mixed=mixed, **format_knobs(block.fmt[i, stack]))


def fused_plans(block, i: int, eps: float = 1e-6, norm_offset: float = 0.0, pack: dict | None = None,
                last: bool = False) -> dict | None:
    """Layer i's three plans {"router", "gate_up", "down"}, or None where the layer cannot take them."""
    int8 = all(FORMATS.get(block.fmt[i, p], {}).get("bits") in (3, 4) for p in ("gate_up", "down"))
    if not (block.ar.int8 and int8) or (block.shared and not (block.stacked[i] or block.mixed[i])):
        return None
    D, F, ar = block.D, block.F, block.ar
    pack = pack or norm_pack_layout(D)
    act = decode_pack_layout(F, block.slots)
    gate_up = gate_up_q8_plan(D, F, E=block.E, top_k=block.top_k, shared=block.shared, norm_topk=block.norm_topk,
                              subgroup_size=ar.subgroup_size, eps=eps, norm_pack=pack, act_pack=act,
                              max_threads=ar.max_threads, stream=block.stream is not None,
                              **_stack(block, i, "gate_up"))
    down = down_q8_plan(F, D, slots=block.slots, norm=not last, norm_offset=norm_offset, norm_pack=pack, act_pack=act,
                        subgroup_size=ar.subgroup_size, max_threads=ar.max_threads, **_stack(block, i, "down"))
    if gate_up is None or down is None:
        return None
    router = router_norm_plan(D, block.E + block.shared, eps, norm_offset, **format_knobs(block.fmt[i, "router"]))
    return {"router": router, "gate_up": gate_up, "down": down}


def can_fuse(block) -> bool:
    """Whether every layer of the block can run its decode token as the three fused passes."""
    return all(fused_plans(block, i) is not None for i in block.layers)


def fused_needs(block) -> dict[str, int]:
    """Scratch of the fused passes (label -> bytes): the int8 activations and route gate_up hands to down."""
    return {"moe-decode-pack": 4 * decode_pack_layout(block.F, block.slots)["words"]}


def build_fused(block, gpu, ws, norms, pack_buf) -> dict[int, list]:
    """Every layer's three dispatches, (pipeline, bind group, grid) each, bound to the residual block's buffers."""
    out = {}
    for i in block.layers:
        src = norms.block_input(i)
        end, norm = norms.ffn_output(i)
        plans = fused_plans(block, i, src["eps"], src["offset"], src["pack"], last=not norm)
        w = block.w[i]
        pack = src["pack"]
        d = block.D
        steps = []
        for kernel, key, buffers in (
                (MOE_ROUTER_NORM, "router", dict(r=src["r"], nw=src["nw"], ss=(src["nq"], pack["ss"], d // 32 * 4),
                                                 w=w["router"][0], s=w["router"][1], y=block.logits)),
                (MOE_GATE_UP_Q8, "gate_up", dict(nq=src["nq"], logits=block.logits, w=w["gate_up"][0],
                                                 s=w["gate_up"][1], act=pack_buf, slot_ids=block.expert_ids)),
                (MOE_DOWN_Q8, "down", dict(act=pack_buf, w=w["down"][0], s=w["down"][1], out=end["r_out"],
                                           r_in=end["r_in"], nw=end["nw"], nq=end["nq"]))):
            consts, grid = plans[key]
            pipe = gpu.pipeline(kernel, consts)
            steps.append((pipe, gpu.bind(pipe, buffers, f"layers.{i}.moe.{key}-fused"), grid))
        out[i] = steps
    return out
