"""int8-activation decode path: quantize_q8 (one x row → int8 per 32-chunk) vs a numpy float64/float32 reference,
and matvec_q8 (4-bit weights · int8 x through dot4I8Packed) vs float64 numpy on exactly the quantized x."""

import numpy as np
import pytest

from engine.kernels import MAX_GROUPS_PER_DIM
from engine.kernels.matmul import FORMATS, matvec_q8_plan, quantize_q8_plan
from tests.kernel_util import poisoned, read, run, step_uniform
from tests.test_kernels_matmul import random_packed, reference_dequantize_fmt, silu

Q4 = {tag: FORMATS[tag] for tag in ("q4f16_1", "q4_0", "q4_1", "mlx4")}


def reference_quantize(row: np.ndarray):
    """(int8 codes [K], scale per chunk, code sum per chunk) as the kernel defines them, in f32 like the GPU."""
    blocks = row.astype(np.float32).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1)
    with np.errstate(divide="ignore"):
        inv = np.where(amax > 0, np.float32(127) / amax, np.float32(0)).astype(np.float32)
    q = np.clip(np.round(blocks * inv[:, None]), -127, 127).astype(np.int8)
    return q.reshape(-1), (amax / np.float32(127)).astype(np.float32), q.astype(np.int64).sum(axis=1)


def unpack_codes(xq: np.ndarray) -> np.ndarray:
    """The kernel's byte order back to element order: per 8-element word, u32 2j = elements 0,2,4,6, 2j+1 = odds."""
    b = xq.view(np.int8).reshape(-1, 4, 2, 4)  # chunk, word, (even, odd), byte
    out = np.empty((b.shape[0], 4, 8), np.int8)
    out[:, :, 0::2], out[:, :, 1::2] = b[:, :, 0], b[:, :, 1]
    return out.reshape(-1)


def quantize_on_gpu(gpu, x: np.ndarray, last_row: bool):
    T, K = x.shape
    xq, xm = poisoned(gpu, "xq", (K // 4,), np.uint32), poisoned(gpu, "xm", (K // 32, 2))
    consts, grid = quantize_q8_plan(K, last_row)
    run(gpu, "quantize_q8", consts, [gpu.upload("x", x), xq, xm, step_uniform(gpu, T)], grid)
    return xq, xm, read(gpu, xq, (K // 4,), np.uint32), read(gpu, xm, (K // 32, 2))


@pytest.mark.parametrize("T,K,last_row", [(1, 32, False), (3, 2080, True), (2, 64 * 70, False)])
def test_quantize_q8_matches_reference(gpu, rng, T, K, last_row):
    x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 30, (T, K // 32)).repeat(32, axis=1)).astype(np.float32)
    x[:, 32:64] = 0  # an all-zero chunk: scale 0, codes 0, no NaN
    _, _, xq, xm = quantize_on_gpu(gpu, x, last_row)
    q, scale, total = reference_quantize(x[T - 1 if last_row else 0])
    np.testing.assert_array_equal(unpack_codes(xq), q)
    np.testing.assert_allclose(xm[:, 0], scale, rtol=1e-7, atol=0)
    np.testing.assert_array_equal(xm[:, 1], total)
    live = scale > 0
    assert (np.abs(q.reshape(-1, 32)).max(axis=1)[live] == 127).all()  # every non-zero chunk uses the full range
    assert K == 32 or not live[1]


def assert_q8_row(gpu, xq_buf, xm_buf, row) -> None:
    """The int8 copy a kernel wrote: `row` quantized exactly as reference_quantize says, or (row None) untouched."""
    n = xm_buf.size // 8
    xq, xm = read(gpu, xq_buf, (n * 8,), np.uint32), read(gpu, xm_buf, (n, 2))
    if row is None:
        assert (xq == np.iinfo(np.uint32).max).all() and np.isnan(xm).all()
        return
    q, scale, total = reference_quantize(row)
    np.testing.assert_array_equal(unpack_codes(xq), q)
    np.testing.assert_allclose(xm[:, 0], scale, rtol=1e-7, atol=0)
    np.testing.assert_array_equal(xm[:, 1], total)


def run_q8(gpu, x_row, w, s, N, gate_up, fmt, subgroup_size=None, **plan):
    K = x_row.shape[0]
    xq_buf, xm_buf, xq, xm = quantize_on_gpu(gpu, x_row[None], False)
    consts, grid = matvec_q8_plan(K, N, subgroup_size or gpu.subgroup_size, gate_up=gate_up, **plan, **fmt)
    y = poisoned(gpu, "y", (N,))
    run(gpu, "matvec_q8", consts, [xq_buf, gpu.upload("w", w), gpu.upload("s", s), y, xm_buf], grid)
    x_hat = unpack_codes(xq).astype(np.float64) * np.repeat(xm[:, 0].astype(np.float64), 32)
    return read(gpu, y, (N,)), x_hat, grid


def reference(x, w, s, N, gate_up, fmt):
    out = x @ reference_dequantize_fmt(w, s, **fmt).T
    return silu(out[:N]) * out[N:] if gate_up else out


@pytest.mark.parametrize("tag", list(Q4))
@pytest.mark.parametrize("K,N,gate_up", [(192, 37, False), (128, 21, True), (1024, 90, False), (640, 33, True)])
def test_matvec_q8_on_the_quantized_x(gpu, rng, tag, K, N, gate_up):
    fmt = Q4[tag]
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    x = rng.standard_normal(K).astype(np.float32)
    out, x_hat, _ = run_q8(gpu, x, w, s, N, gate_up, fmt)
    ref = reference(x_hat, w, s, N, gate_up, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    exact = reference(x.astype(np.float64), w, s, N, gate_up, fmt)  # the int8 rounding: small (seen up to 3.8%)
    assert np.abs(out - exact).max() <= 8e-2 * np.abs(exact).max()


@pytest.mark.parametrize("claimed", [1, 4, 64])
def test_matvec_q8_covers_every_row_whatever_the_subgroup_size(gpu, rng, claimed):
    fmt, K, N = Q4["q4f16_1"], 96, 301
    w, s = random_packed(rng, N, K, **fmt)
    out, x_hat, _ = run_q8(gpu, rng.standard_normal(K).astype(np.float32), w, s, N, False, fmt, claimed,
                           wg=64, rows=3)
    ref = reference(x_hat, w, s, N, False, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_matvec_q8_folded_grid(gpu, rng):
    fmt, K, N = Q4["q4_0"], 32, (MAX_GROUPS_PER_DIM + 1000) * 2
    w, s = random_packed(rng, N, K, **fmt)
    out, x_hat, grid = run_q8(gpu, rng.standard_normal(K).astype(np.float32), w, s, N, False, fmt,
                              wg=gpu.subgroup_size * 2, rows=1)
    assert grid[1] > 1
    ref = reference(x_hat, w, s, N, False, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_q8_plans_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="4-bit"):
        matvec_q8_plan(64, 8, 32, bits=8)
    with pytest.raises(ValueError, match="multiple of the subgroup size"):
        matvec_q8_plan(64, 8, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_plan(48)
