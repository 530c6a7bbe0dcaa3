"""The int8-activation prefill GEMM (shaders/matmul_q8w.wgsl): T rows quantized by quantize_q8, checked against
float64 numpy on exactly the codes and scales the kernel reads, for every 4-bit format, gate_up, a wider output row
(YS), fewer tokens than buffer rows, partial tiles, folded grids and the tile options."""

import numpy as np
import pytest

from engine.kernels import MAX_GROUPS_PER_DIM
from engine.kernels.matmul import FORMATS, gemm_q8w_plan, quantize_q8_plan
from tests.helpers import (
    Q8_SCALE_ULPS,
    assert_within_ulps,
    int8_rounding_bound,
    poisoned,
    random_packed,
    read,
    reference_dequantize_fmt,
    reference_fmt,
    reference_quantize_q8,
    run,
    step_uniform,
    unpack_codes,
)

Q4 = {tag: FORMATS[tag] for tag in ("q4f16_1", "q4_0", "q4_1", "mlx4")}


def pack_rows(x: np.ndarray, got_xq: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """q8_pack.wgsl's layout written from its spec, row by row: (xq u32 [T, K/4], xm [T, K/32, 2] with exact
    scales). Codes whose exact value sits within the kernels' rounding of a half-integer take the GPU's choice
    (reference_quantize_q8), read in element order from `got_xq`."""
    xq, xm = [], []
    for row, got in zip(x, got_xq, strict=True):
        q, scale, total = reference_quantize_q8(row, unpack_codes(got))
        words = q.reshape(-1, 4, 8)  # chunk, 8-element word, element
        xq.append(np.stack([words[:, :, 0::2], words[:, :, 1::2]], axis=2).reshape(-1).view(np.uint32))
        xm.append(np.stack([scale, total.astype(np.float64)], axis=1))
    return np.stack(xq), np.stack(xm)


def dequantized(xq: np.ndarray, xm: np.ndarray) -> np.ndarray:
    """float64 X as the GEMM sees it: codes × their chunk's scale."""
    codes = np.stack([unpack_codes(row) for row in xq]).astype(np.float64)
    return codes * np.repeat(xm[..., 0].astype(np.float64), 32, axis=1)


def scaled_activations(rng, T: int, K: int) -> np.ndarray:
    """Rows whose chunks span two orders of magnitude (so per-chunk scales matter), one chunk all zero."""
    x = rng.standard_normal((T, K)) * rng.uniform(0.1, 10, (T, K // 32)).repeat(32, axis=1)
    x[:, 32:64] = 0
    return x.astype(np.float32)


def quantize_rows(gpu, x: np.ndarray):
    """quantize_q8 over all T rows (one dispatch, grid (ceil(K/32/WG), T)): the buffers and their contents."""
    T, K = x.shape
    xq, xm = poisoned(gpu, "xq", (T, K // 4), np.uint32), poisoned(gpu, "xm", (T, K // 32, 2))
    consts, grid = quantize_q8_plan(K, rows=T)
    run(gpu, "quantize_q8", consts, [gpu.upload("x", x), xq, xm, step_uniform(gpu, T)], grid)
    return xq, xm, read(gpu, xq, (T, K // 4), np.uint32), read(gpu, xm, (T, K // 32, 2))


def run_gemm_q8(gpu, x, w, s, N, gate_up, fmt, n_tokens=None, y_stride=None, **plan):
    """Quantize x's rows on the GPU, run matmul_q8w into a NaN-poisoned Y [rows, YS]; (Y, the X it read, grid)."""
    T, K = x.shape
    n_tokens = T if n_tokens is None else n_tokens
    xq_buf, xm_buf, xq, xm = quantize_rows(gpu, x)
    consts, grid = gemm_q8w_plan(K, N, T, gate_up=gate_up, y_stride=y_stride, **plan, **fmt)
    ys = consts["YS"]
    y = poisoned(gpu, "y", (T, ys))
    unused = [gpu.buffer("yq", 16), gpu.buffer("ym", 16)]  # the int8 output rows (not with these plans)
    run(gpu, "matmul_q8w", consts, [xq_buf, gpu.upload("w", w), gpu.upload("s", s), y, xm_buf,
                                    step_uniform(gpu, n_tokens), *unused], grid)
    return read(gpu, y, (T, ys)), dequantized(xq, xm), grid


def assert_matches(out, ref):
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    # Integer dot products per chunk are exact; only f32 scaling and sums over K/32 ≤ 16 chunks round.
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err <= 1e-5, f"max error {err:.2e} of max|ref|"


def test_quantize_q8_rows_match_the_layout_spec(gpu, rng):
    """The T-row quantize the runtime dispatches writes row t at t·K/4 exactly as q8_pack.wgsl says."""
    x = scaled_activations(rng, 9, 320)
    _, _, xq, xm = quantize_rows(gpu, x)
    ref_q, ref_m = pack_rows(x, xq)
    np.testing.assert_array_equal(xq, ref_q)
    assert_within_ulps(xm[..., 0], ref_m[..., 0], Q8_SCALE_ULPS)
    np.testing.assert_array_equal(xm[..., 1], ref_m[..., 1])


@pytest.mark.parametrize("tag", list(Q4))
@pytest.mark.parametrize(
    "T,K,N,gate_up",
    [
        (1, 64, 5, False),
        (5, 256, 37, False),  # several scale groups (8 at 32, 4 at 64) and steps
        (64, 128, 64, False),  # exact tiles
        (70, 192, 130, False),  # T and N both past a tile edge
        (5, 64, 38, True),  # even N ending mid-tile: the last thread writes one gate/up pair
        (67, 128, 33, True),
    ],
)
def test_gemm_q8_on_the_quantized_x(gpu, rng, tag, T, K, N, gate_up):
    fmt = Q4[tag]
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    out, x_hat, _ = run_gemm_q8(gpu, scaled_activations(rng, T, K), w, s, N, gate_up, fmt)
    assert_matches(out, reference_fmt(x_hat, w, s, N, gate_up, fmt))


@pytest.mark.parametrize("tag", ["q4f16_1", "q4_1"])
def test_gemm_q8_is_close_to_the_f32_product(gpu, rng, tag):
    """Against the unrounded x the int8 rounding shows, within its own bound (per chunk, codes are within half a
    step of max|x|/127); more than the 1e-5 of max|y| that f32 arithmetic on the codes stays within (above)."""
    fmt, T, K, N = Q4[tag], 33, 512, 70
    w, s = random_packed(rng, N, K, **fmt)
    x = rng.standard_normal((T, K)).astype(np.float32)
    out, _, _ = run_gemm_q8(gpu, x, w, s, N, False, fmt)
    exact = reference_fmt(x, w, s, N, False, fmt)
    bound = int8_rounding_bound(x, reference_dequantize_fmt(w, s, **fmt), N, False)
    assert (np.abs(out - exact) <= bound + 1e-5 * np.abs(exact).max()).all()
    assert np.abs(out - exact).max() > 1e-5 * np.abs(exact).max(), "no int8 rounding at all"


@pytest.mark.parametrize("gate_up", [False, True])
def test_gemm_q8_writes_only_live_rows_and_its_columns(gpu, rng, gate_up):
    """A buffer of 8 rows with 5 tokens this forward, and a vocabulary slice of N columns in rows YS wide: rows
    t ≥ n_tokens and columns ≥ N stay untouched (NaN)."""
    fmt, T, K, N, n_tokens, ys = Q4["q4_0"], 8, 128, 21, 5, 29
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    out, x_hat, _ = run_gemm_q8(gpu, scaled_activations(rng, T, K), w, s, N, gate_up, fmt, n_tokens=n_tokens,
                                y_stride=ys)
    assert np.isnan(out[n_tokens:]).all() and np.isnan(out[:, N:]).all()
    assert_matches(out[:n_tokens, :N], reference_fmt(x_hat[:n_tokens], w, s, N, gate_up, fmt))


@pytest.mark.parametrize("tag", ["q4_0", "q4_1"])  # 32-element groups: K may hold an odd number of chunks
@pytest.mark.parametrize("T,K,N,gate_up", [(3, 32, 9, False), (66, 96, 70, True)])
def test_gemm_q8_odd_chunks_of_k(gpu, rng, tag, T, K, N, gate_up):
    """One chunk (matmul_q8w fills only its first buffer) and three (it ends on its first buffer again)."""
    fmt = Q4[tag]
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    out, x_hat, _ = run_gemm_q8(gpu, scaled_activations(rng, T, K), w, s, N, gate_up, fmt)
    assert_matches(out, reference_fmt(x_hat, w, s, N, gate_up, fmt))


@pytest.mark.parametrize(
    "tag,K,T,plan",
    [
        ("q4_1", 160, 137, dict(tm=128, tn=64)),  # 256 threads, T past two 128-row tiles, 5 chunks
        ("q4_0", 128, 37, dict(tm=64, tn=128)),  # 256 threads as 8 × 32
        ("mlx4", 192, 37, dict(tm=32, tn=64)),  # 64 threads
    ],
)
def test_gemm_q8w_tile_options(gpu, rng, tag, K, T, plan):
    fmt, N = Q4[tag], 45
    for gate_up in (False, True):
        w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
        tile = dict(plan, tn=plan["tn"] // 2) if gate_up else plan  # the same staged weight rows
        out, x_hat, _ = run_gemm_q8(gpu, scaled_activations(rng, T, K), w, s, N, gate_up, fmt, **tile)
        assert_matches(out, reference_fmt(x_hat, w, s, N, gate_up, fmt))


def test_gemm_q8w_plan_refuses_what_it_cannot_run():
    with pytest.raises(ValueError, match="4-bit"):
        gemm_q8w_plan(64, 8, 4, **FORMATS["q8_0"])
    with pytest.raises(ValueError, match="4-bit"):
        gemm_q8w_plan(64, 8, 4, bits=16)
    with pytest.raises(ValueError, match="multiple of 64"):
        gemm_q8w_plan(96, 8, 4, **FORMATS["mlx4"])  # K must hold whole groups
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm_q8w_plan(48, 8, 4)
    with pytest.raises(ValueError, match="N must be positive"):
        gemm_q8w_plan(64, 0, 4)
    with pytest.raises(ValueError, match="multiple of 8"):
        gemm_q8w_plan(64, 8, 4, tm=12)
    with pytest.raises(ValueError, match="threads"):
        gemm_q8w_plan(64, 8, 4, tm=64, tn=32)  # 64 threads cannot stage 128 X vec4s
    with pytest.raises(ValueError, match="threads"):
        gemm_q8w_plan(64, 8, 4, tm=128, tn=128)  # 512 threads
    with pytest.raises(ValueError, match="workgroup memory"):
        gemm_q8w_plan(64, 8, 4, tm=32, tn=256)  # 256 threads, 20 KiB
    with pytest.raises(ValueError, match="narrower"):
        gemm_q8w_plan(64, 8, 4, y_stride=7)
    consts, grid = gemm_q8w_plan(3072, 8192, 512, gate_up=True)
    assert (consts["TM"], consts["TN"], grid) == (64, 32, (256, 8, 1))


@pytest.mark.slow
def test_gemm_q8_folded_grid(gpu, rng):
    # More than 65,535 column tiles (32 gate/up pairs each, the fewest a 32-row tile stages): they fold into (x, z).
    fmt, K, N, T = Q4["q4f16_1"], 32, 32 * MAX_GROUPS_PER_DIM + 40, 5
    w, s = random_packed(rng, 2 * N, K, **fmt)
    out, x_hat, grid = run_gemm_q8(gpu, scaled_activations(rng, T, K), w, s, N, True, fmt, tm=32, tn=32)
    assert grid[1] == 1 and grid[2] > 1
    assert_matches(out, reference_fmt(x_hat, w, s, N, True, fmt))
