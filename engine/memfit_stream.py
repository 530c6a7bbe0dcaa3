"""memfit's streaming verdict: a MoE model too big for the GPU that runs with its routed experts streamed from RAM.

The runtime's own rule says how many expert cache slots fit the GPU (engine/gpu_budget.py auto_weights: the
load's blocks in wgpu's allocator and a margin, as the runtime's auto budget plans them); the speed is a model, not a
measurement: per token each MoE layer reads top_k experts, of which a share C/E hits the cache under uniformly
random routing (the worst case: LRU's hit rate on uniform independent requests is exactly C/E; real text routes
more skewed, so it does better), and each miss is uploaded at
UPLOAD_BPS (mapped staging plus a GPU copy: the H200's rate in BENCH.md, rounded down), on top of the resident
decode's time (the active weights read at RESIDENT_BPS) and one routing readback per MoE layer.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.gpu_budget import auto_weights

UPLOAD_BPS = 6e9  # host -> GPU bytes a second through mapped staging (issue 20's H200 measurement, BENCH.md)
RESIDENT_BPS = 300e9  # weight bytes a second a mid-range GPU's decode reads (resident part of a token)
READBACK_S = 2e-4  # one MoE layer's host round trip a token (readback, policy, submit; BENCH.md session 6)


@dataclass(frozen=True)
class StreamFit:
    slots: int  # expert cache slots per MoE layer
    experts: int
    top_k: int
    layers: int
    expert_bytes: int  # one routed expert of one layer, GPU layout
    budget: int  # the weights budget it was planned for
    host_bytes: int  # routed experts kept in host memory (all of them: the cache is a copy)
    tokens_per_s: float

    @property
    def resident_share(self) -> float:
        return self.slots / self.experts

    def sentence(self) -> str:
        return (f"runs with experts streamed from RAM, about {self.tokens_per_s:.0f} tok/s ({self.slots} of "
                f"{self.experts} experts a layer on the GPU; {self.host_bytes / 1e9:.1f} GB of experts in RAM)")


def decode_rate(slots: int, experts: int, top_k: int, layers: int, expert_bytes: int, active_bytes: int) -> float:
    """Tokens a second under uniformly random routing (module docstring)."""
    misses = layers * top_k * (1 - min(1.0, slots / experts))
    seconds = misses * expert_bytes / UPLOAD_BPS + active_bytes / RESIDENT_BPS + layers * READBACK_S
    return 1 / seconds


def entry_formats(entry, spec) -> dict[str, str] | None:
    """Per-matrix formats of a catalog build. An MLX MoE build as mlx-lm quantizes it: the router and the
    shared-expert gate 8-bit, the routed experts at dims.moe.expert_bits (default 4), every other matrix 4-bit. A
    GGUF build with a file_type: llama-quantize's mix (engine/formats/gguf_mix.py). None for the rest (the plan's
    default, q4f16_1)."""
    if entry.format == "gguf" and getattr(entry, "file_type", None):
        from engine.formats.gguf_mix import file_type_formats

        return file_type_formats(entry.file_type, entry.architecture, entry.dims)
    if entry.format != "mlx":
        return None
    from engine.models import model_module
    from engine.models.weights import EXPERTS, MATRIX

    bits = (entry.dims.get("moe") or {}).get("expert_bits", 4)
    out = {}
    for w in model_module(entry.architecture).weights(spec):
        if w.kind in (MATRIX, EXPERTS):
            out[w.name] = ("mlx8" if w.name.endswith((".router", ".shared_gate"))
                           else f"mlx{bits}" if w.kind == EXPERTS and bits == 3 else "mlx4")
    return out


def stream_fit(plan, gpu_available: int | None, budget: int | None = None) -> StreamFit | None:
    """How a model planned as `plan` (engine/transformer.py RuntimePlan, every weight resident) runs on a GPU with
    `gpu_available` bytes: with the slots the runtime's auto budget gives it, or with an explicit weights `budget`
    the slots that budget gives (as the runtime takes it: engine/transformer.py expert_slots, whose
    WeightsBudgetError a budget below the model's minimum raises here too). None when it is not a MoE model, fits
    whole, or under auto even the smallest expert cache does not fit."""
    from engine.transformer import expert_slots, moe_block

    moe = moe_block(plan)
    if budget is not None:
        slots = expert_slots(plan, moe, budget)  # a dense model over it raises; within it, None
        if slots is None:
            return None
    else:
        if moe is None:
            return None
        auto = auto_weights(plan, gpu_available)
        if auto.slots is None:
            return None
        slots, budget = auto.slots, auto.budget
    per_layer = moe.routed_expert_bytes() // len(moe.layers)
    resident = plan.memory()["weights"] - moe.E * moe.routed_expert_bytes()
    active = resident + moe.top_k * moe.routed_expert_bytes()
    rate = decode_rate(slots, moe.E, moe.top_k, len(moe.layers), per_layer, active)
    return StreamFit(slots, moe.E, moe.top_k, len(moe.layers), per_layer, budget,
                     moe.E * moe.routed_expert_bytes(), rate)
