"""The one-dispatch decode attention (attention_decode.wgsl) vs float64 numpy, and vs the three-kernel path it
replaces (rope_append + attention (+ attn_gate)) on the same data."""

import numpy as np
import pytest

from engine.kernels.attention import attention_decode_consts, attn_gate_plan, rope_append_consts
from tests.helpers import (
    PAGE,
    assert_q8_row,
    attention_ref,
    cache_with,
    check_cache,
    inv_freq_for,
    page_table_for,
    poisoned,
    read,
    rope_ref,
    run,
    step_uniform,
)

EPS = 1e-6


def rms(x, w, offset):
    return x / np.sqrt((x**2).mean(-1, keepdims=True) + EPS) * (w.astype(np.float64) + offset)


class DecodeSetup:
    """A paged cache holding positions 0..p-1 (NaN everywhere else, the slot of p included), a fused QKV row for
    position p and, for the gated variant, the gate row behind it at `gate_off`."""

    def __init__(self, g, rng, H, KVH, HD, ROT, p, qk_norm, gate, offset=0.0):
        self.H, self.KVH, self.HD, self.ROT, self.p, self.qk_norm, self.offset = H, KVH, HD, ROT, p, qk_norm, offset
        n = (H + 2 * KVH) * HD
        self.gate_off = -(-n // 64) * 64 + 64 if gate else None  # past the row, as the runtime aligns it
        width = self.gate_off + H * HD if gate else n
        self.row = rng.standard_normal(width).astype(np.float32)
        if gate:
            self.row[n:self.gate_off] = np.nan  # the gap between the two rows is never read
        self.k_old = rng.standard_normal((p, KVH, HD)).astype(np.float16)
        self.v_old = rng.standard_normal((p, KVH, HD)).astype(np.float16)
        self.page_table, self.n_pages = page_table_for(rng, p // PAGE + 1)
        self.inv_freq = inv_freq_for(ROT)
        self.norms = (0.5 + rng.random((2, HD))).astype(np.float16)
        self.shape = (self.n_pages, KVH, PAGE, HD)

    def caches(self, g):
        return [g.upload(name, cache_with(old, self.page_table, self.n_pages, self.KVH, self.HD))
                for name, old in (("k_cache", self.k_old), ("v_cache", self.v_old))]

    def rope(self):
        return rope_append_consts(self.H, self.KVH, self.HD, self.ROT, PAGE, self.qk_norm, EPS, self.offset)

    def reference(self):
        """(out [H·HD], new k [KVH, HD], new v [KVH, HD]) in float64 (the new k and v as the f16 cache holds them)."""
        H, KVH, HD = self.H, self.KVH, self.HD
        heads = self.row[: (H + 2 * KVH) * HD].reshape(1, H + 2 * KVH, HD).astype(np.float64)
        q, k, v = heads[:, :H], heads[:, H:H + KVH], heads[:, H + KVH:]
        if self.qk_norm:
            q, k = rms(q, self.norms[0], self.offset), rms(k, self.norms[1], self.offset)
        q = rope_ref(q, [self.p], self.inv_freq, self.ROT)
        k_new = rope_ref(k, [self.p], self.inv_freq, self.ROT)[0].astype(np.float16)
        v_new = v[0].astype(np.float16)
        keys = np.concatenate([self.k_old, k_new[None]])
        values = np.concatenate([self.v_old, v_new[None]])
        out = attention_ref(q.astype(np.float32), keys, values, self.p, 1.0 / np.sqrt(HD))[0]
        if self.gate_off is not None:
            out = out / (1.0 + np.exp(-self.row[self.gate_off:].astype(np.float64)))
        return out, k_new.astype(np.float64), v_new.astype(np.float64)


def run_decode(g, a, q8, WG=256):
    k_cache, v_cache = a.caches(g)
    params = np.concatenate([a.inv_freq, a.norms[0].astype(np.float32), a.norms[1].astype(np.float32)])
    out = poisoned(g, "out", (a.H * a.HD,))
    xq, xm = poisoned(g, "xq", (a.H * a.HD // 4,), np.uint32), poisoned(g, "xm", (max(a.H * a.HD // 32, 1), 2))
    consts = attention_decode_consts(a.rope(), a.gate_off, q8, wg=WG)
    run(g, "attention_decode", consts, [g.upload("qkv", a.row), k_cache, v_cache, g.upload("pt", a.page_table),
                                        g.upload("params", params), out, step_uniform(g, 1, a.p), xq, xm], (a.H, 1, 1))
    return read(g, out, (a.H * a.HD,)), k_cache, v_cache, xq, xm


@pytest.mark.parametrize(
    "H,KVH,HD,ROT,p,qk_norm,gate,WG",
    [
        (8, 2, 96, 64, 37, False, False, 256),  # GQA, partial rotary, pages crossed, one key block
        (4, 4, 32, 32, 0, False, False, 256),  # the first token: the new key is the only one
        (4, 2, 128, 128, 300, True, False, 256),  # q/k norms, two key blocks of 256 (the new key in the second)
        (8, 2, 64, 32, 70, True, True, 64),  # gated (Qwen3.5), 64 threads: two key blocks
        (2, 1, 256, 64, 19, True, True, 256),  # widest head
        (4, 2, 96, 96, 63, False, False, 32),  # 32 threads, 6 of them a value row: 5 key lanes; 2 key blocks
        (4, 2, 24, 24, 40, False, False, 64),  # 6 chunks: 3 a thread in the P·V phase
        (2, 1, 20, 20, 9, True, False, 32),  # 5 chunks: 1 a thread
    ],
)
def test_attention_decode(any_gpu, rng, H, KVH, HD, ROT, p, qk_norm, gate, WG):
    g = any_gpu
    offset = 1.0 if gate else 0.0  # Qwen3.5's zero-centred q/k norms
    a = DecodeSetup(g, rng, H, KVH, HD, ROT, p, qk_norm, gate, offset)
    ref, k_ref, v_ref = a.reference()
    q8 = HD % 32 == 0
    out, k_cache, v_cache, xq, xm = run_decode(g, a, q8, WG)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert_q8_row(g, xq, xm, out if q8 else None)
    # The cache: the old rows untouched, the new one written once per kv head, nothing else.
    positions = list(range(p + 1))
    for cache, old, new in ((k_cache, a.k_old, k_ref), (v_cache, a.v_old, v_ref)):
        expected = np.concatenate([old.astype(np.float64), new[None]])
        check_cache(read(g, cache, a.shape, np.float16), a.page_table, expected, positions,
                    1e-3 * np.abs(new).max())


def test_attention_decode_without_q8_leaves_the_int8_row(gpu, rng):
    a = DecodeSetup(gpu, rng, 4, 2, 64, 64, 20, False, False)
    out, *_, xq, xm = run_decode(gpu, a, q8=False)
    np.testing.assert_allclose(out, a.reference()[0], rtol=1e-4, atol=1e-5)
    assert_q8_row(gpu, xq, xm, None)


@pytest.mark.parametrize("gate", [False, True])
def test_attention_decode_matches_the_three_kernels(gpu, rng, gate):
    """rope_append + attention (+ attn_gate) on the same row and cache: the same output and the same cache bits."""
    g = gpu
    H, KVH, HD, ROT, p = 8, 2, 128, 64, 45
    a = DecodeSetup(g, rng, H, KVH, HD, ROT, p, True, gate, 1.0 if gate else 0.0)
    fused, k_fused, v_fused, *_ = run_decode(g, a, q8=True)

    k_cache, v_cache = a.caches(g)
    pt, inv_freq, step = g.upload("pt", a.page_table), g.upload("inv_freq", a.inv_freq), step_uniform(g, 1, p)
    n = (H + 2 * KVH) * HD
    q = poisoned(g, "q", (H * HD,))
    norms = [g.upload("q_norm", a.norms[0]), g.upload("k_norm", a.norms[1])]
    run(g, "rope_append", a.rope(), [g.upload("qkv", a.row[:n]), q, k_cache, v_cache, pt, inv_freq, step, *norms],
        (1, H + 2 * KVH))
    out = poisoned(g, "out", (H * HD,))
    attn = dict(WG=64, H=H, KVH=KVH, HD=HD, PAGE=PAGE, SCALE=float(1 / np.sqrt(HD)), SPLIT=False)
    run(g, "attention", attn, [q, k_cache, v_cache, pt, out, g.buffer("part_ml-unused", 16), step], (H, 1, 1))
    if gate:  # the split-K decode's gate: the f32 row and o's int8 row
        gated = poisoned(g, "gated", (H * HD,))
        xq, xm = poisoned(g, "xq", (H * HD // 4,), np.uint32), poisoned(g, "xm", (H * HD // 32, 2))
        consts, groups = attn_gate_plan(H * HD, 64, rows_q8=True, rows_f32=True)
        run(g, "attn_gate", consts, [out, g.upload("gate", a.row[a.gate_off:]), gated, step, xq, xm], (groups, 1))
        out = gated
        assert_q8_row(g, xq, xm, read(g, out, (H * HD,)))
    np.testing.assert_allclose(fused, read(g, out, (H * HD,)), rtol=1e-5, atol=1e-6)
    for mine, theirs in ((k_fused, k_cache), (v_fused, v_cache)):
        mine, theirs = read(g, mine, a.shape, np.float16), read(g, theirs, a.shape, np.float16)
        assert np.array_equal(np.isnan(mine), np.isnan(theirs))
        ok = ~np.isnan(theirs)
        # one f16 ulp at most: the two kernels may contract the RoPE products differently
        np.testing.assert_allclose(mine[ok], theirs[ok], rtol=2**-10, atol=0)
