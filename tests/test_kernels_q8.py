"""int8-activation decode path: quantize_q8 (one x row → int8 per 32-chunk) vs a numpy float64/float32 reference,
and matvec_q8 (4-bit weights · int8 x through dot4I8Packed) vs float64 numpy on exactly the quantized x."""

import numpy as np
import pytest

from engine.kernels import MAX_GROUPS_PER_DIM
from engine.kernels.matmul import matvec_q8_plan, quantize_q8_plan
from tests.helpers import (
    Q4,
    assert_q8_matches,
    int8_rounding_bound,
    q8_reference,
    quantize_on_gpu,
    random_packed,
    reference_dequantize_fmt,
    reference_quantize_q8,
    run_q8,
    unpack_codes,
)


@pytest.mark.parametrize("T,K,last_row", [(1, 32, False), (3, 2080, True), (2, 64 * 70, False)])
def test_quantize_q8_matches_reference(gpu, rng, T, K, last_row):
    x = (rng.standard_normal((T, K)) * rng.uniform(0.1, 30, (T, K // 32)).repeat(32, axis=1)).astype(np.float32)
    x[:, 32:64] = 0  # an all-zero chunk: scale 0, codes 0, no NaN
    _, _, xq, xm = quantize_on_gpu(gpu, x, last_row)
    row = x[T - 1 if last_row else 0]
    assert_q8_matches(xq, xm, row)
    q, scale, _ = reference_quantize_q8(row, unpack_codes(xq))
    live = scale > 0
    assert (np.abs(q.reshape(-1, 32)).max(axis=1)[live] == 127).all()  # every non-zero chunk uses the full range
    assert K == 32 or not live[1]


@pytest.mark.parametrize("tag", list(Q4))
@pytest.mark.parametrize("K,N,gate_up", [(192, 37, False), (128, 21, True), (1024, 90, False), (640, 33, True)])
def test_matvec_q8_on_the_quantized_x(gpu, rng, tag, K, N, gate_up):
    fmt = Q4[tag]
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    x = rng.standard_normal(K).astype(np.float32)
    out, x_hat, _ = run_q8(gpu, x, w, s, N, gate_up, fmt)
    ref = q8_reference(x_hat, w, s, N, gate_up, fmt)
    f32 = 2e-5 * np.abs(ref).max()  # exact integer dots per chunk; f32 scales and sums K/32 ≤ 32
    np.testing.assert_allclose(out, ref, rtol=0, atol=f32)
    exact = q8_reference(x.astype(np.float64), w, s, N, gate_up, fmt)
    bound = int8_rounding_bound(x, reference_dequantize_fmt(w, s, **fmt), N, gate_up)
    assert (np.abs(out - exact) <= bound + f32).all()  # against the unrounded x: the int8 rounding's own bound


@pytest.mark.parametrize("claimed", [1, 4, 64])
def test_matvec_q8_covers_every_row_whatever_the_subgroup_size(gpu, rng, claimed):
    fmt, K, N = Q4["q4f16_1"], 96, 301
    w, s = random_packed(rng, N, K, **fmt)
    out, x_hat, _ = run_q8(gpu, rng.standard_normal(K).astype(np.float32), w, s, N, False, fmt, claimed,
                           wg=64, rows=3)
    ref = q8_reference(x_hat, w, s, N, False, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_matvec_q8_folded_grid(gpu, rng):
    fmt, K, N = Q4["q4_0"], 32, (MAX_GROUPS_PER_DIM + 1000) * 2
    w, s = random_packed(rng, N, K, **fmt)
    out, x_hat, grid = run_q8(gpu, rng.standard_normal(K).astype(np.float32), w, s, N, False, fmt,
                              wg=gpu.subgroup_size * 2, rows=1)
    assert grid[1] > 1
    ref = q8_reference(x_hat, w, s, N, False, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


def test_q8_plans_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="4-bit"):
        matvec_q8_plan(64, 8, 32, bits=8)
    with pytest.raises(ValueError, match="multiple of the subgroup size"):
        matvec_q8_plan(64, 8, 48)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q8_plan(48)
