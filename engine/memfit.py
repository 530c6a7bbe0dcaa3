"""Will a model fit? GPU bytes and host RAM a model needs at a context length, checked against the machine.

GPU bytes = weights + KV cache + working buffers. For the dense models (phi3, llama, qwen3) the KV cache and
buffers mirror engine/transformer.py `_alloc` exactly (tests compare against a real allocation). For the
Qwen3.5/3.6 hybrids (engine/hybrid.py) it is an approximation: KV only on the full-attention layers, the
recurrent + conv state per Gated DeltaNet layer times (1 + STATE_SNAPSHOTS) for the multi-turn snapshots, and
the dense buffer formula over the widest projection.

Host RAM at load: the loaders stream one tensor at a time, so the peak is a baseline (Python, numpy, wgpu
and the GPU driver) plus LOAD_COPIES of the largest tensor. On a GPU that shares system RAM (integrated,
CPU, Apple silicon) the GPU bytes come out of RAM too. wgpu does not report how much memory a GPU has, so
unless the caller knows, the GPU side of the verdict is "unknown".
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from engine.catalog import CatalogEntry
from engine.models.base import DenseSpec
from engine.sampling import WINDOW, argmax_plan
from engine.sysmem import SystemMemory, system_memory
from engine.transformer import LOGIT_ROWS, MAX_SPLITS, PAGE, PREFILL_CHUNK, Q8_PREFILL_MIN_DIM, RING, tensor_shapes

__all__ = ["MemoryEstimate", "FitReport", "GpuMemory", "estimate", "check_fit", "gpu_memory", "system_memory",
           "SystemMemory"]

GB = 1e9  # messages speak decimal GB, as disk and RAM sizes are sold
TIGHT_MARGIN = 0.15  # "tight" = the need is within 15% of what is available
# Measured 119 MiB (imports + wgpu device on Mesa lavapipe); vendor drivers map more, so rounded up generously.
RAM_BASELINE_BYTES = 512 * 2**20
# The array read from disk plus the copy wgpu makes into its staging buffer (create_buffer_with_data).
LOAD_COPIES = 2


@dataclass(frozen=True)
class MemoryEstimate:
    context: int  # tokens the KV cache holds (capped at the model's own window)
    weights_bytes: int
    kv_bytes: int
    state_bytes: int  # fixed recurrent state of linear-attention layers (hybrids only)
    scratch_bytes: int  # activations for one prefill chunk, logits rows, attention partials, rings
    load_ram_bytes: int  # host RAM at the loading peak, GPU buffers not counted
    approximate: bool
    basis: str

    @property
    def gpu_bytes(self) -> int:
        return self.weights_bytes + self.kv_bytes + self.state_bytes + self.scratch_bytes


@dataclass(frozen=True)
class GpuMemory:
    total_bytes: int | None
    shared: bool  # the GPU allocates from system RAM
    note: str


@dataclass(frozen=True)
class FitReport:
    verdict: str  # "ok" | "tight" | "wont_fit" | "unknown"
    gpu_needed: int
    ram_needed: int
    ram_available: int | None
    gpu_available: int | None
    message: str
    ram_warning: bool  # the model's own RAM warning fired (Qwen3.6)
    load_anyway: bool  # the UI should offer "Load anyway" rather than a plain Load
    estimate: MemoryEstimate


def _buf(size: int) -> int:
    return max(16, (int(size) + 3) // 4 * 4)  # engine.gpu.Gpu.buffer rounds the same way


def _up(size: int) -> int:
    return max(4, (int(size) + 3) // 4 * 4)  # and Gpu.upload pads data to whole words


def _scratch(dim: int, q_dim: int, qkv_rows: int, ffn_rows: int, n_heads: int, vocab: int, n_pages: int,
             rot_dim: int, chunk: int, max_binding: int | None) -> int:
    """Every non-weight, non-KV buffer DenseTransformer._alloc and GpuSampler create, in their order."""
    f32 = 4
    logit_rows = max(1, min(chunk, LOGIT_ROWS, max_binding // (4 * vocab))) if max_binding else min(chunk, LOGIT_ROWS)
    uploads = [n_pages * 4, rot_dim // 2 * 4, WINDOW * 4]  # page table, RoPE table, sampler window
    sizes = [16, chunk * 4, RING * 4, chunk * dim * f32, chunk * dim * f32, chunk * dim * f32, chunk * dim * f32,
             chunk * qkv_rows * f32, chunk * q_dim * f32, chunk * q_dim * f32, chunk * ffn_rows * f32,
             logit_rows * vocab * f32, MAX_SPLITS * q_dim * f32, MAX_SPLITS * n_heads * 2 * f32, RING * 4, RING * 4,
             32]
    max_k = max(dim, q_dim, ffn_rows)  # the int8 copy of one activation row for the q8 matvecs, + chunk scales
    sizes += [max_k, max_k // 32 * 8]
    if dim >= Q8_PREFILL_MIN_DIM:  # and of a prefill chunk's rows for the int8 GEMMs (the default from this dim)
        sizes += [chunk * max_k, chunk * max_k // 32 * 8]
    parts = argmax_plan(vocab)[2]
    if parts:  # the two-pass argmax's (value, index) pairs
        sizes.append(8 * parts)
    return sum(_up(s) for s in uploads) + sum(_buf(s) for s in sizes)


def _pages(context: int) -> int:
    return -(-context // PAGE)


def estimate(entry_or_spec: CatalogEntry | DenseSpec, context: int | None = None, *,
             formats: dict[str, str] | None = None, prefill_chunk: int = PREFILL_CHUNK,
             max_binding: int | None = None) -> MemoryEstimate:
    """Memory for a catalog entry or a DenseSpec at `context` tokens (default: the entry's default context,
    the spec's own window). `formats`: a spec's weight formats (absent = q4f16_1). `max_binding`: the GPU's
    max storage binding, which caps the logits rows; None assumes a full chunk of rows (an upper bound)."""
    if isinstance(entry_or_spec, DenseSpec):
        return _spec_estimate(entry_or_spec, context, formats, prefill_chunk, max_binding)
    e = entry_or_spec
    ctx = min(context or e.default_context, e.max_context)
    d = e.dims
    q_dim, kv_dim = d["num_heads"] * d["head_dim"], d["num_kv_heads"] * d["head_dim"]
    kv = _pages(ctx) * PAGE * e.kv_bytes_per_token
    load = RAM_BASELINE_BYTES + LOAD_COPIES * e.largest_tensor_bytes
    lin, moe = d.get("linear_attention"), d.get("moe")
    if not lin and not moe:
        scratch = _scratch(d["hidden_size"], q_dim, q_dim + 2 * kv_dim, d["ffn_dim"], d["num_heads"],
                           d["vocab_size"], _pages(ctx), d["head_dim"], prefill_chunk, max_binding)
        return MemoryEstimate(ctx, e.weights_bytes, kv, 0, scratch, load, e.weights_approximate,
                              "dense: KV cache and buffers as engine/transformer.py allocates them")
    # Hybrid approximation: the widest per-token projection stands in for qkv, routed + shared experts for the
    # FFN activations; each linear-attention layer adds an f32 state [v_heads, head_k, head_v] and a conv ring.
    qkv_rows = q_dim * (2 if d.get("attn_gate") else 1) + 2 * kv_dim
    state = 0
    if lin:
        k_dim, v_dim = lin["k_heads"] * lin["head_k"], lin["v_heads"] * lin["head_v"]
        qkv_rows = max(qkv_rows, 2 * k_dim + 2 * v_dim + 2 * lin["v_heads"])
        state_f32 = lin["v_heads"] * lin["head_k"] * lin["head_v"] * 4
        per_layer = state_f32 + (lin["conv_kernel"] - 1) * (2 * k_dim + v_dim) * 2  # + f16 conv ring
        state = lin["layers"] * per_layer * (1 + STATE_SNAPSHOTS)
    ffn_rows = d["ffn_dim"] * ((moe["top_k"] + moe.get("shared_experts", 0)) if moe else 1)
    scratch = _scratch(d["hidden_size"], q_dim, qkv_rows, ffn_rows, d["num_heads"], d["vocab_size"], _pages(ctx),
                       d["head_dim"], prefill_chunk, max_binding)
    if moe:
        scratch += _buf(prefill_chunk * (moe["experts"] + 1) * 4)  # router logits for a chunk
        act_int8 = (moe["top_k"] + moe.get("shared_experts", 0)) * d["ffn_dim"]  # the experts' int8 decode input
        scratch += _buf(act_int8) + _buf(act_int8 // 32 * 8)
    return MemoryEstimate(ctx, e.weights_bytes, kv, state, scratch, load, True,
                          "hybrid approximation: KV on full-attention layers only, recurrent state per linear layer")


STATE_SNAPSHOTS = 5  # engine/hybrid.py keeps 2 prompt + 3 decode copies of the GDN state for rollback


def _spec_estimate(spec: DenseSpec, context, formats, chunk, max_binding) -> MemoryEstimate:
    ctx = min(context or spec.context_length, spec.context_length)
    sizes = [int(np.prod(shape)) * np.dtype(dtype).itemsize for shape, dtype in tensor_shapes(spec, formats).values()]
    q_dim, kv_dim = spec.n_heads * spec.head_dim, spec.n_kv_heads * spec.head_dim
    kv = spec.n_layers * 2 * _buf(_pages(ctx) * spec.n_kv_heads * PAGE * spec.head_dim * 2)
    scratch = _scratch(spec.dim, q_dim, q_dim + 2 * kv_dim, spec.ffn_dim, spec.n_heads, spec.vocab, _pages(ctx),
                       spec.rot_dim, chunk, max_binding)
    return MemoryEstimate(ctx, sum(_up(s) for s in sizes), kv, 0, scratch,
                          RAM_BASELINE_BYTES + LOAD_COPIES * max(sizes), False,
                          "dense: weights, KV cache and buffers as engine/transformer.py allocates them")


def gpu_memory(adapter=None) -> GpuMemory:
    """What can be said about a GPU's memory: an AdapterInfo (engine.gpu), an adapter type string, or None."""
    kind = getattr(adapter, "adapter_type", adapter)
    if kind in ("IntegratedGPU", "CPU"):
        return GpuMemory(None, True, "this GPU shares system RAM" if kind == "IntegratedGPU"
                         else "this is a software (CPU) adapter; it uses system RAM")
    return GpuMemory(None, False, "wgpu does not report how much memory this GPU has")


def _level(needed: int, available: int | None) -> str:
    if available is None:
        return "unknown"
    if needed > available:
        return "wont_fit"
    return "tight" if needed > available * (1 - TIGHT_MARGIN) else "ok"


_RANK = {"ok": 0, "unknown": 1, "tight": 2, "wont_fit": 3}


def _gb(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    return f"{n / 1e6:.0f} MB" if n < 0.1 * GB else f"{n / GB:.1f} GB"


def _sentence(text: str) -> str:
    return text[:1].upper() + text[1:]


def check_fit(entry: CatalogEntry, context: int | None = None, system: SystemMemory | None = None,
              gpu_bytes_available: int | None = None, shared_memory: bool = False) -> FitReport:
    """Verdict for loading `entry` at `context`. `system`: RAM figures (default: asked of the OS).
    `gpu_bytes_available`: free GPU memory when the caller knows it. `shared_memory`: the GPU allocates from
    system RAM, so its bytes are added to the RAM needed. A model's RAM warning (ram_warning_bytes) fires when
    available RAM is below it or unknown, and turns an "ok" into "tight"."""
    est = estimate(entry, context)
    system = system or system_memory()
    ram_needed = est.load_ram_bytes + (est.gpu_bytes if shared_memory else 0)
    ram_level = _level(ram_needed, system.available_bytes)
    gpu_available = None if shared_memory else gpu_bytes_available
    gpu_level = "ok" if shared_memory else _level(est.gpu_bytes, gpu_available)
    verdict = max(ram_level, gpu_level, key=_RANK.__getitem__)
    warn = entry.ram_warning_bytes is not None and (
        system.available_bytes is None or system.available_bytes < entry.ram_warning_bytes)
    if warn and verdict == "ok":
        verdict = "tight"
    message = _message(entry, est, verdict, ram_needed, system.available_bytes, gpu_available, shared_memory, warn)
    return FitReport(verdict, est.gpu_bytes, ram_needed, system.available_bytes, gpu_available, message, warn,
                     verdict in ("tight", "wont_fit") or warn, est)


def _message(entry, est: MemoryEstimate, verdict, ram_needed, ram_available, gpu_available, shared, warn) -> str:
    about = "about " if est.approximate else ""
    parts = [
        f"{entry.name} at {est.context} tokens needs {about}{_gb(est.gpu_bytes)} of GPU memory "
        f"({_gb(est.weights_bytes)} weights, {_gb(est.kv_bytes + est.state_bytes)} context cache, "
        f"{_gb(est.scratch_bytes)} working buffers)"
        + (", taken from system RAM." if shared else f", and {_gb(ram_needed)} of free RAM while loading."),
        _sentence(f"{_gb(ram_available)} of RAM is free") + (f" of the {_gb(ram_needed)} needed." if shared else "."),
    ]
    if not shared:
        parts.append(f"The GPU has {_gb(gpu_available)} free." if gpu_available is not None
                     else "The GPU does not report its memory size; make sure it has "
                          f"{_gb(est.gpu_bytes)} free.")
    parts.append({
        "ok": "It should fit.",
        "tight": "It fits, but only just: close other apps first.",
        "wont_fit": "It will not fit. Try a shorter context or a smaller model.",
        "unknown": "Whether it fits is unknown.",
    }[verdict])
    if warn:
        parts.append(entry.ram_warning or f"This model needs about {_gb(entry.ram_warning_bytes)} of free RAM.")
    return " ".join(parts)
