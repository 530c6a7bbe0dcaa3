"""The dense-transformer runtime (Phi-3, Llama, Qwen3): GPU buffers, pipelines, bind groups, forward passes.

Everything that does not change per token is built once here; a token costs one uniform write, one
recorded compute pass and no CPU round trip (the sampled id feeds the next embedding on the GPU).
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Iterator

import numpy as np
import wgpu

from engine.attention import attention_consts, qkv_fused_plan
from engine.errors import ContextLimitError, GpuError, ModelFormatError
from engine.gpu import READBACK, UNIFORM, Gpu, PlanRecorder, Recorder
from engine.matmul import (
    FORMATS,
    embedding_pipeline,
    embedding_plan,
    format_knobs,
    gemm_plan,
    gemm_q8_plan,
    matvec_plan,
    matvec_q8_plan,
    matvec_sg_plan,
    packed_shapes,
    prefers_subgroup_rows,
    quantize_q8_plan,
)
from engine.models.base import DenseSpec
from engine.sampling import GpuArgmax, GpuSampler, SamplingParams

PAGE = 16  # tokens per KV page
Q8_PREFILL_MIN_DIM = 2048  # Phi-3 3072, Qwen3-4B 2560, Qwen3.6 2048; SmolLM2-135M 576
# Rows per prefill chunk: the int8 GEMMs ran a 512-token chunk 2.2× faster per token than four of 128 on the H200
# (Phi-3; 1.9× Qwen3.5-4B): 128 rows leave most of a big GPU idle. Activation buffers hold this many rows.
PREFILL_CHUNK = 512
LOGIT_ROWS = 128  # rows of the all-rows logits buffer (the logits API) at most: 512 × 151,936 vocab would be 311 MB
SPLIT_KEYS = 64  # decode attention splits its keys into blocks of this size (more workgroups in flight)
MAX_SPLITS = 32
RING = 4096  # slots in the GPU ring of sampled token ids


def matrix_dims(spec: DenseSpec) -> dict[str, tuple[int, int]]:
    """Per-layer matrix role -> (rows N, columns K); gate_up holds gate rows then up rows."""
    s = spec
    q_dim, kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
    return {"qkv": (q_dim + 2 * kv_dim, s.dim), "o": (s.dim, q_dim), "gate_up": (2 * s.ffn_dim, s.dim),
            "down": (s.dim, s.ffn_dim)}


def tensor_shapes(spec: DenseSpec, formats: dict[str, str] | None = None) -> dict[str, tuple[tuple[int, ...], str]]:
    """Canonical tensor name -> (shape, dtype) that the runtime expects for `spec`.

    `formats` maps a matrix (embed, lm_head, layers.N.qkv, ...) to its weight format tag (engine/matmul.py
    FORMATS); matrices it leaves out are MLC q4f16_1.
    """
    s, formats = spec, formats or {}
    shapes: dict[str, tuple[tuple[int, ...], str]] = {"norm": ((s.dim,), "float16")}

    def matrix(name, n, k):
        for key, value in packed_shapes(formats.get(name, "q4f16_1"), n, k).items():
            shapes[f"{name}.{key}"] = value

    matrix("embed", s.vocab, s.dim)
    if not s.tied_embeddings:
        matrix("lm_head", s.vocab, s.dim)
    for i in range(s.n_layers):
        c = f"layers.{i}"
        shapes[f"{c}.attn_norm"] = shapes[f"{c}.mlp_norm"] = ((s.dim,), "float16")
        for name, (n, k) in matrix_dims(s).items():
            matrix(f"{c}.{name}", n, k)
        if s.qk_norm:
            shapes[f"{c}.q_norm"] = shapes[f"{c}.k_norm"] = ((s.head_dim,), "float16")
    return shapes


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


class DenseTransformer:
    def __init__(self, gpu: Gpu, spec: DenseSpec, weights: Iterable[tuple[str, np.ndarray]],
                 max_context: int | None = None, prefill_chunk: int = PREFILL_CHUNK,
                 split_keys: int = SPLIT_KEYS,
                 formats: dict[str, str] | None = None, fused_qkv: bool = False, matvec_rows: int | None = None,
                 matvec_sg: bool = True, q8_decode: bool = True, q8_in_norm: bool = True,
                 q8_prefill: bool | None = None, combine_q8: bool = True):
        self.gpu, self.spec = gpu, spec
        # Measured on the H200 (BENCH.md): the QKV matvec + rope_append pair beats the fused QKV+RoPE+append
        # kernel, so the fused one is an option for A/B runs; matvec_rows overrides the tuned default likewise.
        self.fused_qkv, self.matvec_rows = fused_qkv, matvec_rows
        # With f32 activations (formats other than 4-bit, or q8_decode off), many-row matrices (gate_up, the LM head)
        # decode with the subgroup-rows matvec where the GPU has subgroups.
        self.matvec_sg = matvec_sg and gpu.use_subgroups
        # 4-bit decode matvecs take int8 activations (quantize_q8 + matvec_q8): ~3× faster matvecs on the H200
        # for int8 rounding of x, as llama.cpp's GPU decode does; q8_decode=False keeps f32 activations (in prefill
        # too: it is the exact-arithmetic switch).
        self.q8 = q8_decode and gpu.use_subgroups
        # Prefill GEMMs on 4-bit weights take int8 activations too (quantize_q8 over the chunk's rows + matmul_q8),
        # so prefill and decode round alike; q8_prefill=False (or q8_decode=False) keeps the f32 GEMM.
        # By default only for models of dim ≥ Q8_PREFILL_MIN_DIM: int8 rounding of every prefill row costs a small
        # model real accuracy (the 135M demo's first answer token flips) while its GEMMs are too small to matter.
        if q8_prefill is None:
            q8_prefill = spec.dim >= Q8_PREFILL_MIN_DIM
        self.q8_prefill = q8_prefill and self.q8
        # The norms write their output row in int8 too, sparing the matvecs they feed a quantize_q8 dispatch each
        # (q8_in_norm=False dispatches those, for A/B runs).
        self.q8_in_norm = self.q8 and q8_in_norm and spec.dim % 32 == 0 and spec.dim <= 8192  # norm_q8.wgsl's room
        # With int8 decode the split-K combine also writes the o-projection's int8 input, its quantize_q8 skipped
        # (combine_q8=False dispatches it, for A/B runs); each head's 32-element chunks must lie inside the head.
        self.combine_q8 = combine_q8 and self.q8 and spec.head_dim % 32 == 0
        self._plans: dict[tuple, object] = {}  # (attention splits, greedy) -> the decode step's DispatchPlan
        self.formats = formats or {}  # matrix -> weight format tag; absent = q4f16_1
        self.split_keys = split_keys
        self.max_context = min(max_context or spec.context_length, spec.context_length)
        s = spec
        self.q_dim, self.kv_dim = s.n_heads * s.head_dim, s.n_kv_heads * s.head_dim
        self.qkv_dim = self.q_dim + 2 * self.kv_dim
        # Logits for every row (the logits API) must fit one binding.
        self.logit_rows = max(1, min(prefill_chunk, LOGIT_ROWS, gpu.max_binding // (4 * s.vocab)))
        self.chunk = prefill_chunk
        self.w = self._upload_weights(weights)
        self._alloc()
        self._build()
        self.sampler = GpuSampler(gpu, s.vocab, self.logits_buf, self.tokens, self.ring, self.step)
        self.sampling = SamplingParams()  # greedy until set_sampling
        self.n_cached = 0  # tokens whose K/V are in the cache
        self.cached_ids: list[int] = []  # those tokens' ids when known (kept by generation for prefix reuse)
        self.dispatches_per_token = self._count_decode_dispatches()

    # ---- weights -------------------------------------------------------------------------
    def _upload_weights(self, weights) -> dict:
        expected = tensor_shapes(self.spec, self.formats)
        out = {c: self._upload(src, arr, vocab=c.startswith(("embed.", "lm_head.")))
               for src, c, arr in checked_tensors(weights, expected, self.spec.names)}
        require_all(expected, self.spec.names, out)
        return out

    def _upload(self, label: str, arr: np.ndarray, vocab: bool = False):
        """Upload one tensor. Only the vocabulary matrices are bound in parts, so any other tensor must fit one
        binding: caught here, with the numbers, rather than as a validation error when it is bound."""
        if arr.nbytes > self.gpu.max_binding and not vocab:
            raise GpuError(f"tensor {label} is {arr.nbytes:,} bytes, but this GPU binds at most "
                           f"{self.gpu.max_binding:,} (max-storage-buffer-binding-size)")
        return self.gpu.upload(label, arr)

    # ---- buffers ---------------------------------------------------------------------------
    def _alloc(self) -> None:
        self.step = self.gpu.buffer("step", 16, UNIFORM)
        self._alloc_shared(range(self.spec.n_layers))

    def _alloc_shared(self, kv_layers) -> None:
        """What every runtime of this family allocates: paged K/V for `kv_layers`, the token ring, a chunk of
        activations, logits, split-attention partials and the readback staging buffers."""
        g, s, C = self.gpu, self.spec, self.chunk
        f32 = 4
        self.n_pages = -(-self.max_context // PAGE)
        page_bytes = s.n_kv_heads * PAGE * s.head_dim * 2
        self.k_cache = {i: g.buffer(f"k-cache-{i}", self.n_pages * page_bytes) for i in kv_layers}
        self.v_cache = {i: g.buffer(f"v-cache-{i}", self.n_pages * page_bytes) for i in kv_layers}
        self.page_table = g.upload("page-table", np.arange(self.n_pages, dtype=np.uint32))
        self.inv_freq = g.upload("rope-inv-freq", s.inv_freq.astype(np.float32))
        self.tokens = g.buffer("tokens", C * 4)
        self.ring = g.buffer("sampled-ring", RING * 4)
        self.res = [g.buffer("residual-a", C * s.dim * f32), g.buffer("residual-b", C * s.dim * f32)]
        self.hidden = g.buffer("normed-hidden", C * s.dim * f32)
        self.delta = g.buffer("block-out", C * s.dim * f32)
        self.qkv = g.buffer("qkv", C * self.qkv_dim * f32)
        self.q = g.buffer("q-roped", C * self.q_dim * f32)
        self.attn = g.buffer("attn-out", C * self.q_dim * f32)
        self.ffn = g.buffer("ffn-act", C * s.ffn_dim * f32)
        self.logits_buf = g.buffer("logits", self.logit_rows * s.vocab * f32)
        self.part_o = g.buffer("attn-part-o", MAX_SPLITS * self.q_dim * f32)
        self.part_ml = g.buffer("attn-part-ml", MAX_SPLITS * s.n_heads * 2 * f32)
        self.readback = [g.buffer(f"readback-{i}", RING * 4, READBACK) for i in range(2)]

    # ---- pipelines and bind groups (built once) ---------------------------------------------
    def _fmt(self, matrix: str) -> str:
        return self.formats.get(matrix, "q4f16_1")

    def _matrix(self, matrix: str) -> tuple:
        """(weight, scale) buffers for bindings 1-2; f16 weights have no scales, any f16 buffer fills 2."""
        if self._fmt(matrix) == "f16":
            return self.w[f"{matrix}.weight"], self.w["norm"]
        return self.w[f"{matrix}.q_weight"], self.w[f"{matrix}.q_scale"]

    def _mat_pipeline(self, kind: str, role: str, tag: str):
        """Matvec ("mv") or GEMM ("mm") pipeline for a matrix role in a weight format, built once (a matvec's
        fixed grid, which depends on the format too, is kept in self._mv_grids under the same key)."""
        key = f"{kind}_{role}:{tag}"
        if key not in self.p:
            k, n, gu = self.mats[role]
            knobs = format_knobs(tag)
            if kind == "mv":
                shader, consts, self._mv_grids[key] = self._mv_plan(k, n, gu, False, knobs)
            elif self._is_q8_prefill(tag):
                shader, consts = "matmul_q8", gemm_q8_plan(k, n, 1, gate_up=gu, **knobs)[0]
            else:
                shader, consts = "matmul_int4", gemm_plan(k, n, 1, gate_up=gu, **knobs)[0]
            self.p[key] = self.gpu.pipeline(shader, consts)
        return self.p[key]

    def _mv_plan(self, k: int, n: int, gate_up: bool, last_row: bool = False, knobs: dict | None = None):
        """(shader, constants, grid) of a decode matvec in the chosen kernel variant."""
        knobs = knobs or {}
        if self.q8 and knobs.get("bits", 4) == 4:
            consts, grid = matvec_q8_plan(k, n, self.gpu.subgroup_size, gate_up=gate_up, **knobs)
            return "matvec_q8", consts, grid
        if self.matvec_sg and prefers_subgroup_rows(k, n, gate_up):
            consts, grid = matvec_sg_plan(k, n, self.gpu.subgroup_size, gate_up=gate_up, last_row=last_row,
                                          rows=self.matvec_rows, **knobs)
            return "matvec_sg", consts, grid
        consts, grid = matvec_plan(k, n, gate_up=gate_up, last_row=last_row, rows=self.matvec_rows, **knobs)
        return "matvec_int4", consts, grid

    def _is_q8(self, tag: str) -> bool:
        return self.q8 and FORMATS[tag]["bits"] == 4

    def _is_q8_prefill(self, tag: str) -> bool:
        return self.q8_prefill and FORMATS[tag]["bits"] == 4

    def _alloc_q8(self, max_k: int) -> None:
        """One int8 copy of an activation row (+ its chunk scales and sums), rewritten before each q8 matvec; with
        q8 prefill, the int8 copy of a chunk's rows that each int8 GEMM's quantize_q8 rewrites."""
        self.x_q8 = self.gpu.buffer("x-int8", max_k)  # a few KB: allocated whether or not q8 is on
        self.x_q8_meta = self.gpu.buffer("x-int8-scales", max_k // 32 * 8)
        self.q8_out = [self.x_q8, self.x_q8_meta]  # the norms' extra bindings (written only with q8 on)
        if self.q8_prefill:
            self.rows_q8 = self.gpu.buffer("x-int8-rows", self.chunk * max_k)
            self.rows_q8_meta = self.gpu.buffer("x-int8-rows-scales", self.chunk * max_k // 32 * 8)

    def _bind_mv(self, b: dict, name: str, tag: str, src, matrix: list, dst, label: str) -> None:
        """b["mv"][name]: the (pipeline, bind group, grid) dispatches of a decode matvec, in order. A q8 one reading
        the normed hidden row finds it in int8 already (the norms write it); any other q8 one is preceded by the
        quantize_q8 dispatch that fills its int8 input from `src`."""
        pipe = self._mat_pipeline("mv", name, tag)
        grid = self._mv_grids[f"mv_{name}:{tag}"]
        steps = b.setdefault("mv", {})
        if not self._is_q8(tag):
            steps[name] = [(pipe, self.gpu.bind(pipe, [src, *matrix, dst, self.step], label), grid)]
            return
        steps[name] = [(pipe, self.gpu.bind(pipe, [self.x_q8, *matrix, dst, self.x_q8_meta], label), grid)]
        if src is not self.hidden or not self.q8_in_norm:
            steps[name].insert(0, self._quantize(src, self.mats[name][0], False, f"{label}.q8"))

    def _bind_mm(self, b: dict, name: str, tag: str, src, matrix: list, dst, label: str,
                 rows_ready: bool = False) -> None:
        """b["mm"][name]: the (pipeline, bind group, grid key) dispatches of a prefill GEMM, in order: matmul_int4 on
        f32 rows, or quantize_q8 of the chunk's rows then matmul_q8 (4-bit weights with q8 prefill); `rows_ready`:
        the GEMM recorded just before quantized the same rows."""
        pipe = self._mat_pipeline("mm", name, tag)
        k, n, gu = self.mats[name]
        steps = b.setdefault("mm", {})
        if not self._is_q8_prefill(tag):
            steps[name] = [(pipe, self.gpu.bind(pipe, [src, *matrix, dst, self.step], label), ("gemm", k, n, gu))]
            return
        bg = self.gpu.bind(pipe, [self.rows_q8, *matrix, dst, self.rows_q8_meta, self.step], label)
        steps[name] = [(pipe, bg, ("gemm_q8", k, n, gu))]
        if not rows_ready:
            steps[name].insert(0, self._quantize_rows(src, k, f"{label}.q8"))

    def _quantize_rows(self, src, k: int, label: str) -> tuple:
        """quantize_q8 of a prefill chunk's rows of `src` into rows_q8 (its grid key: the grid depends on T)."""
        pipe = self.gpu.pipeline("quantize_q8", quantize_q8_plan(k)[0])
        return pipe, self.gpu.bind(pipe, [src, self.rows_q8, self.rows_q8_meta, self.step], label), ("quantize", k)

    def _quantize(self, src, k: int, last_row: bool, label: str) -> tuple:
        consts, grid = quantize_q8_plan(k, last_row)
        pipe = self.gpu.pipeline("quantize_q8", consts)
        return pipe, self.gpu.bind(pipe, [src, self.x_q8, self.x_q8_meta, self.step], label), grid

    # ---- the vocabulary-sized matrices: embedding and LM head ----------------------------------
    def _vocab_parts(self, matrix: str) -> list[tuple[int, int]]:
        """Row ranges [r0, r0 + n) of the embedding or LM-head matrix that each fit one storage binding: a
        151,936 × 2560 q4 table (Qwen3-4B) is 194 MB, over the 128 MiB some GPUs bind at once."""
        s, tag = self.spec, self._fmt(matrix)
        row_bytes = [int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
                     for shape, dtype in packed_shapes(tag, s.vocab, s.dim).values()] + [4]  # + the logits row
        align = max(256 // math.gcd(256, b) for b in row_bytes)  # every part starts on a 256-byte offset
        rows = self.gpu.max_binding // max(row_bytes) // align * align
        if rows >= s.vocab:
            return [(0, s.vocab)]
        if rows == 0:
            raise GpuError(f"one row of {matrix} needs {max(row_bytes)} bytes; this GPU binds at most "
                           f"{self.gpu.max_binding} (max-storage-buffer-binding-size)")
        return [(r0, min(rows, s.vocab - r0)) for r0 in range(0, s.vocab, rows)]

    def _row_ranges(self, matrix: str, r0: int, n: int) -> list:
        """Bindings 1-2 for rows [r0, r0 + n) of a packed vocabulary matrix, as (buffer, offset, size)."""
        s, tag = self.spec, self._fmt(matrix)
        out = []
        for key, (shape, dtype) in packed_shapes(tag, s.vocab, s.dim).items():
            row = int(np.prod(shape[1:])) * np.dtype(dtype).itemsize
            out.append((self.w[f"{matrix}.{key}"], r0 * row, n * row))
        return out if len(out) == 2 else [out[0], self.w["norm"]]  # f16: binding 2 is bound but never read

    def _build_vocab_ends(self) -> None:
        """Embedding and LM-head pipelines and bind groups, one per binding-sized part of the vocabulary."""
        g, s, st = self.gpu, self.spec, self.step
        parts = self._vocab_parts("embed")
        self.embed_parts = []  # (pipeline, bind group, x groups)
        for r0, n in parts:
            consts, overrides, (groups, _) = embedding_plan(s.dim, s.vocab, **format_knobs(self._fmt("embed")))
            if len(parts) > 1:
                overrides = {**overrides, "ROW0": r0, "NROWS": n}
            pipe = embedding_pipeline(g, consts, overrides)
            whole = len(parts) == 1
            table = self._matrix("embed") if whole else self._row_ranges("embed", r0, n)
            self.embed_parts.append((pipe, g.bind(pipe, [self.tokens, *table, self.res[0], st], f"embed-{r0}"),
                                     groups))
        lm = "embed" if s.tied_embeddings else "lm_head"
        knobs = format_knobs(self._fmt(lm))
        self.lm_parts: dict[str, list] = {"mv": [], "mm": []}  # (pipeline, bind group, grid or grid key)
        parts = self._vocab_parts(lm)
        q8 = self._is_q8(self._fmt(lm))  # its int8 input: the final norm's last row, or
        apart = q8 and not self.q8_in_norm
        self.lm_quantize = self._quantize(self.hidden, s.dim, True, "lm-head.q8") if apart else None
        q8_all = self._is_q8_prefill(self._fmt(lm))  # the all-rows GEMM: one quantize_q8 of hidden for every part
        if q8_all:
            self.lm_parts["mm"].append(self._quantize_rows(self.hidden, s.dim, "lm-head-all.q8"))
        for r0, n in parts:
            whole = len(parts) == 1
            table = self._matrix(lm) if whole else self._row_ranges(lm, r0, n)
            y = self.logits_buf if whole else (self.logits_buf, 4 * r0, self.logits_buf.size - 4 * r0)
            shader, consts, grid = self._mv_plan(s.dim, n, False, True, knobs)
            pipe = g.pipeline(shader, consts)
            ins = [self.x_q8, *table, y, self.x_q8_meta] if q8 else [self.hidden, *table, y, st]
            self.lm_parts["mv"].append((pipe, g.bind(pipe, ins, f"lm-head-{r0}"), grid))
            if q8_all:
                pipe = g.pipeline("matmul_q8", gemm_q8_plan(s.dim, n, 1, y_stride=s.vocab, **knobs)[0])
                ins, key = [self.rows_q8, *table, y, self.rows_q8_meta, st], ("gemm_q8", s.dim, n, False)
            else:
                pipe = g.pipeline("matmul_int4", gemm_plan(s.dim, n, 1, y_stride=s.vocab, **knobs)[0])
                ins, key = [self.hidden, *table, y, st], ("gemm", s.dim, n, False)
            self.lm_parts["mm"].append((pipe, g.bind(pipe, ins, f"lm-head-all-{r0}"), key))

    def _record_embed(self, rec: Recorder, T: int) -> None:
        for pipe, bg, groups in self.embed_parts:
            rec.dispatch(pipe, bg, groups, T)

    def _record_lm(self, rec: Recorder, T: int) -> None:
        """Logits of the last row (T == 1 or sampling: the decode matvec) or of all T rows (the GEMM)."""
        if T == 1:
            if self.lm_quantize:
                rec.dispatch(self.lm_quantize[0], self.lm_quantize[1], *self.lm_quantize[2])
            for pipe, bg, grid in self.lm_parts["mv"]:
                rec.dispatch(pipe, bg, *grid)
        else:
            for pipe, bg, key in self.lm_parts["mm"]:
                rec.dispatch(pipe, bg, *self._prefill_grid(key, T))

    # ---- pipelines and bind groups (built once) ---------------------------------------------
    def _build(self) -> None:
        g, s, w = self.gpu, self.spec, self.w
        self.p: dict[str, object] = {}
        self.bg: dict[str, object] = {}
        self._gemm_grids: dict[tuple, tuple] = {}  # prefill grids (GEMMs and their quantize_q8) per (key, T)
        self._mv_grids: dict[str, tuple] = {}
        st = self.step
        self.p["norm0"] = g.pipeline("rms_norm", dict(WG=256, D=s.dim, EPS=float(s.eps), Q8=self.q8_in_norm))
        self.p["add_norm"] = g.pipeline("add_rms_norm", dict(WG=256, D=s.dim, EPS=float(s.eps), Q8=self.q8_in_norm))
        rope = dict(WG=64, H=s.n_heads, KVH=s.n_kv_heads, HD=s.head_dim, ROT=s.rot_dim, PAGE=PAGE,
                    QK_NORM=s.qk_norm, EPS=float(s.eps))
        self._attention_pipelines()
        self.p["rope_append"] = _rope_pipeline(g, "rope_append", rope, s.rope_scale)
        qkv_consts, self.qkv_fused_grid = qkv_fused_plan(s.dim, rope) if self.fused_qkv else (None, None)

        # role -> (K, N, gate_up); N counts outputs (gate_up's weight has 2N rows)
        self.mats = {}
        for name, (n, k) in matrix_dims(s).items():
            self.mats[name] = (k, n // 2, True) if name == "gate_up" else (k, n, False)

        bind = g.bind
        self._alloc_q8(max([s.dim] + [k for k, _, _ in self.mats.values()]))
        self._build_vocab_ends()
        self._bind_shared()
        ins = {"qkv": self.hidden, "o": self.attn, "gate_up": self.hidden, "down": self.ffn}
        outs = {"qkv": self.qkv, "o": self.delta, "gate_up": self.ffn, "down": self.delta}
        self.layer_bg = []
        for i in range(s.n_layers):
            c, b = f"layers.{i}", {}
            kc, vc = self.k_cache[i], self.v_cache[i]
            for name in matrix_dims(s):
                tag = self._fmt(f"{c}.{name}")
                self._bind_mv(b, name, tag, ins[name], self._matrix(f"{c}.{name}"), outs[name], f"{c}.mv_{name}")
                self._bind_mm(b, name, tag, ins[name], self._matrix(f"{c}.{name}"), outs[name], f"{c}.mm_{name}")
            # The fused decode kernel reads q4f16_1 only and cannot see whole heads for q/k norms.
            if self.fused_qkv and self._fmt(f"{c}.qkv") == "q4f16_1" and not s.qk_norm:
                if "qkv_fused" not in self.p:
                    self.p["qkv_fused"] = _rope_pipeline(g, "qkv_rope_append", qkv_consts, s.rope_scale)
                b["qkv_fused"] = bind(self.p["qkv_fused"], [self.hidden, *self._matrix(f"{c}.qkv"), self.q, kc, vc,
                                                             self.page_table, self.inv_freq, st], f"{c}.qkv_fused")
            # Without q/k norms the kernel ignores bindings 7-8; any f16 buffer fills them.
            qn, kn = (w[f"{c}.q_norm"], w[f"{c}.k_norm"]) if s.qk_norm else (w["norm"], w["norm"])
            b["rope_append"] = bind(self.p["rope_append"], [self.qkv, self.q, kc, vc, self.page_table,
                                                             self.inv_freq, st, qn, kn], f"{c}.rope_append")
            b["attn"] = bind(self.p["attn"], [self.q, kc, vc, self.page_table, self.attn, self.part_ml, st],
                             f"{c}.attn")
            b["attn_split"] = bind(self.p["attn_split"], [self.q, kc, vc, self.page_table, self.part_o,
                                                           self.part_ml, st], f"{c}.attn_split")
            next_norm = w[f"layers.{i + 1}.attn_norm"] if i + 1 < s.n_layers else w["norm"]
            b["add_norm1"] = bind(self.p["add_norm"], [self.res[0], self.delta, w[f"{c}.mlp_norm"], self.res[1],
                                                        self.hidden, st, *self.q8_out], f"{c}.add_norm1")
            b["add_norm2"] = bind(self.p["add_norm"], [self.res[1], self.delta, next_norm, self.res[0],
                                                        self.hidden, st, *self.q8_out], f"{c}.add_norm2")
            self.layer_bg.append(b)

    def _attention_pipelines(self) -> None:
        """Paged attention (whole, and split-K with its combine): the same for every runtime of this family."""
        s, g = self.spec, self.gpu
        attn = attention_consts(s.n_heads, s.n_kv_heads, s.head_dim, PAGE)
        self.p["attn"] = g.pipeline("attention", dict(attn, SPLIT=False))
        self.p["attn_split"] = g.pipeline("attention", dict(attn, SPLIT=True))
        self.p["combine"] = g.pipeline("attention_combine",
                                       dict(WG=64, H=s.n_heads, HD=s.head_dim, Q8=self.combine_q8))

    def _bind_shared(self) -> None:
        """The bind groups outside the layers: the first norm, the split-K combine, and greedy sampling."""
        g, st = self.gpu, self.step
        self.bg["norm0"] = g.bind(self.p["norm0"], [self.res[0], self.w["layers.0.attn_norm"], self.hidden, st,
                                                    *self.q8_out], "norm0")
        self.bg["combine"] = g.bind(self.p["combine"], [self.part_o, self.part_ml, self.attn, st, *self.q8_out],
                                    "combine")
        self.argmax = GpuArgmax(g, self.spec.vocab, self.logits_buf, self.tokens, self.ring, st)

    # ---- recording -------------------------------------------------------------------------
    def _splits(self, kv_len: int) -> int:
        return 1 if kv_len <= self.split_keys else min(MAX_SPLITS, -(-kv_len // self.split_keys))

    def _record_body(self, rec: Recorder, T: int, splits: int) -> None:
        """Embedding through the final norm for T rows; T == 1 takes the decode kernels."""
        s, p = self.spec, self.p
        decode = T == 1
        self._record_embed(rec, T)
        rec.dispatch(p["norm0"], self.bg["norm0"], T)
        for b in self.layer_bg:
            if decode and "qkv_fused" in b:
                rec.dispatch(p["qkv_fused"], b["qkv_fused"], *self.qkv_fused_grid)
            else:
                self._mm(rec, b, "qkv", T)
                rec.dispatch(p["rope_append"], b["rope_append"], T, s.n_heads + 2 * s.n_kv_heads)
            self._record_attention(rec, b, T, splits)
            self._mm(rec, b, "o", T, int8_ready=splits > 1 and self.combine_q8)
            rec.dispatch(p["add_norm"], b["add_norm1"], T)
            self._mm(rec, b, "gate_up", T)
            self._mm(rec, b, "down", T)
            rec.dispatch(p["add_norm"], b["add_norm2"], T)

    def _mm(self, rec: Recorder, b: dict, name: str, T: int, int8_ready: bool = False) -> None:
        """A matrix product; a q8 decode matvec not fed by a norm, and a q8 prefill GEMM, first quantize the input
        (unless `int8_ready`: the kernel before it wrote the int8 row, as the split-K combine does for o)."""
        if T == 1:
            steps = b["mv"][name]
            for pipe, bg, grid in steps[1:] if int8_ready and len(steps) > 1 else steps:
                rec.dispatch(pipe, bg, *grid)
        else:
            for pipe, bg, key in b["mm"][name]:
                rec.dispatch(pipe, bg, *self._prefill_grid(key, T))

    def _prefill_grid(self, key: tuple, T: int) -> tuple:
        """The grid of a prefill dispatch (key: ("gemm" | "gemm_q8", K, N, gate_up) or ("quantize", K)), planned once
        per (key, chunk length) instead of on every dispatch."""
        if (key, T) not in self._gemm_grids:
            kind, k, *shape = key
            if kind == "quantize":
                grid = quantize_q8_plan(k, rows=T)[1]
            else:
                plan = gemm_q8_plan if kind == "gemm_q8" else gemm_plan
                grid = plan(k, shape[0], T, gate_up=shape[1])[1]
            self._gemm_grids[key, T] = grid
        return self._gemm_grids[key, T]

    def _record_attention(self, rec: Recorder, b: dict, T: int, splits: int) -> None:
        """Paged attention over the cache; past SPLIT_KEYS keys decode splits them and combines the parts."""
        s, p = self.spec, self.p
        if splits > 1:
            rec.dispatch(p["attn_split"], b["attn_split"], s.n_heads, T, splits)
            rec.dispatch(p["combine"], self.bg["combine"], s.n_heads, T)
        else:
            rec.dispatch(p["attn"], b["attn"], s.n_heads, T, 1)

    def _record_sample(self, rec: Recorder) -> None:
        """LM head on the last row, then the next token into tokens[0] and ring[out_index]."""
        self._record_lm(rec, 1)
        if self._greedy:
            self.argmax.record(rec)
        else:
            self.sampler.record(rec)

    def _record_decode_token(self, rec: Recorder, splits: int) -> None:
        """One decode step. Its dispatches are the same token after token for a split count and sampling mode, so
        they are captured once and replayed: ~0.5 µs of host time a dispatch instead of the recording logic's
        (ZEROTVM_DECODE_PLANS=0 records every token afresh, for A/B runs)."""
        if os.environ.get("ZEROTVM_DECODE_PLANS", "1") == "0":
            self._record_token_body(rec, splits)
            self._record_sample(rec)
            return
        rec.replay(self._decode_plan(splits))

    def _decode_plan(self, splits: int):
        key = (splits, self._greedy)
        if key not in self._plans:
            cap = PlanRecorder()
            self._record_token_body(cap, splits)
            self._record_sample(cap)
            self._plans[key] = cap.plan()
        return self._plans[key]

    def _record_token_body(self, rec, splits: int) -> None:
        """What a decode plan captures before sampling (the hybrid leaves out its per-position state snapshot)."""
        self._record_body(rec, 1, splits)

    def _write_step(self, T: int, pos0: int, out_index: int, splits: int) -> None:
        self.gpu.write(self.step, np.array([T, pos0, out_index, splits], np.uint32))

    def _check_room(self, n: int) -> None:
        if self.n_cached + n > self.max_context:
            raise ContextLimitError(self.n_cached + n, self.max_context)

    # ---- public API --------------------------------------------------------------------------
    def set_sampling(self, params: SamplingParams) -> None:
        """How prefill and decode pick tokens: plain argmax when greedy without a penalty, else the sampler."""
        self.sampling = params
        self.sampler.set_params(params)

    @property
    def _greedy(self) -> bool:
        return self.sampling.temperature == 0 and self.sampling.repetition_penalty == 1.0

    def reset(self) -> None:
        self.n_cached = 0
        self.cached_ids = []

    def truncate(self, n: int) -> None:
        """Roll the cache back to its first n tokens (later entries are simply overwritten)."""
        self.n_cached = min(self.n_cached, max(0, n))
        self.cached_ids = self.cached_ids[: self.n_cached]

    def logits(self, ids, chunk: int | None = None) -> np.ndarray:
        """Teacher-forced f32 logits [T, vocab] for `ids`, appended after the cached tokens."""
        ids = np.asarray(ids, np.uint32)
        chunk = min(chunk or self.logit_rows, self.logit_rows, self.chunk)
        out = []
        for start in range(0, len(ids), chunk):
            part = ids[start:start + chunk]
            out.append(self._forward(part, "logits"))
        return np.concatenate(out) if out else np.zeros((0, self.spec.vocab), np.float32)

    def _forward(self, ids: np.ndarray, then: str, out_index: int = 0) -> np.ndarray | None:
        """One pass over `ids`; `then` is "logits" (every row's), "sample" (the next token) or "none"."""
        T = len(ids)
        self._check_room(T)
        pos0 = self.n_cached
        splits = self._splits(pos0 + T) if T == 1 else 1
        self._write_step(T, pos0, out_index, splits)
        self.gpu.write(self.tokens, ids)
        rec = Recorder(self.gpu, "forward")
        self._record_body(rec, T, splits)
        s = self.spec
        if then == "logits":
            self._record_lm(rec, T)
        elif then == "sample":
            self._record_sample(rec)
        rec.submit()
        if len(self.cached_ids) == self.n_cached:
            self.cached_ids += ids.tolist()
        self.n_cached += T
        if then == "logits":
            return self.gpu.read(self.logits_buf, np.float32, T * s.vocab).reshape(T, s.vocab)
        return None

    def prefill(self, ids, out_index: int = 0) -> None:
        """Absorb `ids` into the cache in chunks; the last chunk samples the next token on the GPU."""
        ids = np.asarray(ids, np.uint32)
        if len(ids) == 0:
            raise ValueError("prefill needs at least one token")
        self._check_room(len(ids))
        starts = range(0, len(ids), self.chunk)
        for start in starts:
            last = start == starts[-1]
            if last and not self._greedy:
                # Only the sampling forward updates the penalty window; bring it up to the cache first.
                self.sampler.set_history(self.cached_ids[: self.n_cached])
            self._forward(ids[start:start + self.chunk], "sample" if last else "none", out_index)

    def read_sampled(self, index: int) -> int:
        """Blocking read of one sampled token id from the ring (used for the first token)."""
        return int(self.gpu.read(self.ring, np.uint32, 1, offset=index * 4)[0])

    def decode(self, last_index: int, count: int, batch: int = 8) -> Iterator[list[int]]:
        """Decode up to `count` tokens after the one sampled into ring[last_index]; yields batches.

        Tokens stay on the GPU (each step's sampled id feeds the next embedding). Each batch is copied to a
        staging buffer that is mapped only once the next batch is queued, so the GPU never idles on a
        readback. Closing the generator stops early; the caller then truncates the cache to what it keeps.
        """
        g = self.gpu
        pending: list[tuple[object, int]] = []  # (staging buffer, n tokens)
        free = list(self.readback)
        idx, remaining = last_index, count
        try:
            while remaining > 0 or pending:
                if remaining > 0 and free:
                    first = (idx + 1) % RING
                    n = min(batch, remaining, RING - first)  # a batch never wraps around the ring
                    self._check_room(n)
                    buf = free.pop()
                    for j in range(n):
                        splits = self._splits(self.n_cached + 1)
                        self._write_step(1, self.n_cached, first + j, splits)
                        rec = Recorder(g, "decode")
                        self._record_decode_token(rec, splits)
                        if j == n - 1:
                            rec.copy(self.ring, first * 4, buf, 0, n * 4)
                        rec.submit()
                        self.n_cached += 1
                    pending.append((buf, n))
                    idx, remaining = (idx + n) % RING, remaining - n
                    if len(pending) < 2 and remaining > 0:
                        continue  # keep one more batch queued before blocking on a readback
                buf, n = pending.pop(0)
                buf.map_sync(mode=wgpu.MapMode.READ)
                got = np.frombuffer(buf.read_mapped(0, n * 4), np.uint32).tolist()
                buf.unmap()
                free.append(buf)
                yield got
        finally:
            for buf, _ in pending:  # drain work still in flight so buffers are reusable
                buf.map_sync(mode=wgpu.MapMode.READ)
                buf.unmap()

    @staticmethod
    def _quantize_dispatches(b: dict, skip: tuple = ()) -> int:
        """quantize_q8 dispatches a layer's decode matvecs add (matrices in `skip` are not recorded)."""
        return sum(len(steps) - 1 for name, steps in b["mv"].items() if name not in skip)

    def _count_decode_dispatches(self) -> int:
        """Dispatches in one greedy decode step without split attention (the sampler adds one); q8 matvecs not
        fed by a norm add their quantize_q8."""
        per_layer = sum(7 + self._quantize_dispatches(b, ("qkv",)) if "qkv_fused" in b  # the fused QKV reads f32
                        else 8 + self._quantize_dispatches(b) for b in self.layer_bg)
        return 2 + per_layer + 1 + len(self.argmax.steps) + bool(self.lm_quantize)


def _rope_pipeline(gpu: Gpu, shader: str, consts: dict, rope_scale: float):
    """A RoPE kernel's pipeline, with the ROPE_SCALE override (shaders/rope.wgsl) when the model scales cos/sin."""
    if rope_scale == 1.0:
        return gpu.pipeline(shader, consts)
    from engine.hybrid import pipeline  # the override-constant builder (hybrid imports this module at load)

    return pipeline(gpu, shader, consts, {"ROPE_SCALE": rope_scale})
