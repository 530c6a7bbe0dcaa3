"""Mixture-of-experts block on the GPU (Qwen3.5/3.6-MoE, Qwen3-Next): router, top-k, experts, combine.

out = Σ_{e in top-k} p_e · down_e(silu(gate_e x) · up_e x) + sigmoid(g·x) · shared(x), with p the softmax
over all E router logits (f32), renormalised over the top-k when norm_topk_prob; the expert ids never
leave the GPU. Dispatches per forward of T tokens (decode T = 1, prefill T > 1):
  1. router logits over the router matrix, whose row E is the shared-expert gate (both 8-bit in MLX
     checkpoints: mlx8) -> logits [T, E + 1]: matvec_int4 for T = 1; for T > 1 moe_matvec with a stack of
     one expert, i.e. a matvec per token (matmul_int4's 64-row tiles give 257 rows only 5 workgroups:
     276 µs on the H200 at T = 64 against 51 µs)
  2. moe_router: softmax, top-k, renormalise; writes ids [T, SLOTS] and weights [T, SLOTS], the shared
     expert as slot k with id E and weight sigmoid(logit E)
  3. moe_matvec gate_up (+ SiLU·mul): grid (F/ROWS, T, SLOTS) -> act [T, SLOTS, F], F = moe_intermediate
  4. moe_matvec down: grid (D/ROWS, T, SLOTS) -> y [T, SLOTS, D]
  5. moe_combine: out (+)= Σ_s weights[t, s]·y[t, s]
Decode with int8 activations (use_int8; the runtime's q8 decode): 4-bit expert stacks run as moe_matvec_q8,
gate_up on the norm's int8 row, down after one quantize_q8 of the slots' activations (one more dispatch).
The shared expert is stacked as expert E of the routed stacks when its size and formats match theirs
(Qwen3.6: 512 = moe_intermediate_size, all mlx4), so steps 3 and 4 run it in the same dispatch; otherwise
it gets its own dispatch of steps 3 and 4 (7 in all).
Prefill cost: each (token, slot) re-reads its expert's weights, so a T-token forward moves T times the
decode weight traffic with no sharing between tokens routed to the same expert (H200, Qwen3.6 sizes:
105 µs of kernel time per layer at T = 1, 2.1 ms at T = 64, i.e. 33 µs per token). A grouped kernel
(tokens sorted by expert, one weight read per expert) is the way past that.
"""

from __future__ import annotations

import numpy as np

from engine.errors import GpuError, UnsupportedModelError
from engine.gpu import MAX_GROUPS_PER_DIM, STORAGE, fold_grid
from engine.matmul import MATVEC_SG_WG, _format_consts, format_knobs, matvec_plan, matvec_q8_plan, quantize_q8_plan
from engine.packed import PackedWeight

ROUTER_WG = 64
# Expert matvec shape, measured on the H200 at Qwen3.6 sizes (ROWS 1/2/4/8/16, WG ≤ 32/64): 4 rows and at most
# 32 threads gave the lowest time per layer (decode 105 µs vs 115 µs at 8/64; T = 64 prefill 2.1 ms vs 2.8 ms).
EXPERT_ROWS = 4
EXPERT_WG = 32  # fewer threads when K has fewer 32-element chunks
COMBINE_WG = 64


def router_plan(E: int, top_k: int, shared: bool, norm_topk: bool, T: int, wg: int = ROUTER_WG):
    """Constants and grid for shaders/moe_router.wgsl (one workgroup per token)."""
    if not 1 <= top_k <= E or E >= 2**24:
        raise ValueError(f"need 1 ≤ top_k ≤ E < 2^24, got top_k={top_k}, E={E}")
    if wg & (wg - 1):
        raise ValueError(f"WG must be a power of two (workgroup reduction), got {wg}")
    return dict(E=E, TOPK=top_k, SHARED=shared, NORM_TOPK=norm_topk, WG=wg), fold_grid(max(T, 1))


def expert_plan(K: int, N: int, experts: int, T: int, slots: int, *, slot0: int = 0, n_slots: int | None = None,
                gate_up: bool = False, x_slot: bool = False, x_stride: int | None = None,
                y_stride: int | None = None, rows: int | None = None, wg: int | None = None,
                bits: int = 4, zero: int = 0, affine: bool = True, group: int = 64):
    """Constants and grid for shaders/moe_matvec.wgsl over slots [slot0, slot0 + n_slots) of every token."""
    fmt = _format_consts(K, bits, zero, affine, group, three_bit=True)  # moe_matvec reads 3-bit rows as stored
    n_slots = slots - slot0 if n_slots is None else n_slots
    rows = rows or EXPERT_ROWS
    x_stride, y_stride = x_stride or K, y_stride or N
    if wg is None:  # one chunk per thread where K is short (down_proj: K = 512 is 16 chunks)
        wg = max(rows, min(EXPERT_WG, 1 << (K // 32 - 1).bit_length()))
    if wg & (wg - 1) or wg < rows:
        raise ValueError(f"WG must be a power of two ≥ ROWS; got WG={wg}, ROWS={rows}")
    if x_stride % 4 or x_stride < K or y_stride < N or not 0 < slot0 + n_slots <= slots:
        raise ValueError(f"bad strides or slots: X_STRIDE={x_stride}, Y_STRIDE={y_stride}, slots {slot0}+{n_slots}"
                         f" of {slots}")
    groups = -(-N // rows)
    if max(groups, T, n_slots) > MAX_GROUPS_PER_DIM:
        raise ValueError(f"grid ({groups}, {T}, {n_slots}) exceeds {MAX_GROUPS_PER_DIM} per dimension")
    consts = dict(K=K, N=N, EXPERTS=experts, WG=wg, ROWS=rows, GATE_UP=gate_up, SLOTS=slots, SLOT0=slot0,
                  X_SLOT=x_slot, X_STRIDE=x_stride, Y_STRIDE=y_stride, **fmt)
    return consts, (groups, max(T, 1), n_slots)


def expert_q8_plan(K: int, N: int, experts: int, slots: int, subgroup_size: int, *, slot0: int = 0,
                   n_slots: int | None = None, gate_up: bool = False, x_slot: bool = False, y_stride: int | None = None,
                   rows: int | None = None, wg: int = MATVEC_SG_WG, bits: int = 4, zero: int = 0, affine: bool = True,
                   group: int = 64):
    """Constants and grid for shaders/moe_matvec_q8.wgsl (decode, one token) over slots [slot0, slot0 + n_slots):
    matvec_q8's constants plus the routing ones."""
    consts, _ = matvec_q8_plan(K, N, subgroup_size, gate_up=gate_up, rows=rows, wg=wg, bits=bits, zero=zero,
                               affine=affine, group=group)
    n_slots = slots - slot0 if n_slots is None else n_slots
    y_stride = y_stride or N
    if y_stride < N or not 0 < slot0 + n_slots <= slots:
        raise ValueError(f"bad stride or slots: Y_STRIDE={y_stride}, slots {slot0}+{n_slots} of {slots}")
    consts |= dict(EXPERTS=experts, SLOTS=slots, SLOT0=slot0, X_SLOT=x_slot, Y_STRIDE=y_stride)
    return consts, (-(-N // (consts["ROWS"] * consts["BLOCKS"])), 1, n_slots)


def combine_plan(D: int, slots: int, T: int, accumulate: bool = False, wg: int = COMBINE_WG):
    """Constants and grid for shaders/moe_combine.wgsl (one thread per 4 outputs)."""
    if D % 4:
        raise ValueError(f"D must be a multiple of 4, got {D}")
    return dict(D=D, SLOTS=slots, ACCUMULATE=accumulate, WG=wg), fold_grid(-(-max(T, 1) * D // 4 // wg))


def _same_format(a: PackedWeight, b: PackedWeight, name_a: str, name_b: str) -> None:
    if a.format != b.format or a.shape[-1] != b.shape[-1]:
        raise UnsupportedModelError(
            f"MoE weights {name_a} ({a.format}, {list(a.shape)}) and {name_b} ({b.format}, {list(b.shape)}) run "
            "as one fused matrix and must share their format and input size")


def _stack(*weights: dict, axis: int) -> dict[str, np.ndarray]:
    """Arrays of same-format weights joined along `axis` (rows of a matrix, or experts of a stack)."""
    return {k: np.concatenate([w[k] for w in weights], axis=axis) for k in weights[0]}


def shared_joins_stack(ffn: int, shared_ffn: int, routed_formats: tuple, shared_formats: tuple) -> bool:
    """The shared expert runs as expert E of the routed stacks when its width and (gate_up, down) formats match
    theirs; otherwise it takes its own two dispatches (e.g. 4-bit shared beside 3-bit routed experts)."""
    return shared_ffn == ffn and tuple(shared_formats) == tuple(routed_formats)


class MoeBlock:
    """One MoE layer: owns its weights, scratch buffers, pipelines and bind groups (built once) and records
    its dispatches for T tokens into an engine.gpu.Recorder.

    weights: PackedWeights keyed as MlxCheckpoint.moe_weights gives them: gate [E, D], switch_mlp.{gate,up}_proj
    [E, F, D], switch_mlp.down_proj [E, D, F] (F = moe_intermediate_size), and optionally
    shared_expert.{gate,up}_proj [Fs, D], shared_expert.down_proj [D, Fs] and shared_expert_gate [1, D].
    `step` is the per-forward uniform; x and out are f32 [T, D] buffers given to record(). The scratch
    buffers (logits, ids, weights, act, y: ~92 KB per token at Qwen3.6 sizes) can be shared by every layer
    of a model, since layers run one after another: pass share_scratch=<an earlier MoeBlock>.
    """

    def __init__(self, gpu, weights: dict[str, PackedWeight], step, *, top_k: int, norm_topk_prob: bool = True,
                 max_tokens: int = 1, accumulate: bool = False, label: str = "moe",
                 share_scratch: MoeBlock | None = None):
        self.gpu, self.step, self.label, self.max_tokens = gpu, step, label, max(max_tokens, 1)
        gate, g, u, down = (weights[k] for k in ("gate", "switch_mlp.gate_proj", "switch_mlp.up_proj",
                                                  "switch_mlp.down_proj"))
        E, F, D = g.shape
        self.E, self.F, self.D, self.top_k = E, F, D, top_k
        self.shared = "shared_expert.gate_proj" in weights
        self.slots = top_k + self.shared
        _same_format(g, u, "switch_mlp.gate_proj", "switch_mlp.up_proj")
        router, gate_up, downs = [gate], [_stack(g, u, axis=1)], [down]  # per expert: gate rows, then up rows
        Fs, self.stacked = 0, False
        if self.shared:
            sg, su, sd, sgate = (weights[k] for k in ("shared_expert.gate_proj", "shared_expert.up_proj",
                                                      "shared_expert.down_proj", "shared_expert_gate"))
            _same_format(sg, su, "shared_expert.gate_proj", "shared_expert.up_proj")
            _same_format(gate, sgate, "gate", "shared_expert_gate")
            router.append(sgate)  # its logit is row E of the router's output
            Fs = sg.shape[0]
            shared_gate_up = {k: a[None] for k, a in _stack(sg, su, axis=0).items()}  # a stack of one expert
            shared_down = {k: a[None] for k, a in sd.items()}
            self.stacked = shared_joins_stack(F, Fs, (g.format, down.format), (sg.format, sd.format))
            if self.stacked:  # expert E of the routed stacks
                gate_up.append(shared_gate_up)
                downs.append(shared_down)
        self.act_stride = max(F, Fs)
        T, n_logits = self.max_tokens, E + self.shared

        self.router_w = self._upload(f"{label}.router", _stack(*router, axis=0))
        gate_up_w = self._upload(f"{label}.gate_up", _stack(*gate_up, axis=0))
        down_w = self._upload(f"{label}.down", _stack(*downs, axis=0))
        sizes = dict(logits=T * n_logits, ids=T * self.slots, weights=T * self.slots,
                     act=T * self.slots * self.act_stride, y=T * self.slots * D)
        for name, count in sizes.items():  # f32 / u32 scratch, another block's where it is large enough
            buf = getattr(share_scratch, name, None)
            setattr(self, name, buf if buf is not None and buf.size >= 4 * count else
                    gpu.buffer(f"{label}.{name}", 4 * count, STORAGE))

        rfmt = format_knobs(gate.format)
        self._router_mv = matvec_plan(D, n_logits, **rfmt)
        # T > 1: a stack of one expert through moe_matvec, a matvec per token (see the module docstring).
        self._router_tokens = expert_plan(D, n_logits, 1, T, 1, **rfmt) if T > 1 else None
        self._topk = router_plan(E, top_k, self.shared, norm_topk_prob, T)
        # Expert passes: (plan, weight buffers, input (None = x), output); every gate_up before its down.
        routed = dict(slots=self.slots, n_slots=self.slots if self.stacked else top_k)
        experts, stride = E + self.stacked, self.act_stride
        self._experts = [
            (expert_plan(D, F, experts, T, gate_up=True, y_stride=stride, **routed, **format_knobs(g.format)),
             gate_up_w, None, self.act),
            (expert_plan(F, D, experts, T, x_slot=True, x_stride=stride, **routed, **format_knobs(down.format)),
             down_w, self.act, self.y)]
        if self.shared and not self.stacked:  # its own stack of one (ids unread), over slot top_k only
            one = dict(slots=self.slots, slot0=top_k, n_slots=1)
            self._experts += [
                (expert_plan(D, Fs, 1, T, gate_up=True, y_stride=stride, **one, **format_knobs(sg.format)),
                 self._upload(f"{label}.shared_gate_up", shared_gate_up), None, self.act),
                (expert_plan(Fs, D, 1, T, x_slot=True, x_stride=stride, **one, **format_knobs(sd.format)),
                 self._upload(f"{label}.shared_down", shared_down), self.act, self.y)]
        self._combine = combine_plan(D, self.slots, T, accumulate)
        self._binds: dict = {}
        self.int8: dict | None = None  # set by the runtime: int8-activation decode (see use_int8)

    def int8_act_bytes(self) -> int:
        """Bytes of the int8 copy of every slot's activations (use_int8's act_q8; its scales take 1/4 of that)."""
        return self.slots * self.act_stride

    def use_int8(self, x_q8, x_q8_meta, x_ready: bool, subgroup_size: int, act_q8, act_q8_meta) -> None:
        """Decode (T = 1) runs the 4-bit expert passes as moe_matvec_q8: gate_up reads the int8 copy of x in
        (x_q8, x_q8_meta) — written by the norm when x_ready, else quantized here first — and down reads its
        slots' activations, quantized by a quantize_q8 dispatch into (act_q8, act_q8_meta) (int8_act_bytes;
        scratch every layer may share). Expert stacks of other widths (3-bit) keep the f32 passes."""
        self.int8 = dict(x=x_q8, x_meta=x_q8_meta, x_ready=x_ready, sg=subgroup_size, act=act_q8, act_meta=act_q8_meta)
        self._binds.clear()

    def _int8_passes(self, x, bound) -> list:
        """Per expert pass of _experts: [(quantize pass or None, moe_matvec_q8 pass)], or None to keep the f32 one."""
        q8, out = self.int8, []
        x_ready = q8["x_ready"]  # x's int8 copy is made once: the down passes quantize into other scratch
        for (plan, (w, s), src, dst) in self._experts:
            c = plan[0]
            if c["BITS"] != 4:
                out.append(None)
                continue
            fmt = dict(zero=c["ZERO"], affine=c["AFFINE"], group=c["GROUP"])
            n_slots = plan[1][2]
            qplan = expert_q8_plan(c["K"], c["N"], c["EXPERTS"], c["SLOTS"], q8["sg"], slot0=c["SLOT0"],
                                   n_slots=n_slots, gate_up=c["GATE_UP"], x_slot=c["X_SLOT"],
                                   y_stride=c["Y_STRIDE"], **fmt)
            if src is None:  # gate_up on x: the norm's int8 row, or quantize it here
                xq, xm = q8["x"], q8["x_meta"]
                quant = None if x_ready else bound("quantize_q8", quantize_q8_plan(c["K"]), [x, xq, xm, self.step])
                x_ready = True
            else:  # down on each slot's activations: quantize those rows of `src` (X_STRIDE apart)
                xq, xm = q8["act"], q8["act_meta"]
                quant = bound("quantize_q8", quantize_q8_plan(c["K"], rows=n_slots, row0=c["SLOT0"],
                                                              x_stride=c["X_STRIDE"]), [src, xq, xm, self.step])
            out.append((quant, bound("moe_matvec_q8", qplan, [xq, self.ids, w, s, dst, xm])))
        return out

    def _upload(self, label: str, arrays: dict[str, np.ndarray]):
        """(weight buffer, scale buffer) for a packed array set; f16 weights get a dummy scale buffer."""
        w = arrays.get("q_weight", arrays.get("weight"))
        for a in (w, arrays.get("q_scale")):
            if a is not None and a.nbytes > self.gpu.max_binding:
                raise GpuError(f"{label} needs a {a.nbytes}-byte binding; this GPU allows {self.gpu.max_binding}")
        s = arrays["q_scale"] if "q_scale" in arrays else np.zeros(4, np.float16)
        return self.gpu.upload(f"{label}.w", w.view(np.uint32)), self.gpu.upload(f"{label}.s", s)

    def _passes(self, x, out) -> dict:
        """(pipeline, bind group, plan) per dispatch for input x / output out, built once per buffer pair."""
        key = (id(x), id(out))
        if key not in self._binds:
            gpu, step = self.gpu, self.step

            def bound(shader, plan, buffers):
                pipe = gpu.pipeline(shader, plan[0])
                return pipe, gpu.bind(pipe, buffers, f"{self.label}.{shader}"), plan

            rw, rs = self.router_w
            passes = {"router_mv": bound("matvec_int4", self._router_mv, [x, rw, rs, self.logits, step])}
            if self._router_tokens:
                passes["router_tokens"] = bound("moe_matvec", self._router_tokens,
                                                [x, self.ids, rw, rs, self.logits, step])
            passes["topk"] = bound("moe_router", self._topk, [self.logits, self.ids, self.weights, step])
            passes["experts"] = [bound("moe_matvec", plan, [x if src is None else src, self.ids, w, s, dst, step])
                                 for plan, (w, s), src, dst in self._experts]
            if self.int8:
                passes["experts_q8"] = self._int8_passes(x, bound)
            passes["combine"] = bound("moe_combine", self._combine, [self.y, self.weights, out, step])
            self._binds[key] = (x, out, passes)  # holding x and out keeps their ids from being reused
        return self._binds[key][2]

    # -- recording --------------------------------------------------------------------------------

    def record(self, rec, x, out, n_tokens: int) -> None:
        """Record the block for n_tokens rows of x (f32 [T, D]) into out (f32 [T, D]); step.n_tokens must match."""
        T = int(n_tokens)
        if not 1 <= T <= self.max_tokens:
            raise ValueError(f"n_tokens={T} outside 1..{self.max_tokens} (max_tokens of this MoeBlock)")
        passes = self._passes(x, out)

        def per_token(pass_):  # moe_matvec grids are (row groups, tokens, slots)
            pipe, bg, plan = pass_
            rec.dispatch(pipe, bg, plan[1][0], T, plan[1][2])

        if T == 1:
            pipe, bg, plan = passes["router_mv"]
            rec.dispatch(pipe, bg, *plan[1])
        else:
            per_token(passes["router_tokens"])
        pipe, bg, _ = passes["topk"]
        rec.dispatch(pipe, bg, *fold_grid(T))
        int8 = passes.get("experts_q8") if T == 1 else None
        for i, pass_ in enumerate(passes["experts"]):
            if int8 and int8[i]:
                quant, q8_pass = int8[i]
                for p in (quant, q8_pass):
                    if p:
                        rec.dispatch(p[0], p[1], *p[2][1])
            else:
                per_token(pass_)
        pipe, bg, plan = passes["combine"]
        rec.dispatch(pipe, bg, *fold_grid(-(-T * self.D // 4 // plan[0]["WG"])))

    def dispatch_count(self, decode: bool = False) -> int:
        """Dispatches per forward: router logits, top-k, gate_up and down (each twice when the shared expert runs
        apart), combine; a decode with int8 passes adds their quantize_q8 dispatches."""
        n = 3 + 2 * (1 + (self.shared and not self.stacked))
        if decode and self.int8:
            passes = self._int8_passes(None, lambda *a: a)  # plans only: count what record() would dispatch
            n += sum(1 for p in passes if p and p[0])
        return n

