"""The runtime: one Transformer walks every architecture's layers through the blocks (engine/blocks/).

A model is planned first (RuntimePlan: which block runs each layer, every tensor they take and every buffer they
allocate, from the spec, the weight formats, the RuntimeOptions and the GPU's traits: no GPU needed, so memfit asks
the same plan), then the checkpoint streams into the blocks and they build. Per forward the host writes the step
uniform and the token ids and records one compute pass; a decode token replays a captured DispatchPlan and the
sampled id feeds the next embedding on the GPU, so nothing is read back per token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import replace

import numpy as np
import wgpu

from engine.blocks import DeviceTraits, sum_needs
from engine.blocks.attention import AttentionMixer
from engine.blocks.gdn import GatedDeltaNetMixer
from engine.blocks.linear import Arithmetic
from engine.blocks.mlp import DenseMlp
from engine.blocks.moe import MoeFfn
from engine.blocks.residual import ResidualNorms
from engine.blocks.sampler import Sampler
from engine.blocks.vocab import VocabEnds
from engine.blocks.workspace import RING, Workspace
from engine.cancel import Cancelled, CancelToken, check
from engine.errors import ContextLimitError, ModelFormatError, WeightsBudgetError, ZeroTVMError
from engine.gpu import Gpu, MapWait, ModelGpu, PlanRecorder, Recorder, SegmentRecorder
from engine.kernels.norm import norm_can_write_int8
from engine.kquant_plan import is_kquant
from engine.models.base import FFNS, MIXERS
from engine.runtime_options import RuntimeOptions
from engine.sampling import SamplingParams

FIRST_PIECE = 32  # rows of the first piece of a prefill that reports progress; later pieces double up to the chunk
QUICK_PIECE_S = 0.1  # a prefill piece that landed this fast lets the next one queue behind it
BATCH_SECONDS = 0.25  # a decode batch holds about this much GPU time: Stop and close wait at most two of them


def layer_blocks(spec) -> list[tuple[str, str]]:
    """Per layer (mixer, ffn), as the architecture declares them on its spec (engine/models/base.py: a mixer from
    MIXERS, a feed-forward block from FFNS)."""
    out = [tuple(kinds) for kinds in spec.layer_blocks]
    if len(out) != spec.n_layers or any(m not in MIXERS or f not in FFNS for m, f in out):
        raise ModelFormatError(f"the model declares layer blocks {out}; the runtime has mixers {', '.join(MIXERS)} "
                               f"and feed-forward blocks {', '.join(FFNS)} for its {spec.n_layers} layers")
    return out


class RuntimePlan:
    """Which block runs each layer and everything they will take and allocate, without a GPU."""

    def __init__(self, spec, formats: dict[str, str] | None = None, options: RuntimeOptions | None = None,
                 traits: DeviceTraits | None = None):
        s, formats = spec, dict(formats or {})
        self.spec, self.options, self.formats = spec, options or RuntimeOptions(), formats
        self.traits = traits = traits or DeviceTraits.typical()
        self.max_context = min(self.options.max_context or s.context_length, s.context_length)
        self.chunk = C = self.options.prefill_chunk
        int8 = self.options.q8_decode and traits.subgroups
        int8_prefill = self.options.int8_prefill(s.dim) and int8
        self.arithmetic = ar = Arithmetic(
            int8=int8, int8_prefill=int8_prefill, norm_int8=int8 and norm_can_write_int8(s.dim),
            subgroup_rows=traits.subgroups, subgroup_size=traits.subgroup_size, max_threads=traits.max_threads,
            int8_epilogues=int8_prefill and self.options.q8_epilogues, norm_splits=self.options.norm_matvec_splits)
        kinds = layer_blocks(s)
        layers_of = lambda kind, at: tuple(i for i, k in enumerate(kinds) if k[at] == kind)  # noqa: E731
        self.vocab = VocabEnds(s.dim, s.vocab, s.tied_embeddings, formats, ar, C, traits.max_binding)
        self.residual = ResidualNorms(s.dim, s.n_layers, s.eps, ar.norm_int8, getattr(s, "norm_offset", 0.0))
        mixers, ffns = [], []
        for gated in (False, True):
            if layers := layers_of("gated_attention" if gated else "attention", 0):
                mixers.append(AttentionMixer(s, layers, formats, ar, C, self.max_context, self.options.split_keys,
                                             gated=gated, single_pass_keys=self.options.single_pass_keys,
                                             offset_alignment=traits.offset_alignment,
                                             fused_split=self.options.fused_split_decode,
                                             storage_buffers=traits.storage_buffers,
                                             decode_variant=self.options.decode_attention))
        if layers := layers_of("gated_deltanet", 0):
            mixers.append(GatedDeltaNetMixer(s, layers, formats, ar, C, traits.offset_alignment,
                                             self.options.state_snapshots, self.options.snapshot_every,
                                             self.options.gdn_conv_runs))
        if layers := layers_of("mlp", 1):
            ffns.append(DenseMlp(s.dim, s.ffn_dim, layers, formats, ar, C, self.options.gate_up_q8))
        if layers := layers_of("moe", 1):
            ffns.append(MoeFfn(s.dim, s.n_experts, s.top_k, s.moe_ffn_dim, s.shared_ffn_dim, layers, formats, ar, C,
                               s.norm_topk_prob, offset_alignment=traits.offset_alignment,
                               max_buffer=traits.max_buffer))
        self.sampler = Sampler(s.vocab)
        self.blocks = [self.vocab, self.residual, *mixers, *ffns, self.sampler]
        self.budget = None  # the weights budget in bytes once resolved (None: no limit)
        moe = ffns[-1] if ffns and isinstance(ffns[-1], MoeFfn) else None
        # An explicit budget binds every model; auto only moves a MoE model's experts to RAM (a dense model, or a MoE
        # one below its minimum, loads whole: the driver, not an estimate, has the last word).
        if self.options.gpu_weights is not None and ffns:
            self.budget = self.options.gpu_weights
            slots = expert_slots(self, moe, self.budget)
        elif moe is not None:
            from engine.gpu_budget import auto_weights

            auto = auto_weights(self, traits.memory_bytes)
            self.budget, slots = auto.budget, auto.slots
        else:
            slots = None
        if slots is not None:
            ffns[-1] = MoeFfn(s.dim, s.n_experts, s.top_k, s.moe_ffn_dim, s.shared_ffn_dim, moe.layers, formats, ar,
                              C, s.norm_topk_prob, cache_slots=slots, policy=self.options.expert_policy,
                              offset_alignment=traits.offset_alignment, max_buffer=traits.max_buffer)
            self.blocks = [self.vocab, self.residual, *mixers, *ffns, self.sampler]
        # A decode token's add + norm dispatches fold into the int8 matvecs around them where every mixer and
        # feed-forward block can carry them (engine/blocks/residual.py); decided once the MoE block is known to be
        # resident or streamed (a streamed one keeps its norms).
        fused = ar.int8 and ar.norm_int8 and all(b.can_carry_norms() for b in [*mixers, *ffns])
        if fused:
            self.residual.in_matvecs = True
            for b in [*mixers, *ffns]:
                b.norms = self.residual
        self.mixer_of = {i: b for b in mixers for i in b.layers}
        self.ffn_of = {i: b for b in ffns for i in b.layers}
        self.attention = next((b for b in mixers if isinstance(b, AttentionMixer)), None)
        shared: dict[str, int] = {}
        for b in self.blocks:
            for name, size in b.shared_needs().items():
                shared[name] = max(shared.get(name, 0), size)
        # int8 rows in element order where every int8 product reads K-quant blocks, which meet it as stored
        int8_tags = set().union(*(b.int8_formats() for b in self.blocks))
        self.q8_natural = self.options.q8_natural and bool(int8_tags) and all(map(is_kquant, int8_tags))
        int8_k = max([s.dim] + [b.int8_row_k() for b in self.blocks])
        # room for the split matvec_q8_norm of the most workgroups a chunk any of its matrices takes
        norm_splits = max([b.norm_matvec_splits() for b in [*mixers, *ffns]] + [1]) if fused else 1
        self.workspace = Workspace(s.dim, C, int8_k, ar.int8_prefill, shared, traits.offset_alignment, fused,
                                   norm_splits)

    @property
    def streaming(self):
        """The expert stream (engine/blocks/expert_cache.py) when routed experts stream from host memory, else
        None."""
        return next((b.stream for b in self.blocks if getattr(b, "stream", None)), None)

    def tensors(self) -> dict[str, tuple[tuple[int, ...], str]]:
        """Canonical checkpoint tensor -> (shape, dtype), every tensor the blocks take."""
        out = {}
        for b in self.blocks:
            out |= b.tensors()
        return out

    def needs(self) -> list:
        return [n for b in [self.workspace, *self.blocks] for n in b.needs()]

    def memory(self) -> dict[str, int]:
        """GPU bytes by kind (weights, kv, state, scratch) once the model is loaded: every buffer the blocks and the
        workspace allocate, as they allocate them."""
        return sum_needs(self.needs())

    def reserved(self) -> list:
        """The buffers the runtime makes before it loads (Gpu.reserve): every planned one but those a block makes
        itself, largest first (ties in plan order). Largest first, wgpu's allocator gives every buffer over its
        first block size a block of its own and packs the rest into the gaps; in checkpoint order a MoE model's
        expert stacks just over half a block wasted the rest of each (engine/gpu_heap.py)."""
        return sorted((n for n in self.needs() if n.how != "staging"), key=lambda n: -n.bytes)

    def footprint(self, memory_kind: str = "discrete"):
        """The GPU memory a load of this plan holds (engine/gpu_heap.py Footprint): its reserved buffers, the staging
        copies of its uploads (the checkpoint's, then the blocks' own while building) and the buffers blocks make
        themselves, in wgpu's allocator on a GPU of `memory_kind` (DeviceTraits.memory_kind)."""
        from engine.gpu_heap import load_footprint

        needs = self.needs()
        uploads = sorted((n for n in needs if n.how == "upload"), key=lambda n: n.kind != "weights")
        uploads = [replace(n, bytes=size) for n in uploads for size in n.writes or (n.bytes,)]  # staged write by write
        return load_footprint(self.reserved(), uploads, [n for n in needs if n.how == "staging"], memory_kind)


def moe_block(plan: RuntimePlan) -> MoeFfn | None:
    """The plan's MoE feed-forward block, if it has one."""
    return next((b for b in plan.blocks if isinstance(b, MoeFfn)), None)


def expert_weight_bytes(plan: RuntimePlan, moe) -> tuple[int, int, int]:
    """(every weight byte, those outside the routed experts, one routed expert of every MoE layer) of a plan whose
    MoE block `moe` (None: a dense model) holds every expert."""
    weights = sum(n.bytes for b in plan.blocks for n in b.needs() if n.kind == "weights")
    if moe is None:
        return weights, weights, 0
    per_slot = moe.routed_expert_bytes()
    return weights, weights - moe.E * per_slot, per_slot


def expert_slots(plan: RuntimePlan, moe, budget: int) -> int | None:
    """Expert cache slots per MoE layer that fit `budget` bytes of weights (None: every weight fits). A MoE model
    needs room for its non-expert weights and top_k experts a layer; a dense one for all of its weights: either
    short is a WeightsBudgetError (a GpuError) naming the minimum."""
    from engine.gpu_budget import shown

    weights, fixed, per_slot = expert_weight_bytes(plan, moe)
    if weights <= budget:
        return None
    if moe is None:
        raise WeightsBudgetError(
            f"this model's weights need {shown(weights, up=True)} on the GPU but the weights budget is "
            f"{shown(budget)}; only mixture-of-experts models can keep part of their weights in RAM, so raise the "
            "budget (--gpu-weights, ZEROTVM_GPU_WEIGHTS or Settings) or pick a smaller model")
    slots = (budget - fixed) // per_slot
    if slots < moe.top_k:
        need = fixed + moe.top_k * per_slot
        raise WeightsBudgetError(
            f"the weights budget of {shown(budget)} is below this model's minimum of {shown(need, up=True)} (its "
            f"{shown(fixed)} of non-expert weights plus {moe.top_k} experts a layer); raise --gpu-weights, "
            "ZEROTVM_GPU_WEIGHTS or the Settings entry to at least that")
    return slots if slots < moe.E else None


def expected_tensors(spec, formats: dict[str, str] | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical tensor name -> (shape, dtype) the runtime's blocks take for `spec` (formats: matrix -> weight format
    tag, engine/kernels/matmul.py FORMATS; absent: MLC q4f16_1)."""
    return RuntimePlan(spec, formats).tensors()


def checked_tensors(weights: Iterable[tuple[str, np.ndarray]], expected: dict, names: dict):
    """(source name, canonical name, array) for each checkpoint tensor a runtime takes (`expected`: canonical name
    -> (shape, dtype); `names`: canonical -> source). f32 stored where f16 is expected (norms, bf16 widened) is
    narrowed; any other shape or dtype is a ModelFormatError naming the tensor; unknown tensors are skipped."""
    canonical = {names[c]: c for c in expected}
    for src, arr in weights:
        c = canonical.get(src)
        if c is None:
            continue
        shape, dtype = expected[c]
        if arr.dtype == np.float32 and dtype == "float16":
            arr = arr.astype(np.float16)
        if tuple(arr.shape) != shape or arr.dtype != np.dtype(dtype):
            raise ModelFormatError(f"tensor {src}: expected {dtype}{list(shape)}, found {arr.dtype}{list(arr.shape)}")
        yield src, c, arr


def require_all(expected: dict, names: dict, seen) -> None:
    """A ModelFormatError naming (some of) the expected tensors the checkpoint did not have."""
    missing = [names[c] for c in expected if c not in seen]
    if missing:
        raise ModelFormatError(f"checkpoint lacks {len(missing)} tensor(s), e.g. {', '.join(missing[:3])}")


class Transformer:
    """A model on the GPU: its blocks, the workspace they share, the KV cache position and the decoding loop.

    cached_ids / n_cached: the tokens whose state the cache holds (kept by generation for prefix reuse). A block
    whose state cannot be truncated (gated DeltaNet) restores a snapshot on truncate; the next forward replays the
    tokens between it and n_cached from cached_ids (which must hold them by then: engine/generate.py sets them).
    """

    def __init__(self, gpu: Gpu, spec, weights: Iterable[tuple[str, np.ndarray]], formats: dict[str, str] | None = None,
                 options: RuntimeOptions | None = None):
        self.gpu, self.spec, self.formats = gpu, spec, dict(formats or {})
        self.options = options or RuntimeOptions()
        self.plan = RuntimePlan(spec, self.formats, self.options, DeviceTraits.of(gpu))
        self.arithmetic, self.max_context, self.chunk = self.plan.arithmetic, self.plan.max_context, self.plan.chunk
        self.blocks, self.vocab, self.sampler = self.plan.blocks, self.plan.vocab, self.plan.sampler
        self.ws = self.plan.workspace
        try:
            gpu.reserve(self.plan.reserved())  # every buffer at once, in the order memfit models (plan.footprint)
            self._load(weights)
            self.ws.build(gpu)
            self.ws.dummy_f16 = self.plan.residual.dummy_f16
            model_gpu = ModelGpu(gpu, {"Q8_NATURAL": self.plan.q8_natural})  # one int8 row layout for all kernels
            for b in self.blocks:
                if b is self.sampler:
                    b.build(model_gpu, self.ws, logits=self.vocab.logits)
                else:
                    b.build(model_gpu, self.ws)
        except BaseException:  # a failed or cancelled load (an exception from the progress callback) frees its memory
            for b in [self.ws, *self.blocks]:
                b.release()
            gpu.release_reserved()
            raise
        self.unused_reservations = gpu.release_reserved()  # planned buffers no block took: none when the plan is right
        gpu.sync()  # the last uploads land before the first forward
        self.logit_rows = self.vocab.logit_rows
        self._stateful = [b for b in self.blocks if b.keeps_state]
        self._plans: dict[tuple, object] = {}  # (attention splits, greedy) -> the decode step's DispatchPlan
        self.n_cached = 0
        self.cached_ids: list[int] = []
        self._lag: int | None = None  # position the stateful blocks are at when behind n_cached (replay pending)
        self._unsettled: list[MapWait] = []  # fence waits a stopped prefill left pending
        self._last_fence = self._next_fence = None
        self.dispatches_per_token = len(self.decode_plan(1).items)  # greedy, attention not split

    def _load(self, weights) -> None:
        expected = self.plan.tensors()
        owner = {name: b for b in self.blocks for name in b.tensors()}
        seen = set()
        for src, c, arr in checked_tensors(weights, expected, self.spec.names):
            owner[c].take(self.gpu, c, arr, src)
            seen.add(c)
        require_all(expected, self.spec.names, seen)

    # ---- introspection ------------------------------------------------------------------------------------
    @property
    def pending_replay(self) -> int | None:
        """After a rollback that restored an earlier state snapshot: the position the state is at (the next forward
        first replays the tokens from there to n_cached); None when nothing is pending."""
        return self._lag

    def block(self, name: str):
        """The block of that name ("attention", "gated_attention", "gated_deltanet", "mlp", "moe", "vocab",
        "residual", "sampler"), or None."""
        return next((b for b in self.blocks if b.name == name), None)

    def report(self) -> list[dict]:
        """Per block: its layers, dispatches per decode token (greedy, attention not split) and GPU bytes by kind."""
        out = [{"block": "workspace", "layers": 0, "dispatches_per_token": 0, **sum_needs(self.ws.needs())}]
        for b in self.blocks:
            out.append({"block": b.name, "layers": len(b.layers),
                        "dispatches_per_token": b.dispatches_per_token(), **b.bytes_by_kind()})
        return out

    def forward_plan(self, T: int, splits: int = 1):
        """The dispatches of one forward of T rows: T == 1 a decode token with sampling (decode_plan), T > 1 a prefill
        chunk with every row's logits (for profiling and tests; the step uniform and tokens are the caller's)."""
        if T == 1:
            return self.decode_plan(splits)
        cap = PlanRecorder()
        self._record_body(cap, T, 1)
        self.vocab.record_head(cap, T)
        return cap.plan()

    def dispatched_kernels(self, T: int = 1) -> list[str]:
        """The kernel of each dispatch of forward_plan(T) (attention not split)."""
        return [item[0].label for item in self.forward_plan(T).items]

    # ---- recording ---------------------------------------------------------------------------------------
    def splits(self, kv_len: int) -> int:
        """Decode attention's split-K partitions over kv_len keys (1 without attention layers)."""
        return self.plan.attention.splits(kv_len) if self.plan.attention else 1

    def _record_body(self, rec, T: int, splits: int) -> None:
        """Embedding through the final norm for T rows; T == 1 takes the decode kernels."""
        res, mixer_of, ffn_of = self.plan.residual, self.plan.mixer_of, self.plan.ffn_of
        self.vocab.record_embed(rec, T)
        res.record_first(rec, T)
        for i in range(self.spec.n_layers):
            mixer_of[i].record(rec, i, T, splits)
            res.record(rec, i, T, after="mixer")
            ffn_of[i].record(rec, i, T, splits)
            res.record(rec, i, T, after="ffn")

    def decode_plan(self, splits: int):
        """The dispatches of one decode token (body, last-row logits, sampling) for a split count and the current
        sampling mode, captured once: they are the same token after token."""
        key = (splits, self.sampler.greedy)
        if key not in self._plans:
            cap = PlanRecorder()
            self._record_body(cap, 1, splits)
            self.vocab.record_head(cap, 1)
            self.sampler.record(cap)
            self._plans[key] = cap.plan()
        return self._plans[key]

    def stream_plan(self, splits: int) -> list:
        """decode_plan cut at each streamed MoE layer's routing readback: [(DispatchPlan, (block, layer) or None)]."""
        key = ("stream", splits, self.sampler.greedy)
        if key not in self._plans:
            cap = SegmentRecorder()
            self._record_body(cap, 1, splits)
            self.vocab.record_head(cap, 1)
            self.sampler.record(cap)
            self._plans[key] = cap.plans()
        return self._plans[key]

    def record_decode_token(self, rec: Recorder, out_index: int) -> None:
        """One decode token into `rec`: the step uniform, a stateful block's snapshot when due, then the captured
        plan; the token sampled at the previous step is the input, the new one goes to ring[out_index]. The caller
        submits."""
        splits = self.splits(self.n_cached + 1)
        self.ws.write_step(1, self.n_cached, out_index, splits)
        for b in self._stateful:
            b.before_single_token(rec, self.n_cached)
        if st := self.plan.streaming:  # each MoE layer reads its routing back mid-token: the plan replays in segments
            try:
                self._record_streamed_token(rec, st, splits)
            except BaseException:
                st.forget()  # uploads it planned may be lost with `rec`
                raise
        else:
            rec.replay(self.decode_plan(splits))
        self.n_cached += 1

    def _record_streamed_token(self, rec: Recorder, st, splits: int) -> None:
        """stream_plan's segments: each is recorded and sealed, ending with its routing's copy to the host, while the
        one before runs on the GPU; at each cut the host waits for that routing and makes its experts resident
        (their uploads go ahead of the next segment, in its submit). The last segment stays open in `rec` for the
        caller."""
        segments, sec = self.stream_plan(splits), st.seconds
        t0 = time.perf_counter()
        for j, (plan, cut) in enumerate(segments):
            if j:
                block, layer = segments[j - 1][1]
                t1 = time.perf_counter()
                rec.submit_sealed()
                t2 = time.perf_counter()
                st.map_ids()
                sec["record"] += t1 - t0
                sec["submit"] += t2 - t1
                t0 = t2
            rec.replay(plan)
            if cut is not None:
                cut[0].request_routing(rec)
                rec.seal()
            if j:
                sec["record"] += time.perf_counter() - t0
                block.resolve(rec, layer)
                t0 = time.perf_counter()
        sec["record"] += time.perf_counter() - t0

    def _check_room(self, n: int) -> None:
        if self.n_cached + n > self.max_context:
            raise ContextLimitError(self.n_cached + n, self.max_context)

    # ---- public API ----------------------------------------------------------------------------------------
    def set_sampling(self, params: SamplingParams) -> None:
        """How prefill and decode pick tokens: plain argmax when greedy without a penalty, else the sampler."""
        self.sampler.set_params(params)

    def reset(self) -> None:
        self.n_cached = 0
        self.cached_ids = []
        self._lag = None
        for b in self._stateful:
            b.reset()

    def truncate(self, n: int) -> None:
        """Roll the cache back to its first n tokens: KV entries past n are simply overwritten later; stateful
        blocks restore their newest snapshot at or before n, and the next forward replays the rest from
        cached_ids."""
        n = min(self.n_cached, max(0, n))
        at = self.n_cached if self._lag is None else self._lag  # where the stateful blocks really are
        for b in self._stateful:
            at = min(at, b.rollback(n, at))
        self._lag = at if at < n else None
        self.n_cached = n
        self.cached_ids = self.cached_ids[:n]

    def _catch_up(self) -> None:
        """Replay the tokens between the restored state and n_cached (see truncate)."""
        if self._lag is None:
            return
        start, end = self._lag, self.n_cached
        if len(self.cached_ids) < end:
            raise ZeroTVMError(f"cannot rebuild the recurrent state up to position {end}: token ids after "
                               f"{len(self.cached_ids)} are unknown (set cached_ids after truncate, as "
                               "engine/generate.py does)")
        ids = np.asarray(self.cached_ids[start:end], np.uint32)
        self._lag, self.n_cached = None, start
        for i in range(0, len(ids), self.chunk):
            self._run(ids[i:i + self.chunk], "none")

    def logits(self, ids, chunk: int | None = None) -> np.ndarray:
        """Teacher-forced f32 logits [T, vocab] for `ids`, appended after the cached tokens."""
        ids = np.asarray(ids, np.uint32)
        chunk = min(chunk or self.logit_rows, self.logit_rows, self.chunk)
        out = [self._forward(ids[start:start + chunk], "logits") for start in range(0, len(ids), chunk)]
        return np.concatenate(out) if out else np.zeros((0, self.spec.vocab), np.float32)

    def _forward(self, ids: np.ndarray, then: str, out_index: int = 0) -> np.ndarray | None:
        self._catch_up()
        return self._run(ids, then, out_index)

    def _run(self, ids: np.ndarray, then: str, out_index: int = 0, fence=None) -> np.ndarray | None:
        """One pass over `ids`; `then` is "logits" (every row's), "sample" (the next token) or "none". `fence`: a
        readback buffer that gets 4 bytes copied at the pass's end, so mapping it waits for exactly this pass."""
        T = len(ids)
        self._check_room(T)
        pos0 = self.n_cached
        splits = self.splits(pos0 + T) if T == 1 else 1
        self.ws.write_step(T, pos0, out_index, splits)
        self.gpu.write(self.ws.tokens, ids)
        rec = Recorder(self.gpu, "forward")
        try:
            if T == 1:
                for b in self._stateful:
                    b.before_single_token(rec, pos0)
            self._record_body(rec, T, splits)
            if then == "logits":
                self.vocab.record_head(rec, T)
            elif then == "sample":
                self.vocab.record_head(rec, 1)
                self.sampler.record(rec)
            if fence is not None:
                rec.copy(self.ws.ring, 0, fence, 0, 4)
            rec.submit()
        except BaseException:
            if st := self.plan.streaming:
                st.forget()  # uploads a streamed forward planned may be lost with `rec`
            raise
        if len(self.cached_ids) == self.n_cached:
            self.cached_ids += ids.tolist()
        self.n_cached += T
        if then == "logits":
            V = self.spec.vocab
            return self.gpu.read(self.vocab.logits, np.float32, T * V).reshape(T, V)
        return None

    def prefill(self, ids, out_index: int = 0, on_chunk: Callable[[int, int], None] | None = None,
                cancel: CancelToken | None = None) -> None:
        """Absorb `ids` into the cache in chunks; the last chunk samples the next token on the GPU (ring[out_index]).
        A stateful block snapshots its state before the prompt's last token, which then goes alone (where a
        regenerate of the same prompt resumes). Without `on_chunk` and `cancel` every chunk is queued at once; with
        either, the prompt goes in pieces waited for one by one (prefill_steps): `on_chunk(done, total)` runs after
        each piece, and an exception from it stops the prefill there, with the cache holding the pieces done."""
        if on_chunk is None and cancel is None:
            for _ in self._prefill_pieces(ids, out_index, self.chunk, None, None):
                pass
            return
        for done, total in self.prefill_steps(ids, out_index, cancel, queue_ahead=False):
            if on_chunk is not None:
                on_chunk(done, total)

    def prefill_steps(self, ids, out_index: int = 0, cancel: CancelToken | None = None,
                      queue_ahead: bool = True) -> Iterator[tuple[int, int]]:
        """prefill() in pieces that grow from FIRST_PIECE rows to the chunk, yielding (done, total) as each piece
        completes on the GPU, so a caller can show progress and stop between pieces. `cancel` is checked before each
        piece and while waiting for one: on cancel this raises Cancelled at once, the cache holding every piece
        submitted (work already queued is never interrupted; anything submitted later runs after it). A piece is
        queued ahead of the one running only while pieces are quick (a slow GPU then holds at most one piece of
        work after a Stop); `queue_ahead=False` never does, so the cache holds exactly the pieces yielded."""
        self._settle_fences(cancel)
        fences = list(self.ws.readback)
        waits: list[tuple[MapWait, int]] = []  # (mapping of a piece's fence, tokens done once it lands)
        quick = False
        total = len(ids)
        try:
            for done in self._prefill_pieces(ids, out_index, FIRST_PIECE, fences.pop(), cancel):
                waits.append((MapWait(self._last_fence, 4), done))
                while waits and (len(waits) >= (2 if quick else 1) or done == total):
                    started = time.perf_counter()
                    wait, landed = waits[0]
                    if not wait.wait(cancel):
                        raise Cancelled
                    waits.pop(0)
                    wait.release()
                    fences.append(wait.buf)
                    quick = queue_ahead and time.perf_counter() - started < QUICK_PIECE_S
                    yield landed, total
                    check(cancel)
                if fences:
                    self._next_fence = fences.pop()
        finally:
            self._unsettled += [w for w, _ in waits]  # abandoned waits: the GPU finishes them before later work

    def _prefill_pieces(self, ids, out_index: int, first: int, fence, cancel) -> Iterator[int]:
        """Submit the prompt piece by piece (sizes doubling from `first` to the chunk); yields tokens submitted
        after each piece. With a fence, each piece's pass ends with a copy into it (self._last_fence), and the
        consumer sets self._next_fence before the next piece."""
        ids = np.asarray(ids, np.uint32)
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self._check_room(len(ids))
        self._catch_up()
        snapshot = bool(self._stateful)
        head_len = len(ids) - 1 if snapshot else len(ids)
        pieces, at, size = [], 0, min(first, self.chunk)
        while at < head_len:
            pieces.append(ids[at:min(at + size, head_len)])
            at += len(pieces[-1])
            size = min(2 * size, self.chunk)
        if snapshot:
            pieces.append(ids[-1:])
        done, self._next_fence = 0, fence
        for j, piece in enumerate(pieces):
            check(cancel)
            last = j == len(pieces) - 1
            if last:
                if snapshot:
                    for b in self._stateful:
                        b.before_prompt_end(self.n_cached)
                if not self.sampler.greedy:
                    # Only the sampling forward updates the penalty window; bring it up to the cache first.
                    self.sampler.sampler.set_history(self.cached_ids[: self.n_cached])
            self._last_fence, self._next_fence = self._next_fence, None
            self._run(piece, "sample" if last else "none", out_index, self._last_fence)
            done += len(piece)
            yield done

    def _settle_fences(self, cancel: CancelToken | None = None) -> None:
        """Finish the fence waits a stopped prefill abandoned, so the readback buffers can be mapped again (the
        wait for that piece of GPU work can itself be abandoned: Cancelled)."""
        while self._unsettled:
            if not self._unsettled[-1].wait(cancel):
                raise Cancelled
            self._unsettled.pop().release()

    def read_sampled(self, index: int) -> int:
        """Blocking read of one sampled token id from the ring (used for the first token)."""
        return int(self.gpu.read(self.ws.ring, np.uint32, 1, offset=index * 4)[0])

    def decode(self, last_index: int, count: int, batch: int = 8) -> Iterator[list[int]]:
        """Decode up to `count` tokens after the one sampled into ring[last_index]; yields batches.

        Tokens stay on the GPU (each step's sampled id feeds the next embedding). Each batch is copied to a
        staging buffer that is mapped only once the next batch is queued, so the GPU never idles on a
        readback. Batches hold at most `batch` tokens and, on a slow GPU, about BATCH_SECONDS of work (the first
        is one token). Closing the generator stops early without waiting for the batch still queued; the caller
        then truncates the cache to what it keeps.
        """
        self._settle_fences()
        self._catch_up()  # eagerly: the rest is a generator
        return self._decode(last_index, count, batch)

    def _decode(self, last_index: int, count: int, batch: int) -> Iterator[list[int]]:
        g = self.gpu
        pending: list[tuple[object, int]] = []  # (staging buffer, n tokens)
        free = list(self.ws.readback)
        idx, remaining = last_index, count
        size, landed_at = 1, None  # tokens in the next batch; when the previous batch's readback landed
        while remaining > 0 or pending:
            if remaining > 0 and free:
                first = (idx + 1) % RING
                n = min(size, remaining, RING - first)  # a batch never wraps around the ring
                self._check_room(n)
                buf = free.pop()
                for j in range(n):
                    rec = Recorder(g, "decode")
                    self.record_decode_token(rec, first + j)
                    if j == n - 1:
                        rec.copy(self.ws.ring, first * 4, buf, 0, n * 4)
                    rec.submit()
                pending.append((buf, n))
                idx, remaining = (idx + n) % RING, remaining - n
                if len(pending) < 2 and remaining > 0:
                    continue  # keep one more batch queued before blocking on a readback
            buf, n = pending.pop(0)
            buf.map_sync(mode=wgpu.MapMode.READ)
            got = np.frombuffer(buf.read_mapped(0, n * 4), np.uint32).tolist()
            buf.unmap()
            free.append(buf)
            now = time.perf_counter()
            if landed_at is not None:  # batches land back to back, so the gap is this batch's GPU time
                per_token = (now - landed_at) / n
                size = max(1, min(batch, int(BATCH_SECONDS / max(per_token, 1e-6))))
            else:
                size = min(batch, 2)  # the first readback's wait includes the queue's start-up: no measure yet
            landed_at = now
            yield got
        # Closed early: the batch still queued just lands later; its staging buffer is only a copy target, never
        # left mapped, so the next decode can reuse it at once (the queue orders the copies).
