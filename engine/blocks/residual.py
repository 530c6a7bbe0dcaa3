"""The residual stream's norms: the first RMSNorm (layer 0's input norm over the embedding), then after each mixer
and each feed-forward block the residual add fused with the next RMSNorm (the layer's post-attention norm, the next
layer's input norm, or the final norm). Residuals ping-pong between the workspace's two residual buffers; with int8
arithmetic each norm also writes the int8 copy of its last row for the matvecs that read `hidden`. With int8 prefill
GEMMs, a prefill chunk's norms (all but the final one) write every row in int8 too (`ws.hidden_rows_q8`: the GEMMs
that read `hidden` skip their quantize_q8); after the first norm one quantize_q8 does it.

With `in_matvecs` (int8 dense or hybrid models whose matvecs are all matvec_q8s) a decode token runs
no add + norm dispatch but the final one: the o and down matvecs add their outputs to the residual and write the
next norm's int8 row without its 1/rms (`epilogue`), and the qkv and gate_up matvecs after them take 1/rms from
the chunks' sums of squares (`rms_input`)."""

from __future__ import annotations

from engine.blocks import Block, BufferNeed, upload_weight
from engine.kernels.matmul import QUANTIZE_Q8, quantize_q8_plan
from engine.kernels.norm import (
    ADD_RMS_NORM,
    ADD_RMS_NORM_ROWS,
    RMS_NORM,
    norm_can_write_rows_int8,
    norm_plan,
    norm_rows_plan,
)


class ResidualNorms(Block):
    name = "residual"

    def __init__(self, dim: int, n_layers: int, eps: float, norm_int8: bool, norm_offset: float = 0.0,
                 in_matvecs: bool = False):
        self.dim, self.n_layers, self.layers = dim, n_layers, tuple(range(n_layers))
        self.eps, self.norm_offset, self.in_matvecs = eps, norm_offset, in_matvecs
        self.consts = norm_plan(dim, eps, norm_int8, norm_offset)
        self.w: dict = {}

    def tensors(self) -> dict:
        vec = ((self.dim,), "float16")
        out = {"norm": vec}
        for i in range(self.n_layers):
            out[f"layers.{i}.attn_norm"] = out[f"layers.{i}.mlp_norm"] = vec
        return out

    def needs(self) -> list[BufferNeed]:
        return [BufferNeed.upload(name, 2 * self.dim) for name in self.tensors()]

    def take(self, gpu, name: str, arr, source: str = "") -> None:
        self.w[name] = upload_weight(gpu, name, arr, source=source)

    @property
    def dummy_f16(self):
        """An f16 buffer to fill bindings a kernel declares but never reads in its variant (f16 matrices' scales)."""
        return self.w["norm"]

    def build(self, gpu, ws) -> None:
        self.p_first = gpu.pipeline(RMS_NORM, self.consts)
        self.p_add = gpu.pipeline(ADD_RMS_NORM, self.consts)
        int8 = dict(xq=ws.x_q8, xm=ws.x_q8_meta)
        self.bg_first = gpu.bind(self.p_first, dict(x=ws.res[0], w=self.w["layers.0.attn_norm"], y=ws.hidden,
                                                    step=ws.step, **int8), "norm0")
        self.bg_layers = []
        for i in range(self.n_layers):
            c = f"layers.{i}"
            after = self.w[f"layers.{i + 1}.attn_norm"] if i + 1 < self.n_layers else self.w["norm"]
            mid = gpu.bind(self.p_add, dict(r_in=ws.res[0], delta=ws.delta, w=self.w[f"{c}.mlp_norm"],
                                            r_out=ws.res[1], y=ws.hidden, step=ws.step, **int8), f"{c}.add_norm1")
            end = gpu.bind(self.p_add, dict(r_in=ws.res[1], delta=ws.delta, w=after, r_out=ws.res[0], y=ws.hidden,
                                            step=ws.step, **int8), f"{c}.add_norm2")
            self.bg_layers.append((mid, end))
        self.ws = ws
        self._build_rows(gpu, ws)

    def epilogue(self, layer: int, after: str) -> dict:
        """Linear.bind's `norm_out` for the matvec that ends the layer's mixer ("mixer": o) or feed-forward block
        ("ffn": down, not the last layer's, whose add + final norm stays a dispatch) in decode."""
        ws, c = self.ws, f"layers.{layer}"
        if after == "mixer":
            r_in, r_out, nw = ws.res[0], ws.res[1], self.w[f"{c}.mlp_norm"]
        else:
            r_in, r_out, nw = ws.res[1], ws.res[0], self.w[f"layers.{layer + 1}.attn_norm"]
        return dict(r_in=r_in, r_out=r_out, nw=nw, nq=ws.norm_q8, pack=ws.norm_pack, offset=self.norm_offset)

    def block_input(self, layer: int) -> dict:
        """For a feed-forward block that norms its own input in decode (the MoE router, engine/blocks/moe_fused.py):
        the residual the mixer's epilogue wrote (`r`), the norm weight (`nw`), the packed row (`nq`, laid out as
        `pack`) and the norm's `eps` and `offset`."""
        ws = self.ws
        return dict(r=ws.res[1], nw=self.w[f"layers.{layer}.mlp_norm"], nq=ws.norm_q8, pack=ws.norm_pack,
                    eps=self.eps, offset=self.norm_offset)

    def ffn_output(self, layer: int) -> tuple[dict, bool]:
        """(bindings, norm) for a feed-forward block whose last pass sums into the residual itself (MoE's down):
        `epilogue(layer, "ffn")` and True; for the last layer, whose add + final norm stays a dispatch, delta as
        r_out, the other bindings unread, and False."""
        if layer < self.n_layers - 1:
            return self.epilogue(layer, "ffn"), True
        ws = self.ws
        return dict(r_in=ws.res[1], r_out=ws.delta, nw=self.w["norm"], nq=ws.norm_q8, pack=ws.norm_pack,
                    offset=self.norm_offset), False

    def rms_input(self) -> dict:
        """Linear.bind's `rms` for a matvec reading the row an `epilogue` matvec wrote (qkv after layer 0, gate_up)."""
        ws, pack, d = self.ws, self.ws.norm_pack, self.dim
        return dict(xq=(ws.norm_q8, 0, d), xm=(ws.norm_q8, pack["meta"], d // 32 * 8),
                    ss=(ws.norm_q8, pack["ss"], d // 32 * 4), eps=self.eps)

    def _skipped(self, layer: int, T: int, after: str) -> bool:
        """A decode token's add + norm that the matvec before it carries."""
        return T == 1 and self.in_matvecs and not (after == "ffn" and layer == self.n_layers - 1)

    def _build_rows(self, gpu, ws) -> None:
        """The prefill variants that also write every normed row in int8 to the workspace's rows (GEMM input)."""
        self.rows_q8 = ws.rows_q8 is not None and norm_can_write_rows_int8(self.dim)
        ws.hidden_rows_q8 = self.rows_q8
        if not self.rows_q8:
            return
        rows = dict(xq=ws.rows_q8, xm=ws.rows_q8_meta, step=ws.step)
        self.p_first_q8 = gpu.pipeline(QUANTIZE_Q8, quantize_q8_plan(self.dim)[0])
        self.bg_first_q8 = gpu.bind(self.p_first_q8, dict(x=ws.hidden, **rows), "norm0.rows-q8")
        self.p_rows = gpu.pipeline(ADD_RMS_NORM_ROWS, norm_rows_plan(self.dim, self.consts["EPS"],
                                                                     self.consts["NORM_OFFSET"]))
        self.bg_rows = []
        for i in range(self.n_layers):
            c, after = f"layers.{i}", self.w.get(f"layers.{i + 1}.attn_norm")
            mid = gpu.bind(self.p_rows, dict(r_in=ws.res[0], delta=ws.delta, w=self.w[f"{c}.mlp_norm"],
                                             r_out=ws.res[1], y=ws.hidden, **rows), f"{c}.add_norm1_rows")
            end = None if after is None else gpu.bind(self.p_rows, dict(r_in=ws.res[1], delta=ws.delta, w=after,
                                                                        r_out=ws.res[0], y=ws.hidden, **rows),
                                                      f"{c}.add_norm2_rows")
            self.bg_rows.append((mid, end))

    def record_first(self, rec, T: int) -> None:
        rec.dispatch(self.p_first, self.bg_first, T)
        if T > 1 and self.rows_q8:
            rec.dispatch(self.p_first_q8, self.bg_first_q8, *quantize_q8_plan(self.dim, rows=T)[1])

    def record(self, rec, layer: int, T: int, splits: int = 1, after: str = "mixer") -> None:
        """The add + norm after the layer's mixer ("mixer") or after its feed-forward block ("ffn")."""
        if self._skipped(layer, T, after):
            return
        rows = self.bg_rows[layer][after == "ffn"] if T > 1 and self.rows_q8 else None
        if rows is not None:  # the final norm keeps the last row's int8 copy for the LM head
            rec.dispatch(self.p_rows, rows, T)
        else:
            rec.dispatch(self.p_add, self.bg_layers[layer][after == "ffn"], T)

    def dispatches_per_token(self, splits: int = 1) -> int:
        return 1 + sum(not self._skipped(i, 1, after) for i in self.layers for after in ("mixer", "ffn"))
