"""The dense feed-forward block: gate_up (gate rows then up rows, one matrix) with SiLU(gate)·up fused into its
product, then down. In decode a quantize_q8 dispatch writes down's int8 input (with RuntimeOptions.gate_up_q8, an
A/B measured slower, gate_up writes it itself where the matvecs carry the norms: matvec_q8_rms_q8); with int8 prefill
GEMMs on both (and the arithmetic's int8_epilogues) the gate_up GEMM writes SiLU(gate)·up's rows in int8 into buffers
of their own, which down's GEMM reads."""

from __future__ import annotations

import numpy as np

from engine.blocks import Block, BufferNeed, array_bytes, upload_weight
from engine.blocks.linear import Arithmetic, Linear, gemm_can_write_rows_q8, matrix_bindings, matrix_tensors
from engine.kernels.matmul import packed_shapes


class DenseMlp(Block):
    name = "mlp"
    norm_producer = "down"

    def __init__(self, dim: int, ffn_dim: int, layers: tuple[int, ...], formats: dict[str, str], ar: Arithmetic,
                 chunk: int, gate_up_int8: bool = False):
        """`gate_up_int8`: gate_up writes down's int8 input where it can (RuntimeOptions.gate_up_q8; False: the
        quantize_q8 dispatch, for A/B)."""
        self.dim, self.ffn_dim, self.layers, self.ar, self.chunk = dim, ffn_dim, tuple(layers), ar, chunk
        self.gate_up_int8 = gate_up_int8
        self.norms = None  # the residual block when down carries the add + norm after it and gate_up reads that row
        self.formats = {(i, m): formats.get(f"layers.{i}.{m}", "q4f16_1") for i in self.layers for m in ("gate_up",
                                                                                                           "down")}
        # gate_up's own buffers for its int8 rows: the GEMM reads the workspace's rows (hidden's) as it writes these
        self.rows_q8 = {i: ar.int8_epilogues and ar.is_int8_prefill(self.formats[i, "gate_up"])
                        and ar.is_int8_prefill(self.formats[i, "down"])
                        and gemm_can_write_rows_q8(dim, ffn_dim, self.formats[i, "gate_up"]) for i in self.layers}
        self.lin = {i: {"gate_up": Linear(dim, ffn_dim, self.formats[i, "gate_up"], ar, gate_up=True,
                                          rows_q8_out=self.rows_q8[i]),
                        "down": Linear(ffn_dim, dim, self.formats[i, "down"], ar)} for i in self.layers}
        self.w: dict[str, object] = {}

    def _shapes(self) -> dict:
        return {"gate_up": (2 * self.ffn_dim, self.dim), "down": (self.dim, self.ffn_dim)}

    def tensors(self) -> dict:
        out = {}
        for i in self.layers:
            for m, (n, k) in self._shapes().items():
                out |= matrix_tensors(f"layers.{i}.{m}", n, k, self.formats[i, m])
        return out

    def needs(self) -> list[BufferNeed]:
        return [BufferNeed.upload(f"layers.{i}.{m}.{key}", array_bytes(shape, dtype))
                for i in self.layers for m, (n, k) in self._shapes().items()
                for key, (shape, dtype) in packed_shapes(self.formats[i, m], n, k).items()]

    def shared_needs(self) -> dict[str, int]:
        out = {"ffn-act": self.chunk * self.ffn_dim * 4}
        if any(self.rows_q8.values()):
            out |= {"ffn-act-int8": self.chunk * self.ffn_dim, "ffn-act-int8-scales": self.chunk * self.ffn_dim // 4}
        return out

    def can_carry_norms(self) -> bool:  # gate_up reads the normed row; down adds to the residual and writes it
        return all(lin.carries_norm(producer=m == "down") for i in self.layers for m, lin in self.lin[i].items())

    def int8_row_k(self) -> int:
        return max(self.dim, self.ffn_dim)

    def take(self, gpu, name: str, arr: np.ndarray, source: str = "") -> None:
        self.w[name] = upload_weight(gpu, name, arr, source=source)

    def build(self, gpu, ws) -> None:
        act = ws.shared["ffn-act"]
        for i in self.layers:
            c, lin = f"layers.{i}", self.lin[i]
            matrix = {m: matrix_bindings({k.removeprefix(f"{c}.{m}."): v for k, v in self.w.items()
                                          if k.startswith(f"{c}.{m}.")}, self.formats[i, m], ws.dummy_f16)
                      for m in ("gate_up", "down")}
            fused = self.norms is not None
            last = fused and i == self.norms.n_layers - 1  # the last add + norm (the final norm) stays a dispatch
            int8_out = fused and self.gate_up_int8 and lin["gate_up"].writes_int8()
            rows = (ws.shared["ffn-act-int8"], ws.shared["ffn-act-int8-scales"]) if self.rows_q8[i] else None
            lin["gate_up"].bind(gpu, ws, ws.hidden, matrix["gate_up"], act, f"{c}.gate_up", src_int8=self.ar.norm_int8,
                                rms=self.norms.rms_input() if fused else None, int8_out=int8_out, rows_out=rows)
            lin["down"].bind(gpu, ws, act, matrix["down"], ws.delta, f"{c}.down", src_int8=int8_out,
                             norm_out=self.norms.epilogue(i, "ffn") if fused and not last else None, rows_in=rows)

    def record(self, rec, layer: int, T: int, splits: int = 1) -> None:
        self.lin[layer]["gate_up"].record(rec, T)
        self.lin[layer]["down"].record(rec, T)
