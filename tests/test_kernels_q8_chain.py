"""matvec_q8_chain: matvec_q8 whose output also goes to int8 (gate_up's, for down) vs float64 numpy on the quantized
x, its int8 copy vs what quantize_q8 writes for the same row, and the same f32 outputs as matvec_q8."""

import numpy as np
import pytest

from engine.kernels import MAX_GROUPS_PER_DIM
from engine.kernels.matmul import matvec_q8_chain_plan
from tests.helpers import assert_q8_matches, poisoned, random_packed, read, run
from tests.test_kernels_q8 import Q4, quantize_on_gpu, reference, run_q8


def run_chain(gpu, x_row, w, s, N, gate_up, fmt, subgroup_size=None):
    K = x_row.shape[0]
    xq_buf, xm_buf, xq, xm = quantize_on_gpu(gpu, x_row[None], False)
    consts, grid = matvec_q8_chain_plan(K, N, subgroup_size or gpu.subgroup_size, gate_up=gate_up, **fmt)
    y, yq, ym = poisoned(gpu, "y", (N,)), poisoned(gpu, "yq", (N // 4,), np.uint32), poisoned(gpu, "ym", (N // 32, 2))
    run(gpu, "matvec_q8_chain", consts, [xq_buf, gpu.upload("w", w), gpu.upload("s", s), y, xm_buf, yq, ym], grid)
    return read(gpu, y, (N,)), read(gpu, yq, (N // 4,), np.uint32), read(gpu, ym, (N // 32, 2)), consts, grid


@pytest.mark.parametrize("tag", list(Q4))
@pytest.mark.parametrize("K,N,gate_up", [(192, 64, False), (128, 96, True), (640, 32, True), (1024, 160, False)])
def test_matvec_q8_chain(gpu, rng, tag, K, N, gate_up):
    fmt = Q4[tag]
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    x = rng.standard_normal(K).astype(np.float32)
    plain, x_hat, _ = run_q8(gpu, x, w, s, N, gate_up, fmt)
    out, yq, ym, consts, _ = run_chain(gpu, x, w, s, N, gate_up, fmt)
    assert consts["BLOCKS"] * consts["ROWS"] == 32
    ref = reference(x_hat, w, s, N, gate_up, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    np.testing.assert_array_equal(out, plain)  # the same sums, in the same order, as matvec_q8's
    assert_q8_matches(yq, ym, out)  # the int8 copy is quantize_q8's of the output row


@pytest.mark.parametrize("claimed", [4, 8, 64])
def test_matvec_q8_chain_whatever_the_subgroup_size(gpu, rng, claimed):
    """Planned for another subgroup size than the GPU's: every output and chunk is still written (the subgroups
    take the blocks in turn)."""
    fmt, K, N = Q4["q4_1"], 96, 224
    w, s = random_packed(rng, 2 * N, K, **fmt)
    x = rng.standard_normal(K).astype(np.float32)
    _, x_hat, _ = run_q8(gpu, x, w, s, N, True, fmt)
    out, yq, ym, _, _ = run_chain(gpu, x, w, s, N, True, fmt, claimed)
    ref = reference(x_hat, w, s, N, True, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert_q8_matches(yq, ym, out)


def test_matvec_q8_chain_folded_grid(gpu, rng):
    fmt, K, N = Q4["q4_0"], 32, (MAX_GROUPS_PER_DIM + 10) * 32
    w, s = random_packed(rng, N, K, **fmt)
    x = rng.standard_normal(K).astype(np.float32)
    out, yq, ym, _, grid = run_chain(gpu, x, w, s, N, False, fmt)
    assert grid[1] > 1 and grid[0] * grid[1] > N // 32  # spare workgroups in the folded grid write nothing
    _, x_hat, _ = run_q8(gpu, x, w, s, N, False, fmt)
    ref = reference(x_hat, w, s, N, False, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert_q8_matches(yq, ym, out)


def test_matvec_q8_chain_plan_refuses_partial_chunks():
    assert matvec_q8_chain_plan(64, 48, 32) is None
    consts, grid = matvec_q8_chain_plan(64, 64, 32, gate_up=True)
    assert (consts["ROWS"], consts["BLOCKS"], consts["WG"], grid) == (1, 32, 1024, (2, 1))
