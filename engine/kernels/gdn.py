"""Gated DeltaNet kernels' host side (Qwen3.5's linear-attention layers): the causal conv (which also computes the
decay/beta gates), the delta-rule recurrence and the gated output norm."""

from __future__ import annotations

from engine.kernels import declare, fold_grid, row_outputs

GDN_CONV = declare("gdn_conv", writes=("state", "y", "gates"))
GDN_RECUR = declare("gdn_recur", writes=("state", "out"))
GDN_RECUR_SG = declare("gdn_recur_sg", writes=("state", "out"))
GDN_NORM_OUT = declare("gdn_norm_out", writes=("y", "xq", "xm"))
# gdn_conv: threads a workgroup with one run (decode: one thread per channel) and with several (a prefill chunk's
# runs of one channel group in one workgroup); a full chunk gives each thread about CONV_RUN_TOKENS tokens to walk
# in order (one thread walking 512 dependent steps left the chunk latency-bound), in at most CONV_MAX_RUNS runs.
CONV_WG = 64
CONV_RUNS_WG = 256
CONV_RUN_TOKENS = 16
CONV_MAX_RUNS = 32
# Threads per state column in gdn_recur: one thread per whole column spilled its registers (BENCH.md, gdn_rsplit).
RECUR_RSPLIT = 4
# gdn_recur_sg: threads per column (its shuffles stay inside one subgroup, so at most the subgroup size), rows a thread
# holds at most (a whole 128-row column a thread spilled), and threads a workgroup (small: decode's T = 1 wants many
# workgroups in flight, and with no barriers a bigger workgroup buys nothing).
RECUR_SG_RSPLITS = (8, 4, 2)
RECUR_SG_MAX_ROWS = 32
RECUR_SG_WG = 64


def gdn_dims(conv_dim: int, v_heads: int, v_dim: int) -> dict:
    """Row layout of the fused in_proj output: [q | k | v (conv channels) | z | a | b]."""
    vd = v_heads * v_dim
    return dict(CONV=conv_dim, VD=vd, ROW=conv_dim + vd + 2 * v_heads, Z_OFF=conv_dim, A_OFF=conv_dim + vd,
                B_OFF=conv_dim + vd + v_heads)


def gdn_conv_plan(conv: int, row: int, kc: int, vh: int, a_off: int, b_off: int, runs: int = 1,
                  wg: int | None = None) -> tuple[dict, tuple[int, int]]:
    """Constants and grid of gdn_conv.wgsl: the conv over `conv` channels, each channel's tokens split into `runs`
    runs walked by WG / runs threads of one workgroup (runs 1: one thread per channel walks them all; WG by default
    the most threads up to CONV_RUNS_WG that `runs` divides), and the gates of `vh` value heads (a and b at columns
    a_off + h, b_off + h of the rows), spread over the grid."""
    wg = wg or (CONV_WG if runs == 1 else max(runs, CONV_RUNS_WG // max(runs, 1) * runs))
    if kc < 2:
        raise ValueError(f"conv kernel width must be at least 2, got {kc}")
    if vh < 1:
        raise ValueError(f"gdn_conv computes the gates of at least one value head, got VH={vh}")
    if not 1 <= runs <= wg <= 256 or wg % runs:
        raise ValueError(f"gdn_conv needs 1 ≤ RUNS ≤ WG ≤ 256 threads and RUNS dividing WG; got RUNS={runs} WG={wg}")
    return (dict(WG=wg, RUNS=runs, CONV=conv, ROW=row, KC=kc, VH=vh, A_OFF=a_off, B_OFF=b_off),
            fold_grid(-(-conv // (wg // runs))))


def gdn_conv_runs(chunk: int) -> int:
    """Runs a prefill chunk's conv splits each channel's tokens into: about CONV_RUN_TOKENS tokens a thread at a
    full chunk (a power of two, at most CONV_MAX_RUNS; 1 for one-token chunks)."""
    want = -(-chunk // CONV_RUN_TOKENS)
    return min(CONV_MAX_RUNS, 1 << (want - 1).bit_length())


def gdn_recur_plan(kh: int, vh: int, dk: int, dv: int, conv: int, wg: int = 128,
                   rsplit: int = RECUR_RSPLIT) -> tuple[dict, tuple[int, int]]:
    """RSPLIT threads per state column (DK / RSPLIT rows each), WG / RSPLIT columns per workgroup: (VH, DV / 32)
    workgroups of 128 threads for Qwen3.5-4B."""
    if vh % kh or wg & (wg - 1) or dk > 1024 or rsplit < 1 or dk % rsplit or wg % rsplit:
        raise ValueError(f"gdn_recur needs VH % KH == 0, WG a power of two, DK ≤ 1024 and RSPLIT dividing DK and WG; "
                         f"got KH={kh} VH={vh} DK={dk} WG={wg} RSPLIT={rsplit}")
    return dict(WG=wg, RSPLIT=rsplit, KH=kh, VH=vh, DK=dk, DV=dv, CONV=conv), (vh, -(-dv // (wg // rsplit)))


def gdn_recur_sg_plan(kh: int, vh: int, dk: int, dv: int, conv: int, rsplit: int,
                      wg: int = RECUR_SG_WG) -> tuple[dict, tuple[int, int]]:
    """gdn_recur_sg.wgsl: RSPLIT lanes of one subgroup per state column (the caller keeps RSPLIT ≤ the subgroup
    size), each holding DK / RSPLIT rows as vec4s, WG / RSPLIT columns per workgroup; q/k/v rows read as vec4s."""
    pow2 = rsplit >= 1 and not rsplit & (rsplit - 1) and wg >= rsplit and not wg & (wg - 1)
    if vh % kh or not pow2 or dk % (4 * rsplit) or conv % 4:
        raise ValueError(f"gdn_recur_sg needs VH % KH == 0, RSPLIT and WG ≥ RSPLIT powers of two, 4·RSPLIT dividing "
                         f"DK and CONV a multiple of 4; got KH={kh} VH={vh} DK={dk} CONV={conv} WG={wg} "
                         f"RSPLIT={rsplit}")
    return dict(WG=wg, RSPLIT=rsplit, KH=kh, VH=vh, DK=dk, DV=dv, CONV=conv), (vh, -(-dv // (wg // rsplit)))


def gdn_recur_kernel(kh: int, vh: int, dk: int, dv: int, conv: int, subgroup_size: int):
    """(Kernel, constants, grid) of the recurrence: the subgroup-shuffle kernel where the device runs subgroup ops
    (`subgroup_size` 0 where it does not) of at least the RSPLIT lanes a column needs, else the workgroup-memory
    one."""
    fits = [r for r in RECUR_SG_RSPLITS if r <= subgroup_size and dk % (4 * r) == 0 and dk // r <= RECUR_SG_MAX_ROWS]
    if fits and vh % kh == 0 and conv % 4 == 0:
        return (GDN_RECUR_SG, *gdn_recur_sg_plan(kh, vh, dk, dv, conv, fits[0]))
    return (GDN_RECUR, *gdn_recur_plan(kh, vh, dk, dv, conv))


def gdn_norm_plan(vh: int, dv: int, eps: float, row: int, z_off: int, rows_q8: bool = False,
                  rows_f32: bool | None = None) -> dict:
    """Constants for gdn_norm_out.wgsl (grid (VH, T)). `rows_q8`: each token's output also (or only) goes to int8,
    the out projection's input (DV a multiple of 32); `rows_f32` (default: not rows_q8) as f32."""
    if rows_q8 and dv % 32:
        raise ValueError(f"gdn_norm_out writes int8 rows only for a value head dim a multiple of 32, got {dv}")
    return dict(WG=min(256, max(32, 1 << (dv - 1).bit_length())), VH=vh, DV=dv, EPS=float(eps), ROW=row, Z_OFF=z_off,
                **row_outputs("gdn_norm_out", rows_q8, rows_f32))
