"""The mixture-of-experts feed-forward block (Qwen3.5/3.6-MoE): router, top-k, experts, combine, for every MoE
layer (weights per layer, one set of scratch buffers for all: layers run one after another).

out = Σ_{e in top-k} p_e · down_e(silu(gate_e x) · up_e x) + sigmoid(g·x) · shared(x), with p the softmax over all
E router logits (f32), renormalised over the top-k when norm_topk_prob; the expert ids never leave the GPU.
Dispatches per forward of T rows:
  1. router logits over the router matrix, whose row E is the shared-expert gate -> logits [T, E + 1]: matvec_int4
     for T = 1; for T > 1 moe_matvec with a stack of one expert, i.e. a matvec per token (matmul_int4's 64-row
     tiles leave 257 rows 5 workgroups; BENCH.md)
  2. moe_router: softmax, top-k, renormalise; writes ids [T, SLOTS] and weights [T, SLOTS], the shared expert as
     slot k with id E and weight sigmoid(logit E)
  Decode (T = 1):
  3. moe_matvec gate_up (+ SiLU·mul): grid (F/ROWS, 1, SLOTS) -> act [SLOTS, F]
  4. moe_matvec down: grid (D/ROWS, 1, SLOTS) -> y [SLOTS, D]
  Prefill (T > 1), tokens grouped by expert so each selected expert's weights are read once per tile of pairs:
  3. moe_sort: the (token, slot) pairs by expert -> order, tiles
  4. moe_gemm gate_up over every expert's tiles -> act [T, SLOTS, F]
  5. moe_gemm down -> y [T, SLOTS, D]
  then moe_combine: out = Σ_s weights[t, s]·y[t, s] (each token sums its slots in slot order: deterministic).
A model whose decode matvecs carry the residual norms (engine/blocks/residual.py) runs its decode token instead as
three fused dispatches a layer, router logits, gate_up with the top-k, down with the combine and the next norm
(engine/blocks/moe_fused.py; streamed experts add the top-k dispatch whose ids the host reads back).
Decode with int8 arithmetic runs the 4-bit and 3-bit expert passes as moe_matvec_q8: gate_up on the norm's int8
row, down after one quantize_q8 of the slots' activations. The shared expert is stacked as expert E of the routed
stacks when its width and formats match theirs (Qwen3.6 4-bit), so the expert passes run it in the same dispatch;
otherwise it gets its own dispatch of each (and in prefill its own sort, of slot k alone in a stack of one). A 4-bit
shared expert beside 3-bit routed stacks of its width (Qwen3.6 3-bit) is stored after the 3-bit stack ("mixed"):
int8 decode runs it as expert E of moe_matvec_q8 (MIXED_W/MIXED_S), the other passes bind its rows as a view.
Every expert kernel finds its expert through the ids buffer it binds (prefill: through moe_sort's tiles, built from
those ids), so expert streaming can remap ids to cache slots there before they run.
With `cache_slots` (a MoE model over its weights budget) the routed stacks hold that many experts (plus the stacked
shared expert) and the rest stream from host memory: engine/blocks/expert_cache.py. The contract every expert pass
keeps: it addresses expert weights only through the ids buffer it binds, `self.expert_ids` (the router's ids when
resident; cache slots [T, SLOTS] u32 when streaming, the stacked shared expert at slot `cache_slots`: a decode token's
written by a lookup in the layer's slot table on the GPU (one dispatch after the top-k), a chunk's by the host), over a
stack of `stack_experts(i)` experts; a prefill chunk in batches runs the grouped passes once per batch with down
into y_batch (`grouped_batch`), whose rows of the batch's experts the select copies into y. Each grouped output row is
computed alone, so streamed and resident prefills give the same bits. Streaming never joins a 3-bit stack with a
4-bit shared expert (its cache slots are whole routed experts).
Resident stacks just over half an allocator block (Qwen3.6 4-bit down, 3-bit gate_up) are stored two layers to a
buffer, each layer binding its part as a range (engine/blocks/moe_pairs.py): every pass reads `self.w` as it is.
"""

from __future__ import annotations

import time

import numpy as np

from engine.blocks import Block, BufferNeed, array_bytes, buffer_bytes, destroy_buffers
from engine.blocks.expert_cache import ExpertStream
from engine.blocks.linear import Arithmetic, matrix_tensors
from engine.blocks.moe_fused import build_fused, can_fuse, fused_needs
from engine.blocks.moe_pairs import pair_stacks, view
from engine.errors import GpuError, UnsupportedModelError
from engine.gpu import PlanRecorder
from engine.kernels import MAX_GROUPS_PER_DIM, fold_grid
from engine.kernels.expert_cache import EXPERT_SELECT, EXPERT_SLOTS, select_plan, slots_plan
from engine.kernels.matmul import (
    FORMATS,
    MATVEC_INT4,
    QUANTIZE_Q8,
    format_knobs,
    matvec_plan,
    packed_shapes,
    quantize_q8_plan,
)
from engine.kernels.moe import (
    MOE_COMBINE,
    MOE_GEMM,
    MOE_GEMM_Q8,
    MOE_MATVEC,
    MOE_MATVEC_Q8,
    MOE_ROUTER,
    MOE_SORT,
    combine_plan,
    expert_plan,
    expert_q8_plan,
    grouped_plan,
    grouped_q8_plan,
    router_plan,
    sort_plan,
)


def shared_joins_stack(ffn: int, shared_ffn: int, routed_formats: tuple, shared_formats: tuple) -> bool:
    """The shared expert runs as expert E of the routed stacks when its width and (gate_up, down) formats match
    theirs; otherwise it takes its own two dispatches (e.g. 4-bit shared beside 3-bit routed experts)."""
    return shared_ffn == ffn and tuple(shared_formats) == tuple(routed_formats)


def moe_matrices(E: int, D: int, F: int, Fs: int) -> dict[str, tuple[int, ...]]:
    """A MoE layer's matrices (canonical suffix after `layers.N.moe.`) -> logical shape ([E,] N, K). gate_up
    stacks hold each expert's gate rows then its up rows; the shared gate is the router's extra row."""
    out = {"router": (E, D), "gate_up": (E, 2 * F, D), "down": (E, D, F)}
    if Fs:
        out |= {"shared_gate_up": (2 * Fs, D), "shared_down": (D, Fs), "shared_gate": (1, D)}
    return out


def _weight_key(tag: str) -> str:
    return "weight" if FORMATS[tag]["bits"] == 16 else "q_weight"


class MoeFfn(Block):
    name = "moe"

    def __init__(self, dim: int, experts: int, top_k: int, ffn: int, shared_ffn: int, layers: tuple[int, ...],
                 formats: dict[str, str], ar: Arithmetic, chunk: int, norm_topk_prob: bool = True,
                 cache_slots: int | None = None, policy: str = "lfu", offset_alignment: int = 256,
                 max_buffer: int | None = None):
        self.D, self.E, self.F, self.Fs, self.top_k = dim, experts, ffn, shared_ffn, top_k
        self.layers, self.ar, self.max_tokens = tuple(layers), ar, max(chunk, 1)
        self.norm_topk = norm_topk_prob
        self.norms = None  # the residual block when the decode token runs the fused passes (engine/blocks/moe_fused.py)
        self.shared = shared_ffn > 0
        self.slots = top_k + self.shared
        self.act_stride = max(ffn, shared_ffn)
        self.parts = moe_matrices(experts, dim, ffn, shared_ffn)
        self.fmt = {(i, p): formats.get(f"layers.{i}.moe.{p}", "q4f16_1") for i in self.layers for p in self.parts}
        self.stacked = {}
        for i in self.layers:
            f = {p: self.fmt[i, p] for p in self.parts}
            if self.shared:
                if f["router"] != f["shared_gate"]:
                    raise UnsupportedModelError(f"layer {i}: the MoE router ({f['router']}) and the shared-expert gate "
                                                f"({f['shared_gate']}) run as one matrix and must share a format")
                self.stacked[i] = shared_joins_stack(ffn, shared_ffn, (f["gate_up"], f["down"]),
                                                     (f["shared_gate_up"], f["shared_down"]))
            else:
                self.stacked[i] = False
        self.mixed = {i: cache_slots is None and self._joins_mixed(i) for i in self.layers}
        self.stream = None
        if cache_slots is not None:
            if not top_k <= cache_slots < experts:
                raise ValueError(f"an expert cache needs {top_k}..{experts - 1} slots, got {cache_slots}")
            self.stream = ExpertStream(experts, cache_slots, top_k, self.slots, self.max_tokens, self.layers, policy,
                                       self.routed_part_bytes())
        # resident stacks that would each keep an allocator block nearly to themselves share a buffer by twos
        self.pairs = {} if self.stream else pair_stacks(
            {(i, name, key): n for i in self.layers for name, key, n in self._weight_sizes(i)}, self.layers,
            offset_alignment, max_buffer)
        self._pair_bufs: dict[str, object] = {}  # a paired buffer, made when its first layer uploads
        T, n_logits = self.max_tokens, experts + self.shared
        if T * self.slots > MAX_GROUPS_PER_DIM:  # a prefill quantizes every (token, slot) row in one grid column
            raise UnsupportedModelError(f"prefill_chunk={T} with {self.slots} expert slots per token is more rows than "
                                        f"a dispatch holds; use prefill_chunk ≤ {MAX_GROUPS_PER_DIM // self.slots}")
        self._topk = router_plan(experts, top_k, self.shared, norm_topk_prob, T)
        self._combine = combine_plan(dim, self.slots, T)
        self.plans = {i: self._layer_plans(i) for i in self.layers}
        self.grouped = {i: self._grouped_plans(i) for i in self.layers} if T > 1 else {}
        self._router_mv = {i: matvec_plan(dim, n_logits, **format_knobs(self.fmt[i, "router"])) for i in self.layers}
        self._router_tokens = {i: expert_plan(dim, n_logits, 1, T, 1, **format_knobs(self.fmt[i, "router"]))
                               if T > 1 else None for i in self.layers}
        self.w: dict[int, dict] = {}
        self._held: dict[int, dict[str, dict[str, np.ndarray]]] = {}
        self.fusable = can_fuse(self)

    def _joins_mixed(self, i: int) -> bool:
        """Whether layer i stores its 4-bit shared expert after its 3-bit routed stacks (Qwen3.6's 3-bit build), so
        that int8 decode runs routed and shared slots in one moe_matvec_q8 dispatch per stack; the shared expert's
        f32 and prefill passes bind its rows there as a stack of one."""
        if not (self.shared and not self.stacked[i] and self.ar.int8 and self.F == self.Fs):
            return False
        pairs = (("gate_up", "shared_gate_up"), ("down", "shared_down"))
        fmt = {p: FORMATS.get(self.fmt[i, p]) for pair in pairs for p in pair}  # None: a format outside FORMATS
        if None in fmt.values():
            return False
        knobs = lambda p: tuple(fmt[p][k] for k in ("zero", "affine", "group"))  # noqa: E731
        return all(fmt[r]["bits"] == 3 and fmt[sh]["bits"] == 4 and knobs(r) == knobs(sh) for r, sh in pairs)

    def _mixed_layout(self, i: int, stack: str) -> tuple[int, int, int, int]:
        """A mixed stack's sizes: (routed u32 words padded to 256 bytes, routed f16 scales padded likewise, shared
        u32 words, shared f16 scales); the shared rows start at the padded offsets (bindable views)."""
        n, k = (2 * self.F, self.D) if stack == "gate_up" else (self.D, self.F)
        group = FORMATS[self.fmt[i, stack]]["group"]
        pad = lambda v, unit: -(-v // unit) * unit  # noqa: E731
        return (pad(self.E * n * k * 3 // 32, 64), pad(self.E * n * (k // group) * 2, 128), n * k // 8,
                n * (k // group) * 2)

    def _layer_plans(self, i: int) -> list[tuple]:
        """Expert passes of layer i: (stack, expert_plan, input ("x" or "act"), output ("act" or "y")), every gate_up
        before its down."""
        F, Fs, D, T, stride = self.F, self.Fs, self.D, self.max_tokens, self.act_stride
        routed = dict(slots=self.slots, n_slots=self.slots if self.stacked[i] else self.top_k)
        experts = self.stack_experts(i)
        out = [("gate_up", expert_plan(D, F, experts, T, gate_up=True, y_stride=stride, **routed,
                                       **format_knobs(self.fmt[i, "gate_up"])), "x", "act"),
               ("down", expert_plan(F, D, experts, T, x_slot=True, x_stride=stride, **routed,
                                    **format_knobs(self.fmt[i, "down"])), "act", "y")]
        if self.shared and not self.stacked[i]:  # its own stack of one (ids unread), over slot top_k only
            one = dict(slots=self.slots, slot0=self.top_k, n_slots=1)
            out += [("shared_gate_up", expert_plan(D, Fs, 1, T, gate_up=True, y_stride=stride, **one,
                                                   **format_knobs(self.fmt[i, "shared_gate_up"])), "x", "act"),
                    ("shared_down", expert_plan(Fs, D, 1, T, x_slot=True, x_stride=stride, **one,
                                                **format_knobs(self.fmt[i, "shared_down"])), "act", "y")]
        return out

    def _grouped_plans(self, i: int) -> dict:
        """Prefill passes of layer i: {"sorts": [(key ("routed" or "shared"), sort_plan)], "passes": [(stack, key,
        kernel, plan, input, output)] every gate_up before every down, "rows_q8": the gate_ups write the pairs' int8
        rows the downs read (no quantize_q8 between)}. 4-bit and 3-bit stacks take int8 activations (moe_gemm_q8)
        with int8 prefill, other stacks the f32 moe_gemm. The gate_ups write int8 rows with the arithmetic's
        int8_epilogues where every pass is int8 and all share one activation width (one row layout)."""
        T = self.max_tokens
        sorts, passes = {}, []
        for stack, (c, grid), src, dst in self.plans[i]:
            key = "shared" if stack.startswith("shared_") else "routed"
            sorts.setdefault(key, sort_plan(c["EXPERTS"], self.slots, T, slot0=c["SLOT0"], n_slots=grid[2]))
            passes.append((stack, key, c, grid, src, dst, self.ar.int8_prefill and c["BITS"] in (3, 4)))
        widths = {c["N"] if src == "x" else c["K"] for _, _, c, _, src, _, _ in passes}
        rows_q8 = self.ar.int8_epilogues and len(widths) == 1 and all(p[-1] for p in passes)
        out = None
        if rows_q8:
            try:
                out = [self._grouped_pass(T, *p, rows_q8=True) for p in passes]
            except ValueError:  # a width the int8 epilogue cannot take (not whole 32-element chunks)
                rows_q8 = False
        out = out or [self._grouped_pass(T, *p, rows_q8=False) for p in passes]
        gate_ups = [p for p in out if p[4] == "x"]
        downs = [p for p in out if p[4] != "x"]
        return {"sorts": list(sorts.items()), "passes": gate_ups + downs, "rows_q8": rows_q8}

    def _grouped_pass(self, T: int, stack: str, key: str, c: dict, grid: tuple, src: str, dst: str, int8: bool, *,
                      rows_q8: bool) -> tuple:
        """One prefill pass (stack, key, kernel, plan, input, output) from the decode pass's constants and grid."""
        fmt = dict(bits=c["BITS"], zero=c["ZERO"], affine=c["AFFINE"], group=c["GROUP"])
        shape = dict(n_slots=grid[2], gate_up=c["GATE_UP"], x_slot=c["X_SLOT"], y_stride=c["Y_STRIDE"])
        if int8:
            out = dict(rows_q8=True) if rows_q8 and src == "x" else {}
            kernel, plan = MOE_GEMM_Q8, grouped_q8_plan(c["K"], c["N"], c["EXPERTS"], T, self.slots, **shape, **fmt,
                                                        **out)
        else:
            kernel, plan = MOE_GEMM, grouped_plan(c["K"], c["N"], c["EXPERTS"], T, self.slots, **shape,
                                                  x_stride=c["X_STRIDE"], **fmt)
        return stack, key, kernel, plan, src, dst

    # ---- plan --------------------------------------------------------------------------------------------
    def stack_experts(self, i: int) -> int:
        """Experts in layer i's routed GPU stacks: every one, or the cache's slots (+ the stacked shared expert)."""
        return (self.stream.slots if self.stream else self.E) + self.stacked[i]

    def routed_part_bytes(self) -> dict[tuple[str, str], int]:
        """(stack, "w" | "s") -> bytes of one routed expert's part in the GPU layout (the first MoE layer's formats;
        the cache needs every layer's to match)."""
        out = {}
        for i in self.layers:
            mine = {}
            for stack, (n, k) in (("gate_up", (2 * self.F, self.D)), ("down", (self.D, self.F))):
                shapes = packed_shapes(self.fmt[i, stack], n, k)
                mine[stack, "w"] = array_bytes(*shapes[_weight_key(self.fmt[i, stack])])
                if "q_scale" in shapes:
                    mine[stack, "s"] = array_bytes(*shapes["q_scale"])
            if out and mine != out:
                raise UnsupportedModelError(f"layer {i}: its routed experts' formats differ from layer "
                                            f"{self.layers[0]}'s; an expert cache needs them alike")
            out = mine
        return out

    def routed_expert_bytes(self) -> int:
        """GPU bytes of one routed expert of every MoE layer together."""
        return sum(self.routed_part_bytes().values()) * len(self.layers)

    def tensors(self) -> dict:
        out = {}
        for i in self.layers:
            for part, (*lead, n, k) in self.parts.items():
                out |= matrix_tensors(f"layers.{i}.moe.{part}", n, k, self.fmt[i, part], tuple(lead))
        return out

    def _stacks(self, i: int) -> dict[str, tuple[str, int, int, int]]:
        """Layer i's GPU stacks: name -> (format, experts in the stack, N, K)."""
        E, F, Fs, D = self.E, self.F, self.Fs, self.D
        out = {"router": (self.fmt[i, "router"], 1, E + self.shared, D),
               "gate_up": (self.fmt[i, "gate_up"], self.stack_experts(i), 2 * F, D),
               "down": (self.fmt[i, "down"], self.stack_experts(i), D, F)}
        if self.shared and not self.stacked[i]:
            out |= {"shared_gate_up": (self.fmt[i, "shared_gate_up"], 1, 2 * Fs, D),
                    "shared_down": (self.fmt[i, "shared_down"], 1, D, Fs)}
        return out

    def _weight_sizes(self, i: int) -> list[tuple[str, str, int]]:
        """Layer i's weight buffers as (stack, "w" | "s", bytes of the array it holds), each alone."""
        out = []
        for name, (tag, n_exp, n, k) in self._stacks(i).items():
            if self.mixed[i] and name != "router":  # routed and shared rows in one buffer each (_mixed_layout)
                if name in ("gate_up", "down"):
                    wr, sr, wsh, ssh = self._mixed_layout(i, name)
                    out += [(name, "w", 4 * (wr + wsh)), (name, "s", 2 * (sr + ssh))]
                continue
            shapes = packed_shapes(tag, n, k)
            w_shape, w_dtype = shapes[_weight_key(tag)]
            s_bytes = n_exp * array_bytes(*shapes["q_scale"]) if "q_scale" in shapes else 8  # f16: a dummy
            out += [(name, "w", n_exp * array_bytes(w_shape, w_dtype)), (name, "s", s_bytes)]
        return out

    def needs(self) -> list[BufferNeed]:
        out = []
        for i in self.layers:
            for name, key, nbytes in self._weight_sizes(i):
                label = f"layers.{i}.moe.{name}.{key}"
                if (part := self.pairs.get((i, name, key))) is not None:  # the pair's buffer, at its first layer
                    if part.offset == 0:
                        out.append(BufferNeed(part.label, buffer_bytes(part.total), "weights", "upload", part.writes))
                elif self.stream and (name, key) in self.stream.part_bytes:  # cache slots, filled as experts route
                    out.append(BufferNeed.buffer(label, nbytes, "weights"))
                else:
                    out.append(BufferNeed.upload(label, nbytes))
        T = self.max_tokens
        sizes = dict(logits=T * (self.E + self.shared), ids=T * self.slots, weights=T * self.slots,
                     act=T * self.slots * self.act_stride, y=T * self.slots * self.D)
        for key in ("routed", "shared"):  # prefill's pairs sorted by expert and their tiles, at the largest layer's
            sorts = [sp for i in self.grouped for k, sp in self.grouped[i]["sorts"] if k == key]
            if sorts:
                sizes |= {f"order-{key}": max(T * c["NSLOTS"] for c, _, _ in sorts),
                          f"tiles-{key}": 4 * max(v for _, _, v in sorts)}
        out += [BufferNeed.buffer(f"moe.{name}", 4 * count) for name, count in sizes.items()]
        if self.stream:  # slot ids, the ids' readback, the batch rows and their mask, the upload staging
            out += [*self.stream.needs(), BufferNeed.buffer("moe.y_batch", 4 * sizes["y"])]
        if any(k is MOE_GEMM_Q8 for i in self.grouped for _, _, k, _, src, _ in self.grouped[i]["passes"]
               if src == "act"):  # every pair's activations in int8 for the int8 grouped down passes
            act = T * self.slots * self.act_stride
            out += [BufferNeed.buffer("moe-act-rows-int8", act),
                    BufferNeed.buffer("moe-act-rows-int8-scales", act // 32 * 8)]
        if self.ar.int8:  # the slots' activations in int8 for the decode down passes
            act = self.slots * self.act_stride
            out += [BufferNeed.buffer("moe-act-int8", act), BufferNeed.buffer("moe-act-int8-scales", act // 32 * 8)]
        if self.fusable:
            out += [BufferNeed.buffer(label, size) for label, size in fused_needs(self).items()]
        return out

    def int8_row_k(self) -> int:
        return self.D

    def int8_formats(self) -> set[str]:  # its kernels read matvec_q8's int8 order, and its formats are never K-quant
        return set(self.fmt.values()) if self.ar.int8 else set()

    def can_carry_norms(self) -> bool:
        """A resident block of int8 expert stacks runs its decode token as the fused passes, which read the mixer's
        residual and norm row and end in the next norm's row (engine/blocks/moe_fused.py)."""
        return self.fusable

    # ---- load --------------------------------------------------------------------------------------------
    def take(self, gpu, name: str, arr: np.ndarray, source: str = "") -> None:
        """Held until the layer's last MoE tensor arrives, then uploaded as stacks (so the host holds one layer's
        stacks at a time)."""
        layer, _, rest = name.removeprefix("layers.").partition(".moe.")
        part, _, key = rest.partition(".")
        i = int(layer)
        held = self._held.setdefault(i, {})
        held.setdefault(part, {})[key] = arr
        want = sum(len(packed_shapes(self.fmt[i, p], 1, 32)) for p in self.parts)
        if sum(len(v) for v in held.values()) == want:
            self.w[i] = self._upload_layer(gpu, i, self._held.pop(i))

    def _upload_layer(self, gpu, i: int, parts: dict[str, dict[str, np.ndarray]]) -> dict:
        one = lambda p: {k: a[None] for k, a in parts[p].items()}  # noqa: E731  (a stack of one expert)
        if self.stream:
            return self._cache_layer(gpu, i, parts, one)
        stacks = {"router": _join(parts["router"], parts.get("shared_gate"), axis=0),
                  "gate_up": _join(parts["gate_up"], one("shared_gate_up") if self.stacked[i] else None, axis=0),
                  "down": _join(parts["down"], one("shared_down") if self.stacked[i] else None, axis=0)}
        if self.mixed[i]:
            return {"router": self._upload(gpu, i, "router", stacks["router"]),
                    **self._upload_mixed(gpu, i, parts, "gate_up"), **self._upload_mixed(gpu, i, parts, "down")}
        if self.shared and not self.stacked[i]:
            stacks |= {"shared_gate_up": one("shared_gate_up"), "shared_down": one("shared_down")}
        return {name: self._upload(gpu, i, name, arrays) for name, arrays in stacks.items()}

    def _upload_mixed(self, gpu, i: int, parts: dict, stack: str) -> dict:
        """A 3-bit routed stack and the 4-bit shared expert after it (_mixed_layout): the stack's (w, s) buffers,
        and the shared expert's as views into them."""
        wr, sr, wsh, ssh = self._mixed_layout(i, stack)
        shared = "shared_" + stack
        w, s = np.zeros(wr + wsh, np.uint32), np.zeros(sr + ssh, np.float16)
        flat = lambda part, key: np.asarray(parts[part][key]).reshape(-1)  # noqa: E731  (lazy joins read now)
        routed_w, routed_s = flat(stack, "q_weight").view(np.uint32), flat(stack, "q_scale")
        w[:routed_w.size], w[wr:] = routed_w, flat(shared, "q_weight").view(np.uint32)
        s[:routed_s.size], s[sr:] = routed_s, flat(shared, "q_scale")
        label = f"layers.{i}.moe.{stack}"
        for a in (w, s):
            if a.nbytes > gpu.max_binding:
                raise GpuError(f"{label} needs a {a.nbytes}-byte binding; this GPU allows {gpu.max_binding}")
        wb, sb = self._put(gpu, i, stack, "w", w), self._put(gpu, i, stack, "s", s)
        return {stack: (wb, sb), shared: (view(wb, 4 * wr, 4 * wsh), view(sb, 2 * sr, 2 * ssh))}

    def _cache_layer(self, gpu, i: int, parts: dict, one) -> dict:
        """Streaming: the routed stacks stay on the host; their GPU stacks are cache slots (+ the shared expert in
        the last slot, uploaded now); the router and a shared expert of its own are uploaded as usual."""
        out = {"router": self._upload(gpu, i, "router", _join(parts["router"], parts.get("shared_gate"), axis=0))}
        n = self.stack_experts(i)
        for stack in ("gate_up", "down"):
            bufs = []
            for key, src in (("w", "q_weight" if "q_weight" in parts[stack] else "weight"), ("s", "q_scale")):
                if (stack, key) not in self.stream.part_bytes:
                    bufs.append(gpu.upload(f"layers.{i}.moe.{stack}.s", np.zeros(4, np.float16)))  # f16: unread
                    continue
                per = self.stream.part_bytes[stack, key]
                if n * per > gpu.max_binding:
                    raise GpuError(f"layers.{i}.moe.{stack} expert cache needs a {n * per}-byte binding; this GPU "
                                   f"allows {gpu.max_binding}")
                self.stream.keep_host(i, stack, key, parts[stack][src])
                buf = gpu.buffer(f"layers.{i}.moe.{stack}.{key}", n * per)
                if self.stacked[i]:
                    shared = np.ascontiguousarray(parts[f"shared_{stack}"][src]).view(np.uint8).reshape(-1)
                    gpu.write(buf, shared, offset=self.stream.slots * per)
                bufs.append(buf)
            out[stack] = tuple(bufs)
        if self.shared and not self.stacked[i]:
            out |= {name: self._upload(gpu, i, name, one(name)) for name in ("shared_gate_up", "shared_down")}
        return out

    def _upload(self, gpu, i: int, name: str, arrays: dict[str, np.ndarray]):
        """(weight buffer, scale buffer) of layer i's stack `name` for a packed array set; f16 weights get a dummy
        scale buffer."""
        label = f"layers.{i}.moe.{name}"
        w = np.asarray(arrays.get("q_weight", arrays.get("weight")))  # a lazy join of mapped stacks: joined now
        for a in (w, arrays.get("q_scale")):
            if a is not None and a.nbytes > gpu.max_binding:
                raise GpuError(f"{label} needs a {a.nbytes}-byte binding; this GPU allows {gpu.max_binding}")
        s = arrays["q_scale"] if "q_scale" in arrays else np.zeros(4, np.float16)
        return self._put(gpu, i, name, "w", w.view(np.uint32)), self._put(gpu, i, name, "s", s)

    def _put(self, gpu, i: int, name: str, key: str, array: np.ndarray):
        """Layer i's buffer `key` of stack `name` holding `array`: its own buffer, or where the stack is paired
        (engine/blocks/moe_pairs.py) its part of the pair's buffer as a (buffer, offset, size) range."""
        part = self.pairs.get((i, name, key))
        if part is None:
            return gpu.upload(f"layers.{i}.moe.{name}.{key}", array)
        data = np.ascontiguousarray(array)
        if data.nbytes != part.size:
            raise GpuError(f"layers.{i}.moe.{name}.{key} is {data.nbytes} bytes; its part of {part.label} "
                           f"{part.size}")
        if part.label not in self._pair_bufs:
            self._pair_bufs[part.label] = gpu.buffer(part.label, part.total)
        buf = self._pair_bufs[part.label]
        gpu.upload_at(buf, data, part.offset)
        return buf, part.offset, part.size

    # ---- build -------------------------------------------------------------------------------------------
    def build(self, gpu, ws) -> None:
        made = {n.label: n.allocate(gpu) for n in self.needs()
                if n.how not in ("upload", "staging") and n.kind != "weights"}  # weights: made while loading
        self._gpu = gpu
        self.logits, self.ids, self.weights = made["moe.logits"], made["moe.ids"], made["moe.weights"]
        self.act, self.y = made["moe.act"], made["moe.y"]
        act_q8, act_q8_meta = made.get("moe-act-int8"), made.get("moe-act-int8-scales")
        x, out, st = ws.hidden, ws.delta, ws.step
        # The expert kernels read cache slots (host-written) when streaming, else the router's expert ids.
        self.expert_ids = made["moe.slot_ids"] if self.stream else self.ids
        if self.stream:
            self.y_batch, self.rows_mask = made["moe.y_batch"], made["moe.rows_mask"]
            self.slot_table = made["moe.slot_table"]
            self.stream.build(gpu, [made["moe.ids_readback.0"], made["moe.ids_readback.1"]], self.slot_table)
            # each layer's cache buffers by expert part, as ExpertStream.upload copies into them
            self._cache_parts = {i: {(stack, key): self.w[i][stack][j] for stack in ("gate_up", "down")
                                     for j, key in enumerate("ws") if (stack, key) in self.stream.part_bytes}
                                 for i in self.layers}

        def bound(kernel, plan, buffers, label):
            pipe = gpu.pipeline(kernel, plan[0])
            return pipe, gpu.bind(pipe, buffers, label), plan

        self.passes = {}
        for i in self.layers:
            c, w = f"layers.{i}.moe", self.w[i]
            rw, rs = w["router"]
            p = {"router_mv": bound(MATVEC_INT4, self._router_mv[i], dict(x=x, w=rw, s=rs, y=self.logits, step=st),
                                    f"{c}.router")}
            if self._router_tokens[i]:
                p["router_tokens"] = bound(MOE_MATVEC, self._router_tokens[i], dict(
                    x=x, ids=self.ids, w=rw, s=rs, y=self.logits, step=st), f"{c}.router-tokens")
            p["topk"] = bound(MOE_ROUTER, self._topk, dict(logits=self.logits, ids=self.ids, weights=self.weights,
                                                           step=st), f"{c}.topk")
            buf = {"x": x, "act": self.act, "y": self.y}
            p["experts"] = [bound(MOE_MATVEC, plan, dict(x=buf[src], ids=self.expert_ids, w=w[stack][0],
                                                         s=w[stack][1], y=buf[dst], step=st), f"{c}.{stack}")
                            for stack, plan, src, dst in self.plans[i]]
            if self.stream:  # a prefill chunk in batches of cached experts: down writes y_batch, then the select
                p["select"] = bound(EXPERT_SELECT, select_plan(self.D, self.slots, self.max_tokens), dict(
                    yb=self.y_batch, mask=self.rows_mask, y=self.y, step=st), f"{c}.select")
                offset, size = self.stream.table_range(i)  # a decode token's slots from the layer's slot table
                p["lookup"] = bound(EXPERT_SLOTS, slots_plan(self.E, self.top_k, self.slots, self.stream.slots), dict(
                    ids=self.ids, table=(self.slot_table, offset, size), slot_ids=self.expert_ids), f"{c}.slots")
            one_token = [(pipe, bg, (c, (grid[0], 1, grid[2]))) for pipe, bg, (c, grid) in p["experts"]]
            p["decode"] = (self._int8_passes(i, bound, ws, act_q8, act_q8_meta, one_token) if self.ar.int8
                           else one_token)
            p["grouped"] = self._grouped_passes(i, bound, ws, made, self.y) if i in self.grouped else []
            if self.stream and i in self.grouped:
                p["grouped_batch"] = self._grouped_passes(i, bound, ws, made, self.y_batch)
            p["combine"] = bound(MOE_COMBINE, self._combine, dict(y=self.y, weights=self.weights, out=out, step=st),
                                 f"{c}.combine")
            self.passes[i] = p
        self.fused = build_fused(self, gpu, ws, self.norms, made["moe-decode-pack"]) if self.norms else {}

    def _grouped_passes(self, i: int, bound, ws, made: dict, y) -> list:
        """Layer i's prefill expert dispatches in order, (pipeline, bind group, plan, rows) each: the sorts, every
        gate_up, every down; with int8 passes one quantize_q8 of the chunk's x rows before the gate_ups (unless the
        norm wrote them) and one of every pair's activations before the downs (one per down pass where their K differ;
        none where the gate_ups write them, "rows_q8"). `rows`: None (the
        plan's grid) or what a quantize's grid rows are per token (1 for x, SLOTS for the pairs). The sorts read
        `expert_ids`; the down passes write `y`."""
        c, w, g = f"layers.{i}.moe", self.w[i], self.grouped[i]
        out = []
        for key, sp in g["sorts"]:
            out.append((*bound(MOE_SORT, sp[:2], dict(ids=self.expert_ids, order=made[f"moe.order-{key}"],
                                                      tiles=made[f"moe.tiles-{key}"], step=ws.step),
                               f"{c}.sort-{key}"), None))
        buf = {"x": ws.hidden, "act": self.act, "y": y}
        # K of the rows quantized last; the prefill's norm wrote x's rows in int8 (engine/blocks/residual.py), the
        # gate_ups the pairs' rows with rows_q8 (one width: the downs' K)
        quantized = {"x": self.D if getattr(ws, "hidden_rows_q8", False) else None,
                     "act": g["passes"][-1][3][0]["K"] if g["rows_q8"] else None}
        act_rows = (made["moe-act-rows-int8"], made["moe-act-rows-int8-scales"]) if g["rows_q8"] else None
        for stack, key, kernel, plan, src, dst in g["passes"]:
            order, tiles = made[f"moe.order-{key}"], made[f"moe.tiles-{key}"]
            if kernel is MOE_GEMM:
                out.append((*bound(kernel, plan, dict(x=buf[src], order=order, tiles=tiles, w=w[stack][0],
                                                      s=w[stack][1], y=buf[dst]), f"{c}.{stack}-grouped"), None))
                continue
            K = plan[0]["K"]
            xq, xm = ((ws.rows_q8, ws.rows_q8_meta) if src == "x"
                      else (made["moe-act-rows-int8"], made["moe-act-rows-int8-scales"]))
            if quantized[src] != K:
                qplan = quantize_q8_plan(K, x_stride=None if src == "x" else self.act_stride)
                out.append((*bound(QUANTIZE_Q8, qplan, dict(x=buf[src], xq=xq, xm=xm, step=ws.step),
                                   f"{c}.{stack}-rows-q8"), 1 if src == "x" else self.slots))
                quantized[src] = K
            rows_out = act_rows if act_rows and src == "x" else (ws.x_q8, ws.x_q8_meta)  # else bound, unwritten
            out.append((*bound(kernel, plan, dict(xq=xq, order=order, tiles=tiles, w=w[stack][0], s=w[stack][1],
                                                  y=buf[dst], xm=xm, yq=rows_out[0], ym=rows_out[1]),
                               f"{c}.{stack}-grouped"), None))
        return out

    def _int8_passes(self, i: int, bound, ws, act_q8, act_q8_meta, f32_passes: list) -> list:
        """Layer i's decode expert dispatches in order, (pipeline, bind group, plan) each: every gate_up, then every
        down. 4-bit and 3-bit stacks run moe_matvec_q8 (others keep their f32 pass): gate_up on the norm's int8 row
        (or one quantize of x), down after a quantize of the slots' activations, one for all the down passes when
        they share K (Qwen3.6's 3-bit experts beside the 4-bit shared one), else one per pass."""
        passes = list(zip(self.plans[i], f32_passes, strict=True))
        if self.mixed[i]:  # the shared slot joins the routed dispatches (expert E: the 4-bit rows after the stack)
            passes = [p for p in passes if not p[0][0].startswith("shared_")]
        int8 = {stack: c["BITS"] in (3, 4) for (stack, (c, _), _, _), _ in passes}
        downs = [(c, grid) for (stack, (c, grid), src, _), _ in passes if src == "act" and int8[stack]]
        one_quant = len({c["K"] for c, _ in downs}) == 1
        out, x_ready, act_ready = [], self.ar.norm_int8, False  # x's int8 row: the norm's, or quantized once here
        for want_src in ("x", "act"):
            for (stack, (c, grid), src, dst), f32_pass in passes:
                if src != want_src:
                    continue
                if not int8[stack]:
                    out.append(f32_pass)
                    continue
                label = f"layers.{i}.moe.{stack}"
                if src == "x":
                    xq, xm = ws.x_q8, ws.x_q8_meta
                    if not x_ready:
                        out.append(bound(QUANTIZE_Q8, quantize_q8_plan(c["K"]), dict(
                            x=ws.hidden, xq=xq, xm=xm, step=ws.step), f"{label}.q8"))
                        x_ready = True
                else:  # the slots' activations, rows X_STRIDE apart in act
                    xq, xm = act_q8, act_q8_meta
                    if not act_ready:
                        if one_quant:
                            row0 = min(d["SLOT0"] for d, _ in downs)
                            end = self.slots if self.mixed[i] else max(d["SLOT0"] + g[2] for d, g in downs)
                            rows = end - row0
                        else:
                            row0, rows = c["SLOT0"], grid[2]
                        out.append(bound(QUANTIZE_Q8, quantize_q8_plan(c["K"], rows=rows, row0=row0,
                                                                       x_stride=c["X_STRIDE"]),
                                         dict(x=self.act, xq=xq, xm=xm, step=ws.step), f"{label}.q8"))
                        act_ready = one_quant
                experts, n_slots, mixed = c["EXPERTS"], grid[2], (0, 0)
                if self.mixed[i]:
                    experts, n_slots, mixed = self.E + 1, self.slots, self._mixed_layout(i, stack)[:2]
                qplan = expert_q8_plan(c["K"], c["N"], experts, c["SLOTS"], self.ar.subgroup_size,
                                       slot0=c["SLOT0"], n_slots=n_slots, gate_up=c["GATE_UP"], x_slot=c["X_SLOT"],
                                       y_stride=c["Y_STRIDE"], bits=c["BITS"], zero=c["ZERO"], affine=c["AFFINE"],
                                       group=c["GROUP"], mixed=mixed)
                w, s = self.w[i][stack]
                out.append(bound(MOE_MATVEC_Q8, qplan, dict(xq=xq, ids=self.expert_ids, w=w, s=s,
                                                            y=self.y if dst == "y" else self.act, xm=xm), label))
        return out

    # ---- record ------------------------------------------------------------------------------------------
    def record(self, rec, layer: int, T: int, splits: int = 1) -> None:
        if not 1 <= T <= self.max_tokens:
            raise ValueError(f"n_tokens={T} outside 1..{self.max_tokens} (the MoE block's rows)")
        passes = self.passes[layer]
        fused = T == 1 and bool(self.fused)  # the three fused passes (engine/blocks/moe_fused.py)

        def per_token(pass_):  # moe_matvec grids are (row groups, tokens, slots)
            pipe, bg, plan = pass_
            rec.dispatch(pipe, bg, plan[1][0], T, plan[1][2])

        if fused:
            pipe, bg, grid = self.fused[layer][0]
            rec.dispatch(pipe, bg, *grid)
        elif T == 1:
            pipe, bg, plan = passes["router_mv"]
            rec.dispatch(pipe, bg, *plan[1])
        else:
            per_token(passes["router_tokens"])
        if fused and not self.stream:  # the fused gate_up routes the token itself
            self._record_experts(rec, layer, T)
            return
        pipe, bg, _ = passes["topk"]
        rec.dispatch(pipe, bg, *fold_grid(T))
        if self.stream and T == 1:  # the slot lookup, then the experts reading their slots
            if hasattr(rec, "cut"):  # a decode token captured in segments: the routing is read back at the cut
                rec.cut((self, layer))
            elif not isinstance(rec, PlanRecorder):  # read back now
                self._stream_token(rec, layer)
            pipe, bg, plan = passes["lookup"]
            rec.dispatch(pipe, bg, *plan[1])
            self._record_experts(rec, layer, T)
        elif self.stream and not isinstance(rec, PlanRecorder):
            self._stream_experts(rec, layer, T)
        else:
            self._record_experts(rec, layer, T)
        if fused:  # the fused down pass sums the slots
            return
        pipe, bg, plan = passes["combine"]
        rec.dispatch(pipe, bg, *fold_grid(-(-T * self.D // 4 // plan[0]["WG"])))

    def _record_experts(self, rec, layer: int, T: int, batch: bool = False) -> None:
        """The expert dispatches of T rows: a decode token's list (int8 or f32, as build made it), else the sorts and
        grouped GEMMs (grids fixed: workgroups past a sort's tile count leave at once); `batch`: the streamed batch
        variant, down into y_batch."""
        passes = self.passes[layer]
        if T == 1 and self.fused:  # gate_up and down of the fused passes
            for pipe, bg, grid in self.fused[layer][1:]:
                rec.dispatch(pipe, bg, *grid)
            return
        if T == 1:
            for pipe, bg, plan in passes["decode"]:
                rec.dispatch(pipe, bg, *plan[1])
            return
        for pipe, bg, plan, rows in passes["grouped_batch" if batch else "grouped"]:
            rec.dispatch(pipe, bg, *(plan[1] if rows is None else (plan[1][0], rows * T)))

    def request_routing(self, rec) -> None:
        """A decode token's routing copied for the host at the end of the segment recorded last (Transformer)."""
        self.stream.request_ids(rec, self.ids, 1)

    def resolve(self, rec, layer: int) -> None:
        """At a streamed decode token's cut, after the segment before it was submitted (ExpertStream.map_ids): wait
        for the routing, make its experts resident; their uploads go in `rec`'s next submit, ahead of the slot
        lookup and the experts."""
        st = self.stream
        ids = st.wait_ids()[0]
        t0 = time.perf_counter()
        routed = ids[:self.top_k].tolist()
        if st.route is not None:  # a benchmark's routing: the slot lookup reads it from the ids buffer
            routed = [int(e) for e in st.route(layer, 1)[0]]
            self._gpu.write(self.ids, np.array(routed + [self.E] * (self.slots - self.top_k), np.uint32))
            t1 = time.perf_counter()
            st.seconds["route"] += t1 - t0
            t0 = t1
        last = self.E - 1  # a bad id (NaN logits) reads a real expert, as resident
        _, loads = st.maps[layer].assign([e if e <= last else last for e in routed])
        st.seconds["policy"] += time.perf_counter() - t0
        if loads:
            st.upload(layer, self._cache_parts[layer], loads)
        rec.submit_first(st.take_pending())

    def _stream_token(self, rec, layer: int) -> None:
        """One token's routing read back in a forward recorded as it goes (not a captured decode step)."""
        t0 = time.perf_counter()
        self.request_routing(rec)
        rec.flush()
        self.stream.map_ids()
        self.stream.seconds["submit"] += time.perf_counter() - t0
        self.resolve(rec, layer)

    def _stream_experts(self, rec, layer: int, T: int) -> None:
        """A chunk of T > 1 rows: the routing so far is submitted and read back; the experts it picked are made
        resident (batches of them when the chunk's outnumber the slots) and the expert passes recorded reading
        their slots, which the host writes."""
        st, S, k = self.stream, self.slots, self.top_k
        sec, t0 = st.seconds, time.perf_counter()
        st.request_ids(rec, self.ids, T)
        rec.flush()
        st.map_ids()
        sec["submit"] += time.perf_counter() - t0
        ids = st.wait_ids()
        t0 = time.perf_counter()
        if st.route is not None:
            ids[:, :k] = st.route(layer, T)
        np.minimum(ids[:, :k], self.E - 1, out=ids[:, :k])  # a bad id (NaN logits) reads a real expert, as resident
        slot_ids = np.full((T, S), st.slots, np.uint32)  # the stacked shared expert's slot (unread otherwise)
        smap = st.maps[layer]
        batches = smap.batches(ids[:, :k].reshape(-1))
        for b, experts in enumerate(batches):
            where, loads = smap.assign(experts)
            if loads:
                sec["policy"] += time.perf_counter() - t0
                st.upload(layer, self._cache_parts[layer], loads)
                rec.submit_first(st.take_pending())
                t0 = time.perf_counter()
            lut = np.full(self.E + 1, st.slots, np.uint32)  # expert -> its slot in this batch
            lut[list(where)] = list(where.values())
            chosen = np.isin(ids[:, :k], experts)
            slot_ids[:, :k][chosen] = lut[np.minimum(ids[:, :k][chosen], self.E)]
            t1 = time.perf_counter()
            sec["policy"] += t1 - t0
            self._gpu.write(self.expert_ids, slot_ids)
            t0 = time.perf_counter()
            sec["slot_write"] += t0 - t1
            if len(batches) == 1:
                self._record_experts(rec, layer, T)
                return
            mask = np.zeros((T, S), np.uint32)
            mask[:, :k] = chosen
            if b == 0:
                mask[:, k:] = 1  # the shared expert's rows come with the first batch
            self._gpu.write(self.rows_mask, mask)
            self._record_experts(rec, layer, T, batch=True)
            pipe, bg, plan = self.passes[layer]["select"]
            rec.dispatch(pipe, bg, *fold_grid(-(-T * S * self.D // 4 // plan[0]["WG"])))
            rec.flush()  # the next batch's slots and ids are written after this one ran

    def release(self) -> None:
        super().release()
        if self.stream:
            destroy_buffers(vars(self.stream))


def _join(first: dict, second: dict | None, axis: int) -> dict[str, np.ndarray]:
    """Arrays of same-format weights joined along `axis` (rows of a matrix, or experts of a stack)."""
    if second is None:
        return first
    return {k: np.concatenate([first[k], second[k]], axis=axis) for k in first}
