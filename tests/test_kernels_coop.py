"""The tensor-core prefill GEMM (shaders/matmul_coop.wgsl) vs float64 numpy, and its fallback.

lavapipe offers no cooperative matrices: there the tests check that the runtime keeps the f32 GEMM (and that a
GPU which claims the feature but rejects the kernel does too). The kernel tests run where the adapter offers
cooperative-matrix (the H200 of BENCH.md: `python3 -m pytest tests/test_kernels_coop.py`).
"""

import numpy as np
import pytest

from engine import matmul
from engine.bench import random_weights
from engine.matmul import coop_gemm_check, gemm_plan, gemm_shader
from engine.models.base import DenseSpec, rope_inv_freq
from engine.transformer import DenseTransformer, tensor_shapes
from tests.test_kernels_matmul import VARIANTS, random_packed, reference_dequantize_fmt, run_int4, silu

ALL_FORMATS = {"q4f16_1": matmul.FORMATS["q4f16_1"], **VARIANTS}


@pytest.fixture
def coop_gpu(gpu):
    if not gpu.has_coop:
        pytest.skip(f"{gpu.info.summary()} offers no cooperative matrices (the fallback is tested below)")
    assert coop_gemm_check(gpu), "the GPU offers cooperative matrices but matmul_coop failed its self-check"
    return gpu


def reference_f16(x, w, s, N, gate_up, fmt):
    """The exact product of the f16-rounded operands the tensor cores see (sums in float64)."""
    x16 = x.astype(np.float16).astype(np.float64)
    w16 = reference_dequantize_fmt(w, s, **fmt).astype(np.float16).astype(np.float64)
    out = x16 @ w16.T
    return silu(out[..., :N]) * out[..., N:] if gate_up else out


@pytest.mark.parametrize("variant", list(ALL_FORMATS))
@pytest.mark.parametrize("T,K,N,gate_up", [
    (70, 128, 96, False),  # a partial second token tile, a partial column tile
    (5, 256, 37, True),  # fewer tokens than a subgroup's rows; gate_up with N not a multiple of 16
    (130, 64, 200, False),  # three token tiles, four column tiles
])
def test_coop_gemm_formats(coop_gpu, rng, variant, T, K, N, gate_up):
    g, fmt = coop_gpu, ALL_FORMATS[variant]
    if K % fmt["group"]:
        pytest.skip("K is not a multiple of this format's group")
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = gemm_plan(K, N, T, gate_up=gate_up, subgroup=g.subgroup_size, **fmt)
    out = run_int4(g, "matmul_coop", consts, grid, x, w, s, (T, N), T)
    ref = reference_f16(x, w, s, N, gate_up, fmt)
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 1e-5, f"max error {err:.2e} of max|ref| against the f16-rounded operands"


def test_coop_gemm_writes_only_its_rows_and_its_slice(coop_gpu, rng):
    # n_tokens < the buffer's rows, and YS > N (a slice of a wider Y, as the split LM head writes it).
    g = coop_gpu
    T, n_tokens, K, N, YS = 80, 67, 128, 40, 56
    w, s = random_packed(rng, N, K, **ALL_FORMATS["q4f16_1"])
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = gemm_plan(K, N, T, y_stride=YS, subgroup=g.subgroup_size)
    out = run_int4(g, "matmul_coop", consts, grid, x, w, s, (T, YS), n_tokens)
    ref = reference_f16(x[:n_tokens], w, s, N, False, ALL_FORMATS["q4f16_1"])
    assert np.isnan(out[n_tokens:]).all() and np.isnan(out[:n_tokens, N:]).all()
    assert np.abs(out[:n_tokens, :N] - ref).max() < 1e-5 * np.abs(ref).max()


def small_spec(vocab=512) -> DenseSpec:
    inv, rot = rope_inv_freq(64, 10000.0)
    spec = DenseSpec(256, 2, 4, 2, 64, 512, vocab, 1e-5, inv, rot, 1024, False, False)
    spec.names = {c: c for c in tensor_shapes(spec)}
    return spec


def test_model_logits_on_tensor_cores_match_the_f32_gemm(coop_gpu):
    spec = small_spec()
    ids = np.random.default_rng(3).integers(0, spec.vocab, 150).astype(np.uint32)
    logits = {}
    for coop in (True, False):
        rt = DenseTransformer(coop_gpu, spec, random_weights(spec), max_context=256, prefill_chunk=128,
                              coop_gemm=coop, q8_decode=False)
        assert rt.gemm_shader == ("matmul_coop" if coop else "matmul_int4")
        logits[coop] = np.concatenate([rt.logits(ids[:128]), rt.logits(ids[128:])])
    ref = logits[False]
    rel = np.abs(logits[True] - ref).max() / np.abs(ref).max()
    assert rel < 1e-2, f"tensor-core logits differ from the f32 GEMM's by {rel:.2e} of max|logit|"
    assert (logits[True].argmax(1) == ref.argmax(1)).mean() > 0.95


# ---- the fallback (runs everywhere) ---------------------------------------------------------------
def test_without_cooperative_matrices_the_f32_gemm_runs(gpu):
    if gpu.has_coop:
        pytest.skip("this GPU has cooperative matrices")
    assert not coop_gemm_check(gpu) and gemm_shader(gpu) == ("matmul_int4", 0)
    spec = small_spec()
    rt = DenseTransformer(gpu, spec, random_weights(spec), max_context=64, prefill_chunk=32)
    assert rt.gemm_shader == "matmul_int4"
    assert {p.label for p in rt.p.values() if p.label.startswith("matmul")} == {"matmul_int4"}


def test_a_gpu_that_rejects_the_kernel_keeps_the_f32_gemm(gpu, monkeypatch):
    # A driver that claims the feature but fails to build (or run) the kernel must not take the prefill down.
    if gpu.has_coop:
        pytest.skip("this GPU has cooperative matrices")
    monkeypatch.setattr(gpu, "has_coop", True)
    monkeypatch.setattr(matmul, "_coop_checked", type(matmul._coop_checked)())
    assert coop_gemm_check(gpu) is False  # lavapipe rejects `enable wgpu_cooperative_matrix`
    assert gemm_shader(gpu) == ("matmul_int4", 0)


def test_coop_plan_fixes_its_tile():
    consts, grid = gemm_plan(128, 96, 70, subgroup=32)
    assert consts["SG"] == 32 and grid == gemm_plan(128, 96, 70)[1]
    assert gemm_plan(128, 96, 70, gate_up=True, subgroup=32)[0]["TN"] == 32
    with pytest.raises(ValueError, match="64 tokens × 64 weight rows"):
        gemm_plan(128, 96, 70, tm=32, subgroup=32)
