"""The decode matvecs that carry the residual add + RMSNorm between them: matvec_q8_norm (+ residual add, the next
norm's int8 row without 1/rms, each chunk's Σ x²) and matvec_q8_rms (its input that row), vs float64 numpy on the
quantized x, the int8 row vs what quantize_q8 writes, and the pair vs add_rms_norm + matvec_q8; matvec_q8_rms_q8
(matvec_q8_rms that also writes its output in int8) vs matvec_q8_rms then quantize_q8, bit for bit."""

import numpy as np
import pytest

from engine.kernels.matmul import (
    MAX_NORM_SPLITS,
    matvec_q8_norm_plan,
    matvec_q8_plan,
    matvec_q8_rms_plan,
    matvec_q8_rms_q8_plan,
    norm_matvec_splits,
    norm_pack_layout,
)
from tests.helpers import (
    Q4,
    assert_q8_matches,
    poisoned,
    q8_reference,
    quantize_on_gpu,
    random_packed,
    read,
    reference_dequantize_fmt,
    run,
    run_q8,
    step_uniform,
)


def run_rms(gpu, v_row, w, s, N, gate_up, fmt, ss, eps, subgroup_size=None):
    """matvec_q8_rms on v_row quantized by quantize_q8, with the chunks' sums of squares `ss`."""
    K = v_row.shape[0]
    xq_buf, xm_buf, _, _ = quantize_on_gpu(gpu, v_row[None], False)
    consts, grid = matvec_q8_rms_plan(K, N, subgroup_size or gpu.subgroup_size, eps, gate_up=gate_up, **fmt)
    y = poisoned(gpu, "y", (N,))
    run(gpu, "matvec_q8_rms", consts, [xq_buf, gpu.upload("w", w), gpu.upload("s", s), y, xm_buf,
                                       gpu.upload("ss", ss)], grid)
    return read(gpu, y, (N,))


@pytest.mark.parametrize("tag", list(Q4))
@pytest.mark.parametrize("K,N,gate_up,claimed", [(256, 72, False, None), (128, 64, True, None), (128, 37, True, 4),
                                                 (192, 50, False, 64)])
def test_matvec_q8_rms(gpu, rng, tag, K, N, gate_up, claimed):
    """The input row is stored without its norm's 1/rms; the kernel takes it from the chunks' Σ x² (ss), in every
    subgroup alike, whatever the subgroup size it was planned for."""
    fmt, eps = Q4[tag], 1e-5
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    v = rng.standard_normal(K).astype(np.float32) * 4
    ss = (rng.random(K // 32) * 40).astype(np.float32)
    out = run_rms(gpu, v, w, s, N, gate_up, fmt, ss, eps, claimed)
    _, v_hat, _ = run_q8(gpu, v, w, s, N, False, fmt)  # the quantized input row, in float64
    inv = 1.0 / np.sqrt(ss.astype(np.float64).sum() / K + eps)
    ref = q8_reference(v_hat * inv, w, s, N, gate_up, fmt)
    np.testing.assert_allclose(out, ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.slow  # an A/B variant, not the default path: the long pass runs it
@pytest.mark.parametrize("tag", list(Q4))
@pytest.mark.parametrize("K,N,gate_up,claimed", [(128, 96, True, None), (256, 64, True, 4), (192, 32, True, 64),
                                                 (128, 64, True, 32), (128, 64, False, None)])
def test_matvec_q8_rms_q8_writes_what_quantize_q8_writes(gpu, rng, tag, K, N, gate_up, claimed):
    """Its f32 outputs are matvec_q8_rms's (the same sums in the same order: equal bits, so the decode logits do not
    move) and its int8 row is, bit for bit, what quantize_q8 writes from that f32 row (the dense MLP's down reads it
    in place of the quantize_q8 dispatch), whatever the subgroup size it was planned for (claimed 32 or 64: up to 1,024
    threads, more subgroups than blocks where the real size is smaller). Outputs start poisoned."""
    fmt, eps = Q4[tag], 1e-5
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    v = rng.standard_normal(K).astype(np.float32) * 4
    ss = (rng.random(K // 32) * 40).astype(np.float32)
    xq_buf, xm_buf, _, _ = quantize_on_gpu(gpu, v[None], False)
    threads = gpu.limits["max-compute-invocations-per-workgroup"]  # as the runtime plans it
    consts, grid = matvec_q8_rms_q8_plan(K, N, claimed or gpu.subgroup_size, eps, gate_up, threads, **fmt)
    assert consts["BLOCKS"] * consts["ROWS"] == 32 and grid == (N // 32, 1)
    y, yq, ym = poisoned(gpu, "y", (N,)), poisoned(gpu, "yq", (N // 4,), np.uint32), poisoned(gpu, "ym", (N // 32, 2))
    run(gpu, "matvec_q8_rms_q8", consts, [xq_buf, gpu.upload("w", w), gpu.upload("s", s), y, xm_buf,
                                          gpu.upload("ss", ss), yq, ym], grid)
    got = read(gpu, y, (N,))
    np.testing.assert_array_equal(got, run_rms(gpu, v, w, s, N, gate_up, fmt, ss, eps))
    _, v_hat, _ = run_q8(gpu, v, w, s, N, False, fmt)
    ref = q8_reference(v_hat / np.sqrt(ss.astype(np.float64).sum() / K + eps), w, s, N, gate_up, fmt)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    codes, meta = read(gpu, yq, (N // 4,), np.uint32), read(gpu, ym, (N // 32, 2))
    _, _, q_codes, q_meta = quantize_on_gpu(gpu, got[None], False)
    np.testing.assert_array_equal(codes, q_codes)
    np.testing.assert_array_equal(meta.view(np.uint32), q_meta.view(np.uint32))
    assert_q8_matches(codes, meta, got)


def test_matvec_q8_rms_q8_plan():
    assert matvec_q8_rms_q8_plan(64, 48, 32, 1e-5, True) is None  # not whole chunks
    # gate_up: a subgroup a one-output block, up to 1024 threads and the GPU's limit
    for sg, limit, wg in ((32, 1024, 1024), (32, 256, 256), (8, 1024, 256), (64, 1024, 1024), (64, 1536, 1024),
                          (1, 256, 32)):
        consts, grid = matvec_q8_rms_q8_plan(64, 96, sg, 1e-5, True, limit)
        assert (consts["ROWS"], consts["BLOCKS"], consts["WG"], consts["EPS"], grid) == (1, 32, wg, 1e-5, (3, 1))


@pytest.mark.parametrize("splits", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("tag,K,N,offset", [("q4f16_1", 128, 96, 0.0), ("q4_1", 256, 64, 1.0), ("mlx4", 192, 32, 0.0),
                                            ("q4_0", 1056, 64, 0.0)])
def test_matvec_q8_norm(gpu, rng, tag, K, N, offset, splits):
    """matvec_q8 + residual add + the next norm's row without 1/rms: the new residual, the int8 codes and scales of
    residual · (w + offset), Σ residual² per chunk, each where the packed layout says; split along K into `splits`
    workgroups a chunk (matvec_q8_norm_split; K's 4 to 33 blocks: splits of unequal size, some empty) the same to
    f32 rounding, the tickets back at zero, a second dispatch the same bits (the partials are summed in split order).
    Everything else starts poisoned."""
    fmt = Q4[tag]
    w, s = random_packed(rng, N, K, **fmt)
    x = rng.standard_normal(K).astype(np.float32)
    r_in = (rng.standard_normal(N) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, N).astype(np.float16)
    pack = norm_pack_layout(N, splits=splits)
    xq_buf, xm_buf, _, _ = quantize_on_gpu(gpu, x[None], False)
    consts, grid = matvec_q8_norm_plan(K, N, gpu.subgroup_size, offset, pack, splits, **fmt)
    assert grid == (N // 32 * splits, 1)
    if splits > 1:  # a folded grid with spare workgroups, as fold_grid makes past 65,535
        grid = (-(-grid[0] // 2) + 1, 2)
    words0 = np.full(pack["bytes"] // 4, 0xFFFFFFFF, np.uint32)
    if splits > 1:
        words0[pack["TICKETS"]:pack["TICKETS"] + N // 32] = 0  # zero between dispatches, as a new buffer is
    y, nq = poisoned(gpu, "y", (N,)), gpu.upload("nq", words0)
    kernel = "matvec_q8_norm_split" if splits > 1 else "matvec_q8_norm"
    bufs = [xq_buf, gpu.upload("w", w), gpu.upload("s", s), y, xm_buf, gpu.upload("r_in", r_in), gpu.upload("nw", nw),
            nq]
    run(gpu, kernel, consts, bufs, grid)
    _, x_hat, _ = run_q8(gpu, x, w, s, N, False, fmt)
    ref = r_in.astype(np.float64) + q8_reference(x_hat, w, s, N, False, fmt)
    got = read(gpu, y, (N,))
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    words = read(gpu, nq, (pack["bytes"] // 4,), np.uint32)
    meta = words[pack["META"]:pack["META"] + N // 16].view(np.float32).reshape(-1, 2)
    v = (got.astype(np.float64) * (nw.astype(np.float64) + offset)).astype(np.float32)
    assert_q8_matches(words[:N // 4], meta, v)
    ss = words[pack["SS"]:pack["SS"] + N // 32].view(np.float32)
    np.testing.assert_allclose(ss, (got.astype(np.float64).reshape(-1, 32) ** 2).sum(1), rtol=1e-6)
    if splits > 1:
        assert (words[pack["TICKETS"]:pack["TICKETS"] + N // 32] == 0).all()
        run(gpu, kernel, consts, bufs, grid)
        np.testing.assert_array_equal(read(gpu, y, (N,)), got)
        np.testing.assert_array_equal(read(gpu, nq, (pack["bytes"] // 4,), np.uint32)[:pack["tickets"] // 4],
                                      words[:pack["tickets"] // 4])


def test_norm_then_rms_matvec_is_add_rms_norm_then_matvec(gpu, rng):
    """The fused pair (matvec_q8_norm, then matvec_q8_rms) against the dispatches it replaces
    (add_rms_norm with its int8 row, then matvec_q8), to int8 rounding: each rounds the same normed row to int8,
    the fused one without the 1/rms factor (the codes match but for values at a rounding boundary)."""
    from engine.kernels.norm import norm_plan

    fmt, K, D, N, eps = Q4["q4_0"], 96, 128, 64, 1e-5
    w1, s1 = random_packed(rng, D, K, **fmt)
    w2, s2 = random_packed(rng, N, D, **fmt)
    x = rng.standard_normal(K).astype(np.float32)
    r_in = (rng.standard_normal(D) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, D).astype(np.float16)
    xq_buf, xm_buf, _, _ = quantize_on_gpu(gpu, x[None], False)
    pack = norm_pack_layout(D)
    # fused
    nq, r_out = gpu.buffer("nq", pack["bytes"]), poisoned(gpu, "r_out", (D,))
    consts, grid = matvec_q8_norm_plan(K, D, gpu.subgroup_size, 0.0, pack, **fmt)
    run(gpu, "matvec_q8_norm", consts, [xq_buf, gpu.upload("w1", w1), gpu.upload("s1", s1), r_out, xm_buf,
                                         gpu.upload("r_in", r_in), gpu.upload("nw", nw), nq], grid)
    consts, grid = matvec_q8_rms_plan(D, N, gpu.subgroup_size, eps, **fmt)
    fused = poisoned(gpu, "fused", (N,))
    run(gpu, "matvec_q8_rms", consts, [(nq, 0, D), gpu.upload("w2", w2), gpu.upload("s2", s2), fused,
                                        (nq, pack["meta"], D // 4), (nq, pack["ss"], D // 8)], grid)
    # separate: add_rms_norm (delta = the first matvec's output) writes the int8 row, then matvec_q8
    delta = read(gpu, r_out, (D,)) - r_in
    hidden, r2 = poisoned(gpu, "hidden", (D,)), poisoned(gpu, "r2", (D,))
    nq2, nm2 = poisoned(gpu, "xq2", (D // 4,), np.uint32), poisoned(gpu, "xm2", (D // 32, 2))
    run(gpu, "add_rms_norm", norm_plan(D, eps, True), [gpu.upload("r_in", r_in), gpu.upload("delta", delta),
                                                       gpu.upload("nw", nw), r2, hidden, step_uniform(gpu), nq2, nm2],
        (1,))
    consts, grid = matvec_q8_plan(D, N, gpu.subgroup_size, **fmt)
    plain = poisoned(gpu, "plain", (N,))
    run(gpu, "matvec_q8", consts, [nq2, gpu.upload("w2", w2), gpu.upload("s2", s2), plain, nm2], grid)
    fused, plain = read(gpu, fused, (N,)), read(gpu, plain, (N,))
    np.testing.assert_allclose(read(gpu, r2, (D,)), read(gpu, r_out, (D,)), rtol=1e-6, atol=1e-6)
    # two int8 roundings of the same row differ by at most one code step per element: the output by at most the
    # matrix row's Σ|w| times one step (scale) of its chunk
    h = read(gpu, hidden, (D,)).astype(np.float64)
    step = np.repeat(np.abs(h).reshape(-1, 32).max(1) / 127, 32)
    bound = np.abs(reference_dequantize_fmt(w2, s2, **fmt)) @ step
    assert (np.abs(fused - plain) <= bound + 2e-5 * np.abs(plain).max()).all()
    assert np.abs(fused - plain).max() <= 0.05 * np.abs(plain).max()


def test_matvec_q8_norm_plan():
    pack = norm_pack_layout(64)
    assert matvec_q8_norm_plan(64, 48, 32, 0.0, norm_pack_layout(48)) is None  # not whole chunks
    for sg, wg in ((32, 512), (8, 128), (64, 512), (1, 32)):  # a subgroup a block of 2 rows, up to 512 threads
        consts, grid = matvec_q8_norm_plan(64, 64, sg, 0.0, pack)
        assert (consts["ROWS"], consts["BLOCKS"], consts["WG"], grid) == (2, 16, wg, (2, 1))
    assert (pack["meta"], pack["ss"], pack["bytes"]) == (256, 512, 520)
    split = norm_pack_layout(64, splits=4)  # the same row, then the tickets and 4 partial records a chunk
    assert {k: split[k] for k in pack if k not in ("bytes", "splits")} == {k: v for k, v in pack.items()
                                                                           if k not in ("bytes", "splits")}
    assert (split["tickets"], split["part"], split["bytes"], split["TICKETS"], split["PART"]) == (768, 1024, 2048,
                                                                                               192, 256)
    consts, grid = matvec_q8_norm_plan(64, 64, 32, 0.0, split, 3)
    assert (consts["SPLITS"], consts["TICKETS"], consts["PART"], consts["WG"], grid) == (3, 192, 256, 512, (6, 1))
    with pytest.raises(ValueError, match="2 to 4 splits"):
        matvec_q8_norm_plan(64, 64, 32, 0.0, split, 5)  # more than the pack has room for


def test_norm_matvec_splits():
    """The split count the runtime takes: as asked, at most one a 32-element block of K; automatic: enough for
    NORM_SPLIT_WORKGROUPS workgroups while every lane of a subgroup keeps a block, at most MAX_NORM_SPLITS."""
    assert [norm_matvec_splits(3072, 3072, 32, n) for n in (1, 4, 16)] == [1, 4, 16]
    assert norm_matvec_splits(64, 3072, 32, 8) == 2
    assert norm_matvec_splits(3072, 3072, 32, None) == 3  # 96 chunks: 6 wanted, 96 blocks / 32 lanes
    assert norm_matvec_splits(8192, 3072, 32, None) == 6
    assert norm_matvec_splits(8192, 3072, 8, None) == 6
    assert norm_matvec_splits(32768, 1024, 8, None) == MAX_NORM_SPLITS
    assert norm_matvec_splits(8192, 65536, 32, None) == 1  # the grid is full already
    assert norm_matvec_splits(512, 3072, 32, None) == 1
