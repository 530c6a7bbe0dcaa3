"""The one-dispatch decode attention (attention_decode.wgsl) vs float64 numpy, and vs the three-kernel path it
replaces (rope_append + attention (+ attn_gate)) on the same data; its split-K form (attention_decode_split.wgsl,
the last workgroup of each head combining) vs float64 numpy, vs attention_decode and vs the split-K path it replaces
(rope_append + split attention + attention_combine (+ attn_gate)), dispatch after dispatch on the same tickets."""

import numpy as np
import pytest

from engine.gpu import Recorder
from engine.kernels.attention import (
    LANES_SUBGROUP,
    attention_decode_consts,
    attn_gate_plan,
    combine_consts,
    rope_append_consts,
    split_decode_part_bytes,
    split_decode_wg,
)
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
    split_ranges,
    step_uniform,
)

EPS = 1e-6


@pytest.fixture(params=["serial", "batched", "lanes"])
def variant(request):
    """attention_decode_consts' variant: both kernels' loads one at a time, in groups, or lane groups across the head
    dim (the decode_attention knob)."""
    return request.param


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

    def reference(self, new_kv=None):
        """(out [H·HD], new k [KVH, HD], new v [KVH, HD]) in float64 (the new k and v as the f16 cache holds them).
        `new_kv`: the new k and v rows (f16 [KVH, HD]) the attention takes instead (the kernel's own: a one-ulp f16
        rounding difference of a heavily weighted new key moves the output by up to ~1e-4)."""
        H, KVH, HD = self.H, self.KVH, self.HD
        heads = self.row[: (H + 2 * KVH) * HD].reshape(1, H + 2 * KVH, HD).astype(np.float64)
        q, k, v = heads[:, :H], heads[:, H:H + KVH], heads[:, H + KVH:]
        if self.qk_norm:
            q, k = rms(q, self.norms[0], self.offset), rms(k, self.norms[1], self.offset)
        q = rope_ref(q, [self.p], self.inv_freq, self.ROT)
        k_new = rope_ref(k, [self.p], self.inv_freq, self.ROT)[0].astype(np.float16)
        v_new = v[0].astype(np.float16)
        k_att, v_att = (k_new, v_new) if new_kv is None else new_kv
        keys = np.concatenate([self.k_old, k_att[None]])
        values = np.concatenate([self.v_old, v_att[None]])
        out = attention_ref(q.astype(np.float32), keys, values, self.p, 1.0 / np.sqrt(HD))[0]
        if self.gate_off is not None:
            out = out / (1.0 + np.exp(-self.row[self.gate_off:].astype(np.float64)))
        return out, k_new.astype(np.float64), v_new.astype(np.float64)


def run_decode(g, a, q8, WG=256, variant="serial", subgroup=LANES_SUBGROUP):
    k_cache, v_cache = a.caches(g)
    params = np.concatenate([a.inv_freq, a.norms[0].astype(np.float32), a.norms[1].astype(np.float32)])
    out = poisoned(g, "out", (a.H * a.HD,))
    xq, xm = poisoned(g, "xq", (a.H * a.HD // 4,), np.uint32), poisoned(g, "xm", (max(a.H * a.HD // 32, 1), 2))
    consts = attention_decode_consts(a.rope(), a.gate_off, q8, wg=WG, variant=variant, subgroup=subgroup)
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
def test_attention_decode(any_gpu, rng, variant, H, KVH, HD, ROT, p, qk_norm, gate, WG):
    g = any_gpu
    offset = 1.0 if gate else 0.0  # Qwen3.5's zero-centred q/k norms
    a = DecodeSetup(g, rng, H, KVH, HD, ROT, p, qk_norm, gate, offset)
    ref, k_ref, v_ref = a.reference()
    q8 = HD % 32 == 0
    out, k_cache, v_cache, xq, xm = run_decode(g, a, q8, WG, variant)
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert_q8_row(g, xq, xm, out if q8 else None)
    # The cache: the old rows untouched, the new one written once per kv head, nothing else.
    positions = list(range(p + 1))
    for cache, old, new in ((k_cache, a.k_old, k_ref), (v_cache, a.v_old, v_ref)):
        expected = np.concatenate([old.astype(np.float64), new[None]])
        check_cache(read(g, cache, a.shape, np.float16), a.page_table, expected, positions,
                    1e-3 * np.abs(new).max())


def test_attention_decode_without_q8_leaves_the_int8_row(gpu, rng, variant):
    a = DecodeSetup(gpu, rng, 4, 2, 64, 64, 20, False, False)
    out, *_, xq, xm = run_decode(gpu, a, q8=False, variant=variant)
    np.testing.assert_allclose(out, a.reference()[0], rtol=1e-4, atol=1e-5)
    assert_q8_row(gpu, xq, xm, None)


def rope_append_reference(g, a, H, KVH, HD, step):
    """rope_append on the setup's row into fresh caches: (q, k_cache, v_cache, page table, step) for the kernels the
    fused ones replace."""
    k_cache, v_cache = a.caches(g)
    pt, inv_freq = g.upload("pt", a.page_table), g.upload("inv_freq", a.inv_freq)
    q = poisoned(g, "q", (H * HD,))
    norms = [g.upload("q_norm", a.norms[0]), g.upload("k_norm", a.norms[1])]
    qkv = g.upload("qkv", a.row[:(H + 2 * KVH) * HD])
    run(g, "rope_append", a.rope(), [qkv, q, k_cache, v_cache, pt, inv_freq, step, *norms], (1, H + 2 * KVH))
    return q, k_cache, v_cache, pt, step


def assert_same_as_the_kernels(g, a, fused, theirs_out, fused_caches, their_caches):
    """The fused kernel's output to f32 rounding and its cache rows to one f16 ulp (the two kernels may contract the
    RoPE products differently) against the separate kernels'."""
    np.testing.assert_allclose(fused, theirs_out, rtol=1e-5, atol=1e-6)
    for mine, theirs in zip(fused_caches, their_caches, strict=True):
        mine, theirs = read(g, mine, a.shape, np.float16), read(g, theirs, a.shape, np.float16)
        assert np.array_equal(np.isnan(mine), np.isnan(theirs))
        ok = ~np.isnan(theirs)
        np.testing.assert_allclose(mine[ok], theirs[ok], rtol=2**-10, atol=0)


@pytest.mark.parametrize("gate", [False, True])
def test_attention_decode_matches_the_three_kernels(gpu, rng, variant, gate):
    """rope_append + attention (+ attn_gate) on the same row and cache: the same output and the same cache bits."""
    g = gpu
    H, KVH, HD, ROT, p = 8, 2, 128, 64, 45
    a = DecodeSetup(g, rng, H, KVH, HD, ROT, p, True, gate, 1.0 if gate else 0.0)
    fused, k_fused, v_fused, *_ = run_decode(g, a, q8=True, variant=variant)

    q, k_cache, v_cache, pt, step = rope_append_reference(g, a, H, KVH, HD, step_uniform(g, 1, p))
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
    assert_same_as_the_kernels(g, a, fused, read(g, out, (H * HD,)), (k_fused, v_fused), (k_cache, v_cache))


# ---- the split-K form: attention_decode_split.wgsl ----------------------------------------------------------------
# Tolerance vs float64: f32 dots of HD terms and softmax sums over ≤ 600 keys of O(1) values, about (HD + n)·2^-24
# relative at worst (< 5e-5), under rtol 1e-4 / atol 1e-5 as the whole-head kernel's test uses.

MAX_SPLITS = 32


def slow(*case):
    return pytest.param(*case, marks=pytest.mark.slow)


class SplitScratch:
    """The split kernel's `part` (NaN: a record read before it is written fails the test) and `tickets` (zero, as
    the runtime allocates them) for H heads."""

    def __init__(self, g, H, HD):
        self.part = g.upload("part", np.full(split_decode_part_bytes(H, HD, MAX_SPLITS) // 4, np.nan, np.float32))
        self.tickets = g.upload("tickets", np.zeros(max(H, 4), np.uint32))

    def tickets_zero(self, g, H):
        return not read(g, self.tickets, (max(H, 4),), np.uint32).any()


def split_bindings(g, a, q8, splits, scratch, WG, variant="serial", subgroup=LANES_SUBGROUP):
    """(pipeline, bind group, (out, k_cache, v_cache, xq, xm)) of one split-K decode dispatch over `a`."""
    k_cache, v_cache = a.caches(g)
    params = np.concatenate([a.inv_freq, a.norms[0].astype(np.float32), a.norms[1].astype(np.float32)])
    out = poisoned(g, "out", (a.H * a.HD,))
    xq, xm = poisoned(g, "xq", (a.H * a.HD // 4,), np.uint32), poisoned(g, "xm", (max(a.H * a.HD // 32, 1), 2))
    pipe = g.pipeline("attention_decode_split", attention_decode_consts(a.rope(), a.gate_off, q8, wg=WG,
                                                                        variant=variant, subgroup=subgroup))
    step = step_uniform(g, 1, a.p, attn_splits=splits)
    bg = g.bind(pipe, [g.upload("qkv", a.row), k_cache, v_cache, g.upload("pt", a.page_table),
                       g.upload("params", params), out, step, xq, xm, scratch.part, scratch.tickets], "split")
    return pipe, bg, (out, k_cache, v_cache, xq, xm)


def run_split(g, a, q8, splits, WG=None, grid_y=None, scratch=None, variant="serial", subgroup=LANES_SUBGROUP):
    scratch = scratch or SplitScratch(g, a.H, a.HD)
    wg = WG or split_decode_wg(a.HD, variant)
    pipe, bg, (out, k_cache, v_cache, xq, xm) = split_bindings(g, a, q8, splits, scratch, wg, variant, subgroup)
    rec = Recorder(g, "test-split")
    rec.dispatch(pipe, bg, a.H, grid_y or splits, 1)
    rec.submit()
    g.sync()
    assert scratch.tickets_zero(g, a.H), "a head's ticket was left for the next dispatch"
    return read(g, out, (a.H * a.HD,)), k_cache, v_cache, xq, xm


def check_split(g, a, out, k_cache, v_cache, xq, xm, q8):
    page, sl = int(a.page_table[a.p // PAGE]), a.p % PAGE
    written = [read(g, c, a.shape, np.float16)[page, :, sl] for c in (k_cache, v_cache)]  # checked below
    ref = a.reference(written)[0]
    _, k_ref, v_ref = a.reference()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)
    assert_q8_row(g, xq, xm, out if q8 else None)
    positions = list(range(a.p + 1))
    for cache, old, new in ((k_cache, a.k_old, k_ref), (v_cache, a.v_old, v_ref)):
        expected = np.concatenate([old.astype(np.float64), new[None]])
        check_cache(read(g, cache, a.shape, np.float16), a.page_table, expected, positions,
                    1e-3 * np.abs(new).max())


@pytest.mark.parametrize(
    "H,KVH,HD,ROT,p,qk_norm,gate,splits",
    [
        (8, 2, 64, 32, 100, False, False, 2),  # GQA, two splits
        slow(4, 4, 128, 128, 299, True, False, 5),  # MHA, q/k norms, five splits of 60 keys
        slow(8, 2, 96, 64, 600, False, False, 10),  # the bench's context: ten splits of 61 keys
        slow(4, 2, 256, 64, 130, True, True, 3),  # widest head, gated (Qwen3.5)
        (4, 1, 128, 64, 8, True, True, 8),  # 2 keys a split: p alone in split 4, splits 5-7 empty
        slow(2, 1, 64, 64, 2, False, False, 2),  # p alone in the last split (the boundary at p)
        slow(4, 2, 128, 128, 127, False, True, 2),  # p the last key of a full split (n = 2·64)
        slow(4, 2, 64, 64, 700, True, False, 32),  # the most splits
    ],
)
def test_attention_decode_split(any_gpu, rng, variant, H, KVH, HD, ROT, p, qk_norm, gate, splits):
    g = any_gpu
    a = DecodeSetup(g, rng, H, KVH, HD, ROT, p, qk_norm, gate, 1.0 if gate else 0.0)
    ranges = split_ranges(p + 1, splits)
    assert sum(b - a_ for a_, b in ranges) == p + 1
    out, k_cache, v_cache, xq, xm = run_split(g, a, True, splits, variant=variant)
    check_split(g, a, out, k_cache, v_cache, xq, xm, True)


@pytest.mark.parametrize("HD,gate", [(96, False), slow(64, True)])
def test_attention_decode_split_without_q8_and_a_grid_past_the_splits(gpu, rng, variant, HD, gate):
    """Q8 off leaves the int8 row; workgroups past step.attn_splits (a grid taller than the splits) take no ticket."""
    a = DecodeSetup(gpu, rng, 4, 2, HD, HD, 200, True, gate, 1.0 if gate else 0.0)
    out, k_cache, v_cache, xq, xm = run_split(gpu, a, False, 4, grid_y=7, variant=variant)
    check_split(gpu, a, out, k_cache, v_cache, xq, xm, False)


@pytest.mark.parametrize("subgroup", [4, 16, 64])
def test_attention_decode_lanes_sized_for_another_subgroup(gpu, rng, subgroup):
    """"lanes" with its lane chunks sized for subgroups other than the adapter's: smaller (a lane holds more chunks
    than its group needs) or larger (too few for the adapter's lane groups: the kernel takes batched's walk)."""
    a = DecodeSetup(gpu, rng, 8, 2, 128, 64, 100, True, False)
    out, k_cache, v_cache, xq, xm = run_decode(gpu, a, True, variant="lanes", subgroup=subgroup)
    np.testing.assert_allclose(out, a.reference()[0], rtol=1e-4, atol=1e-5)
    assert_q8_row(gpu, xq, xm, out)
    a = DecodeSetup(gpu, rng, 8, 2, 128, 64, 100, True, False)
    out, k_cache, v_cache, xq, xm = run_split(gpu, a, True, 3, variant="lanes", subgroup=subgroup)
    check_split(gpu, a, out, k_cache, v_cache, xq, xm, True)


@pytest.mark.parametrize("H,KVH,HD,p,gate,WG", [(8, 2, 128, 45, False, 64), slow(4, 2, 64, 300, True, 256),
                                                slow(4, 4, 96, 20, False, 32)])
def test_attention_decode_split_with_one_split_is_attention_decode(gpu, rng, variant, H, KVH, HD, p, gate, WG):
    """S = 1: attention_decode.wgsl's bits (output, int8 row, cache), no partial written, no ticket taken."""
    a = DecodeSetup(gpu, rng, H, KVH, HD, HD // 2, p, True, gate, 1.0 if gate else 0.0)
    q8 = HD % 32 == 0
    scratch = SplitScratch(gpu, H, HD)
    split = run_split(gpu, a, q8, 1, WG, scratch=scratch, variant=variant)
    whole = run_decode(gpu, a, q8, WG, variant)
    assert np.array_equal(split[0].view(np.uint32), whole[0].view(np.uint32))
    for mine, theirs, dtype in ((split[1], whole[1], np.uint16), (split[2], whole[2], np.uint16),
                                (split[3], whole[3], np.uint32), (split[4], whole[4], np.uint32)):
        size = mine.size // np.dtype(dtype).itemsize
        assert np.array_equal(read(gpu, mine, (size,), dtype), read(gpu, theirs, (size,), dtype))
    assert np.isnan(read(gpu, scratch.part, (scratch.part.size // 4,))).all()


@pytest.mark.slow
@pytest.mark.parametrize("gate", [False, True])
def test_attention_decode_split_matches_the_split_k_kernels(gpu, rng, variant, gate):
    """rope_append + split attention + attention_combine (+ attn_gate) at the same splits: the same output to f32
    rounding (the partials sum their keys in another order; the combine's order over splits is the same), the same
    int8 row where it rounds alike, and the cache to one f16 ulp (as the whole-head test states)."""
    g = gpu
    H, KVH, HD, ROT, p, S = 8, 2, 128, 64, 330, 6
    a = DecodeSetup(g, rng, H, KVH, HD, ROT, p, True, gate, 1.0 if gate else 0.0)
    fused, k_fused, v_fused, *_ = run_split(g, a, True, S, variant=variant)

    q, k_cache, v_cache, pt, step = rope_append_reference(g, a, H, KVH, HD, step_uniform(g, 1, p, 0, S))
    part_o, part_ml = poisoned(g, "part_o", (S, H * HD)), poisoned(g, "part_ml", (S, H, 2))
    attn = dict(WG=64, H=H, KVH=KVH, HD=HD, PAGE=PAGE, SCALE=float(1 / np.sqrt(HD)), SPLIT=True)
    run(g, "attention", attn, [q, k_cache, v_cache, pt, part_o, part_ml, step], (H, 1, S))
    out = poisoned(g, "out", (H * HD,))
    xq, xm = poisoned(g, "xq", (H * HD // 4,), np.uint32), poisoned(g, "xm", (H * HD // 32, 2))
    run(g, "attention_combine", combine_consts(H, HD, not gate), [part_o, part_ml, out, step, xq, xm], (H, 1))
    if gate:
        gated = poisoned(g, "gated", (H * HD,))
        consts, groups = attn_gate_plan(H * HD, 64, rows_q8=True, rows_f32=True)
        run(g, "attn_gate", consts, [out, g.upload("gate", a.row[a.gate_off:]), gated, step, xq, xm], (groups, 1))
        out = gated
    assert_same_as_the_kernels(g, a, fused, read(g, out, (H * HD,)), (k_fused, v_fused), (k_cache, v_cache))


@pytest.mark.slow
def test_attention_decode_split_layer_after_layer(gpu, rng, variant):
    """Decode's use: one recording, a dispatch per layer on the same part and tickets (each layer its own row and
    cache); every layer's output is right and the tickets are zero at the end."""
    g = gpu
    H, KVH, HD, p, S = 8, 2, 64, 250, 4
    layers = [DecodeSetup(g, rng, H, KVH, HD, HD, p, True, False) for _ in range(5)]
    scratch = SplitScratch(g, H, HD)
    rec = Recorder(g, "test-split-layers")
    outs = []
    for a in layers:
        pipe, bg, bufs = split_bindings(g, a, True, S, scratch, split_decode_wg(HD, variant), variant)
        rec.dispatch(pipe, bg, H, S, 1)
        outs.append(bufs)
    rec.submit()
    g.sync()
    assert scratch.tickets_zero(g, H)
    for a, (out, k_cache, v_cache, xq, xm) in zip(layers, outs, strict=True):
        check_split(g, a, read(g, out, (H * HD,)), k_cache, v_cache, xq, xm, True)
