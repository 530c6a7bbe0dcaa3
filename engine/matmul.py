"""Host side of the q4f16_1 matmul kernels: pipeline constants and dispatch grid for a shape.

matvec_int4 (decode, one activation row) and matmul_int4 (prefill GEMM, T rows) share bindings:
0 x f32[T, K], 1 q_weight u32[N or 2N, K/8], 2 q_scale f16[N or 2N, K/32], 3 y f32, 4 step uniform.
With gate_up the weight holds gate rows then up rows and y gets silu(gate)·up ([N] or [T, N]).
The defaults are untuned starting points.
"""

from __future__ import annotations

from engine.gpu import fold_grid

MATVEC_WG = 64
MATVEC_ROWS = 8  # outputs per workgroup: each thread keeps this many weight loads in flight
GEMM_TM = 64
GEMM_TN = 64  # halved with gate_up, so the staged weight tile stays 64 rows
WORKGROUP_BYTES = 16384


def _check_shape(K: int, N: int) -> None:
    if K <= 0 or K % 32:
        raise ValueError(f"K must be a positive multiple of 32 (the q4f16_1 group size), got {K}")
    if N <= 0:
        raise ValueError(f"N must be positive, got {N}")


def matvec_plan(
    K: int, N: int, gate_up: bool = False, last_row: bool = False, rows: int = MATVEC_ROWS, wg: int = MATVEC_WG
) -> tuple[dict, tuple[int, int]]:
    """Constants and grid for shaders/matvec_int4.wgsl: y[N] from x row 0 (or row n_tokens-1 if last_row)."""
    _check_shape(K, N)
    if wg & (wg - 1) or wg < rows:
        raise ValueError(f"WG must be a power of two (workgroup reduction) and ≥ ROWS; got WG={wg}, ROWS={rows}")
    consts = dict(K=K, N=N, WG=wg, ROWS=rows, LAST_ROW=last_row, GATE_UP=gate_up)
    return consts, fold_grid(-(-N // rows))


def gemm_plan(
    K: int, N: int, T: int, gate_up: bool = False, tm: int = GEMM_TM, tn: int | None = None
) -> tuple[dict, tuple[int, int, int]]:
    """Constants and grid for shaders/matmul_int4.wgsl: Y[T, N]. The constants do not depend on T."""
    _check_shape(K, N)
    tn = tn or (GEMM_TN // 2 if gate_up else GEMM_TN)
    staged_rows = tm + tn * (2 if gate_up else 1)
    if tm % 4 or tn % 4 or 128 * staged_rows > WORKGROUP_BYTES:
        raise ValueError(f"TM={tm}, TN={tn}: need multiples of 4 and 128·(TM + staged W rows) ≤ {WORKGROUP_BYTES}")
    consts = dict(K=K, N=N, TM=tm, TN=tn, GATE_UP=gate_up)
    # Output-column tiles fold into (x, z); y walks the token tiles.
    x, z = fold_grid(-(-N // tn))
    return consts, (x, max(-(-T // tm), 1), z)
