"""The vocabulary ends: the embedding (token ids → the residual stream) and the LM head (the final norm's rows →
logits). Both tables may exceed one storage binding (Qwen3-4B's q4 table is 194 MB; some GPUs bind 128 MiB): they are
then bound in row parts, each on a 256-byte offset, the embedding running once per part and the LM head writing
each part's columns of the full logits. The LM head runs on the last row in decode (a matvec) or on every row (a GEMM,
for the logits API)."""

from __future__ import annotations

import math

import numpy as np

from engine.blocks import Block, BufferNeed, array_bytes, upload_weight
from engine.blocks.linear import (
    Arithmetic,
    decode_kernel,
    gemm_kernel,
    gemm_rows_out,
    matrix_bindings,
    matrix_tensors,
)
from engine.errors import GpuError
from engine.kernels.matmul import (
    EMBEDDING,
    QUANTIZE_Q8,
    embedding_plan,
    format_knobs,
    packed_shapes,
    quantize_q8_plan,
)
from engine.kquant_plan import EMBEDDING_KQ, embedding_kq_plan, is_kquant

LOGIT_ROWS = 128  # rows of the all-rows logits buffer (the logits API) at most: 512 × 151,936 vocab would be 311 MB


class VocabEnds(Block):
    name = "vocab"

    def __init__(self, dim: int, vocab: int, tied: bool, formats: dict[str, str], ar: Arithmetic, chunk: int,
                 max_binding: int | None):
        self.dim, self.vocab, self.tied, self.ar = dim, vocab, tied, ar
        self.max_binding = max_binding
        self.lm = "embed" if tied else "lm_head"
        self.formats = {m: formats.get(m, "q4f16_1") for m in ("embed", self.lm)}
        # Logits for every row (the logits API) must fit one binding.
        fit = max_binding // (4 * vocab) if max_binding else chunk
        self.logit_rows = max(1, min(chunk, LOGIT_ROWS, fit))
        self.parts = {m: self._parts(m) for m in self.formats}
        self.w: dict[str, object] = {}

    def _parts(self, matrix: str) -> list[tuple[int, int]]:
        """Row ranges [r0, r0 + n) of the matrix that each fit one storage binding."""
        shapes = packed_shapes(self.formats[matrix], self.vocab, self.dim).values()
        row_bytes = [array_bytes(shape[1:], dtype) for shape, dtype in shapes] + [4]  # + the logits row
        if self.max_binding is None:
            return [(0, self.vocab)]
        align = max(256 // math.gcd(256, b) for b in row_bytes)  # every part starts on a 256-byte offset
        rows = self.max_binding // max(row_bytes) // align * align
        if rows >= self.vocab:
            return [(0, self.vocab)]
        if rows == 0:
            raise GpuError(f"one row of {matrix} needs {max(row_bytes)} bytes; this GPU binds at most "
                           f"{self.max_binding} (max-storage-buffer-binding-size)")
        return [(r0, min(rows, self.vocab - r0)) for r0 in range(0, self.vocab, rows)]

    # ---- plan --------------------------------------------------------------------------------------------
    def tensors(self) -> dict:
        out = {}
        for m in self.formats:
            out |= matrix_tensors(m, self.vocab, self.dim, self.formats[m])
        return out

    def needs(self) -> list[BufferNeed]:
        out = [BufferNeed.upload(name, array_bytes(*shape)) for name, shape in self.tensors().items()]
        return out + [BufferNeed.buffer("logits", self.logit_rows * self.vocab * 4)]

    def int8_row_k(self) -> int:
        return self.dim

    def int8_formats(self) -> set[str]:  # the LM head's (the embedding reads no activations)
        tag = self.formats[self.lm]
        return {tag} if self.ar.is_int8(tag) or self.ar.is_int8_prefill(tag) else set()

    # ---- load --------------------------------------------------------------------------------------------
    def take(self, gpu, name: str, arr: np.ndarray, source: str = "") -> None:
        self.w[name] = upload_weight(gpu, name, arr, parts_ok=True, source=source)

    # ---- build -------------------------------------------------------------------------------------------
    def _tables(self, matrix: str, r0: int, n: int, dummy) -> dict:
        """Bindings w, s for rows [r0, r0 + n) of a vocabulary matrix (the whole buffers for a single part)."""
        tag = self.formats[matrix]
        arrays = {k.removeprefix(f"{matrix}."): v for k, v in self.w.items() if k.startswith(f"{matrix}.")}
        if len(self.parts[matrix]) == 1:
            return matrix_bindings(arrays, tag, dummy)
        ranges = {}
        for key, (shape, dtype) in packed_shapes(tag, self.vocab, self.dim).items():
            row = array_bytes(shape[1:], dtype)
            ranges[key] = (arrays[key], r0 * row, n * row)
        return matrix_bindings(ranges, tag, dummy)

    def build(self, gpu, ws) -> None:
        self.logits = BufferNeed.buffer("logits", self.logit_rows * self.vocab * 4).allocate(gpu)
        dummy, ar, st = ws.dummy_f16, self.ar, ws.step
        parts = self.parts["embed"]
        self.embed_parts = []  # (pipeline, bind group, x groups)
        etag = self.formats["embed"]
        for r0, n in parts:
            split = len(parts) > 1
            t = self._tables("embed", r0, n, dummy)
            if is_kquant(etag):  # GGUF blocks as stored
                consts, (groups, _) = embedding_kq_plan(etag, self.dim, self.vocab, row0=r0, nrows=n if split else 0)
                pipe = gpu.pipeline(EMBEDDING_KQ, consts)
                tables = dict(w=t["w"], wh=t["wh"])
            else:
                consts, (groups, _) = embedding_plan(self.dim, self.vocab, **(dict(row0=r0, n_rows=n) if split else {}),
                                                     **format_knobs(etag))
                pipe = gpu.pipeline(EMBEDDING, consts)
                tables = dict(q_weight=t["w"], q_scale=t["s"])
            self.embed_parts.append((pipe, gpu.bind(pipe, dict(tokens=ws.tokens, **tables, x=ws.res[0], step=st),
                                                    f"embed-{r0}"), groups))
        tag, lm = self.formats[self.lm], self.lm
        int8, int8_all = ar.is_int8(tag), ar.is_int8_prefill(tag)
        # The last row's int8 copy: the final norm's, or a quantize_q8 of its own
        self.lm_quantize = None
        if int8 and not ar.norm_int8:
            consts, grid = quantize_q8_plan(self.dim, last_row=True)
            pipe = gpu.pipeline(QUANTIZE_Q8, consts)
            self.lm_quantize = (pipe, gpu.bind(pipe, dict(x=ws.hidden, xq=ws.x_q8, xm=ws.x_q8_meta, step=st),
                                               "lm-head.q8"), grid)
        self.lm_decode, self.lm_prefill = [], []  # (pipeline, bind group, grid) / (pipeline, bind group, kind, N)
        if int8_all:  # the all-rows GEMM: one quantize_q8 of hidden's rows for every part
            pipe = gpu.pipeline(QUANTIZE_Q8, quantize_q8_plan(self.dim)[0])
            self.lm_prefill.append((pipe, gpu.bind(pipe, dict(x=ws.hidden, xq=ws.rows_q8, xm=ws.rows_q8_meta,
                                                              step=st), "lm-head-all.q8"), "quantize", 0))
        whole = len(self.parts[lm]) == 1
        for r0, n in self.parts[lm]:
            table = self._tables(lm, r0, n, dummy)
            y = self.logits if whole else (self.logits, 4 * r0, self.logits.size - 4 * r0)
            kernel, consts, grid = decode_kernel(self.dim, n, False, tag, ar, last_row=True)
            pipe = gpu.pipeline(kernel, consts)
            ins = dict(xq=ws.x_q8, xm=ws.x_q8_meta) if int8 else dict(x=ws.hidden, step=st)
            self.lm_decode.append((pipe, gpu.bind(pipe, dict(**ins, **table, y=y), f"lm-head-{r0}"), grid))
            kernel, consts, _ = gemm_kernel(self.dim, n, False, tag, int8_all, y_stride=self.vocab)
            pipe = gpu.pipeline(kernel, consts)
            if int8_all:
                ins = dict(xq=ws.rows_q8, xm=ws.rows_q8_meta, step=st, **gemm_rows_out(ws))
            else:
                ins = dict(x=ws.hidden, step=st)
            self.lm_prefill.append((pipe, gpu.bind(pipe, dict(**ins, **table, y=y), f"lm-head-all-{r0}"),
                                    "gemm_q8" if int8_all else "gemm", n))
        self._grids: dict[tuple, tuple] = {}

    # ---- record ------------------------------------------------------------------------------------------
    def record_embed(self, rec, T: int) -> None:
        for pipe, bg, groups in self.embed_parts:
            rec.dispatch(pipe, bg, groups, T)

    def record_head(self, rec, T: int) -> None:
        """Logits of the last row (T == 1: the decode matvec) or of all T rows (the GEMM)."""
        if T == 1:
            if self.lm_quantize:
                rec.dispatch(self.lm_quantize[0], self.lm_quantize[1], *self.lm_quantize[2])
            for pipe, bg, grid in self.lm_decode:
                rec.dispatch(pipe, bg, *grid)
            return
        for pipe, bg, kind, n in self.lm_prefill:
            rec.dispatch(pipe, bg, *self._grid(kind, n, T))

    def _grid(self, kind: str, n: int, T: int) -> tuple:
        if (kind, n, T) not in self._grids:
            if kind == "quantize":
                grid = quantize_q8_plan(self.dim, rows=T)[1]
            else:
                grid = gemm_kernel(self.dim, n, False, self.formats[self.lm], kind == "gemm_q8", T)[2]
            self._grids[kind, n, T] = grid
        return self._grids[kind, n, T]

    def record(self, rec, layer: int, T: int, splits: int = 1) -> None:
        """A decode token's two ends: the embedding and the last row's logits."""
        self.record_embed(rec, T)
        self.record_head(rec, T)
