"""Host side of the K-quant kernels (Q2_K … Q6_K, Q5_0, Q5_1 blocks read as stored): constants, grids, bindings.

Every kernel takes the weight as two bindings, `w` (q_blocks, u32) and `wh` (an f16 view: q_d for the split types,
q_blocks itself for the whole-block ones; engine/formats/kquant.py). `weight_buffers` picks them from a tensor's
arrays. Pipelines are built by name with Gpu.pipeline(shader, consts):

| shader | role | bindings (in order) | grid |
|---|---|---|---|
| matvec_kq | decode, f32 x | x, w, wh, y, step | matvec_kq_plan |
| matvec_kq_q8_wide | decode, int8 x (quantize_q8's): Q2_K, Q3_K, N<FEW_ROWS_N | xq, w, wh, y, xm | matvec_kq_q8_plan |
| matvec_kq_q8_wide_vec4 | the same for Q4_K, w as vec4 | xq, w, wh, y, xm | matvec_kq_q8_plan |
| matvec_kq_q8_chunks | the same, Q2_K, Q3_K, N ≥ FEW_ROWS_N (chunk a lane) | xq, w, wh, y, xm | matvec_kq_q8_plan |
| matvec_kq_q8 | the same, other types (Q4_K: N ≥ FEW_ROWS_N), u32 w | xq, w, wh, y, xm | matvec_kq_q8_plan |
| matvec_kq_q8_vec4 | the same, w as vec4 (blocks of whole 16-byte units) | xq, w, wh, y, xm | matvec_kq_q8_plan |
| matmul_kq | prefill GEMM, f32 X | x, w, wh, y, step | gemm_kq_plan |
| matmul_kq_q8 | prefill GEMM, int8 X (quantize_q8 rows) | xq, w, wh, y, xm, step, yq, ym | gemm_kq_q8_plan |
| embedding_kq | embedding rows as f32 | tokens, w, wh, x, step | embedding_kq_plan |

`matvec_kq_q8_kernel` picks among the five int8 decode kernels by type and output count N.
"""

from __future__ import annotations

from engine.formats.kquant import TYPES, ktype
from engine.kernels import declare, fold_grid
from engine.kernels.matmul import rows_q8_consts, rows_q8_stage_bytes

# The host's expectations of each kernel, checked against its WGSL declarations (engine/kernels/__init__.py).
MATVEC_KQ = declare("matvec_kq", writes=("y",))
MATVEC_KQ_Q8_WIDE = declare("matvec_kq_q8_wide", writes=("y",))
MATVEC_KQ_Q8_WIDE_VEC4 = declare("matvec_kq_q8_wide_vec4", writes=("y",))
MATVEC_KQ_Q8_CHUNKS = declare("matvec_kq_q8_chunks", writes=("y",))
MATVEC_KQ_Q8 = declare("matvec_kq_q8", writes=("y",))
MATVEC_KQ_Q8_VEC4 = declare("matvec_kq_q8_vec4", writes=("y",))
MATMUL_KQ = declare("matmul_kq", writes=("y",))
MATMUL_KQ_Q8 = declare("matmul_kq_q8", writes=("y", "yq", "ym"))
EMBEDDING_KQ = declare("embedding_kq", writes=("x",))

MATVEC_WG = 64
MATVEC_ROWS = 4  # weight rows per decode workgroup (halved with gate_up), as engine.kernels.matmul.MATVEC_SLOTS
MATVEC_Q8_WG = 128
MATVEC_Q8_ROWS = 2  # weight rows per subgroup (halved with gate_up), as engine.kernels.matmul.MATVEC_Q8_SLOTS
GEMM_TM = 64
GEMM_TN = 64  # halved with gate_up, so the staged weight tile stays 64 rows
GEMM_KQ_Q8_TM = 64
GEMM_KQ_Q8_TN = 64
GEMM_KQ_Q8_KC = 2
MAX_WG = 256  # WebGPU's default maxComputeInvocationsPerWorkgroup
WORKGROUP_BYTES = 16384
EMBED_WG = 64

BINDINGS = {
    "matvec_kq": ("x", "w", "wh", "y", "step"),
    "matvec_kq_q8_wide": ("xq", "w", "wh", "y", "xm"),
    "matvec_kq_q8_wide_vec4": ("xq", "w", "wh", "y", "xm"),
    "matvec_kq_q8_chunks": ("xq", "w", "wh", "y", "xm"),
    "matvec_kq_q8": ("xq", "w", "wh", "y", "xm"),
    "matvec_kq_q8_vec4": ("xq", "w", "wh", "y", "xm"),
    "matmul_kq": ("x", "w", "wh", "y", "step"),
    "matmul_kq_q8": ("xq", "w", "wh", "y", "xm", "step", "yq", "ym"),
    "embedding_kq": ("tokens", "w", "wh", "x", "step"),
}


def is_kquant(tag: str) -> bool:
    return tag in TYPES


def kq_consts(tag: str) -> dict:
    """The format constants every K-quant kernel takes (see shaders/kq_decode.wgsl)."""
    t = ktype(tag)
    return dict(KTYPE=int(t.qtype), QK=t.elements, BW=t.words, BH=t.halfs, HALVES=t.halves)


def weight_buffers(arrays: dict):
    """(w, wh): what to bind at the kernels' `w` and `wh` for a tensor's arrays (or their GPU buffers) by name."""
    return arrays["q_blocks"], arrays.get("q_d", arrays["q_blocks"])


def _check(tag: str, K: int, N: int, what: str = "K") -> dict:
    t = ktype(tag)
    if K <= 0 or K % t.elements:
        raise ValueError(f"{what} must be a positive multiple of {t.elements} for {tag}, got {K}")
    if N <= 0:
        raise ValueError(f"N must be positive, got {N}")
    return kq_consts(tag)


def matvec_kq_plan(tag: str, K: int, N: int, gate_up: bool = False, last_row: bool = False,
                   rows: int | None = None, wg: int = MATVEC_WG) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/matvec_kq.wgsl: y[N] from x row 0 (or row n_tokens − 1 with last_row)."""
    fmt = _check(tag, K, N)
    rows = rows or max(MATVEC_ROWS // (2 if gate_up else 1), 1)
    if wg & (wg - 1) or wg < rows:
        raise ValueError(f"WG must be a power of two (workgroup reduction) and ≥ ROWS; got WG={wg}, ROWS={rows}")
    consts = dict(K=K, N=N, WG=wg, ROWS=rows, LAST_ROW=last_row, GATE_UP=gate_up, **fmt)
    return consts, fold_grid(-(-N // rows))


# The int8 decode kernel of each type, the faster on the H200 (BENCH.md, K-quant int8 decode matvecs): for Q2_K,
# Q3_K and Q4_K below FEW_ROWS_N outputs matvec_kq_q8_wide (Q2_K, Q3_K) or matvec_kq_q8_wide_vec4 (Q4_K), a lane per
# 64-element item of WROWS rows built for few instructions a weight byte; from FEW_ROWS_N outputs, and for the other
# types, Q2_K / Q3_K on matvec_kq_q8_chunks (lanes of whole 32-element chunks), the others on lanes of consecutive
# 16-byte items (matvec_kq_q8, matvec_kq_q8_vec4). wide=True / wide=False override the output count's choice.
SUB_BLOCK_TYPES = ("q2_k", "q3_k")
WIDE_TYPES = ("q2_k", "q3_k", "q4_k")
SPLITS = (1, 2, 4, 8, 16)  # segments a subgroup of matvec_kq_q8_wide may be cut into
FEW_ROWS_N = 8192  # outputs below which the int8 decode kernels take one row a subgroup and WIDE_TYPES run wide
U32_DEFAULT = ("q4_k",)  # vec4 types whose default is matvec_kq_q8 (u32 loads): measured faster (BENCH.md)
Q8_BATCHES = (1, 2, 4)  # items (chunks) a lane of the item kernels or matvec_kq_q8_chunks takes per pass
Q8_BATCH_DEFAULT: dict[str, int] = {}  # per type where it is not 1


def wide_default(tag: str, n: int | None) -> bool:
    """Whether `tag`'s int8 decode matvec of `n` outputs runs matvec_kq_q8_wide(_vec4) when no knob names a kernel:
    WIDE_TYPES below FEW_ROWS_N outputs (the H200 measured it faster on 3072 outputs, not on 9216)."""
    if tag not in WIDE_TYPES:
        return False
    if n is None:
        raise ValueError(f"{tag}'s int8 decode kernel depends on the output count: pass n (or wide=)")
    return n < FEW_ROWS_N


def has_vec4_blocks(tag: str) -> bool:
    """Blocks of whole 16-byte units in q_blocks (Q4_K, Q5_K, Q6_K): matvec_kq_q8_vec4 can read them."""
    return ktype(tag).words % 4 == 0


def q8_kernel_kind(tag: str, vec4: bool | None = None, chunks: bool | None = None, wide: bool | None = None,
                   *, n: int | None = None) -> str:
    """Which int8 decode kernel the knobs ask for: "wide" (wide=True, or with no knob wide_default(tag, n)),
    Q2_K / Q3_K's "chunks", the others' "items"."""
    if wide and tag not in WIDE_TYPES:
        raise ValueError(f"matvec_kq_q8_wide reads {', '.join(t.upper() for t in WIDE_TYPES)} only, not {tag}")
    if chunks is not None and tag not in SUB_BLOCK_TYPES:
        raise ValueError(f"matvec_kq_q8_chunks reads Q2_K and Q3_K only, not {tag}")
    if chunks is False:
        raise ValueError("chunks=False named matvec_kq_q8_sub, which is gone: wide=True names the other Q2_K / Q3_K "
                         "kernel")
    if wide and (chunks or vec4 is not None):
        raise ValueError("wide=True and chunks / vec4 name different kernels")
    if wide or (wide is None and chunks is None and vec4 is None and wide_default(tag, n)):
        return "wide"
    return "chunks" if tag in SUB_BLOCK_TYPES else "items"


def matvec_kq_q8_kernel(tag: str, vec4: bool | None = None, chunks: bool | None = None, wide: bool | None = None,
                        *, n: int | None = None):
    """The int8 decode kernel for `tag` and `n` outputs (q8_kernel_kind's). By default Q2_K, Q3_K and Q4_K below
    FEW_ROWS_N outputs run matvec_kq_q8_wide (Q2_K, Q3_K) or matvec_kq_q8_wide_vec4 (Q4_K); otherwise Q2_K and Q3_K
    run matvec_kq_q8_chunks (chunks=True names it at any n), the others matvec_kq_q8_vec4 where the blocks allow (or
    `vec4` asks), else matvec_kq_q8 (u32 loads; vec4=False asks for it on any of them; U32_DEFAULT's types by
    default). wide=True / wide=False: the wide kernel or not, whatever n."""
    if vec4 and not has_vec4_blocks(tag):
        raise ValueError(f"{tag} blocks are {ktype(tag).words * 4} bytes in q_blocks, not whole 16-byte units: "
                         "matvec_kq_q8_vec4 cannot read them")
    if tag in SUB_BLOCK_TYPES and vec4 is not None:
        raise ValueError(f"{tag} runs matvec_kq_q8_wide or matvec_kq_q8_chunks only "
                         "(shaders/kq_items.wgsl has no items of its blocks)")
    kind = q8_kernel_kind(tag, vec4, chunks, wide, n=n)
    if kind == "wide":
        return MATVEC_KQ_Q8_WIDE_VEC4 if has_vec4_blocks(tag) else MATVEC_KQ_Q8_WIDE
    if kind == "chunks":
        return MATVEC_KQ_Q8_CHUNKS
    vec4 = has_vec4_blocks(tag) and tag not in U32_DEFAULT if vec4 is None else vec4
    return MATVEC_KQ_Q8_VEC4 if vec4 else MATVEC_KQ_Q8


def wide_split(items: int, subgroup_size: int) -> int:
    """matvec_kq_q8_wide(_vec4)'s default SPLIT: whole subgroups on a row set (most subgroups, each lane at most a
    few items) unless a row has at most half a subgroup's items; then segments of the fewest lanes that still take a
    row's items in one pass (K = 1024: 16 items, segments of 16 lanes at 32)."""
    split = 1
    while 2 * split in SPLITS and 2 * split <= subgroup_size and items <= subgroup_size // (2 * split):
        split *= 2
    return split


def q8_rows_default(N: int, gate_up: bool = False) -> int:
    """ROWS of the int8 decode kernels: MATVEC_Q8_ROWS (halved with gate_up), but 1 for matrices of fewer than
    FEW_ROWS_N outputs, whose subgroups would otherwise not fill the GPU (the H200 measured rows 1 faster for every
    type on 3072 outputs, rows 2 on 9216: BENCH.md, 2026-12-07)."""
    if N < FEW_ROWS_N:
        return 1
    return max(MATVEC_Q8_ROWS // (2 if gate_up else 1), 1)


def q8_stage_fits(K: int, wg: int) -> bool:
    """Whether an int8 decode kernel can stage the activation row in workgroup memory (shaders/kq_q8_halves.wgsl):
    its element-order codes (K bytes, in whole 128-byte groups) and per-chunk scale and half sums (K / 4 bytes),
    beside reduce_subgroup's WG vec4s."""
    return -(-K // 128) * 128 + K // 4 + 16 * wg <= WORKGROUP_BYTES


def matvec_kq_q8_plan(tag: str, K: int, N: int, subgroup_size: int, gate_up: bool = False, rows: int | None = None,
                      wg: int = MATVEC_Q8_WG, *, vec4: bool | None = None, chunks: bool | None = None,
                      wide: bool | None = None,
                      split: int | None = None, stage: bool | None = None,
                      batch: int | None = None) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for the int8 decode kernel of `tag` and N outputs (matvec_kq_q8_kernel's with n=N:
    shaders/matvec_kq_q8_wide(_vec4), matvec_kq_q8_chunks, matvec_kq_q8 or matvec_kq_q8_vec4; x from quantize_q8 or
    a norm's Q8 output; `vec4`, `chunks`, `wide` as there). BLOCKS row blocks of ROWS outputs per workgroup, one per
    subgroup of the probed size (any real size still covers all). `stage` (the item kernels; default off): the
    activation row staged in workgroup memory. `split` (matvec_kq_q8_wide, default wide_split): segments per
    subgroup, each taking ROWS outputs. `batch` (the item kernels and matvec_kq_q8_chunks, default Q8_BATCH_DEFAULT's
    or 1): items (chunks) a lane takes per pass, their loads issued together."""
    fmt = _check(tag, K, N)
    if subgroup_size < 1 or wg % subgroup_size:
        raise ValueError(f"WG={wg} must be a multiple of the subgroup size {subgroup_size}")
    rows = rows or q8_rows_default(N, gate_up)
    blocks = wg // subgroup_size
    which = q8_kernel_kind(tag, vec4, chunks, wide, n=N)
    if split is not None and which != "wide":
        raise ValueError("split is matvec_kq_q8_wide's knob (Q2_K, Q3_K, Q4_K below FEW_ROWS_N outputs or wide=True)")
    if stage is not None and which in ("chunks", "wide"):
        raise ValueError(f"matvec_kq_q8_{which} reads the activation row as it is: no stage")
    consts = dict(K=K, N=N, WG=wg, ROWS=rows, BLOCKS=blocks, GATE_UP=gate_up, **fmt)
    if batch is not None and which not in ("items", "chunks"):
        raise ValueError("batch is the item kernels' and matvec_kq_q8_chunks' knob")
    if which in ("items", "chunks"):
        batch = Q8_BATCH_DEFAULT.get(tag, 1) if batch is None else batch
        if batch not in Q8_BATCHES:
            raise ValueError(f"BATCH must be one of {Q8_BATCHES}, got {batch}")
        consts["BATCH"] = batch
    if which == "items":
        stage = False if stage is None else stage  # staging measured slower on the H200 for every type (BENCH.md)
        if stage and not q8_stage_fits(K, wg):
            raise ValueError(f"K={K}: the staged activation row ({K * 5 // 4} bytes) and WG={wg} do not fit "
                             f"{WORKGROUP_BYTES} bytes of workgroup memory")
        consts["STAGE"] = stage
    if which == "wide":
        split = split or wide_split(K // 64, subgroup_size)
        if split not in SPLITS:
            raise ValueError(f"SPLIT must be one of {SPLITS}, got {split}")
        del consts["HALVES"], consts["BH"]
        consts["SPLIT"] = split
        return consts, fold_grid(-(-N // (rows * blocks * split)))
    # Q2_K and Q3_K both scale per 16 elements (no HALVES); kq_items.wgsl indexes wh by block (no BH).
    del consts["HALVES" if tag in SUB_BLOCK_TYPES else "BH"]
    return consts, fold_grid(-(-N // (rows * blocks)))


def _y_stride(N: int, y_stride: int | None) -> int:
    if y_stride is not None and y_stride < N:
        raise ValueError(f"YS={y_stride} is narrower than N={N}")
    return y_stride or N


def gemm_kq_plan(tag: str, K: int, N: int, T: int, gate_up: bool = False, tm: int = GEMM_TM, tn: int | None = None,
                 *, y_stride: int | None = None) -> tuple[dict, tuple[int, int, int]]:
    """Constants and grid for shaders/matmul_kq.wgsl: Y[T, N] (row t at t·YS). The constants do not depend on T."""
    fmt = _check(tag, K, N)
    tn = tn or (GEMM_TN // 2 if gate_up else GEMM_TN)
    wn = tn * (2 if gate_up else 1)
    if tm % 4 or tn % 4 or tm < 4 or tn < 4 or 128 * (tm + wn) > WORKGROUP_BYTES or tm * wn // 16 > MAX_WG:
        raise ValueError(f"TM={tm}, TN={tn}: need multiples of 4, 128·(TM + staged W rows) ≤ {WORKGROUP_BYTES} "
                         f"bytes and (TM/4)·(staged W rows/4) ≤ {MAX_WG} threads")
    consts = dict(K=K, N=N, TM=tm, TN=tn, GATE_UP=gate_up, YS=_y_stride(N, y_stride), **fmt)
    x, z = fold_grid(-(-N // tn))
    return consts, (x, max(-(-T // tm), 1), z)


def gemm_kq_q8_workgroup_bytes(tm: int, wn: int, kc: int, rows_q8: bool = False) -> int:
    """Workgroup memory of matmul_kq_q8: int8 X and W halves (16 B each), W (a, b) per half, X scale and Σ per half;
    with `rows_q8` the int8 epilogue's staging (engine/kernels/matmul.py rows_q8_stage_bytes)."""
    return kc * (2 * 16 * (tm + wn) + 2 * 2 * 4 * wn + 4 * tm + 2 * 4 * tm) + rows_q8_stage_bytes(tm, rows_q8)


def gemm_kq_q8_plan(tag: str, K: int, N: int, T: int, gate_up: bool = False, tm: int = GEMM_KQ_Q8_TM,
                    tn: int | None = None, kc: int | None = None, *, y_stride: int | None = None,
                    rows_q8: bool = False, rows_f32: bool | None = None) -> tuple[dict, tuple[int, int, int]]:
    """Constants and grid for shaders/matmul_kq_q8.wgsl: Y[T, N] from X quantized by quantize_q8 (T rows).
    `rows_q8` (gate_up): Y's rows go out in int8 (yq, ym) for the down GEMM; `rows_f32` (default: not rows_q8):
    as f32."""
    fmt = _check(tag, K, N)
    out, tn = rows_q8_consts(N, gate_up, tn, rows_q8, rows_f32)
    tn = tn or (GEMM_KQ_Q8_TN // 2 if gate_up else GEMM_KQ_Q8_TN)
    wn = tn * (2 if gate_up else 1)
    chunks = K // 32
    kc = kc or (GEMM_KQ_Q8_KC if chunks % GEMM_KQ_Q8_KC == 0 else 1)
    if tm % 4 or tn % 4 or tm < 4 or tn < 4 or tm * wn // 16 > MAX_WG:
        raise ValueError(f"TM={tm}, TN={tn}: need multiples of 4 and (TM/4)·(staged W rows/4) ≤ {MAX_WG} threads")
    if kc < 1 or chunks % kc:
        raise ValueError(f"KC={kc} must divide the {chunks} chunks of K={K}")
    if rows_q8 and tm // 2 > tm * wn // 16:
        raise ValueError(f"TM={tm}, staged W rows {wn}: fewer threads than the int8 epilogue's staged rows")
    lds = gemm_kq_q8_workgroup_bytes(tm, wn, kc, rows_q8)
    if lds > WORKGROUP_BYTES:
        raise ValueError(f"TM={tm}, staged W rows {wn}, KC={kc}: {lds} bytes of workgroup memory > {WORKGROUP_BYTES}")
    consts = dict(K=K, N=N, TM=tm, TN=tn, KC=kc, GATE_UP=gate_up, YS=_y_stride(N, y_stride), **fmt, **out)
    x, z = fold_grid(-(-N // tn))
    return consts, (x, max(-(-T // tm), 1), z)


def embedding_kq_plan(tag: str, D: int, vocab: int, T: int = 1, wg: int = EMBED_WG, row0: int = 0,
                      nrows: int = 0) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/embedding_kq.wgsl: x[t, :] = row tokens[t]. A table bound in parts: this
    dispatch holds rows [row0, row0 + nrows) (nrows 0: the whole vocabulary) and embeds only tokens among them."""
    fmt = _check(tag, D, vocab, what="D")
    if row0 < 0 or nrows < 0 or row0 + nrows > vocab or (row0 and not nrows):
        raise ValueError(f"rows {row0} + {nrows} do not fit a vocabulary of {vocab}")
    consts = dict(WG=wg, D=D, VOCAB=vocab, ROW0=row0, NROWS=nrows, **fmt)
    return consts, (-(-(D // 4) // wg), max(T, 1))
