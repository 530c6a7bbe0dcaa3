"""One weight matrix's products inside a block: the decode matvec and the prefill GEMM, in the kernel variant the
weight format and the arithmetic pick (engine/kernels/matmul.py; GGUF K-quant and Q5_0/Q5_1 blocks: the K-quant
kernels of engine/kquant_plan.py), with the quantize_q8 dispatch an int8 product needs where its int8 input is not
already written. A gate_up prefill GEMM may write its output rows in int8 itself (`rows_q8_out`: the down GEMM's
input, shaders/gemm_rows_q8.wgsl). SplitLinear runs a matrix whose row ranges differ in format (a GGUF qkv whose v
is Q6_K and q, k Q4_K) as one product per range into the output's columns."""

from __future__ import annotations

from dataclasses import dataclass

from engine.errors import UnsupportedModelError
from engine.kernels.matmul import (
    FORMATS,
    MATMUL_INT4,
    MATMUL_Q8W,
    MATVEC_INT4,
    MATVEC_Q8,
    MATVEC_Q8_NORM,
    MATVEC_Q8_NORM_SPLIT,
    MATVEC_Q8_RMS,
    MATVEC_Q8_RMS_Q8,
    MATVEC_SG,
    QUANTIZE_Q8,
    format_knobs,
    gemm_plan,
    gemm_q8w_plan,
    matvec_plan,
    matvec_q8_norm_plan,
    matvec_q8_plan,
    matvec_q8_rms_plan,
    matvec_q8_rms_q8_plan,
    matvec_sg_plan,
    norm_matvec_splits,
    norm_pack_layout,
    packed_shapes,
    prefers_subgroup_rows,
    quantize_q8_plan,
)
from engine.kquant_plan import (
    MATMUL_KQ,
    MATMUL_KQ_Q8,
    MATVEC_KQ,
    gemm_kq_plan,
    gemm_kq_q8_plan,
    is_kquant,
    matvec_kq_plan,
    matvec_kq_q8_kernel,
    matvec_kq_q8_plan,
    weight_buffers,
)

OFFSET_ALIGN = 256  # WebGPU's largest minStorageBufferOffsetAlignment: a SplitLinear's column offsets keep to it


@dataclass(frozen=True)
class Arithmetic:
    """How the matrix products compute, decided once per model (engine/transformer.py RuntimePlan)."""

    int8: bool  # 4-bit decode matvecs take int8 activations (matvec_q8)
    int8_prefill: bool  # 4-bit prefill GEMMs take int8 activations (quantize_q8 over the rows + matmul_q8w)
    norm_int8: bool  # the norms write the int8 copy of the normed row (its matvecs need no quantize of their own)
    subgroup_rows: bool  # f32-activation matvecs of many-row matrices use the subgroup-rows kernel
    subgroup_size: int
    max_threads: int = 256  # threads a workgroup may have (matvec_q8_norm takes up to 512)
    # the prefill kernels before an int8 GEMM (tiled attention, gate_up) write its int8 rows: no quantize_q8 between
    int8_epilogues: bool = False
    # workgroups a 32-output chunk of matvec_q8_norm takes (RuntimeOptions.norm_matvec_splits; None: per matrix)
    norm_splits: int | None = 1

    def is_int8(self, tag: str) -> bool:
        return self.int8 and _int8_format(tag)

    def is_int8_prefill(self, tag: str) -> bool:
        return self.int8_prefill and _int8_format(tag)


def _int8_format(tag: str) -> bool:
    """4-bit codes and the K-quant blocks (2 to 6 bits, as llama.cpp: its K-quant dot products take 8-bit
    activations) run with int8 activations when the arithmetic allows; 8- and 16-bit weights keep f32 ones."""
    return is_kquant(tag) or FORMATS[tag]["bits"] == 4


def gemm_kernel(k: int, n: int, gate_up: bool, tag: str, int8: bool, T: int = 1, y_stride: int | None = None,
                rows_q8: bool = False):
    """(Kernel, constants, grid) of the prefill GEMM over T rows; `int8`: the rows come quantized by quantize_q8;
    `rows_q8` (int8 gate_up only): it writes its output rows in int8 instead of f32."""
    out = dict(rows_q8=True) if rows_q8 else {}
    if rows_q8 and not int8:
        raise ValueError("only the int8-activation GEMMs write int8 output rows")
    if is_kquant(tag):
        plan = gemm_kq_q8_plan if int8 else gemm_kq_plan
        return ((MATMUL_KQ_Q8 if int8 else MATMUL_KQ), *plan(tag, k, n, T, gate_up=gate_up, y_stride=y_stride, **out))
    plan = gemm_q8w_plan if int8 else gemm_plan
    return ((MATMUL_Q8W if int8 else MATMUL_INT4),
            *plan(k, n, T, gate_up=gate_up, y_stride=y_stride, **format_knobs(tag), **out))


def gemm_can_write_rows_q8(k: int, n: int, tag: str) -> bool:
    """Whether the int8 gate_up GEMM of this shape and format can write its output rows in int8 (the plan takes it:
    n whole 32-element chunks, the staging within workgroup memory)."""
    try:
        gemm_kernel(k, n, True, tag, True, rows_q8=True)
    except ValueError:
        return False
    return True


def gemm_rows_out(ws, rows: tuple | None = None) -> dict:
    """An int8-activation GEMM's yq / ym bindings: `rows` (codes, scales) where it writes int8 rows, else the
    workspace's decode int8 row, bound but never written (no prefill GEMM reads it)."""
    yq, ym = rows or (ws.x_q8, ws.x_q8_meta)
    return dict(yq=yq, ym=ym)


def decode_kernel(k: int, n: int, gate_up: bool, tag: str, ar: Arithmetic, last_row: bool = False):
    """(Kernel, constants, grid) of the decode matvec for an [n (×2 with gate_up), k] matrix in format `tag`."""
    if is_kquant(tag):
        if ar.is_int8(tag):
            # Both pick by n (outputs): the wide kernels below FEW_ROWS_N, gate_up included (kq_q8_rows.wgsl's GATE_UP).
            return (matvec_kq_q8_kernel(tag, n=n), *matvec_kq_q8_plan(tag, k, n, ar.subgroup_size, gate_up=gate_up))
        return (MATVEC_KQ, *matvec_kq_plan(tag, k, n, gate_up=gate_up, last_row=last_row))
    knobs = format_knobs(tag)
    if ar.is_int8(tag):
        return (MATVEC_Q8, *matvec_q8_plan(k, n, ar.subgroup_size, gate_up=gate_up, **knobs))
    if ar.subgroup_rows and prefers_subgroup_rows(k, n, gate_up):
        return (MATVEC_SG, *matvec_sg_plan(k, n, ar.subgroup_size, gate_up=gate_up, last_row=last_row, **knobs))
    return (MATVEC_INT4, *matvec_plan(k, n, gate_up=gate_up, last_row=last_row, **knobs))


def matrix_bindings(weights: dict, tag: str, dummy) -> dict:
    """Bindings w and s of a matrix's packed arrays (weights: "q_weight"/"q_scale" or "weight"); f16 weights have
    no scales, so `dummy` (any f16 buffer) fills s, which the kernel never reads. K-quant blocks bind as w and wh
    (engine/kquant_plan.py); a matrix of parts in several formats (tag "a,b,..."), per part index."""
    if "," in tag:
        return {j: matrix_bindings(part_arrays(weights, j), part, dummy) for j, part in enumerate(tag.split(","))}
    if is_kquant(tag):
        w, wh = weight_buffers(weights)
        return {"w": w, "wh": wh}
    if FORMATS[tag]["bits"] == 16:
        return {"w": weights["weight"], "s": dummy}
    return {"w": weights["q_weight"], "s": weights["q_scale"]}


def part_arrays(arrays: dict, j: int) -> dict:
    """Part j's arrays of a matrix of mixed formats (keys "<part>.<array>"), under their own names."""
    return {k.partition(".")[2]: v for k, v in arrays.items() if k.partition(".")[0] == str(j)}


def matrix_tensors(name: str, n: int, k: int, tag: str, lead: tuple = ()) -> dict:
    """Canonical tensor name -> (shape, dtype) of a matrix's packed arrays ([*lead, n, k] logically)."""
    if "," in tag:
        raise ValueError(f"{name}: a matrix of parts in formats {tag} needs its parts' rows (split_tensors)")
    return {f"{name}.{key}": ((*lead, *shape), dtype) for key, (shape, dtype) in packed_shapes(tag, n, k).items()}


class Linear:
    """y = W x (gate_up: silu(gate)·up) for one weight matrix: K inputs, N outputs (gate_up: N of each half)."""

    def __init__(self, k: int, n: int, tag: str, ar: Arithmetic, gate_up: bool = False, y_stride: int | None = None,
                 rows_q8_out: bool = False):
        """`y_stride`: the prefill output's row stride when it is wider than n (a SplitLinear's part);
        `rows_q8_out` (gate_up with int8 prefill): the prefill GEMM writes its rows in int8 (bind's `rows_out`)."""
        self.k, self.n, self.tag, self.gate_up, self.rows_q8_out = k, n, tag, gate_up, rows_q8_out
        self.int8, self.int8_prefill = ar.is_int8(tag), ar.is_int8_prefill(tag)
        self.subgroup_size, self.max_threads = ar.subgroup_size, ar.max_threads
        self.norm_splits = norm_matvec_splits(k, n, ar.subgroup_size, ar.norm_splits)
        self.mv = decode_kernel(k, n, gate_up, tag, ar)
        # matvec_q8_rms / matvec_q8_norm are matvec_q8 with a prologue / epilogue: only for its formats
        self.norm_variants = self.mv[0] is MATVEC_Q8
        self.mm = gemm_kernel(k, n, gate_up, tag, self.int8_prefill, y_stride=y_stride, rows_q8=rows_q8_out)[:2]
        self._grids: dict[int, tuple] = {}

    def bind(self, gpu, ws, src, matrix: dict, dst, label: str, src_int8: bool = False,
             rows_ready: bool = False, rms: dict | None = None, norm_out: dict | None = None,
             int8_out: bool = False, rows_in: tuple | None = None, rows_out: tuple | None = None) -> None:
        """Bind the products from `src` to `dst`. `src_int8`: the int8 copy of src's last row is in the workspace's
        int8 row already (a norm wrote it); `rows_ready`: src's rows are in the workspace's int8 rows already (the
        GEMM recorded just before quantized them, or the kernel before wrote them); `rows_in` (codes, scales): the
        prefill GEMM reads src's int8 rows from there (the kernel before wrote them); `rows_out` (codes, scales):
        where a `rows_q8_out` GEMM writes its int8 rows.
        Decode-only variants of the int8 matvec (the prefill GEMM is unchanged):
        `rms` {xq, xm, ss: bindings, eps}: the input is matvec_q8_norm's int8 row without its 1/rms (matvec_q8_rms);
        with `int8_out` (and `rms`) the output row also goes to the workspace's int8 row as quantize_q8 writes it
        (matvec_q8_rms_q8: the next matvec binds src_int8); `norm_out` {r_in, r_out, nw, nq: bindings, pack:
        norm_pack_layout, offset}: the output is added to the residual r_in into r_out and the next norm's row
        without 1/rms goes to nq (matvec_q8_norm; split along K where the arithmetic's norm_splits gives this shape
        more than one workgroup a chunk and the pack has room for them, matvec_q8_norm_split)."""
        kernel, consts, grid = self.mv
        knobs = format_knobs(self.tag) if self.norm_variants else {}
        extra = {}
        y = dst
        if int8_out and (rms is None or not self.writes_int8()):
            raise ValueError(f"{label}: no matvec_q8_rms_q8 for K={self.k}, N={self.n} reading {self.tag} weights "
                             f"{'here' if rms else 'from a row other than a norm without 1/rms'}")
        if rms is not None:
            if not self.norm_variants:
                raise ValueError(f"{label}: only matvec_q8's formats read a norm's row without 1/rms")
            kernel, (consts, grid) = MATVEC_Q8_RMS, matvec_q8_rms_plan(self.k, self.n, self.subgroup_size, rms["eps"],
                                                                        self.gate_up, **knobs)
            extra = dict(ss=rms["ss"])
            if int8_out:
                kernel, (consts, grid) = MATVEC_Q8_RMS_Q8, matvec_q8_rms_q8_plan(
                    self.k, self.n, self.subgroup_size, rms["eps"], self.gate_up, self.max_threads, **knobs)
                extra |= dict(yq=ws.x_q8, ym=ws.x_q8_meta)
        if norm_out is not None:
            splits = min(self.norm_splits, norm_out["pack"]["splits"])
            plan = self.norm_variants and matvec_q8_norm_plan(self.k, self.n, self.subgroup_size, norm_out["offset"],
                                                              norm_out["pack"], splits, **knobs)
            if not plan or plan[0]["WG"] > self.max_threads:
                raise ValueError(f"{label}: no matvec_q8_norm for K={self.k}, N={self.n} on this GPU")
            kernel, (consts, grid) = MATVEC_Q8_NORM_SPLIT if splits > 1 else MATVEC_Q8_NORM, plan
            y, extra = norm_out["r_out"], dict(r_in=norm_out["r_in"], nw=norm_out["nw"], nq=norm_out["nq"])
        pipe = gpu.pipeline(kernel, consts)
        self.decode_steps = []  # (pipeline, bind group, grid)
        if self.int8:
            xq, xm = (rms["xq"], rms["xm"]) if rms else (ws.x_q8, ws.x_q8_meta)
            if not src_int8 and rms is None:
                qconsts, qgrid = quantize_q8_plan(self.k)
                qpipe = gpu.pipeline(QUANTIZE_Q8, qconsts)
                self.decode_steps.append((qpipe, gpu.bind(qpipe, dict(x=src, xq=ws.x_q8, xm=ws.x_q8_meta,
                                                                      step=ws.step), f"{label}.q8"), qgrid))
            bg = gpu.bind(pipe, dict(xq=xq, **matrix, y=y, xm=xm, **extra), f"{label}.mv")
        else:
            bg = gpu.bind(pipe, dict(x=src, **matrix, y=dst, step=ws.step), f"{label}.mv")
        self.decode_steps.append((pipe, bg, grid))
        kernel, consts = self.mm
        pipe = gpu.pipeline(kernel, consts)
        self.prefill_steps = []  # (pipeline, bind group, "quantize" | "gemm")
        if (rows_out is not None) != self.rows_q8_out:
            raise ValueError(f"{label}: int8 output rows need rows_q8_out at construction and rows_out at bind")
        if self.int8_prefill:
            # The prefill's norms write `hidden`'s rows in int8 themselves (engine/blocks/residual.py).
            if not rows_ready and rows_in is None and not (src is ws.hidden and getattr(ws, "hidden_rows_q8", False)):
                qpipe = gpu.pipeline(QUANTIZE_Q8, quantize_q8_plan(self.k)[0])
                self.prefill_steps.append((qpipe, gpu.bind(qpipe, dict(x=src, xq=ws.rows_q8, xm=ws.rows_q8_meta,
                                                                       step=ws.step), f"{label}.rows-q8"), "quantize"))
            xq, xm = rows_in or (ws.rows_q8, ws.rows_q8_meta)
            bg = gpu.bind(pipe, dict(xq=xq, **matrix, y=dst, xm=xm, step=ws.step, **gemm_rows_out(ws, rows_out)),
                          label)
        else:
            if rows_in is not None:
                raise ValueError(f"{label}: an f32-activation GEMM cannot read int8 rows")
            bg = gpu.bind(pipe, dict(x=src, **matrix, y=dst, step=ws.step), label)
        self.prefill_steps.append((pipe, bg, "gemm"))

    def carries_norm(self, producer: bool) -> bool:
        """Whether the decode matvec can take the residual block's part (engine/blocks/residual.py): read a norm's
        row without 1/rms (matvec_q8_rms: any matvec_q8 shape) or, `producer`, add to the residual and write that row
        (matvec_q8_norm: N whole 32-output chunks and a workgroup size the GPU allows)."""
        if not self.norm_variants:
            return False
        if not producer:
            return True
        plan = matvec_q8_norm_plan(self.k, self.n, self.subgroup_size, 0.0, norm_pack_layout(self.n),
                                   **format_knobs(self.tag))
        return plan is not None and plan[0]["WG"] <= self.max_threads

    def writes_int8(self) -> bool:
        """Whether the decode matvec, reading a norm's row without 1/rms, can also write its output row in int8
        (matvec_q8_rms_q8: N whole 32-output chunks and a workgroup size the GPU allows)."""
        if not self.norm_variants:
            return False
        plan = matvec_q8_rms_q8_plan(self.k, self.n, self.subgroup_size, 0.0, self.gate_up, self.max_threads,
                                     **format_knobs(self.tag))
        return plan is not None and plan[0]["WG"] <= self.max_threads

    @property
    def quantizes_rows(self) -> bool:
        """Whether the prefill GEMM quantizes its rows itself (a GEMM after it on the same rows can reuse them)."""
        return self.int8_prefill

    def record(self, rec, T: int, int8_ready: bool = False) -> None:
        """The product for T rows (T == 1: the decode matvec). `int8_ready`: the kernel before it wrote the int8
        row (the split-K combine does for o), so its quantize_q8 is skipped."""
        if T == 1:
            steps = self.decode_steps
            for pipe, bg, grid in steps[1:] if int8_ready and len(steps) > 1 else steps:
                rec.dispatch(pipe, bg, *grid)
            return
        gemm, quantize = self._prefill_grids(T)
        for pipe, bg, what in self.prefill_steps:
            rec.dispatch(pipe, bg, *(quantize if what == "quantize" else gemm))

    def _prefill_grids(self, T: int) -> tuple:
        if T not in self._grids:
            gemm = gemm_kernel(self.k, self.n, self.gate_up, self.tag, self.int8_prefill, T,
                               rows_q8=self.rows_q8_out)[2]
            self._grids[T] = (gemm, quantize_q8_plan(self.k, rows=T)[1])
        return self._grids[T]


def split_tensors(name: str, rows: tuple[int, ...], k: int, tag: str) -> dict:
    """matrix_tensors of a matrix whose row ranges `rows` are stored in the formats of `tag` ("a,b,..."), as
    "<name>.<part>.<array>"."""
    out = {}
    for j, (n, part) in enumerate(zip(rows, tag.split(","), strict=True)):
        out |= matrix_tensors(f"{name}.{j}", n, k, part)
    return out


class SplitLinear:
    """y = W x for a matrix whose row ranges differ in format: one Linear per range, each writing its columns of y
    (decode: at a binding offset; prefill: the same offset with the full row stride). Parts that take int8
    activations share one quantize_q8 of the input."""

    def __init__(self, k: int, rows: tuple[int, ...], tag: str, ar: Arithmetic):
        tags = tag.split(",")
        if len(tags) != len(rows):
            raise ValueError(f"formats {tag} name {len(tags)} parts, the matrix has {len(rows)}")
        self.k, self.n, self.tag = k, sum(rows), tag
        self.starts = [sum(rows[:j]) for j in range(len(rows))]
        for start in self.starts:
            if start * 4 % OFFSET_ALIGN:
                raise UnsupportedModelError(
                    f"a matrix of parts in formats {tag} needs each part's first output column at a multiple of "
                    f"{OFFSET_ALIGN // 4} (its byte offset is bound); one starts at {start}")
        self.parts = [Linear(k, n, t, ar, y_stride=self.n) for n, t in zip(rows, tags, strict=True)]

    @property
    def int8(self) -> bool:
        return any(p.int8 for p in self.parts)

    def carries_norm(self, producer: bool) -> bool:
        """Its parts write columns of one output: the residual block keeps its norms around it."""
        return False

    @property
    def quantizes_rows(self) -> bool:
        return any(p.quantizes_rows for p in self.parts)

    def bind(self, gpu, ws, src, matrix: dict, dst, label: str, src_int8: bool = False,
             rows_ready: bool = False, rms: dict | None = None) -> None:
        """As Linear.bind; `matrix`: part index -> that part's bindings (matrix_bindings of the "a,b,..." tag).
        `rms` is never given (carries_norm is False: the residual block keeps its norms)."""
        if rms is not None:
            raise ValueError(f"{label}: a matrix of parts cannot read a norm's row without 1/rms")
        for j, (part, start) in enumerate(zip(self.parts, self.starts, strict=True)):
            y = dst if start == 0 else (dst, 4 * start, dst.size - 4 * start)
            part.bind(gpu, ws, src, matrix[j], y, f"{label}.{j}", src_int8=src_int8, rows_ready=rows_ready)
            src_int8 = src_int8 or part.int8  # this part quantized the decode row: the next ones read it
            rows_ready = rows_ready or part.quantizes_rows

    def record(self, rec, T: int, int8_ready: bool = False) -> None:
        for part in self.parts:
            part.record(rec, T, int8_ready)
