"""Will a model fit? GPU bytes and host RAM a model needs at a context length, checked against the machine.

GPU bytes = weights + KV cache + recurrent state + working buffers, as the runtime's blocks will allocate them, plus
what wgpu's allocator holds beyond them (the unused rest of its blocks of device memory, and the block its upload
staging keeps): the estimate asks the same RuntimePlan the runtime builds from (engine/transformer.py) for its
buffers and for their footprint in the allocator (engine/gpu_heap.py), so nothing here mirrors the runtime by hand.
A catalog entry is planned from its recorded dimensions; its weight bytes are the catalog's figure (exact for the MLC
builds, approximate where the entry says so). While loading, the GPU also holds the uploads' staging copies, one
window of them at a time (engine/gpu.py UPLOAD_WINDOW), in the allocator's blocks too.

Host RAM at load: the loaders stream one tensor at a time, so the peak is a baseline (Python, numpy, wgpu
and the GPU driver) plus LOAD_COPIES of the largest tensor. On a GPU that shares system RAM (integrated,
CPU, Apple silicon) the GPU bytes come out of RAM too. wgpu does not report how much memory a GPU has, so
unless the caller knows (engine/vram.py asks nvidia-smi or AMD's sysfs), the GPU side of the verdict is "unknown".
A MoE model gets the verdict "streams" on a GPU whose memory is known when the runtime's auto budget would stream its
routed experts from RAM there (engine/memfit_stream.py); the RAM it needs then counts the host-resident experts.

On a software adapter (engine/gpu.py is_software_adapter) the verdict also weighs speed: decode reads
`decode_bytes` of weights per token, and engine/speed.py turns that into a rough tokens/s; every model is then at
least "slow", and "too_slow" when an answer would take minutes.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.blocks import DeviceTraits, array_bytes, sum_needs
from engine.catalog import CatalogEntry
from engine.errors import WeightsBudgetError
from engine.gpu import AdapterInfo, is_software_adapter
from engine.gpu_budget import shown
from engine.humanize import human_rate
from engine.memfit_stream import StreamFit
from engine.models import model_module
from engine.models.base import DenseSpec
from engine.runtime_options import RuntimeOptions
from engine.speed import SpeedEstimate, software_speed
from engine.sysmem import SystemMemory, system_memory
from engine.transformer import RuntimePlan

__all__ = ["MemoryEstimate", "FitReport", "GpuMemory", "estimate", "check_fit", "gpu_memory", "system_memory",
           "SystemMemory", "SpeedEstimate"]

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
    state_bytes: int  # recurrent state of linear-attention layers and its rollback snapshots (hybrids only)
    scratch_bytes: int  # activations for one prefill chunk, logits rows, attention partials, rings
    load_ram_bytes: int  # host RAM at the loading peak, GPU buffers not counted
    approximate: bool
    basis: str
    staging_bytes: int = 0  # upload staging the GPU holds at most while loading, on top of gpu_bytes
    decode_bytes: int = 0  # weight bytes one decoded token reads (not the embedding table, only the routed experts)
    overhead_bytes: int = 0  # what the allocator holds beyond the buffers (engine/gpu_heap.py): block tails and such
    open_bytes: int = 0  # of gpu_bytes, what the opened device held before the load (its allocator's first block)

    @property
    def buffer_bytes(self) -> int:
        """The bytes of every buffer the runtime creates (kinds summed)."""
        return self.weights_bytes + self.kv_bytes + self.state_bytes + self.scratch_bytes

    @property
    def gpu_bytes(self) -> int:
        """GPU memory the loaded model holds: its buffers and the allocator's overhead around them."""
        return self.buffer_bytes + self.overhead_bytes

    @property
    def load_gpu_bytes(self) -> int:
        """GPU bytes at the loading peak: the loaded model plus one staging window."""
        return self.gpu_bytes + self.staging_bytes


@dataclass(frozen=True)
class GpuMemory:
    total_bytes: int | None
    shared: bool  # the GPU allocates from system RAM
    note: str


@dataclass(frozen=True)
class FitReport:
    verdict: str  # "ok" | "unknown" | "slow" | "tight" | "streams" | "too_slow" | "wont_fit" (the worse)
    gpu_needed: int
    ram_needed: int
    ram_available: int | None
    gpu_available: int | None
    message: str
    ram_warning: bool  # the model's own RAM warning fired (Qwen3.6)
    load_anyway: bool  # the UI should offer "Load anyway" rather than a plain Load
    estimate: MemoryEstimate
    memory_verdict: str = ""  # "ok" | "tight" | "wont_fit" | "unknown": memory alone
    speed: SpeedEstimate | None = None  # on a software adapter: the decode speed to expect
    summary: str = ""  # a short label: "fits (needs 2.6 GB)", "tight (...)", "does not fit (...)", speed after it
    stream: object | None = None  # engine.memfit_stream.StreamFit when the verdict is "streams"


def entry_spec(e: CatalogEntry) -> DenseSpec:
    """The architecture's spec from a catalog entry's recorded dimensions (what memfit plans the blocks from)."""
    d = e.dims
    cfg = dict(hidden_size=d["hidden_size"], intermediate_size=d["ffn_dim"], num_hidden_layers=d["num_layers"],
               num_attention_heads=d["num_heads"], num_key_value_heads=d["num_kv_heads"], head_dim=d["head_dim"],
               vocab_size=d["vocab_size"], tie_word_embeddings=d["tied_embeddings"],
               max_position_embeddings=e.max_context)
    lin, moe = d.get("linear_attention"), d.get("moe")
    if lin:
        cfg |= dict(linear_num_key_heads=lin["k_heads"], linear_num_value_heads=lin["v_heads"],
                    linear_key_head_dim=lin["head_k"], linear_value_head_dim=lin["head_v"],
                    linear_conv_kernel_dim=lin["conv_kernel"],
                    full_attention_interval=d["num_layers"] // max(1, d["kv_layers"]))
    if moe:  # ffn_dim is the routed experts' width; the shared one (if any) is as wide in these models
        cfg |= dict(intermediate_size=0, num_experts=moe["experts"], num_experts_per_tok=moe["top_k"],
                    moe_intermediate_size=d["ffn_dim"],
                    shared_expert_intermediate_size=d["ffn_dim"] if moe.get("shared_experts") else 0)
    module = model_module(e.architecture)
    return module.spec(module.ModelArgs.from_dict(cfg))


def estimate(entry_or_spec: CatalogEntry | DenseSpec, context: int | None = None, *,
             formats: dict[str, str] | None = None, options: RuntimeOptions | None = None,
             prefill_chunk: int | None = None, max_binding: int | None = None,
             traits: DeviceTraits | None = None) -> MemoryEstimate:
    """Memory for a catalog entry or a model spec at `context` tokens (default: the entry's default context, the
    spec's own window). `formats`: the weight formats (absent: a catalog MLX build's own, else q4f16_1). `options`:
    the RuntimeOptions the model will run with (the context and prefill_chunk arguments override theirs). `traits`:
    the GPU's (DeviceTraits.of(gpu)); by default a typical discrete GPU whose largest binding is `max_binding`
    (None: every logits row fits, an upper bound)."""
    entry = None if isinstance(entry_or_spec, DenseSpec) else entry_or_spec
    spec = entry_or_spec if entry is None else entry_spec(entry)
    if entry is not None and formats is None:  # an MLX build's own formats (a 3-bit one packs differently)
        from engine.memfit_stream import entry_formats

        formats = entry_formats(entry, spec)
    window = min(entry.max_context, spec.context_length) if entry else spec.context_length
    ctx = min(context or (entry.default_context if entry else window), window)
    changes = {"max_context": ctx} | ({"prefill_chunk": prefill_chunk} if prefill_chunk else {})
    traits = traits or DeviceTraits.typical(max_binding)
    plan = RuntimePlan(spec, formats, RuntimeOptions.of(options, **changes), traits)
    needs = plan.needs()  # asked once: planning every buffer is the cost of an estimate
    mem = sum_needs(needs)
    if entry is None:
        tensors = [array_bytes(shape, dtype) for shape, dtype in plan.tensors().values()]
        weights, largest, approximate = mem["weights"], max(tensors), False
        basis = "the runtime's blocks: weights, KV cache, state and buffers as they allocate them"
    elif plan.streaming is not None:  # a budget keeps the routed experts in RAM: the GPU holds the plan's share
        weights, largest, approximate = mem["weights"], entry.largest_tensor_bytes, entry.weights_approximate
        basis = "the runtime's blocks planned from the catalog's dimensions, routed experts in a GPU cache"
    else:
        weights, largest, approximate = entry.weights_bytes, entry.largest_tensor_bytes, entry.weights_approximate
        basis = "the runtime's blocks planned from the catalog's dimensions; weights as the catalog records them"
    foot = plan.footprint(traits.memory_kind)
    overhead = foot.steady - sum(mem.values())  # the planned weights' share of it stays with a catalog's figure
    decode = round(weights * _decode_share(plan, needs))  # the plan's share, applied to the recorded bytes
    return MemoryEstimate(plan.max_context, weights, mem["kv"], mem["state"], mem["scratch"],
                          RAM_BASELINE_BYTES + LOAD_COPIES * largest, approximate, basis, foot.peak - foot.steady,
                          decode, overhead, foot.open)


def _decode_share(plan: RuntimePlan, needs: list) -> float:
    """The fraction of the weight bytes a decoded token reads: all but the embedding table (one row of it) when the
    head is its own matrix, and of a MoE stack only the top-k experts (plus the shared one stacked with them)."""
    from engine.blocks.moe import MoeFfn

    needs = [n for n in needs if n.kind == "weights"]
    total = sum(n.bytes for n in needs)
    moe = next((b for b in plan.blocks if isinstance(b, MoeFfn)), None)
    own_head = any(n.label.startswith("lm_head.") for n in needs)
    read = 0.0
    for n in needs:
        parts = n.label.split(".")
        if own_head and parts[0] == "embed":
            continue
        if moe is not None and len(parts) > 3 and parts[2] == "moe" and parts[3] in ("gate_up", "down"):
            stacked = int(moe.stacked.get(int(parts[1]), False))
            read += n.bytes * (moe.top_k + stacked) / (moe.E + stacked)
        else:
            read += n.bytes
    return read / total if total else 1.0


_ESTIMATES: dict = {}  # check_fit's estimates: a picker refresh asks for every model again


def _estimate_key(entry: CatalogEntry, context: int | None, budget: int | None = None) -> tuple:
    import json

    return json.dumps(entry.to_dict(), sort_keys=True, default=str), context, budget  # all the estimate reads


def _entry_estimate(entry: CatalogEntry, context: int | None, budget: int | None = None) -> MemoryEstimate:
    """estimate(entry, context) with the weights budget `budget` (None: auto's plan, every weight resident),
    remembered."""
    key = _estimate_key(entry, context, budget)
    if key not in _ESTIMATES:
        if len(_ESTIMATES) > 256:
            _ESTIMATES.clear()
        _ESTIMATES[key] = estimate(entry, context, options=RuntimeOptions(gpu_weights=budget))
    return _ESTIMATES[key]


def fit_is_quick(entry: CatalogEntry, context: int | None = None, gpu_bytes: int | None = None,
                 gpu_weights: int | None = None) -> bool:
    """True when check_fit(entry, context, gpu_bytes_available=gpu_bytes, gpu_weights=gpu_weights) will not plan the
    model again (its estimate, and its streaming plan where one is asked, are remembered): the GUI asks this and
    leaves the others to a background thread."""
    if _estimate_key(entry, context) not in _ESTIMATES:
        return False
    ctx = _ESTIMATES[_estimate_key(entry, context)].context
    if gpu_weights is not None:  # an explicit budget binds dense models too, and a streamed plan has its estimate
        stream = _STREAM_FITS.get(_stream_key(entry, ctx, None, gpu_weights), _UNKNOWN)
        return stream is not _UNKNOWN and (not isinstance(stream, StreamFit)
                                           or _estimate_key(entry, context, gpu_weights) in _ESTIMATES)
    if gpu_bytes is None or not (entry.dims or {}).get("moe"):
        return True
    return _stream_key(entry, ctx, gpu_bytes) in _STREAM_FITS


def gpu_memory(adapter=None) -> GpuMemory:
    """What can be said about a GPU's memory: an AdapterInfo (engine.gpu), an adapter type string, or None."""
    kind = getattr(adapter, "adapter_type", adapter)
    if kind == "CPU" or (isinstance(adapter, AdapterInfo) and is_software_adapter(adapter)):
        return GpuMemory(None, True, "this is a software (CPU) adapter; it uses system RAM")
    if kind == "IntegratedGPU":
        return GpuMemory(None, True, "this GPU shares system RAM")
    from engine.vram import adapter_memory

    total = adapter_memory(adapter) if not isinstance(adapter, str) else None
    if total:
        return GpuMemory(total, False, "as the GPU's driver tools report it")
    return GpuMemory(None, False, "wgpu does not report how much memory this GPU has")


def _level(needed: int, available: int | None) -> str:
    if available is None:
        return "unknown"
    if needed > available:
        return "wont_fit"
    return "tight" if needed > available * (1 - TIGHT_MARGIN) else "ok"


_RANK = {"ok": 0, "unknown": 1, "slow": 2, "tight": 3, "streams": 4, "too_slow": 5, "wont_fit": 6}


def _gb(n: int | None) -> str:
    if n is None:
        return "an unknown amount"
    return f"{n / 1e6:.0f} MB" if n < 0.1 * GB else f"{n / GB:.1f} GB"


def check_fit(entry: CatalogEntry, context: int | None = None, system: SystemMemory | None = None,
              gpu_bytes_available: int | None = None, shared_memory: bool = False, software: bool = False,
              cores: int | None = None, decode_rate: float | None = None,
              gpu_weights: int | None = None) -> FitReport:
    """Verdict for loading `entry` at `context`. `system`: RAM figures (default: asked of the OS).
    `gpu_bytes_available`: free GPU memory when the caller knows it. `shared_memory`: the GPU allocates from
    system RAM, so its bytes are added to the RAM needed. A model's RAM warning (ram_warning_bytes) fires when
    available RAM is below it or unknown, and turns an "ok" into "tight". `software`: the adapter is a software one
    (engine/gpu.py); the verdict then also says how slow decode will be: from `decode_rate` (weight bytes/s
    measured there, engine/speed.py measured_rate) when known, else from `cores` (default: this machine's).
    `gpu_weights`: the weights budget set by hand (bytes; None: auto), taken as the load takes it: a MoE model over
    it streams its experts whatever the GPU's size, and one it cannot load within is "wont_fit" with the load's
    own sentence."""
    est = _entry_estimate(entry, context)
    system = system or system_memory()
    gpu_available = None if shared_memory else gpu_bytes_available
    stream, budget_error = None, None
    if gpu_weights is not None:
        try:
            stream = stream_fit_of(entry, est.context, gpu_available, gpu_weights)
        except WeightsBudgetError as e:
            budget_error = e
        if stream is not None:  # the GPU holds the streamed plan: its non-expert weights and the expert cache
            est = _entry_estimate(entry, context, gpu_weights)
    elif gpu_available is not None:
        # Where the runtime's auto budget streams the experts (too big whole once the allocator's blocks and its
        # margin count: engine/gpu_budget.py auto_weights), it runs so; the plan fits that GPU by construction.
        stream = stream_fit_of(entry, est.context, gpu_available)
    ram_needed = est.load_ram_bytes + (est.gpu_bytes if shared_memory else 0)
    gpu_level = "ok" if shared_memory else _level(est.gpu_bytes, gpu_available)
    if stream is not None:  # the experts count as RAM needed
        gpu_level = "wont_fit" if gpu_level == "wont_fit" and gpu_weights is not None else "streams"
        ram_needed += stream.host_bytes
    if budget_error is not None:
        gpu_level = "wont_fit"
    ram_level = _level(ram_needed, system.available_bytes)
    memory = max(ram_level, gpu_level, key=_RANK.__getitem__)
    warn = entry.ram_warning_bytes is not None and (
        system.available_bytes is None or system.available_bytes < entry.ram_warning_bytes)
    if warn and memory == "ok":
        memory = "tight"
    speed = software_speed(est.decode_bytes, cores, decode_rate) if software else None
    verdict = max(memory, speed.level, key=_RANK.__getitem__) if speed else memory
    message = _message(entry, est, memory, ram_needed, system.available_bytes, gpu_available, shared_memory, warn,
                       gpu_weights if stream is not None else None)
    if budget_error is not None:  # what the load would say, in place of the memory sentences
        text = str(budget_error)
        message = f"{entry.name} cannot load with the GPU weights budget you set: {text}."
    elif gpu_weights is not None and gpu_level == "wont_fit" and (entry.dims or {}).get("moe"):
        message += (f" With the GPU weights budget of {shown(gpu_weights)} it needs {_gb(est.gpu_bytes)} of GPU "
                    "memory: lower the budget, or set it to auto.")
    elif stream is not None:
        message += f" It {stream.sentence()}."
    # "streams" outranks "tight": RAM that the host-resident experts nearly fill is said, and asked about, anyway.
    ram_tight = stream is not None and ram_level == "tight"
    if ram_tight and not warn:
        message += " Its experts in RAM leave little of it free: close other apps first."
    if speed is not None:
        message += " " + speed.message
    # The figure that sets the verdict: the GPU's, the RAM estimate's, or the model's measured RAM need (warning).
    if warn and _RANK[memory] > _RANK[max(ram_level, gpu_level, key=_RANK.__getitem__)]:
        need, have, where = entry.ram_warning_bytes, system.available_bytes, "RAM"
    elif not shared_memory and _RANK[gpu_level] >= _RANK[ram_level]:
        need, have, where = est.gpu_bytes, gpu_available, "GPU memory"
    else:
        need, have, where = ram_needed, system.available_bytes, "RAM"
    if budget_error is not None:
        summary = f"does not fit the weights budget ({shown(gpu_weights)})"
    elif memory == "streams":
        summary = stream.sentence().split(" (")[0]
    else:
        summary = _summary(memory, need, have, where, speed)
    return FitReport(verdict, est.gpu_bytes, ram_needed, system.available_bytes, gpu_available, message, warn,
                     verdict in ("tight", "wont_fit", "too_slow") or warn or ram_tight, est, memory, speed, summary,
                     stream)


_STREAM_FITS: dict = {}  # StreamFit, None (every weight on the GPU) or, for an explicit budget, its WeightsBudgetError
_UNKNOWN = object()


def _stream_key(entry: CatalogEntry, context: int, gpu_available: int | None, budget: int | None = None) -> tuple:
    return entry.key, entry.dims_source, context, gpu_available, budget


def stream_fit_of(entry: CatalogEntry, context: int, gpu_available: int | None, budget: int | None = None):
    """The streaming plan of a catalog MoE model on a GPU of `gpu_available` bytes under auto, or with the explicit
    weights budget `budget` (the GPU's size then does not matter), or None (remembered: the picker asks again on
    every refresh). A budget the model cannot load with raises its WeightsBudgetError, as the load would."""
    from engine.memfit_stream import entry_formats, stream_fit

    key = _stream_key(entry, context, None if budget is not None else gpu_available, budget)
    if key not in _STREAM_FITS:
        if budget is None and not (entry.dims or {}).get("moe"):
            _STREAM_FITS[key] = None
        else:
            spec = entry_spec(entry)
            plan = RuntimePlan(spec, entry_formats(entry, spec), RuntimeOptions(max_context=context))
            try:
                _STREAM_FITS[key] = stream_fit(plan, gpu_available, budget)
            except WeightsBudgetError as e:
                _STREAM_FITS[key] = e
    if isinstance(found := _STREAM_FITS[key], WeightsBudgetError):
        raise found
    return found


def _summary(memory: str, need: int, have: int | None, where: str, speed: SpeedEstimate | None) -> str:
    """The picker's and `zerotvm models`' short label, e.g. "fits (3.9 GB of GPU memory)" or "does not fit (needs
    21.6 GB of RAM, 8.0 GB free)", then the speed on a software adapter."""
    if memory == "unknown":
        text = f"needs {_gb(need)} of {where} (free amount unknown)"
    elif memory == "ok":
        text = f"fits ({_gb(need)} of {where})"
    else:
        free = f", {_gb(have)} free" if have is not None else ""
        text = f"{'tight' if memory == 'tight' else 'does not fit'} (needs {_gb(need)} of {where}{free})"
    if speed is not None:
        rate = human_rate(speed.tokens_per_s)
        text += f" · too slow ({rate})" if speed.level == "too_slow" else f" · slow (about {rate})"
    return text


def _ram_consequence(entry) -> str:
    """The catalog's RAM warning without its own "Needs about N GB" figure (the message states the need once)."""
    import re

    text = entry.ram_warning or ""
    rest = re.sub(r"^Needs about [^()]*?(\([^)]*\))?\.\s*", "", text)
    return rest if rest != text else text


def _message(entry, est: MemoryEstimate, verdict, ram_needed, ram_available, gpu_available, shared, warn,
             budget: int | None = None) -> str:
    """One sentence of what the model needs and what is free, one of the verdict, then the model's own RAM
    warning when it fires. `budget`: the weights budget set by hand that streams its experts."""
    about = "about " if est.approximate else ""
    parts = (f"{_gb(est.weights_bytes)} weights, {_gb(est.kv_bytes + est.state_bytes)} context cache, "
             f"{_gb(est.scratch_bytes)} working buffers, {_gb(est.overhead_bytes)} allocator overhead")
    measured = entry.ram_warning_bytes if (entry.ram_warning_bytes or 0) > ram_needed else None
    also = f" (in practice about {_gb(measured)} of free RAM)" if measured else ""
    if shared:
        need = (f"{entry.name} at {est.context} tokens needs {about}{_gb(ram_needed)} of free RAM{also}: "
                f"{_gb(est.gpu_bytes)} for the model ({parts}; this GPU uses system RAM) and "
                f"{_gb(est.load_ram_bytes)} more while loading")
        have = f"{_gb(ram_available)} of RAM is free"
    else:
        need = (f"{entry.name} at {est.context} tokens needs {about}{_gb(est.gpu_bytes)} of GPU memory ({parts}) "
                f"and {_gb(ram_needed)} of free RAM while loading{also}")
        have = f"{_gb(ram_available)} of RAM is free" + (
            f" and the GPU has {_gb(gpu_available)} free" if gpu_available is not None
            else f"; the GPU does not report its memory size, so make sure it has {_gb(est.gpu_bytes)} free")
    out = [f"{need}; {have}.", {
        "ok": "It should fit.",
        "tight": "It fits, but only just: close other apps first.",
        "wont_fit": "It will not fit. Try a shorter context or a smaller model.",
        "streams": (f"The GPU weights budget of {shown(budget)} does not hold it whole." if budget is not None
                    else "It does not fit whole on this GPU."),
        "unknown": "Whether it fits is unknown.",
    }[verdict]]
    if warn:
        out.append(_ram_consequence(entry) or f"This model needs about {_gb(entry.ram_warning_bytes)} of free RAM.")
    return " ".join(out)
