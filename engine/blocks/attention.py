"""The attention mixer: paged f16 KV cache per layer, fused QKV projection, RoPE + cache append, attention over the
cache, and the output projection. A decode token over at most `single_pass_keys` keys takes one dispatch for RoPE,
append and attention (attention_decode.wgsl, which also applies the gate and writes o's int8 input); past that, RoPE +
append, then split-K attention in blocks of `split_keys` keys and a combine, unless `fused_split` and the adapter allow
attention_decode_split.wgsl, whose split-K workgroups' last of each head combines: one dispatch at any context. The
gated variant (Qwen3.5) projects a per-head output gate with q (checkpoint c_attn = per-head [Q | gate] ++ K ++ V, split
at load into qkv and gate) and applies sigmoid(gate) before the output projection; its q/k norms may be zero-centred.
The gate rows live in the qkv buffer behind the QKV rows (at an aligned offset), so the one-dispatch decode kernel reads
both through one binding. A prefill chunk's tiled attention writes o's int8 GEMM input itself where o reads its output
directly (not through the gate) and the arithmetic's int8_epilogues allow: no quantize_q8 before o; in the gated variant
the gate writes it (a prefill chunk's rows under the same switch, a decode token's row where o's matvec is int8)."""

from __future__ import annotations

import numpy as np

from engine.blocks import Block, BufferNeed, array_bytes, upload_weight
from engine.blocks.linear import Arithmetic, Linear, SplitLinear, matrix_bindings, matrix_tensors, split_tensors
from engine.kernels.attention import (
    ATTENTION,
    ATTENTION_DECODE,
    ATTENTION_DECODE_SPLIT,
    ATTENTION_TILED,
    ATTN_GATE,
    COMBINE,
    LANES_SUBGROUP,
    ROPE_APPEND,
    attention_consts,
    attention_decode_consts,
    attention_decode_fits,
    attention_tiled_grid,
    attention_tiled_plan,
    attn_gate_plan,
    combine_consts,
    rope_append_consts,
    split_decode_part_bytes,
    split_decode_storage_buffers,
    split_decode_wg,
)
from engine.kernels.matmul import packed_shapes

PAGE = 16  # tokens per KV page
MAX_SPLITS = 32  # split-K partitions of decode attention at most


class AttentionMixer(Block):
    name = "attention"
    norm_producer = "o"

    def __init__(self, spec, layers: tuple[int, ...], formats: dict[str, str], ar: Arithmetic, chunk: int,
                 max_context: int, split_keys: int, gated: bool = False, single_pass_keys: int = 1,
                 offset_alignment: int = 256, fused_split: bool = False, storage_buffers: int = 8,
                 decode_variant: str = "serial"):
        s = self.spec = spec
        self.name = "gated_attention" if gated else "attention"
        self.layers, self.gated, self.ar, self.chunk, self.split_keys = tuple(layers), gated, ar, chunk, split_keys
        self.single_pass_keys = single_pass_keys
        self.decode_variant = decode_variant  # attention_decode_consts' variant
        self.norms = None  # the residual block when o carries the add + norm after it and qkv (gate) read that row
        self.q_dim, self.kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        self.qkv_dim = self.q_dim + 2 * self.kv_dim
        # The gate's rows (chunk × q_dim) follow the QKV rows in the qkv buffer, at a bindable offset.
        self.gate_offset = -(-chunk * self.qkv_dim * 4 // offset_alignment) * offset_alignment
        self.qkv_bytes = self.gate_offset + chunk * self.q_dim * 4 if gated else chunk * self.qkv_dim * 4
        # The one-dispatch decode attention writes o's int8 input when each head's 32-element chunks lie inside it.
        self.decode_int8 = ar.int8 and s.head_dim % 32 == 0
        # Heads too wide for it keep RoPE + append and attention apart in decode too.
        self.decode_fused = attention_decode_fits(s.head_dim)
        # Past single_pass_keys too, where the adapter binds the split kernel's storage buffers (else the 3 kernels).
        self.split_fused = (fused_split and self.decode_fused and attention_decode_fits(s.head_dim, split_decode_wg(
            s.head_dim, decode_variant)) and storage_buffers >= split_decode_storage_buffers())
        self.qkv_rows = (self.q_dim, self.kv_dim, self.kv_dim)
        self.qk_norm = gated or s.qk_norm
        self.n_pages = -(-max_context // PAGE)
        self.page_bytes = s.n_kv_heads * PAGE * s.head_dim * 2
        self.formats = {i: formats.get(f"layers.{i}.{'c_attn' if gated else 'qkv'}", "q4f16_1") for i in layers}
        self.o_formats = {i: formats.get(f"layers.{i}.o", "q4f16_1") for i in layers}
        # The split-K combine also writes the o-projection's int8 input when o reads the combine's output directly
        # (not through the gate) and each head's 32-element chunks lie inside the head.
        self.combine_int8 = ar.int8 and not gated and s.head_dim % 32 == 0
        self.lin = {}
        self.tiled_int8 = {}  # per layer: the tiled prefill attention writes o's int8 rows (o's GEMM takes them)
        self.gate_int8 = {}  # per layer, gated: the gate writes o's int8 (prefill rows, decode row)
        for i in self.layers:
            tag, o_tag = self.formats[i], self.o_formats[i]
            if "," in tag and not gated:  # q, k, v stored in different formats (a GGUF Q4_K_M file's Q6_K v)
                qkv = SplitLinear(s.dim, self.qkv_rows, tag, ar)
            else:
                qkv = Linear(s.dim, self.qkv_dim, tag, ar)
            self.lin[i] = {"qkv": qkv, "o": Linear(self.q_dim, s.dim, o_tag, ar)}
            self.tiled_int8[i] = (ar.int8_epilogues and not gated and self.lin[i]["o"].int8_prefill
                                  and attention_tiled_plan(s.n_heads, s.n_kv_heads, s.head_dim, PAGE) is not None)
            if gated:
                self.lin[i]["gate"] = Linear(s.dim, self.q_dim, tag, ar)
                o, whole = self.lin[i]["o"], self.q_dim % 32 == 0
                self.gate_int8[i] = (ar.int8_epilogues and o.int8_prefill and whole, o.int8 and whole)
        self.w: dict[str, object] = {}

    # ---- plan --------------------------------------------------------------------------------------------
    def tensors(self) -> dict:
        s, out = self.spec, {}
        for i in self.layers:
            c = f"layers.{i}"
            rows = self.qkv_dim + self.q_dim if self.gated else self.qkv_dim
            if "," in self.formats[i]:
                out |= split_tensors(f"{c}.qkv", self.qkv_rows, s.dim, self.formats[i])
            else:
                out |= matrix_tensors(f"{c}.{'c_attn' if self.gated else 'qkv'}", rows, s.dim, self.formats[i])
            out |= matrix_tensors(f"{c}.o", s.dim, self.q_dim, self.o_formats[i])
            if self.qk_norm:
                out[f"{c}.q_norm"] = out[f"{c}.k_norm"] = ((s.head_dim,), "float16")
        return out

    def needs(self) -> list[BufferNeed]:
        s, C, f32 = self.spec, self.chunk, 4
        out = []
        for i in self.layers:
            c = f"layers.{i}"
            if "," in self.formats[i]:
                qkv = split_tensors(f"{c}.qkv", self.qkv_rows, s.dim, self.formats[i])
                out += [BufferNeed.upload(name, array_bytes(shape, dtype)) for name, (shape, dtype) in qkv.items()]
            for key, (shape, dtype) in ({} if "," in self.formats[i] else
                                        packed_shapes(self.formats[i], self.qkv_dim, s.dim)).items():
                out.append(BufferNeed.upload(f"{c}.qkv.{key}", array_bytes(shape, dtype)))
                if self.gated:
                    rows = packed_shapes(self.formats[i], self.q_dim, s.dim)[key]
                    out.append(BufferNeed.upload(f"{c}.gate.{key}", array_bytes(*rows)))
            for key, (shape, dtype) in packed_shapes(self.o_formats[i], s.dim, self.q_dim).items():
                out.append(BufferNeed.upload(f"{c}.o.{key}", array_bytes(shape, dtype)))
            if self.qk_norm:
                out += [BufferNeed.upload(f"{c}.{n}", 2 * s.head_dim) for n in ("q_norm", "k_norm")]
            if self.decode_fused:
                out.append(BufferNeed.upload(f"{c}.decode-rope", self._decode_rope(i).nbytes, "scratch"))
            out += [BufferNeed.buffer(f"{kv}-cache-{i}", self.n_pages * self.page_bytes, "kv") for kv in "kv"]
        out += [BufferNeed.upload("page-table", 4 * self.n_pages, "scratch"),
                BufferNeed.upload("rope-inv-freq", 4 * len(s.inv_freq), "scratch"),
                BufferNeed.buffer("qkv", self.qkv_bytes), BufferNeed.buffer("q-roped", C * self.q_dim * f32),
                BufferNeed.buffer("attn-out", C * self.q_dim * f32)]
        if self.split_fused:  # the split kernel's partial records and its tickets (zero at creation, after each use)
            out += [BufferNeed.buffer("attn-split-part", split_decode_part_bytes(s.n_heads, s.head_dim, MAX_SPLITS)),
                    BufferNeed.buffer("attn-tickets", s.n_heads * 4)]
        else:
            out += [BufferNeed.buffer("attn-part-o", MAX_SPLITS * self.q_dim * f32),
                    BufferNeed.buffer("attn-part-ml", MAX_SPLITS * s.n_heads * 2 * f32)]
        return out

    def _decode_rope(self, layer: int) -> np.ndarray:
        """attention_decode's `inv_freq` binding for a layer: the inverse frequencies, then the q and k norm weights
        as f32 (zeros, never read, without q/k norms)."""
        s, norms = self.spec, getattr(self, "norm_host", {})
        parts = [s.inv_freq.astype(np.float32)]
        for n in ("q_norm", "k_norm"):
            parts.append(np.asarray(norms.get(f"layers.{layer}.{n}", np.zeros(s.head_dim)), np.float32))
        return np.concatenate(parts)

    def shared_needs(self) -> dict[str, int]:
        return {"mixer-out": self.chunk * self.q_dim * 4} if self.gated else {}

    def can_carry_norms(self) -> bool:  # qkv and gate read the normed row; o adds to the residual and writes it
        return all(lin.carries_norm(producer=m == "o") for i in self.layers for m, lin in self.lin[i].items())

    def int8_row_k(self) -> int:
        return max(self.spec.dim, self.q_dim)

    def splits(self, kv_len: int) -> int:
        """Split-K partitions of decode attention over kv_len keys (1: the one-dispatch kernel)."""
        if kv_len <= max(self.single_pass_keys, self.split_keys):
            return 1
        return min(MAX_SPLITS, -(-kv_len // self.split_keys))

    # ---- load --------------------------------------------------------------------------------------------
    def take(self, gpu, name: str, arr: np.ndarray, source: str = "") -> None:
        layer, _, rest = name.removeprefix("layers.").partition(".")
        matrix, _, key = rest.partition(".")
        if matrix == "c_attn":  # per-head [Q | gate] rows ++ K ++ V -> qkv (Q ++ K ++ V) and gate
            qkv, gate = self._split_c_attn(arr)
            for part, rows in (("qkv", qkv), ("gate", gate)):
                label = f"layers.{layer}.{part}.{key}"
                self.w[label] = upload_weight(gpu, label, rows, source=f"{source or name}:{part}")
        else:
            self.w[name] = upload_weight(gpu, name, arr, source=source)
            if matrix in ("q_norm", "k_norm"):  # also a part of the decode kernel's rope binding (built later)
                self.norm_host = getattr(self, "norm_host", {})
                self.norm_host[name] = np.array(arr, np.float32)

    def _split_c_attn(self, arr: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        s = self.spec
        q_rows = 2 * s.n_heads * s.head_dim
        rest = arr.shape[1:]  # [K/8] words, or [groups, 2] affine (scale, bias) pairs
        pairs = arr[:q_rows].reshape(s.n_heads, 2, s.head_dim, *rest)
        qkv = np.concatenate([pairs[:, 0].reshape(s.n_heads * s.head_dim, *rest), arr[q_rows:]])
        return np.ascontiguousarray(qkv), np.ascontiguousarray(pairs[:, 1].reshape(s.n_heads * s.head_dim, *rest))

    # ---- build -------------------------------------------------------------------------------------------
    def build(self, gpu, ws) -> None:
        s = self.spec
        made = {n.label: n.allocate(gpu) for n in self.needs() if n.how != "upload"}
        self.k_cache = {i: made[f"k-cache-{i}"] for i in self.layers}
        self.v_cache = {i: made[f"v-cache-{i}"] for i in self.layers}
        self.page_table = gpu.upload("page-table", np.arange(self.n_pages, dtype=np.uint32))
        self.inv_freq = gpu.upload("rope-inv-freq", s.inv_freq.astype(np.float32))
        self.qkv, self.q, self.attn = made["qkv"], made["q-roped"], made["attn-out"]
        attn = attention_consts(s.n_heads, s.n_kv_heads, s.head_dim, PAGE)
        self.p_attn = gpu.pipeline(ATTENTION, attn)
        if not self.split_fused:  # the three-kernel split-K decode
            self.part_o, self.part_ml = made["attn-part-o"], made["attn-part-ml"]
            self.p_split = gpu.pipeline(ATTENTION, dict(attn, SPLIT=True))
            self.p_combine = gpu.pipeline(COMBINE, combine_consts(s.n_heads, s.head_dim, self.combine_int8))
            self.bg_combine = gpu.bind(self.p_combine, dict(part_o=self.part_o, part_ml=self.part_ml, out=self.attn,
                                                            step=ws.step, xq=ws.x_q8, xm=ws.x_q8_meta), "combine")
        # Prefill chunks: 32 query rows share each staged key block (None: head_dim not a multiple of 32).
        self.tiled = attention_tiled_plan(s.n_heads, s.n_kv_heads, s.head_dim, PAGE)
        # by whether it writes o's int8 rows (the workspace's, as a quantize_q8 before o would) instead of f32 ones
        self.p_tiled = {q8: gpu.pipeline(ATTENTION_TILED, attention_tiled_plan(
            s.n_heads, s.n_kv_heads, s.head_dim, PAGE, rows_q8=q8)) for q8 in set(self.tiled_int8.values())
            } if self.tiled else {}
        self.p_rope = gpu.pipeline(ROPE_APPEND, rope_append_consts(
            s.n_heads, s.n_kv_heads, s.head_dim, s.rot_dim, PAGE, self.qk_norm, s.eps,
            getattr(s, "norm_offset", 0.0), getattr(s, "rope_scale", 1.0)))
        rope = rope_append_consts(s.n_heads, s.n_kv_heads, s.head_dim, s.rot_dim, PAGE, self.qk_norm, s.eps,
                                  getattr(s, "norm_offset", 0.0), getattr(s, "rope_scale", 1.0))
        # "lanes" sizes a lane's chunks for the adapter's probed subgroup size (a smaller one falls back in-kernel)
        lanes = dict(variant=self.decode_variant, subgroup=gpu.subgroup_size if gpu.use_subgroups else LANES_SUBGROUP)
        if self.decode_fused:
            decode = attention_decode_consts(rope, self.gate_offset // 4 if self.gated else None, self.decode_int8,
                                             **lanes)
            self.p_decode = gpu.pipeline(ATTENTION_DECODE, decode)
        if self.split_fused:
            self.p_decode_split = gpu.pipeline(ATTENTION_DECODE_SPLIT, attention_decode_consts(
                rope, self.gate_offset // 4 if self.gated else None, self.decode_int8,
                split_decode_wg(s.head_dim, self.decode_variant), **lanes))
            self.split_part, self.tickets = made["attn-split-part"], made["attn-tickets"]
        if self.gated:
            self.gate = (self.qkv, self.gate_offset, self.chunk * self.q_dim * 4)
            self.gated_out = ws.shared["mixer-out"]
            self.gate_groups = attn_gate_plan(self.q_dim)[1]
            # (pipeline, bind group) by (decode, int8): prefill rows go to the workspace's int8 rows (f32 rows when
            # not), a decode row to its int8 row and f32 (as attention_decode writes them)
            self.gate_steps = {}
            for decode, q8 in {(d, q[d]) for q in self.gate_int8.values() for d in (False, True)}:
                pipe = gpu.pipeline(ATTN_GATE, attn_gate_plan(self.q_dim, rows_q8=q8, rows_f32=decode or not q8)[0])
                rows = (ws.rows_q8, ws.rows_q8_meta) if q8 and not decode else (ws.x_q8, ws.x_q8_meta)
                self.gate_steps[decode, q8] = (pipe, gpu.bind(pipe, dict(
                    x=self.attn, gate=self.gate, y=self.gated_out, step=ws.step, xq=rows[0], xm=rows[1]),
                    f"attn_gate{'_decode' if decode else ''}{'_q8' if q8 else ''}"))
        o_in = self.gated_out if self.gated else self.attn
        self.bg = {}
        self.decode_rope = {i: gpu.upload(f"layers.{i}.decode-rope", self._decode_rope(i))
                            for i in self.layers if self.decode_fused}
        for i in self.layers:
            c, lin, dummy = f"layers.{i}", self.lin[i], ws.dummy_f16
            kc, vc = self.k_cache[i], self.v_cache[i]
            norms = (self.w[f"{c}.q_norm"], self.w[f"{c}.k_norm"]) if self.qk_norm else (dummy, dummy)
            cache = dict(k_cache=kc, v_cache=vc, page_table=self.page_table)
            self.bg[i] = {
                "rope": gpu.bind(self.p_rope, dict(qkv=self.qkv, q_out=self.q, **cache, inv_freq=self.inv_freq,
                                                   step=ws.step, q_norm=norms[0], k_norm=norms[1]), f"{c}.rope_append"),
                # part_ml is never written without SPLIT: any scratch buffer
                "attn": gpu.bind(self.p_attn, dict(q=self.q, **cache, out=self.attn, step=ws.step, part_ml=(
                    self.split_part if self.split_fused else self.part_ml)), f"{c}.attn")}
            if not self.split_fused:
                self.bg[i]["split"] = gpu.bind(self.p_split, dict(
                    q=self.q, **cache, out=self.part_o, part_ml=self.part_ml, step=ws.step), f"{c}.attn_split")
            decode = dict(qkv=self.qkv, **cache, inv_freq=self.decode_rope.get(i), out=o_in, step=ws.step, xq=ws.x_q8,
                          xm=ws.x_q8_meta)
            if self.decode_fused:
                self.bg[i]["decode"] = gpu.bind(self.p_decode, decode, f"{c}.attn_decode")
            if self.split_fused:
                self.bg[i]["decode_split"] = gpu.bind(self.p_decode_split, dict(
                    decode, part=self.split_part, tickets=self.tickets), f"{c}.attn_decode_split")
            if self.tiled:
                rows = (ws.rows_q8, ws.rows_q8_meta) if self.tiled_int8[i] else (ws.x_q8, ws.x_q8_meta)  # else unused
                self.bg[i]["tiled"] = gpu.bind(self.p_tiled[self.tiled_int8[i]], dict(
                    q=self.q, **cache, out=self.attn, step=ws.step, xq=rows[0], xm=rows[1]), f"{c}.attn_tiled")
            fused = self.norms is not None
            lin["qkv"].bind(gpu, ws, ws.hidden, self._matrix(f"{c}.qkv", self.formats[i], dummy), self.qkv,
                            f"{c}.qkv", src_int8=self.ar.norm_int8,
                            rms=self.norms.rms_input() if fused and i > 0 else None)
            if self.gated:
                lin["gate"].bind(gpu, ws, ws.hidden, self._matrix(f"{c}.gate", self.formats[i], dummy), self.gate,
                                 f"{c}.gate", src_int8=self.ar.norm_int8, rows_ready=lin["qkv"].quantizes_rows,
                                 rms=self.norms.rms_input() if fused and i > 0 else None)
            lin["o"].bind(gpu, ws, o_in, self._matrix(f"{c}.o", self.o_formats[i], dummy), ws.delta, f"{c}.o",
                          norm_out=self.norms.epilogue(i, "mixer") if fused else None,
                          rows_ready=self.tiled_int8[i] or self.gated and self.gate_int8[i][0])

    def _matrix(self, name: str, tag: str, dummy) -> dict:
        return matrix_bindings({k.removeprefix(f"{name}."): v for k, v in self.w.items() if k.startswith(name + ".")},
                               tag, dummy)

    # ---- record ------------------------------------------------------------------------------------------
    def record(self, rec, layer: int, T: int, splits: int) -> None:
        s, lin, bg = self.spec, self.lin[layer], self.bg[layer]
        lin["qkv"].record(rec, T)
        if self.gated:
            lin["gate"].record(rec, T)
        if T == 1 and self.decode_fused and (splits == 1 or self.split_fused):  # RoPE, append, attention (and gate)
            if splits == 1:
                rec.dispatch(self.p_decode, bg["decode"], s.n_heads, 1, 1)
            else:  # split-K, combined by each head's last workgroup
                rec.dispatch(self.p_decode_split, bg["decode_split"], s.n_heads, splits, 1)
            lin["o"].record(rec, T, int8_ready=self.decode_int8)
            return
        rec.dispatch(self.p_rope, bg["rope"], T, s.n_heads + 2 * s.n_kv_heads)
        if splits > 1:
            rec.dispatch(self.p_split, bg["split"], s.n_heads, T, splits)
            rec.dispatch(self.p_combine, self.bg_combine, s.n_heads, T)
        elif T > 1 and self.tiled:
            rec.dispatch(self.p_tiled[self.tiled_int8[layer]], bg["tiled"], *attention_tiled_grid(self.tiled, T))
        else:
            rec.dispatch(self.p_attn, bg["attn"], s.n_heads, T, 1)
        if self.gated:  # T == 1 (split-K decode, or heads too wide for the fused kernel) takes o's decode matvec
            decode = T == 1
            q8 = self.gate_int8[layer][decode]
            rec.dispatch(*self.gate_steps[decode, q8], self.gate_groups, T)
            lin["o"].record(rec, T, int8_ready=decode and q8)
            return
        lin["o"].record(rec, T, int8_ready=splits > 1 and self.combine_int8)
