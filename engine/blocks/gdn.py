"""The gated DeltaNet mixer (Qwen3.5's linear-attention layers) and its state.

Per layer: the four input projections fused into one matvec (in_proj_qkv ‖ z ‖ a ‖ b rows, joined at load), the
causal conv (state: the last K−1 raw inputs) with the decay/beta gates in the same dispatch, the delta-rule
recurrence on an f32 state [v_heads, d_k, d_v], the gated RMSNorm (it also writes the output projection's int8
input: a decode token's where out's matvec is int8, a prefill chunk's where out's GEMM is and the arithmetic's
int8_epilogues allow: no quantize_q8 before out) and the output projection. All layers' states live in one `state`
buffer, so a checkpoint of the whole sequence state is one buffer copy.

Rollback contract: the recurrent state cannot be truncated like a KV cache, so it is snapshotted by position: one
snapshot before the last token of each prompt (a regenerate resumes there exactly) and a rolling few every
`snapshot_every` positions of one-token forwards. rollback(n) restores the newest snapshot at or before n (or
position 0: the kernels start from a zero state when pos0 == 0); the runtime then replays the tokens between.
"""

from __future__ import annotations

import numpy as np

from engine.blocks import Block, BufferNeed, array_bytes, upload_weight
from engine.blocks.linear import Arithmetic, Linear, matrix_bindings, matrix_tensors
from engine.errors import UnsupportedModelError
from engine.kernels.gdn import (
    GDN_CONV,
    GDN_NORM_OUT,
    gdn_conv_plan,
    gdn_conv_runs,
    gdn_dims,
    gdn_norm_plan,
    gdn_recur_kernel,
)
from engine.kernels.matmul import packed_shapes

IN_PROJ = ("in_proj_qkv", "in_proj_z", "in_proj_a", "in_proj_b")  # fused at load, rows in this order


def in_proj_format(formats: dict[str, str], layer: int) -> str:
    """The format the four input projections share (they run as one matrix)."""
    tags = [formats.get(f"layers.{layer}.{p}", "q4f16_1") for p in IN_PROJ]
    if len(set(tags)) > 1:
        raise UnsupportedModelError(f"layer {layer}: the GDN input projections run as one matrix and must share a "
                                    f"weight format; found {dict(zip(IN_PROJ, tags, strict=True))}")
    return tags[0]


class GatedDeltaNetMixer(Block):
    name = "gated_deltanet"
    norm_producer = "out"
    keeps_state = True
    # True: the recurrence's subgroup-shuffle kernel where it fits; it measured 2.8x slower than the workgroup-memory
    # kernel on the H200 (BENCH.md), so only bench/gdn_subgroups.py's A/B turns it on.
    recur_on_subgroups = False

    def __init__(self, spec, layers: tuple[int, ...], formats: dict[str, str], ar: Arithmetic, chunk: int,
                 offset_alignment: int, snapshots: tuple[int, int], snapshot_every: int, conv_runs: int | None = None):
        s = self.spec = spec
        self.layers, self.ar, self.chunk = tuple(layers), ar, chunk
        # A prefill chunk's conv walks each channel's tokens in this many runs at once (decode: one thread a channel).
        self.conv_runs = conv_runs or gdn_conv_runs(chunk)
        self.d = gdn_dims(s.conv_dim, s.gdn_v_heads, s.gdn_v_dim)
        self.in_formats = {i: in_proj_format(formats, i) for i in self.layers}
        self.out_formats = {i: formats.get(f"layers.{i}.out", "q4f16_1") for i in self.layers}
        self.lin = {i: {"in_proj": Linear(s.dim, self.d["ROW"], self.in_formats[i], ar),
                        "out": Linear(self.d["VD"], s.dim, self.out_formats[i], ar)} for i in self.layers}
        # per layer: the prefill norm writes out's int8 rows (the workspace's, as a quantize_q8 before out would)
        self.rows_int8 = {i: ar.int8_epilogues and s.gdn_v_dim % 32 == 0 and self.lin[i]["out"].int8_prefill
                          for i in self.layers}
        self.norms = None  # the residual block when out carries the add + norm after it and in_proj reads that row
        # Per layer: recurrent state then conv state, each at a bindable (aligned) offset.
        f32, align = 4, offset_alignment
        recur_bytes = s.gdn_v_heads * s.gdn_k_dim * s.gdn_v_dim * f32
        conv_bytes = (s.conv_kernel - 1) * self.d["CONV"] * f32
        self.slices, off = {}, 0
        for i in self.layers:
            conv_off = -(-(off + recur_bytes) // align) * align
            self.slices[i] = ((off, recur_bytes), (conv_off, conv_bytes))
            off = -(-(conv_off + conv_bytes) // align) * align
        self.state_bytes = max(off, 16)
        self.snap_every = snapshot_every
        self._caps = {"prompt": snapshots[0], "decode": snapshots[1]}
        self._snaps: dict[str, list[tuple[int, object]]] = {"prompt": [], "decode": []}  # (position, buffer)
        self.w: dict[str, object] = {}
        self._parts: dict[tuple[str, str], dict[str, np.ndarray]] = {}

    # ---- plan --------------------------------------------------------------------------------------------
    def tensors(self) -> dict:
        s, out = self.spec, {}
        vh, vd = s.gdn_v_heads, s.gdn_v_heads * s.gdn_v_dim
        for i in self.layers:
            c = f"layers.{i}"
            for proj, n in zip(IN_PROJ, (s.conv_dim, vd, vh, vh), strict=True):
                out |= matrix_tensors(f"{c}.{proj}", n, s.dim, self.in_formats[i])
            out |= matrix_tensors(f"{c}.out", s.dim, vd, self.out_formats[i])
            out[f"{c}.A_log"] = out[f"{c}.dt_bias"] = ((vh,), "float32")
            out[f"{c}.conv1d"] = ((s.conv_dim, 1, s.conv_kernel), "float16")
            out[f"{c}.gdn_norm"] = ((s.gdn_v_dim,), "float16")
        return out

    def needs(self) -> list[BufferNeed]:
        s, d, C, f32 = self.spec, self.d, self.chunk, 4
        out = []
        for i in self.layers:
            c = f"layers.{i}"
            for key, (shape, dtype) in packed_shapes(self.in_formats[i], d["ROW"], s.dim).items():
                out.append(BufferNeed.upload(f"{c}.in_proj.{key}", array_bytes(shape, dtype)))
            for key, (shape, dtype) in packed_shapes(self.out_formats[i], s.dim, d["VD"]).items():
                out.append(BufferNeed.upload(f"{c}.out.{key}", array_bytes(shape, dtype)))
            out += [BufferNeed.upload(f"{c}.A_log", 4 * s.gdn_v_heads), BufferNeed.upload(f"{c}.dt_bias",
                                                                                          4 * s.gdn_v_heads),
                    BufferNeed.upload(f"{c}.conv1d", 2 * s.conv_dim * s.conv_kernel),
                    BufferNeed.upload(f"{c}.gdn_norm", 2 * s.gdn_v_dim)]
        out += [BufferNeed.buffer("gdn-in-proj", C * d["ROW"] * f32), BufferNeed.buffer("gdn-conv-out",
                                                                                         C * d["CONV"] * f32),
                BufferNeed.buffer("gdn-gates", C * 2 * s.gdn_v_heads * f32),
                BufferNeed.buffer("gdn-recur-out", C * d["VD"] * f32),
                BufferNeed.buffer("gdn-state", self.state_bytes, "state")]
        out += [BufferNeed.buffer(f"gdn-snapshot-{j}", self.state_bytes, "state")
                for j in range(sum(self._caps.values()))]
        return out

    def shared_needs(self) -> dict[str, int]:
        return {"mixer-out": self.chunk * self.d["VD"] * 4}

    def can_carry_norms(self) -> bool:  # in_proj reads the normed row; out adds to the residual and writes it
        return all(lin.carries_norm(producer=m == "out") for i in self.layers for m, lin in self.lin[i].items())

    def int8_row_k(self) -> int:
        return max(self.spec.dim, self.d["VD"])

    # ---- load --------------------------------------------------------------------------------------------
    def take(self, gpu, name: str, arr: np.ndarray, source: str = "") -> None:
        layer, _, rest = name.removeprefix("layers.").partition(".")
        matrix, _, key = rest.partition(".")
        if matrix not in IN_PROJ:
            self.w[name] = upload_weight(gpu, name, arr, source=source)
            return
        # one in_proj matrix (one matvec) for q|k|v, z, a, b: rows are independent in every format
        group = self._parts.setdefault((layer, key), {})
        group[matrix] = arr
        if len(group) == len(IN_PROJ):
            label = f"layers.{layer}.in_proj.{key}"
            self.w[label] = upload_weight(gpu, label, np.concatenate([group[p] for p in IN_PROJ]))
            del self._parts[(layer, key)]

    # ---- build -------------------------------------------------------------------------------------------
    def build(self, gpu, ws) -> None:
        s, d = self.spec, self.d
        made = {n.label: n.allocate(gpu) for n in self.needs() if n.how != "upload"}
        self.proj, self.conv_out, self.gates = made["gdn-in-proj"], made["gdn-conv-out"], made["gdn-gates"]
        self.recur, self.state, self.mixer_out = made["gdn-recur-out"], made["gdn-state"], ws.shared["mixer-out"]
        self._free = [made[f"gdn-snapshot-{j}"] for j in range(sum(self._caps.values()))]
        self.gpu = gpu
        conv_dims = (d["CONV"], d["ROW"], s.conv_kernel, s.gdn_v_heads, d["A_OFF"], d["B_OFF"])
        (decode_consts, self.conv_grid), (prefill_consts, self.conv_runs_grid) = (
            gdn_conv_plan(*conv_dims), gdn_conv_plan(*conv_dims, runs=self.conv_runs))
        sg = gpu.subgroup_size if gpu.use_subgroups and self.recur_on_subgroups else 0
        recur, recur_consts, self.recur_grid = gdn_recur_kernel(s.gdn_k_heads, s.gdn_v_heads, s.gdn_k_dim,
                                                                s.gdn_v_dim, d["CONV"], sg)
        self.p_conv, self.p_conv_runs = gpu.pipeline(GDN_CONV, decode_consts), gpu.pipeline(GDN_CONV, prefill_consts)
        self.p_recur = gpu.pipeline(recur, recur_consts)
        # The norm writes out's int8 input in decode when out takes int8 (no quantize_q8 before it).
        self.norm_int8 = s.gdn_v_dim % 32 == 0 and all(self.lin[i]["out"].int8 for i in self.layers)
        norm_pipe = lambda **rows: gpu.pipeline(GDN_NORM_OUT, gdn_norm_plan(  # noqa: E731
            s.gdn_v_heads, s.gdn_v_dim, s.eps, d["ROW"], d["Z_OFF"], **rows))
        self.p_norm = norm_pipe(rows_q8=self.norm_int8, rows_f32=True)
        # prefill chunks, by whether the norm writes out's int8 rows instead of f32 ones
        self.p_norm_rows = {q8: norm_pipe(rows_q8=q8) for q8 in set(self.rows_int8.values())}
        self.bg = {}
        for i in self.layers:
            c, w, st = f"layers.{i}", self.w, ws.step
            (r_off, r_size), (c_off, c_size) = self.slices[i]
            conv = dict(x=self.proj, w=w[f"{c}.conv1d"], state=(self.state, c_off, c_size), y=self.conv_out, step=st,
                        a_log=w[f"{c}.A_log"], dt_bias=w[f"{c}.dt_bias"], gates=self.gates)
            norm_in = dict(x=self.recur, zsrc=self.proj, w=w[f"{c}.gdn_norm"], y=self.mixer_out, step=st)
            rows = (ws.rows_q8, ws.rows_q8_meta) if self.rows_int8[i] else (ws.x_q8, ws.x_q8_meta)  # else unused
            self.bg[i] = {
                "conv": gpu.bind(self.p_conv, conv, f"{c}.gdn_conv"),
                "conv_runs": gpu.bind(self.p_conv_runs, conv, f"{c}.gdn_conv_runs"),
                "recur": gpu.bind(self.p_recur, dict(qkv=self.conv_out, gates=self.gates,
                                                     state=(self.state, r_off, r_size), out=self.recur, step=st),
                                  f"{c}.gdn_recur"),
                "norm": gpu.bind(self.p_norm, dict(norm_in, xq=ws.x_q8, xm=ws.x_q8_meta), f"{c}.gdn_norm"),
                "norm_rows": gpu.bind(self.p_norm_rows[self.rows_int8[i]], dict(norm_in, xq=rows[0], xm=rows[1]),
                                      f"{c}.gdn_norm_rows")}
            lin, fused = self.lin[i], self.norms is not None
            lin["in_proj"].bind(gpu, ws, ws.hidden, self._matrix(f"{c}.in_proj", self.in_formats[i], ws.dummy_f16),
                                self.proj, f"{c}.in_proj", src_int8=self.ar.norm_int8,
                                rms=self.norms.rms_input() if fused and i > 0 else None)
            lin["out"].bind(gpu, ws, self.mixer_out, self._matrix(f"{c}.out", self.out_formats[i], ws.dummy_f16),
                            ws.delta, f"{c}.out", norm_out=self.norms.epilogue(i, "mixer") if fused else None,
                            rows_ready=self.rows_int8[i])

    def _matrix(self, name: str, tag: str, dummy) -> dict:
        return matrix_bindings({k.removeprefix(f"{name}."): v for k, v in self.w.items() if k.startswith(name + ".")},
                               tag, dummy)

    # ---- record ------------------------------------------------------------------------------------------
    def record(self, rec, layer: int, T: int, splits: int = 1) -> None:
        lin, bg = self.lin[layer], self.bg[layer]
        lin["in_proj"].record(rec, T)
        if T == 1:
            rec.dispatch(self.p_conv, bg["conv"], *self.conv_grid)
        else:
            rec.dispatch(self.p_conv_runs, bg["conv_runs"], *self.conv_runs_grid)
        rec.dispatch(self.p_recur, bg["recur"], *self.recur_grid)
        if T == 1:  # as out's record: T == 1 takes the decode matvec, which reads the workspace's int8 row
            rec.dispatch(self.p_norm, bg["norm"], self.spec.gdn_v_heads, 1)
        else:
            rec.dispatch(self.p_norm_rows[self.rows_int8[layer]], bg["norm_rows"], self.spec.gdn_v_heads, T)
        lin["out"].record(rec, T, int8_ready=self.norm_int8)

    # ---- state snapshots ---------------------------------------------------------------------------------
    def snapshots(self) -> list[tuple[int, object]]:
        """(position, buffer) of every snapshot held: the state before that position."""
        return self._snaps["prompt"] + self._snaps["decode"]

    @property
    def snapshot_slots(self) -> int:
        return sum(self._caps.values())

    def free_slots(self) -> int:
        return len(self._free)

    def before_single_token(self, rec, pos: int) -> None:
        if pos % self.snap_every == 0:
            self._snapshot("decode", pos, rec)  # before this token touches the state

    def before_prompt_end(self, pos: int) -> None:
        self._snapshot("prompt", pos)

    def _snapshot(self, kind: str, pos: int, rec=None) -> None:
        """Copy `state` (the state before position pos) into a snapshot slot of `kind`."""
        if pos == 0 or self._caps[kind] == 0 or any(q == pos for q, _ in self.snapshots()):
            return
        ring = self._snaps[kind]
        buf = ring.pop(0)[1] if len(ring) >= self._caps[kind] else self._free.pop()
        ring.append((pos, buf))
        if rec is not None:
            rec.copy(self.state, 0, buf, 0, self.state_bytes)
        else:
            self._copy(self.state, buf)

    def _copy(self, src, dst) -> None:
        enc = self.gpu.device.create_command_encoder(label="gdn-state-copy")
        enc.copy_buffer_to_buffer(src, 0, dst, 0, self.state_bytes)
        self.gpu.queue.submit([enc.finish()])

    def _drop_snapshots(self, after: int) -> None:
        for ring in self._snaps.values():
            self._free += [buf for q, buf in ring if q > after]
            ring[:] = [(q, buf) for q, buf in ring if q <= after]

    def reset(self) -> None:
        self._drop_snapshots(after=0)

    def rollback(self, n: int, at: int) -> int:
        self._drop_snapshots(after=n)
        if n < at:
            at, buf = max(self.snapshots(), key=lambda e: e[0], default=(0, None))
            if buf is not None:
                self._copy(buf, self.state)
        return at
