"""The matrix kernels' host side: weight formats, and the constants and grids of the matvecs, GEMMs, quantize_q8 and
the embedding, declared beside their kernels.

matvec_int4 (decode, one activation row) and matmul_int4 (prefill GEMM, T rows) share bindings:
0 x f32[T, K], 1 weight u32[N or 2N, K·BITS/32], 2 scale f16[N or 2N, K/GROUP (, 2 with AFFINE)],
3 y f32, 4 step uniform. With gate_up the weight holds gate rows then up rows and y gets
silu(gate)·up ([N] or [T, N]). The defaults are untuned starting points.

The int8-activation kernels (matvec_q8 in decode, matmul_q8w in prefill) read 4-bit weights the same
way but take x as quantize_q8 writes it (xq codes, xm (scale, Σ codes) per 32-element chunk; shaders/q8_pack.wgsl).

Weight formats are kernel constants (see FORMATS): integer codes q of BITS bits, w = (q − ZERO)·scale,
plus a per-group minimum with AFFINE (w = scale·q + min, GGUF Q4_1), one scale per GROUP elements
along K; or plain f16 weights (BITS=16, binding 2 is then bound but never read). The defaults are
MLC's q4f16_1, so callers that pass no format keep the original kernels.

Why the Q4_1 minimum shares binding 2 (as (scale, min) f16 pairs) instead of a binding 5 of its own:
pipelines use layout="auto", and a binding referenced anywhere in the entry point (even in a branch
that a constant turns off) becomes part of the layout, so every q4f16_1 bind group would have needed
a sixth buffer. Two variables cannot share a binding index either (naga rejects it).
"""

from __future__ import annotations

from engine.formats import kquant
from engine.kernels import declare, fold_grid, row_outputs
from engine.runtime_options import MAX_NORM_MATVEC_SPLITS

MATVEC_INT4 = declare("matvec_int4", writes=("y",))
MATVEC_SG = declare("matvec_sg", writes=("y",))
MATVEC_Q8 = declare("matvec_q8", writes=("y",))
MATVEC_Q8_RMS = declare("matvec_q8_rms", writes=("y",))
MATVEC_Q8_NORM = declare("matvec_q8_norm", writes=("y", "nq"))
MATVEC_Q8_NORM_SPLIT = declare("matvec_q8_norm_split", writes=("y", "nq"))
MATVEC_Q8_RMS_Q8 = declare("matvec_q8_rms_q8", writes=("y", "yq", "ym"))
MATMUL_INT4 = declare("matmul_int4", writes=("y",))
MATMUL_Q8W = declare("matmul_q8w", writes=("y", "yq", "ym"))
QUANTIZE_Q8 = declare("quantize_q8", writes=("xq", "xm"))
EMBEDDING = declare("embedding", writes=("x",))

MATVEC_WG = 64
# Weight rows per decode-matvec workgroup (gate_up reads two per output, so it takes half as many outputs).
# 4 measured fastest on the H200 for every Phi-3 / Qwen3-4B matrix (bench/tune_matvec.py; BENCH.md): fewer
# rows starve each thread of loads in flight, more rows spill registers and leave SMs idle.
MATVEC_SLOTS = 4
# The subgroup-rows matvec (shaders/matvec_sg.wgsl) wins where a matrix has many rows for its K (gate_up, LM heads)
# and loses on long-K, few-row ones (o, down; bench/matvec_probe.py, BENCH.md). It is used from this many weight
# rows per K element up.
MATVEC_SG_MIN_ROWS_PER_K = 4
MATVEC_SG_WG = 128
# The int8-activation matvec (shaders/matvec_q8.wgsl): 2 weight rows per subgroup measured best on the H200
# (bench/matvec_probe.py; BENCH.md).
MATVEC_Q8_SLOTS = 2
# matvec_q8_norm's workgroups (one 32-output chunk each): a subgroup per block of rows up to this many threads (512
# on the H200's 32-lane subgroups: as many threads in flight as matvec_q8's 128-thread workgroups over 4× as many).
MATVEC_Q8_NORM_MAX_WG = 512
# matvec_q8_norm split along K (shaders/matvec_q8_norm_split.wgsl): at most this many workgroups a chunk; the automatic
# choice (norm_matvec_splits None) adds splits until the grid has NORM_SPLIT_WORKGROUPS workgroups, while every lane
# of a subgroup still gets a block of K. Untuned starting points.
MAX_NORM_SPLITS = MAX_NORM_MATVEC_SPLITS
NORM_SPLIT_WORKGROUPS = 512
# matvec_q8_rms_q8's (gate_up: 32 one-output blocks a chunk): a subgroup per output, as matvec_q8's gate_up, up to
# this many threads and the GPU's limit (past it a subgroup takes several blocks in turn). Untuned; bench/ab.py
# variants may set it ("matmul_consts").
MATVEC_Q8_RMS_Q8_MAX_WG = 1024
QUANTIZE_WG = 64
GEMM_TM = 64
GEMM_TN = 64  # halved with gate_up, so the staged weight tile stays 64 rows
# The int8-activation prefill GEMM (shaders/matmul_q8w.wgsl): 8 rows × 4 columns per thread, 64 tokens × 64 staged
# weight rows (128 threads); tile variants in bench/gemm_probe.py --variants.
GEMM_Q8W_TM = 64
GEMM_Q8W_TN = 64  # halved with gate_up, as GEMM_TN
GEMM_Q8W_ROWS = 8  # token rows per thread, fixed by the kernel
GEMM_Q8W_MAX_WG = 256  # WebGPU's default maxComputeInvocationsPerWorkgroup
WORKGROUP_BYTES = 16384
EMBED_WG = 64
CHUNK = 32  # elements every kernel walks K by; GROUP must be a multiple of it

# Kernel constants per weight format tag (the tags engine/formats/gguf.py attaches to each weight).
FORMATS: dict[str, dict] = {
    "q4f16_1": dict(bits=4, zero=7, affine=False, group=32),  # MLC
    "q4_0": dict(bits=4, zero=8, affine=False, group=32),  # GGUF: w = (q − 8)·d
    "q4_1": dict(bits=4, zero=0, affine=True, group=32),  # GGUF: w = d·q + m
    "q8_0": dict(bits=8, zero=128, affine=False, group=32),  # GGUF int8 stored as q + 128: w = (u − 128)·d
    "f16": dict(bits=16, zero=0, affine=False, group=32),  # unquantized
    "mlx4": dict(bits=4, zero=0, affine=True, group=64),  # MLX affine w = scale·q + bias (2-bit, other 3-bit widened)
    "mlx8": dict(bits=8, zero=0, affine=True, group=64),  # MLX affine 8-bit (the MoE router; 5/6-bit widened)
    "mlx3": dict(bits=3, zero=0, affine=True, group=64),  # MLX 3-bit expert rows as stored (decode matvecs only)
}


def format_knobs(tag: str) -> dict:
    """Keyword arguments for matvec_plan / gemm_plan / embedding_plan for a weight format tag."""
    if tag not in FORMATS:
        raise ValueError(f"no kernel variant for weight format {tag!r}; have {', '.join(FORMATS)}")
    return dict(FORMATS[tag])


def packed_shapes(tag: str, n: int, k: int) -> dict[str, tuple[tuple[int, ...], str]]:
    """Array name -> (shape, dtype) of an [n, k] matrix in format `tag`, as the kernels bind it."""
    if kquant.is_ktag(tag):  # GGUF blocks as stored, for the K-quant kernels (engine/kquant_plan.py)
        return kquant.packed_shapes(tag, n, k)
    bits, affine, group = FORMATS[tag]["bits"], FORMATS[tag]["affine"], FORMATS[tag]["group"]
    if bits == 16:
        return {"weight": ((n, k), "float16")}
    scale = (n, k // group, 2) if affine else (n, k // group)
    return {"q_weight": ((n, k * bits // 32), "uint32"), "q_scale": (scale, "float16")}


def _format_consts(K: int, bits: int, zero: int, affine: bool, group: int, what: str = "K",
                   three_bit: bool = False) -> dict:
    """`three_bit`: the caller's kernel reads MLX 3-bit rows (the decode matvecs do; GEMM and embedding do not)."""
    if bits not in ((3, 4, 8, 16) if three_bit else (4, 8, 16)):
        raise ValueError(f"BITS must be 4, 8 (integer codes) or 16 (f16 weights), got {bits}"
                         + ("" if three_bit else "; 3-bit weights run only in the decode matvecs"))
    if group <= 0 or group % CHUNK:
        raise ValueError(f"GROUP must be a positive multiple of {CHUNK}, got {group}")
    if bits < 16 and not 0 <= zero < 2**bits:
        raise ValueError(f"ZERO={zero} is not a {bits}-bit code")
    if K <= 0 or K % CHUNK or (bits < 16 and K % group):
        unit = CHUNK if bits == 16 else group
        raise ValueError(f"{what} must be a positive multiple of {unit} (the group size), got {K}")
    return dict(BITS=bits, ZERO=zero, AFFINE=bool(affine), GROUP=group)


def _check_n(N: int) -> None:
    if N <= 0:
        raise ValueError(f"N must be positive, got {N}")


def matvec_plan(
    K: int, N: int, gate_up: bool = False, last_row: bool = False, rows: int | None = None, wg: int = MATVEC_WG,
    *, bits: int = 4, zero: int = 7, affine: bool = False, group: int = 32,
) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/matvec_int4.wgsl: y[N] from x row 0 (or row n_tokens-1 if last_row).
    `rows`: outputs per workgroup (default: MATVEC_SLOTS weight rows' worth)."""
    rows = rows or (MATVEC_SLOTS // 2 if gate_up else MATVEC_SLOTS)
    fmt = _format_consts(K, bits, zero, affine, group, three_bit=True)
    _check_n(N)
    if wg & (wg - 1) or wg < rows:
        raise ValueError(f"WG must be a power of two (workgroup reduction) and ≥ ROWS; got WG={wg}, ROWS={rows}")
    consts = dict(K=K, N=N, WG=wg, ROWS=rows, LAST_ROW=last_row, GATE_UP=gate_up, **fmt)
    return consts, fold_grid(-(-N // rows))


def matvec_sg_plan(
    K: int, N: int, subgroup_size: int, gate_up: bool = False, last_row: bool = False, rows: int | None = None,
    wg: int = MATVEC_SG_WG, *, bits: int = 4, zero: int = 7, affine: bool = False, group: int = 32,
) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/matvec_sg.wgsl: matvec_int4's constants plus BLOCKS, the row blocks of
    ROWS outputs a workgroup covers (one per subgroup of the probed size)."""
    if subgroup_size < 1 or wg % subgroup_size:
        raise ValueError(f"WG={wg} must be a multiple of the subgroup size {subgroup_size}")
    consts, _ = matvec_plan(K, N, gate_up, last_row, rows, wg, bits=bits, zero=zero, affine=affine, group=group)
    blocks = wg // subgroup_size
    consts["BLOCKS"] = blocks
    return consts, fold_grid(-(-N // (consts["ROWS"] * blocks)))


def matvec_q8_plan(
    K: int, N: int, subgroup_size: int, gate_up: bool = False, rows: int | None = None, wg: int = MATVEC_SG_WG,
    *, bits: int = 4, zero: int = 7, affine: bool = False, group: int = 32, three_bit: bool = False,
) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/matvec_q8.wgsl (x comes quantized by quantize_q8: no LAST_ROW here).
    `three_bit`: the caller's kernel reads MLX 3-bit rows too (moe_matvec_q8 does)."""
    if bits not in ((3, 4) if three_bit else (4,)):
        raise ValueError(f"matvec_q8 reads 4-bit codes{' or 3-bit rows' if three_bit else ''}, got BITS={bits}")
    fmt = _format_consts(K, bits, zero, affine, group, three_bit=three_bit)
    _check_n(N)
    if subgroup_size < 1 or wg % subgroup_size:
        raise ValueError(f"WG={wg} must be a multiple of the subgroup size {subgroup_size}")
    rows = rows or max(MATVEC_Q8_SLOTS // (2 if gate_up else 1), 1)
    blocks = wg // subgroup_size
    consts = dict(K=K, N=N, WG=wg, ROWS=rows, BLOCKS=blocks, GATE_UP=gate_up, BITS=bits, ZERO=fmt["ZERO"],
                  AFFINE=fmt["AFFINE"], GROUP=fmt["GROUP"])
    return consts, fold_grid(-(-N // (rows * blocks)))


def matvec_q8_rms_plan(
    K: int, N: int, subgroup_size: int, eps: float, gate_up: bool = False, *, bits: int = 4, zero: int = 7,
    affine: bool = False, group: int = 32,
) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/matvec_q8_rms.wgsl: matvec_q8's, with the norm's EPS."""
    consts, grid = matvec_q8_plan(K, N, subgroup_size, gate_up, bits=bits, zero=zero, affine=affine, group=group)
    return dict(consts, EPS=float(eps)), grid


def norm_pack_layout(n: int, alignment: int = 256, splits: int = 1) -> dict:
    """Where matvec_q8_norm.wgsl puts a row of n values in its one output buffer (the readers bind each part as a
    range, so parts start on `alignment` bytes): codes at byte 0, (scale, Σ codes) pairs at `meta`, Σ x² per chunk at
    `ss` (bytes); META and SS are the same offsets in u32 for the kernel; `bytes` the buffer size. `splits` > 1: room
    after them for matvec_q8_norm_split.wgsl of up to that many splits, its tickets at `tickets` (u32 TICKETS) and
    its partial records at `part` (u32 PART)."""
    up = lambda b: -(-b // alignment) * alignment  # noqa: E731
    meta = up(n)
    ss = meta + up(n // CHUNK * 8)
    out = dict(meta=meta, ss=ss, bytes=ss + n // CHUNK * 4, META=meta // 4, SS=ss // 4, splits=1)
    if splits > 1:
        tickets = up(out["bytes"])
        part = tickets + up(n // CHUNK * 4)
        out |= dict(tickets=tickets, part=part, bytes=part + n * splits * 4, TICKETS=tickets // 4, PART=part // 4,
                    splits=splits)
    return out


def matvec_q8_norm_plan(
    K: int, N: int, subgroup_size: int, norm_offset: float, pack: dict, splits: int = 1, *, bits: int = 4,
    zero: int = 7, affine: bool = False, group: int = 32,
) -> tuple[dict, tuple[int, int]] | None:
    """Constants and grid for shaders/matvec_q8_norm.wgsl (matvec_q8 + residual add + the next norm's int8 row
    without 1/rms, `pack` = norm_pack_layout(N)): one 32-output chunk per workgroup, a subgroup per block of ROWS
    while MATVEC_Q8_NORM_MAX_WG allows; with `splits` > 1 for shaders/matvec_q8_norm_split.wgsl, `splits`
    workgroups a chunk (`pack` must have room for them). None where the shape cannot take it (N not whole chunks)."""
    consts, _ = matvec_q8_plan(K, N, subgroup_size, bits=bits, zero=zero, affine=affine, group=group)
    chunked = _chunk_workgroups(consts, N, subgroup_size, MATVEC_Q8_NORM_MAX_WG)
    if chunked is None:
        return None
    consts = dict(chunked[0], NORM_OFFSET=float(norm_offset), META=pack["META"], SS=pack["SS"])
    if splits == 1:
        return consts, chunked[1]
    if not 1 < splits <= min(pack["splits"], MAX_NORM_SPLITS):
        raise ValueError(f"matvec_q8_norm_split takes 2 to {min(pack['splits'], MAX_NORM_SPLITS)} splits "
                         f"(MAX_NORM_SPLITS and the packed row's room), got {splits}")
    return (dict(consts, SPLITS=splits, TICKETS=pack["TICKETS"], PART=pack["PART"]),
            fold_grid(N // CHUNK * splits))


def norm_matvec_splits(K: int, N: int, subgroup_size: int, requested: int | None) -> int:
    """Workgroups a 32-output chunk of matvec_q8_norm takes (1: matvec_q8_norm.wgsl, else its split-K variant):
    `requested` (RuntimeOptions.norm_matvec_splits), at most one a 32-element block of K; None: the fewest that give
    the grid NORM_SPLIT_WORKGROUPS workgroups, at most one a subgroup's worth of blocks (every lane keeps a block)
    and MAX_NORM_SPLITS."""
    blocks = K // CHUNK
    if requested is not None:
        return max(min(requested, blocks), 1)
    cap = max(min(blocks // max(subgroup_size, 1), MAX_NORM_SPLITS), 1)
    return max(min(-(-NORM_SPLIT_WORKGROUPS // max(N // CHUNK, 1)), cap), 1)


def matvec_q8_rms_q8_plan(
    K: int, N: int, subgroup_size: int, eps: float, gate_up: bool = False, max_threads: int = 256, *, bits: int = 4,
    zero: int = 7, affine: bool = False, group: int = 32,
) -> tuple[dict, tuple[int, int]] | None:
    """Constants and grid for shaders/matvec_q8_rms_q8.wgsl (matvec_q8_rms whose output also goes out in int8, as
    quantize_q8 writes it): matvec_q8_rms's constants, one 32-output chunk per workgroup as matvec_q8_norm, of at most
    `max_threads` (the GPU's) and MATVEC_Q8_RMS_Q8_MAX_WG threads. None where the shape cannot take it (N not whole
    chunks)."""
    consts, _ = matvec_q8_rms_plan(K, N, subgroup_size, eps, gate_up, bits=bits, zero=zero, affine=affine,
                                   group=group)
    return _chunk_workgroups(consts, N, subgroup_size, min(MATVEC_Q8_RMS_Q8_MAX_WG, max_threads))


def _chunk_workgroups(consts: dict, N: int, subgroup_size: int, max_wg: int) -> tuple[dict, tuple[int, int]] | None:
    """matvec_q8's constants regridded to one 32-output chunk per workgroup (the kernels that quantize their own
    output chunk): a subgroup per block of ROWS outputs while max_wg threads allow, the rest looping."""
    rows = consts["ROWS"]
    if N % CHUNK or CHUNK % rows:
        return None
    blocks = CHUNK // rows
    wg = max(min(blocks * subgroup_size, max_wg // subgroup_size * subgroup_size), CHUNK)
    if wg % subgroup_size:
        return None
    return dict(consts, WG=wg, BLOCKS=blocks), fold_grid(N // CHUNK)


def quantize_q8_plan(K: int, last_row: bool = False, rows: int = 1, row0: int = 0,
                     x_stride: int | None = None) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/quantize_q8.wgsl: rows row0 .. row0 + rows of x (X_STRIDE floats apart), or
    with last_row the row n_tokens - 1; xq takes K bytes and xm K / 32 · 8 bytes per row (row r at r·K/4 u32)."""
    x_stride = x_stride or K
    if K <= 0 or K % CHUNK:
        raise ValueError(f"K must be a positive multiple of {CHUNK}, got {K}")
    if x_stride % 4 or x_stride < K or rows < 1 or (last_row and (rows, row0) != (1, 0)):
        raise ValueError(f"bad rows: X_STRIDE={x_stride} for K={K}, rows {row0}+{rows}, last_row={last_row}")
    consts = dict(K=K, WG=QUANTIZE_WG, LAST_ROW=last_row, ROW0=row0, X_STRIDE=x_stride)
    return consts, (-(-(K // CHUNK) // QUANTIZE_WG), rows)


def prefers_subgroup_rows(K: int, N: int, gate_up: bool) -> bool:
    """Whether the subgroup-rows matvec is the faster decode kernel for this shape (measured; see above)."""
    return N * (2 if gate_up else 1) >= MATVEC_SG_MIN_ROWS_PER_K * K


def gemm_plan(
    K: int, N: int, T: int, gate_up: bool = False, tm: int = GEMM_TM, tn: int | None = None,
    *, y_stride: int | None = None, bits: int = 4, zero: int = 7, affine: bool = False, group: int = 32,
) -> tuple[dict, tuple[int, int, int]]:
    """Constants and grid for shaders/matmul_int4.wgsl: Y[T, N]. The constants do not depend on T."""
    fmt = _format_consts(K, bits, zero, affine, group)
    _check_n(N)
    tn = tn or (GEMM_TN // 2 if gate_up else GEMM_TN)
    staged_rows = tm + tn * (2 if gate_up else 1)
    if tm % 4 or tn % 4 or 128 * staged_rows > WORKGROUP_BYTES:
        raise ValueError(f"TM={tm}, TN={tn}: need multiples of 4 and 128·(TM + staged W rows) ≤ {WORKGROUP_BYTES}")
    # y_stride: floats per row of Y (default N); a part of the vocabulary writes its columns of a wider Y.
    consts = dict(K=K, N=N, TM=tm, TN=tn, GATE_UP=gate_up, YS=y_stride or N, **fmt)
    # Output-column tiles fold into (x, z); y walks the token tiles.
    x, z = fold_grid(-(-N // tn))
    return consts, (x, max(-(-T // tm), 1), z)


def rows_q8_consts(N: int, gate_up: bool, tn: int | None, rows_q8: bool, rows_f32: bool | None) -> tuple[dict, int]:
    """(ROWS_F32 / ROWS_Q8 constants, TN) of an int8-activation GEMM (shaders/gemm_rows_q8.wgsl): with `rows_q8` the
    gate_up tile is one 32-element chunk of Y's row wide, so it can write that chunk in int8; `rows_f32` defaults to
    not rows_q8. `tn` None: the kernel's default, filled in by the caller."""
    rows = row_outputs("a GEMM", rows_q8, rows_f32)
    if rows_q8:
        if not gate_up or N % CHUNK or tn not in (None, CHUNK):
            raise ValueError(f"int8 output rows need gate_up, N a multiple of {CHUNK} and TN = {CHUNK} (one chunk a "
                             f"tile); got gate_up={gate_up}, N={N}, TN={tn}")
        tn = CHUNK
    return rows, tn


def rows_q8_stage_bytes(tm: int, rows_q8: bool) -> int:
    """Workgroup memory gemm_rows_q8.wgsl stages through: half the tile's rows of 33 f32s."""
    return tm // 2 * 33 * 4 if rows_q8 else 0


def gemm_q8w_plan(
    K: int, N: int, T: int, gate_up: bool = False, tm: int = GEMM_Q8W_TM, tn: int | None = None, *,
    y_stride: int | None = None, bits: int = 4, zero: int = 7, affine: bool = False, group: int = 32,
    rows_q8: bool = False, rows_f32: bool | None = None,
) -> tuple[dict, tuple[int, int, int]]:
    """Constants and grid for shaders/matmul_q8w.wgsl: Y[T, N] from X quantized by quantize_q8 (T rows), 8×4 outputs
    per thread, one 32-element chunk of K per step in two alternating buffers. The constants do not depend on T.
    `rows_q8` (gate_up): Y's rows go out in int8 (yq, ym) for the down GEMM; `rows_f32` (default: not rows_q8):
    as f32."""
    if bits != 4:
        raise ValueError(f"matmul_q8w reads 4-bit codes, got BITS={bits}")
    fmt = _format_consts(K, bits, zero, affine, group)
    _check_n(N)
    out, tn = rows_q8_consts(N, gate_up, tn, rows_q8, rows_f32)
    tn = tn or (GEMM_Q8W_TN // 2 if gate_up else GEMM_Q8W_TN)
    wn = tn * (2 if gate_up else 1)
    if tm % GEMM_Q8W_ROWS or tn % 4 or tm < GEMM_Q8W_ROWS or tn < 4:
        raise ValueError(f"TM={tm}, TN={tn}: need TM a multiple of {GEMM_Q8W_ROWS} and TN a multiple of 4")
    threads = tm // GEMM_Q8W_ROWS * (wn // 4)
    # Each thread stages at most one X vec4, one row scale and one weight row per step.
    if threads > GEMM_Q8W_MAX_WG or 2 * tm > threads or wn > threads:
        raise ValueError(f"TM={tm}, staged W rows {wn}: {threads} threads; need ≤ {GEMM_Q8W_MAX_WG}, ≥ 2·TM and "
                         f"≥ the staged W rows")
    # 32 code bytes and a scale (and a sum or min) per row
    lds = 2 * (tm + wn) * (40 if affine else 36) + rows_q8_stage_bytes(tm, rows_q8)
    if lds > WORKGROUP_BYTES:
        raise ValueError(f"TM={tm}, staged W rows {wn}: {lds} bytes of workgroup memory > {WORKGROUP_BYTES}")
    if y_stride is not None and y_stride < N:
        raise ValueError(f"YS={y_stride} is narrower than N={N}")
    consts = dict(K=K, N=N, TM=tm, TN=tn, GATE_UP=gate_up, YS=y_stride or N, ZERO=fmt["ZERO"],
                  AFFINE=fmt["AFFINE"], GROUP=fmt["GROUP"], **out)
    x, z = fold_grid(-(-N // tn))
    return consts, (x, max(-(-T // tm), 1), z)


def embedding_plan(
    D: int, vocab: int, T: int = 1, wg: int = EMBED_WG, *, row0: int = 0, n_rows: int = 0,
    bits: int = 4, zero: int = 7, affine: bool = False, group: int = 32,
) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/embedding.wgsl; a table bound in parts embeds rows [row0, row0 + n_rows)
    (n_rows 0: the whole vocabulary)."""
    fmt = _format_consts(D, bits, zero, affine, group, what="D")
    if vocab <= 0 or row0 + n_rows > vocab:
        raise ValueError(f"bad vocabulary rows: VOCAB={vocab}, rows {row0}+{n_rows}")
    words = D * bits // 32  # one thread per u32 word
    return dict(WG=wg, D=D, VOCAB=vocab, ROW0=row0, NROWS=n_rows, **fmt), (-(-words // wg), max(T, 1))

