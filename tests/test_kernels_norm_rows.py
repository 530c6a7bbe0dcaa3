"""The prefill's add + norm that writes every row in int8 (add_rms_norm_rows.wgsl): bit for bit what add_rms_norm
and quantize_q8 over the rows write (the pair it replaces), and the int8 rows as the kernels define them."""

import numpy as np
import pytest

from engine.kernels.matmul import quantize_q8_plan
from engine.kernels.norm import norm_can_write_rows_int8, norm_plan, norm_rows_plan
from tests.helpers import assert_q8_matches, poisoned, read, run, step_uniform


@pytest.mark.parametrize("T,D,offset", [(1, 32, 0.0), (3, 96, 0.0), (5, 3072, 0.0), (2, 2560, 1.0)])
@pytest.mark.parametrize("natural", [False, True])  # the int8 rows in element order (q8_codes.wgsl Q8_NATURAL)
def test_norm_rows_equal_norm_then_quantize(any_gpu, rng, T, D, offset, natural):
    g = any_gpu
    r_in = rng.standard_normal((T, D)).astype(np.float32)
    delta = rng.standard_normal((T, D)).astype(np.float32)
    r_in[0, :32] = 0.0  # a chunk of zeros: scale 0, codes 0
    delta[0, :32] = 0.0
    w = rng.standard_normal(D).astype(np.float16)
    ins = [g.upload("r_in", r_in), g.upload("d", delta), g.upload("w", w)]

    def outputs():  # one row past T everywhere: it must stay untouched
        return [poisoned(g, "r_out", (T + 1, D)), poisoned(g, "y", (T + 1, D)),
                poisoned(g, "xq", (T + 1, D // 4), np.uint32), poisoned(g, "xm", (T + 1, D // 32, 2))]

    r_out, y, xq, xm = outputs()
    step = step_uniform(g, T)
    run(g, "add_rms_norm_rows", dict(norm_rows_plan(D, 1e-6, offset), Q8_NATURAL=natural),
        ins + [r_out, y, step, xq, xm], (T,))

    r_ref, y_ref, xq_ref, xm_ref = outputs()
    unused = [g.buffer("xq-unused", 16), g.buffer("xm-unused", 16)]
    run(g, "add_rms_norm", norm_plan(D, 1e-6, False, offset), ins + [r_ref, y_ref, step] + unused, (T,))
    consts, grid = quantize_q8_plan(D, rows=T)
    run(g, "quantize_q8", dict(consts, Q8_NATURAL=natural), [y_ref, xq_ref, xm_ref, step], grid)

    pairs = ((r_out, r_ref, np.float32, (T + 1, D)), (y, y_ref, np.float32, (T + 1, D)),
             (xq, xq_ref, np.uint32, (T + 1, D // 4)), (xm, xm_ref, np.float32, (T + 1, D // 16)))
    for got, ref, dtype, shape in pairs:
        a, b = read(g, got, shape, dtype), read(g, ref, shape, dtype)
        np.testing.assert_array_equal(a[:T], b[:T])
        assert (np.isnan(a[T]) if dtype == np.float32 else a[T] == np.iinfo(np.uint32).max).all()
    ys, words, metas = read(g, y, (T + 1, D)), read(g, xq, (T + 1, D // 4), np.uint32), read(g, xm, (T + 1, D // 32, 2))
    for t in range(T):
        assert_q8_matches(words[t], metas[t], ys[t], natural)


def test_norm_rows_limits():
    assert norm_can_write_rows_int8(3072) and norm_can_write_rows_int8(5120)
    assert not norm_can_write_rows_int8(8192) and not norm_can_write_rows_int8(100)
    with pytest.raises(ValueError, match="multiple of 32"):
        norm_rows_plan(100, 1e-6)
