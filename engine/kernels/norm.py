"""RMSNorm kernels' host side: the first norm (rms_norm) and the residual add fused with the next norm
(add_rms_norm); with Q8 either also writes its last row in int8 (shaders/norm_q8.wgsl)."""

from __future__ import annotations

from engine.kernels import declare

RMS_NORM = declare("rms_norm", writes=("y", "xq", "xm"))
ADD_RMS_NORM = declare("add_rms_norm", writes=("r_out", "y", "xq", "xm"))
ADD_RMS_NORM_ROWS = declare("add_rms_norm_rows", writes=("r_out", "y", "xq", "xm"))
NORM_WG = 256
ROWS_Q8_MAX_DIM = 5120  # add_rms_norm_rows.wgsl keeps 2·D bytes of a row in workgroup memory (+ 4 KiB reduction)
Q8_MAX_DIM = 8192  # norm_q8.wgsl keeps a row's int8 codes in workgroup memory: D/4 words


def norm_can_write_int8(dim: int) -> bool:
    """Whether the norms can write their row's int8 copy (norm_q8.wgsl needs whole 32-element chunks, and room)."""
    return dim % 32 == 0 and dim <= Q8_MAX_DIM


def norm_plan(dim: int, eps: float, q8: bool, norm_offset: float = 0.0) -> dict:
    """Constants for rms_norm.wgsl and add_rms_norm.wgsl (one workgroup per row: grid (T,))."""
    if q8 and not norm_can_write_int8(dim):
        raise ValueError(f"the norms write int8 rows only for D a multiple of 32 up to {Q8_MAX_DIM}, got {dim}")
    return dict(WG=NORM_WG, D=dim, EPS=float(eps), Q8=bool(q8), NORM_OFFSET=float(norm_offset))


def norm_can_write_rows_int8(dim: int) -> bool:
    """Whether the prefill's add + norm can write every row in int8 (add_rms_norm_rows.wgsl)."""
    return dim % 32 == 0 and dim <= ROWS_Q8_MAX_DIM


def norm_rows_plan(dim: int, eps: float, norm_offset: float = 0.0) -> dict:
    """Constants for add_rms_norm_rows.wgsl (one workgroup per row: grid (T,))."""
    if not norm_can_write_rows_int8(dim):
        raise ValueError(f"add_rms_norm_rows needs D a multiple of 32 up to {ROWS_Q8_MAX_DIM}, got {dim}")
    return dict(WG=NORM_WG, D=dim, EPS=float(eps), NORM_OFFSET=float(norm_offset))
