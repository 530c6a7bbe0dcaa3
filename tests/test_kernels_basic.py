"""Embedding, add+RMSNorm and argmax kernels vs float64 numpy on fresh random data."""

import numpy as np
import pytest

from engine.blocks.sampler import GpuArgmax
from engine.gpu import Recorder
from engine.kernels.matmul import embedding_plan, format_knobs
from engine.kernels.sampling import ARGMAX_SLICE
from tests.helpers import assert_q8_row, poisoned, read, run, step_uniform


def quantize(w):
    """Reference q4f16_1 packing (group 32 along K, symmetric, element i of a word at bits 4i)."""
    n, k = w.shape
    g = w.reshape(n, k // 32, 32)
    scale = (np.abs(g).max(-1) / 7).astype(np.float16)
    s = scale.astype(np.float32)[..., None]
    q = np.clip(np.round(np.divide(g, s, out=np.zeros_like(g), where=s > 0)) + 7, 0, 14).astype(np.uint32)
    q = q.reshape(n, k // 8, 8)
    words = np.zeros((n, k // 8), np.uint32)
    for i in range(8):
        words |= q[..., i] << np.uint32(4 * i)
    deq = (q.reshape(n, k).astype(np.float64) - 7) * np.repeat(scale.astype(np.float64), 32, axis=1)
    return words, scale, deq


@pytest.mark.parametrize("V,D,T", [(37, 32, 1), (300, 96, 5)])
def test_embedding(gpu, rng, V, D, T):
    words, scale, deq = quantize(rng.standard_normal((V, D)).astype(np.float32))
    tokens = rng.integers(0, V, T).astype(np.uint32)
    tokens[0] = V - 1
    x = poisoned(gpu, "x", (T, D))
    bufs = [gpu.upload("t", tokens), gpu.upload("w", words), gpu.upload("s", scale), x, step_uniform(gpu, T)]
    run(gpu, "embedding", embedding_plan(D, V, T)[0], bufs, (-(-D // 8 // 64), T))
    # f16 scale × code is exact in f32; only an affine minimum adds one rounding
    np.testing.assert_allclose(read(gpu, x, (T, D)), deq[tokens], rtol=0, atol=1e-6)


def test_embedding_out_of_vocab_id_gives_zeros(gpu, rng):
    words, scale, _ = quantize(rng.standard_normal((8, 32)).astype(np.float32))
    x = poisoned(gpu, "x", (1, 32))
    bufs = [gpu.upload("t", np.array([99], np.uint32)), gpu.upload("w", words), gpu.upload("s", scale), x,
            step_uniform(gpu, 1)]
    run(gpu, "embedding", embedding_plan(32, 8)[0], bufs, (1, 1))
    assert np.all(read(gpu, x, (1, 32)) == 0)


EMBED_VARIANTS = {
    "q4f16_1": format_knobs("q4f16_1"),
    "q4_0": format_knobs("q4_0"),
    "q4_1": format_knobs("q4_1"),
    "q8_0": format_knobs("q8_0"),
    "f16": format_knobs("f16"),
    "q4_1_g64": dict(bits=4, zero=0, affine=True, group=64),
    "q8_g64": dict(bits=8, zero=128, affine=False, group=64),
}


def random_table(rng, V, D, bits, zero, affine, group):
    """A random packed table in a format, its float64 dequantization, and the scale buffer to bind
    (a NaN stub for f16: the kernel must not read it)."""
    if bits == 16:
        table = rng.uniform(-1, 1, (V, D)).astype(np.float16)
        return table.view(np.uint32), np.full(4, np.nan, np.float16), table.astype(np.float64)
    words = rng.integers(0, 2**32, (V, D * bits // 32), dtype=np.uint32)
    scale = rng.uniform(0.01, 0.1, (V, D // group)).astype(np.float16)
    minimum = rng.uniform(-0.5, 0.5, (V, D // group)).astype(np.float16)
    per_word = 32 // bits
    k = np.arange(D)
    q = (words[:, k // per_word] >> (bits * (k % per_word)).astype(np.uint32)) & np.uint32(2**bits - 1)
    deq = (q.astype(np.float64) - zero) * scale[:, k // group].astype(np.float64)
    if affine:
        deq += minimum[:, k // group].astype(np.float64)
        scale = np.stack([scale, minimum], axis=-1)  # (scale, min) pairs share binding 2
    return words, scale, deq


def run_embedding(gpu, tokens, words, scale, V, D, fmt):
    T = len(tokens)
    consts, grid = embedding_plan(D, V, T, **fmt)
    pipe = gpu.pipeline("embedding", consts)
    x = poisoned(gpu, "x", (T, D))
    bufs = [gpu.upload("t", tokens), gpu.upload("w", words), gpu.upload("s", scale), x, step_uniform(gpu, T)]
    rec = Recorder(gpu, "test-embedding")
    rec.dispatch(pipe, gpu.bind(pipe, bufs, "test-embedding"), *grid)
    rec.submit()
    return read(gpu, x, (T, D))


@pytest.mark.parametrize("variant", list(EMBED_VARIANTS))
@pytest.mark.parametrize("V,D,T", [(37, 64, 1), (300, 192, 5)])
def test_embedding_formats(gpu, rng, variant, V, D, T):
    fmt = EMBED_VARIANTS[variant]
    words, scale, deq = random_table(rng, V, D, **fmt)
    tokens = rng.integers(0, V, T).astype(np.uint32)
    tokens[0] = V - 1
    out = run_embedding(gpu, tokens, words, scale, V, D, fmt)
    np.testing.assert_allclose(out, deq[tokens], rtol=0, atol=1e-6)  # as above: one rounding at most


@pytest.mark.parametrize("variant", ["q8_0", "f16"])
def test_embedding_formats_out_of_vocab_id_gives_zeros(gpu, rng, variant):
    fmt = EMBED_VARIANTS[variant]
    words, scale, _ = random_table(rng, 8, 32, **fmt)
    out = run_embedding(gpu, np.array([99], np.uint32), words, scale, 8, 32, fmt)
    assert np.all(out == 0)


def test_embedding_plan():
    consts, grid = embedding_plan(96, 300, 5)
    assert grid == (-(-96 // 8 // 64), 5) and (consts["ROW0"], consts["NROWS"]) == (0, 0)  # q4f16_1, whole table
    assert embedding_plan(96, 300, 5, **format_knobs("q8_0"))[1] == (1, 5)  # 24 words of 4 bytes
    assert embedding_plan(96, 300, row0=256, n_rows=44)[0]["ROW0"] == 256
    with pytest.raises(ValueError, match="D must be a positive multiple of 64"):
        embedding_plan(96, 300, group=64)
    with pytest.raises(ValueError, match="bad vocabulary rows"):
        embedding_plan(96, 300, row0=256, n_rows=45)


# natural: the int8 row in element order (shaders/q8_codes.wgsl Q8_NATURAL, a model of K-quant products)
@pytest.mark.parametrize("T,D,q8,natural", [(1, 64, False, False), (3, 77, False, False), (4, 3072, False, False),
                                            (1, 96, True, False), (4, 3072, True, False), (1, 96, True, True),
                                            (4, 3072, True, True)])
def test_add_rms_norm(any_gpu, rng, T, D, q8, natural):
    g = any_gpu
    r_in = rng.standard_normal((T, D)).astype(np.float32)
    delta = rng.standard_normal((T, D)).astype(np.float32)
    w = rng.standard_normal(D).astype(np.float16)
    r_out, y = poisoned(g, "r_out", (T, D)), poisoned(g, "y", (T, D))
    xq, xm = poisoned(g, "xq", (max(D // 4, 1),), np.uint32), poisoned(g, "xm", (max(D // 32, 1), 2))
    bufs = [g.upload("r_in", r_in), g.upload("d", delta), g.upload("w", w), r_out, y, step_uniform(g, T), xq, xm]
    run(g, "add_rms_norm", dict(WG=128, D=D, EPS=1e-6, Q8=q8, NORM_OFFSET=0.0, Q8_NATURAL=natural), bufs, (T,))
    s = r_in.astype(np.float64) + delta
    ref = s / np.sqrt((s**2).mean(1, keepdims=True) + 1e-6) * w.astype(np.float64)
    np.testing.assert_allclose(read(g, r_out, (T, D)), s, rtol=1e-6, atol=1e-6)  # one f32 addition
    out = read(g, y, (T, D))
    # Σx² over D ≤ 3072 positive terms: ≤ (D − 1)·2^-24 relative, halved by the root (inverseSqrt: 2 ULP)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert_q8_row(g, xq, xm, out[-1] if q8 else None, natural)  # the last row in int8, or nothing written


def greedy_pick(gpu, logits, out_index=0):
    """GpuArgmax (one pass, or two past 2 slices) over `logits`; returns (tokens[0], the ring)."""
    tokens = poisoned(gpu, "tokens", (4,), np.uint32)
    ring = poisoned(gpu, "ring", (8,), np.uint32)
    picker = GpuArgmax(gpu, len(logits), gpu.upload("l", logits), tokens, ring, step_uniform(gpu, out_index=out_index))
    rec = Recorder(gpu, "argmax-test")
    picker.record(rec)
    rec.submit()
    return int(read(gpu, tokens, (4,), np.uint32)[0]), read(gpu, ring, (8,), np.uint32), picker


@pytest.mark.parametrize("V", [5, 1000, 4097, 32064, 151936, 248320])
def test_argmax_writes_token_and_ring(gpu, rng, V):
    logits = rng.standard_normal(V).astype(np.float32)
    logits[rng.integers(V)] = 50.0
    token, ring, picker = greedy_pick(gpu, logits, out_index=3)
    want = int(np.argmax(logits))
    assert token == want and ring[3] == want and ring[2] == np.iinfo(np.uint32).max
    assert (picker.parts > 0) == (V > 2 * ARGMAX_SLICE)  # big vocabularies take the two-pass path


@pytest.mark.parametrize("V", [1000, 151936])
def test_argmax_ties_pick_lowest_index(gpu, V):
    # Ties inside one slice, across slices and at the last element; all logits negative around them.
    logits = np.full(V, -5.0, np.float32)
    hits = [V - 1, V // 2, 300, 700]
    logits[hits] = -1.0
    assert greedy_pick(gpu, logits)[0] == 300


def test_argmax_in_the_last_partial_slice(gpu, rng):
    V = 3 * ARGMAX_SLICE + 7  # four slices of ceil(V/4); the maximum sits in the short last one
    logits = rng.standard_normal(V).astype(np.float32)
    logits[V - 3] = 9.0
    assert greedy_pick(gpu, logits)[0] == V - 3
