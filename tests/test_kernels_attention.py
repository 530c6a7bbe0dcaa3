"""Attention-side kernels vs float64 numpy: RoPE + KV append, paged causal attention (plain and split-K + combine),
and decode-vs-prefill agreement."""

import numpy as np
import pytest

from tests.helpers import (
    PAGE,
    AttentionSetup,
    assert_q8_row,
    attention_partials_ref,
    attention_ref,
    check_cache,
    inv_freq_for,
    page_table_for,
    poisoned,
    read,
    rope_ref,
    run,
    step_uniform,
)


def _run(g, shader, consts, buffers, grid):
    run(g, shader, consts, buffers, grid)


# ---- numpy references ------------------------------------------------------------------------------


EPS = 1e-6


def rope_consts(H, KVH, HD, ROT, qk_norm=False):
    return dict(WG=64, H=H, KVH=KVH, HD=HD, ROT=ROT, PAGE=PAGE, QK_NORM=qk_norm, EPS=EPS, NORM_OFFSET=0.0,
                ROPE_SCALE=1.0)


def dummy_norms(g, hd):
    """q/k norm weights the kernel binds but ignores when QK_NORM is false."""
    return [g.upload("q_norm", np.full(hd, np.nan, np.float16)), g.upload("k_norm", np.full(hd, np.nan, np.float16))]


def quantize_q4f16_1(w):
    """MLC q4f16_1 per 32-element group along K: scale = max|w|/7 (f16), q = clamp(round(w/s)+7, 0, 14)."""
    n, k = w.shape
    groups = w.reshape(n, k // 32, 32).astype(np.float64)
    scale = (np.abs(groups).max(axis=2) / 7.0).astype(np.float16)
    s64 = scale.astype(np.float64)[..., None]
    q = np.clip(np.round(np.divide(groups, s64, out=np.zeros_like(groups), where=s64 > 0)) + 7, 0, 14)
    q = q.astype(np.uint32).reshape(n, k // 8, 8)
    words = np.zeros((n, k // 8), np.uint32)
    for i in range(8):
        words |= q[..., i] << np.uint32(4 * i)
    dequant = (q.reshape(n, k // 32, 32).astype(np.float64) - 7.0) * s64
    return words, scale, dequant.reshape(n, k)


# ---- rope_append (prefill) -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "H,KVH,HD,ROT,T,pos0,Y,qk_norm",  # grid (T, Y): Y = 0 means one head slot per workgroup, H + 2·KVH
    [(8, 2, 96, 64, 5, 30, 0, False), (4, 4, 32, 32, 3, 0, 1, False), (8, 2, 128, 128, 7, 13, 3, False),
     (2, 1, 128, 96, 1, 47, 0, False), (8, 2, 128, 128, 5, 13, 3, True), (4, 2, 96, 48, 3, 17, 0, True)],
)
def test_rope_append(any_gpu, rng, H, KVH, HD, ROT, T, pos0, Y, qk_norm):
    g = any_gpu
    n_logical = (pos0 + T - 1) // PAGE + 1
    page_table, n_pages = page_table_for(rng, n_logical)
    inv_freq = inv_freq_for(ROT)
    qkv = rng.standard_normal((T, (H + 2 * KVH) * HD)).astype(np.float32)
    q_out = poisoned(g, "q_out", (T, H * HD))
    k_cache = poisoned(g, "k_cache", (n_pages, KVH, PAGE, HD), np.float16)
    v_cache = poisoned(g, "v_cache", (n_pages, KVH, PAGE, HD), np.float16)
    q_w, k_w = (0.5 + rng.random((2, HD))).astype(np.float16)
    consts = rope_consts(H, KVH, HD, ROT, qk_norm=qk_norm)
    buffers = [
        g.upload("qkv", qkv),
        q_out,
        k_cache,
        v_cache,
        g.upload("pt", page_table),
        g.upload("inv_freq", inv_freq),
        step_uniform(g, T, pos0),
        g.upload("q_norm", q_w),
        g.upload("k_norm", k_w),
    ]
    _run(g, "rope_append", consts, buffers, (T, Y or H + 2 * KVH))

    positions = np.arange(pos0, pos0 + T)
    heads = qkv.reshape(T, H + 2 * KVH, HD).astype(np.float64)
    if qk_norm:  # Qwen3: RMSNorm over each q and k head before RoPE
        def rms(x, w):
            return x / np.sqrt((x**2).mean(-1, keepdims=True) + EPS) * w.astype(np.float64)

        heads = np.concatenate([rms(heads[:, :H], q_w), rms(heads[:, H:H + KVH], k_w), heads[:, H + KVH:]], axis=1)
    q_ref = rope_ref(heads[:, :H], positions, inv_freq, ROT)
    k_ref = rope_ref(heads[:, H : H + KVH], positions, inv_freq, ROT)
    v_ref = heads[:, H + KVH :].astype(np.float64)
    np.testing.assert_allclose(read(g, q_out, (T, H, HD)), q_ref, rtol=1e-5, atol=1e-5)
    tol = 1e-3 * max(np.abs(k_ref).max(), np.abs(v_ref).max())
    shape = (n_pages, KVH, PAGE, HD)
    check_cache(read(g, k_cache, shape, np.float16), page_table, k_ref, positions, tol)
    check_cache(read(g, v_cache, shape, np.float16), page_table, v_ref, positions, tol)


def test_rope_append_far_positions(gpu, rng):
    """Angles of ~10⁵ rad: the kernel reduces them to [-π, π] itself, as WGSL only bounds cos/sin there."""
    g = gpu
    H, KVH, HD, ROT, T, pos0 = 2, 1, 64, 64, 3, 131_070  # crosses a page boundary at 131,072
    page_table = np.zeros(pos0 // PAGE + 2, np.uint32)
    page_table[pos0 // PAGE :] = [2, 1]  # the two live logical pages; the rest point at page 0
    inv_freq = inv_freq_for(ROT)
    qkv = rng.standard_normal((T, (H + 2 * KVH) * HD)).astype(np.float32)
    q_out = poisoned(g, "q_out", (T, H * HD))
    shape = (3, KVH, PAGE, HD)
    k_cache, v_cache = poisoned(g, "k_cache", shape, np.float16), poisoned(g, "v_cache", shape, np.float16)
    buffers = [g.upload("qkv", qkv), q_out, k_cache, v_cache, g.upload("pt", page_table)]
    buffers += [g.upload("inv_freq", inv_freq), step_uniform(g, T, pos0)]
    _run(g, "rope_append", rope_consts(H, KVH, HD, ROT), buffers + dummy_norms(g, HD), (T, 1))

    positions = np.arange(pos0, pos0 + T)
    heads = qkv.reshape(T, H + 2 * KVH, HD)
    q_ref = rope_ref(heads[:, :H], positions, inv_freq, ROT, f32_angle=True)
    k_ref = rope_ref(heads[:, H : H + KVH], positions, inv_freq, ROT, f32_angle=True)
    np.testing.assert_allclose(read(g, q_out, (T, H, HD)), q_ref, rtol=0, atol=1e-4)
    check_cache(read(g, k_cache, shape, np.float16), page_table, k_ref, positions, 1e-3 * np.abs(k_ref).max())


# ---- attention + combine ---------------------------------------------------------------------------


def attention_unsplit(g, a, WG):
    out = poisoned(g, "out", (a.T, a.H * a.HD))
    dummy = g.buffer("part_ml-unused", 16)
    _run(g, "attention", a.consts(WG, False), a.bufs + [out, dummy, step_uniform(g, a.T, a.pos0)], (a.H, a.T, 1))
    return read(g, out, (a.T, a.H * a.HD))


def attention_split(g, a, WG, splits):
    part_o = poisoned(g, "part_o", (splits, a.T, a.H, a.HD))
    part_ml = poisoned(g, "part_ml", (splits, a.T, a.H, 2))
    step = step_uniform(g, a.T, a.pos0, attn_splits=splits)
    _run(g, "attention", a.consts(WG, True), a.bufs + [part_o, part_ml, step], (a.H, a.T, splits))
    out = poisoned(g, "out", (a.T, a.H * a.HD))
    unused = [g.buffer("xq-unused", 16), g.buffer("xm-unused", 16)]
    _run(g, "attention_combine", dict(WG=64, H=a.H, HD=a.HD, Q8=False), [part_o, part_ml, out, step, *unused],
         (a.H, a.T))
    parts = read(g, part_o, (splits, a.T, a.H, a.HD)), read(g, part_ml, (splits, a.T, a.H, 2))
    return read(g, out, (a.T, a.H * a.HD)), parts


@pytest.mark.parametrize(
    "H,KVH,HD,T,pos0,WG",
    [
        (8, 2, 96, 5, 37, 32),  # GQA, 2 key blocks per query, pages crossed
        (4, 4, 32, 3, 0, 64),  # MHA, small head: 8 key lanes in the P·V phase
        (8, 2, 128, 1, 70, 64),  # decode, 71 keys over 5 pages
        (2, 1, 256, 2, 9, 64),  # widest head: one key lane
        (4, 2, 64, 2, 0, 32),  # 1–2 keys: with 3 splits some splits have none
    ],
)
def test_attention(any_gpu, rng, H, KVH, HD, T, pos0, WG):
    g = any_gpu
    a = AttentionSetup(g, rng, H, KVH, HD, T, pos0)
    ref = attention_ref(a.q, a.k, a.v, pos0, a.scale)
    got = attention_unsplit(g, a, WG)
    np.testing.assert_allclose(got, ref, rtol=1e-4, atol=1e-5)

    for splits in (1, 3):
        merged, (part_o, part_ml) = attention_split(g, a, WG, splits)
        np.testing.assert_allclose(merged, got, rtol=1e-5, atol=1e-6)
        o_ref, ml_ref = attention_partials_ref(a.q, a.k, a.v, pos0, a.scale, splits)
        np.testing.assert_allclose(part_ml, ml_ref, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(part_o, o_ref, rtol=1e-4, atol=1e-4)
        empty = ml_ref[..., 1] == 0
        if splits == 3 and pos0 == 0:
            assert empty.any(), "this case is meant to hold splits with no keys"
        assert (part_ml[..., 0][empty] <= -1e38).all() and (part_o[empty] == 0).all()


@pytest.mark.parametrize("HD", [96, 128])
def test_combine_writes_the_int8_row_quantize_q8_would(gpu, rng, HD):
    # Decode (T = 1) with 3 splits: the combine's own int8 copy of its output, chunk by chunk inside each head.
    a = AttentionSetup(gpu, rng, 4, 2, HD, 1, 70)
    splits = 3
    part_o, part_ml = poisoned(gpu, "part_o", (splits, 1, 4, HD)), poisoned(gpu, "part_ml", (splits, 1, 4, 2))
    step = step_uniform(gpu, 1, 70, attn_splits=splits)
    _run(gpu, "attention", a.consts(64, True), a.bufs + [part_o, part_ml, step], (4, 1, splits))
    out = poisoned(gpu, "out", (1, 4 * HD))
    xq, xm = poisoned(gpu, "xq", (4 * HD // 4,), np.uint32), poisoned(gpu, "xm", (4 * HD // 32, 2))
    _run(gpu, "attention_combine", dict(WG=64, H=4, HD=HD, Q8=True), [part_o, part_ml, out, step, xq, xm], (4, 1))
    row = read(gpu, out, (1, 4 * HD))[0]
    np.testing.assert_allclose(row, attention_ref(a.q, a.k, a.v, 70, a.scale)[0], rtol=1e-4, atol=1e-5)
    assert_q8_row(gpu, xq, xm, row)


# ---- decode path == prefill path -------------------------------------------------------------------


def test_decode_matches_prefill(any_gpu, rng):
    """Same tokens two ways: the decode path (int4 QKV matvec, rope_append of one row, attention) one token at a
    time; or the numpy GEMM + rope_append + attention over two prefill chunks (the second one at pos0 > 0)."""
    from engine.kernels.matmul import matvec_plan

    g = any_gpu
    H, KVH, HD, ROT, D, T, chunk = 4, 2, 64, 32, 128, 7, 4
    n = (H + 2 * KVH) * HD
    words, scales, w_deq = quantize_q4f16_1(rng.standard_normal((n, D)).astype(np.float32) * 0.1)
    x = rng.standard_normal((T, D)).astype(np.float32)
    page_table, n_pages = page_table_for(rng, (T - 1) // PAGE + 2)  # one logical page beyond need
    shape = (n_pages, KVH, PAGE, HD)
    pt, inv_freq = g.upload("pt", page_table), g.upload("inv_freq", inv_freq_for(ROT))
    attn_consts = dict(WG=64, H=H, KVH=KVH, HD=HD, PAGE=PAGE, SCALE=float(1 / np.sqrt(HD)), SPLIT=False)
    dummy = g.buffer("part_ml-unused", 16)

    def attend(q, k_cache, v_cache, t_len, pos0, step):
        out = poisoned(g, "out", (t_len, H * HD))
        _run(g, "attention", attn_consts, [q, k_cache, v_cache, pt, out, dummy, step], (H, t_len, 1))
        return read(g, out, (t_len, H * HD))

    # Decode: one token at a time.
    k_dec, v_dec = poisoned(g, "k_dec", shape, np.float16), poisoned(g, "v_dec", shape, np.float16)
    w_buf, s_buf = g.upload("w", words), g.upload("s", scales)
    mv_consts, mv_grid = matvec_plan(D, n)
    norms = dummy_norms(g, HD)
    decoded = []
    for t in range(T):
        q, qkv = poisoned(g, "q", (H * HD,)), poisoned(g, "qkv", (n,))
        step = step_uniform(g, 1, t)
        _run(g, "matvec_int4", mv_consts, [g.upload("x", x[t : t + 1]), w_buf, s_buf, qkv, step], mv_grid)
        _run(g, "rope_append", rope_consts(H, KVH, HD, ROT), [qkv, q, k_dec, v_dec, pt, inv_freq, step, *norms],
             (1, H + 2 * KVH))
        decoded.append(attend(q, k_dec, v_dec, 1, t, step)[0])

    # Prefill: the fused GEMM in numpy (f32), then RoPE + append and attention per chunk.
    k_pre, v_pre = poisoned(g, "k_pre", shape, np.float16), poisoned(g, "v_pre", shape, np.float16)
    qkv_all = (x @ w_deq.astype(np.float32).T).astype(np.float32)
    prefilled = []
    for pos0 in range(0, T, chunk):
        t_len = min(chunk, T - pos0)
        q = poisoned(g, "q", (t_len, H * HD))
        step = step_uniform(g, t_len, pos0)
        buffers = [g.upload("qkv", qkv_all[pos0 : pos0 + t_len]), q, k_pre, v_pre, pt, inv_freq, step]
        _run(g, "rope_append", rope_consts(H, KVH, HD, ROT), buffers + dummy_norms(g, HD), (t_len,))
        prefilled.append(attend(q, k_pre, v_pre, t_len, pos0, step))

    decoded, prefilled = np.array(decoded), np.concatenate(prefilled)
    assert np.isfinite(decoded).all()
    np.testing.assert_allclose(decoded, prefilled, rtol=0, atol=2e-3 * np.abs(prefilled).max())
    for dec, pre in ((k_dec, k_pre), (v_dec, v_pre)):
        dec_c, pre_c = read(g, dec, shape, np.float16), read(g, pre, shape, np.float16)
        assert np.array_equal(np.isnan(dec_c), np.isnan(pre_c)), "both paths fill the same slots"
        ok = ~np.isnan(pre_c)
        np.testing.assert_allclose(dec_c[ok], pre_c[ok], rtol=0, atol=1e-3 * np.abs(pre_c[ok]).max())
