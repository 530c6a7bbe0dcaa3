"""q4f16_1 format helpers and the packed matvec / GEMM kernels (every weight format) vs float64 numpy."""

import numpy as np
import pytest

from engine.formats.q4f16_1 import dequantize_q4f16_1, quantize_q4f16_1
from engine.kernels import MAX_GROUPS_PER_DIM
from engine.kernels.matmul import FORMATS, format_knobs, gemm_plan, matvec_plan, matvec_sg_plan, prefers_subgroup_rows
from tests.helpers import poisoned, random_packed, read, reference_fmt, run, silu, step_uniform


@pytest.fixture
def kernel_gpu(any_gpu):
    # Gpu.pipeline keys its cache by reduction path, so each any_gpu variant builds its own pipeline.
    return any_gpu


# ---- an independent reference of the format, written from the spec ---------------------------------
def reference_quantize(w):
    """Per group of 32 along K: scale = max|w|/7 (f16), q = clamp(round(w/scale)+7, 0, 14); packed 8 per u32."""
    n, k = w.shape
    q_weight = np.zeros((n, k // 8), np.uint32)
    q_scale = np.zeros((n, k // 32), np.float16)
    for r in range(n):
        for g in range(k // 32):
            group = w[r, 32 * g : 32 * g + 32].astype(np.float64)
            scale = np.float16(np.abs(group).max() / 7)
            q_scale[r, g] = scale
            q = np.full(32, 7) if scale == 0 else np.clip(np.round(group / np.float64(scale)) + 7, 0, 14)
            for i, qi in enumerate(q.astype(np.uint32)):
                q_weight[r, (32 * g + i) // 8] |= np.uint32(qi) << np.uint32(4 * (i % 8))
    return q_weight, q_scale


def reference_dequantize(q_weight, q_scale):
    """float64 [N, K]: element k of a row is nibble (word[k/8] >> 4*(k%8)) & 15, w = (q - 7)·scale[k/32]."""
    n, words = q_weight.shape
    k = np.arange(words * 8)
    q = (q_weight[:, k // 8] >> (4 * (k % 8)).astype(np.uint32)) & 15
    return (q.astype(np.float64) - 7) * q_scale[:, k // 32].astype(np.float64)


def random_q4(rng, rows, K):
    """Random packed weights using all 16 nibble values (15 included) and positive f16 scales."""
    q_weight = rng.integers(0, 2**32, size=(rows, K // 8), dtype=np.uint32)
    q_scale = rng.uniform(0.002, 0.02, size=(rows, K // 32)).astype(np.float16)
    return q_weight, q_scale


def assert_close(out, ref):
    assert np.isfinite(out).all(), "unwritten (NaN) or non-finite outputs"
    # f32 sums of K ≤ 4096 random-sign products drift like √K·2^-24 of Σ|terms| (≈ √K·|y|): ~1e-6 of max|y|,
    # while a single wrong code already moves its output by ~scale·|x|, about 1e-3 of max|y| or more here
    err = np.abs(out - ref).max() / np.abs(ref).max()
    assert err < 1e-4, f"max error {err:.2e} of max|ref|"


# ---- the format ------------------------------------------------------------------------------------
def test_q4f16_1_bit_layout_by_hand():
    # Element i of the group has q = i % 15; max|w| = 7·scale, so the scale is exact (1 and 0.5).
    q = np.arange(32) % 15
    w = np.stack([q - 7.0, (q - 7.0) * 0.5]).astype(np.float32)
    q_weight, q_scale = quantize_q4f16_1(w)
    assert q_weight.dtype == np.uint32 and q_weight.shape == (2, 4)
    assert q_scale.dtype == np.float16 and q_scale.tolist() == [[1.0], [0.5]]
    # Element 0 sits in the lowest nibble of word 0, element 8 in the lowest nibble of word 1.
    words = [0x76543210, 0x0EDCBA98, 0x87654321, 0x10EDCBA9]
    assert q_weight.tolist() == [words, words]
    np.testing.assert_array_equal(dequantize_q4f16_1(q_weight, q_scale), w)
    # Rounding with scale 1: 0.49 → 0, 0.51 → 1, 1.5 and 2.5 → 2 (numpy rounds half to even).
    w2 = np.zeros((1, 32), np.float32)
    w2[0, :6] = [7, 0.49, 0.51, 1.5, 2.5, -7]
    assert quantize_q4f16_1(w2)[0][0, 0] == 0x7709987E


def test_q4f16_1_matches_spec_reference(rng):
    w = rng.standard_normal((5, 96)).astype(np.float32) * 0.1
    w[2, 32:64] = 0  # a zero group: scale 0, all q = 7
    w[3, 5] = 3.0  # an outlier dominating its group
    q_weight, q_scale = quantize_q4f16_1(w)
    ref_weight, ref_scale = reference_quantize(w)
    np.testing.assert_array_equal(q_weight, ref_weight)
    np.testing.assert_array_equal(q_scale, ref_scale)
    assert q_scale[2, 1] == 0 and (q_weight[2, 4:8] == 0x77777777).all()


def test_q4f16_1_round_trip(rng):
    w = rng.standard_normal((7, 128)).astype(np.float32)
    q_weight, q_scale = quantize_q4f16_1(w)
    back = dequantize_q4f16_1(q_weight, q_scale)
    assert back.dtype == np.float32 and back.shape == w.shape
    # Error within half a step (plus f16 rounding of the scale), and re-quantizing is lossless.
    step = np.repeat(q_scale.astype(np.float32), 32, axis=1)
    assert (np.abs(back - w) <= 0.5 * step * 1.01 + 1e-6).all()
    again = quantize_q4f16_1(back)
    np.testing.assert_array_equal(again[0], q_weight)
    np.testing.assert_array_equal(again[1], q_scale)


def test_dequantize_matches_reference_on_all_nibbles(rng):
    q_weight, q_scale = random_q4(rng, 6, 64)
    np.testing.assert_array_equal(dequantize_q4f16_1(q_weight, q_scale), reference_dequantize(q_weight, q_scale))


def test_plans_validate_k():
    with pytest.raises(ValueError, match="multiple of 32"):
        matvec_plan(48, 10)
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm_plan(100, 10, 4)
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_q4f16_1(np.zeros((2, 48), np.float32))


# ---- kernels ---------------------------------------------------------------------------------------
def run_int4(gpu, shader, consts, grid, x, q_weight, q_scale, y_shape, n_tokens):
    y = poisoned(gpu, "y", y_shape)
    buffers = [gpu.upload("x", x), gpu.upload("w", q_weight), gpu.upload("s", q_scale), y]
    run(gpu, shader, consts, buffers + [step_uniform(gpu, n_tokens)], grid)
    return read(gpu, y, y_shape)


def reference(x, q_weight, q_scale, N, gate_up):
    out = x.astype(np.float64) @ reference_dequantize(q_weight, q_scale).T
    return silu(out[..., :N]) * out[..., N:] if gate_up else out


@pytest.mark.parametrize(
    "K,N,T,gate_up,last_row",
    [
        (32, 1, 1, False, False),
        (64, 37, 1, False, False),  # N not a multiple of ROWS
        (1024, 1003, 2, False, False),  # x row 0 of 2
        (2080, 6, 1, False, False),  # 65 K groups: some threads take two
        (256, 37, 3, False, True),  # LM head after a prefill: x row n_tokens-1
        (96, 45, 1, True, False),  # fused gate_up + SiLU·mul, odd N
        (512, 19, 4, True, True),
    ],
)
def test_matvec_int4(kernel_gpu, rng, K, N, T, gate_up, last_row):
    g = kernel_gpu
    q_weight, q_scale = random_q4(rng, 2 * N if gate_up else N, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = matvec_plan(K, N, gate_up=gate_up, last_row=last_row)
    out = run_int4(g, "matvec_int4", consts, grid, x, q_weight, q_scale, (N,), T)
    assert_close(out, reference(x[T - 1 if last_row else 0], q_weight, q_scale, N, gate_up))


@pytest.mark.parametrize("rows,wg", [(1, 8), (3, 4)])
def test_matvec_int4_odd_rows_per_workgroup(kernel_gpu, rng, rows, wg):
    g = kernel_gpu
    K, N = 288, 23  # 9 K groups over 4 or 8 threads
    q_weight, q_scale = random_q4(rng, 2 * N, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    consts, grid = matvec_plan(K, N, gate_up=True, rows=rows, wg=wg)
    out = run_int4(g, "matvec_int4", consts, grid, x, q_weight, q_scale, (N,), 1)
    assert_close(out, reference(x[0], q_weight, q_scale, N, True))


def test_matvec_int4_folded_grid(kernel_gpu, rng):
    # More than 65,535 workgroups: the grid folds into (x, y) and the kernel rebuilds the group id.
    g = kernel_gpu
    K, N = 32, MAX_GROUPS_PER_DIM + 1000
    q_weight, q_scale = random_q4(rng, N, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    consts, grid = matvec_plan(K, N, rows=1, wg=4)
    assert grid[1] > 1
    out = run_int4(g, "matvec_int4", consts, grid, x, q_weight, q_scale, (N,), 1)
    assert_close(out, reference(x[0], q_weight, q_scale, N, False))


@pytest.mark.parametrize(
    "T,K,N,gate_up",
    [
        (1, 32, 5, False),
        (3, 64, 37, False),
        (64, 64, 64, False),  # exact tiles
        (70, 96, 130, False),  # T and N both past a tile edge
        (5, 64, 38, True),  # even N ending mid-tile: the last thread writes one gate/up pair
        (67, 128, 33, True),
    ],
)
def test_gemm_int4(gpu, rng, T, K, N, gate_up):
    # No reduction in this kernel, so one reduction path is enough.
    g = gpu
    q_weight, q_scale = random_q4(rng, 2 * N if gate_up else N, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = gemm_plan(K, N, T, gate_up=gate_up)
    out = run_int4(g, "matmul_int4", consts, grid, x, q_weight, q_scale, (T, N), T)
    assert_close(out, reference(x, q_weight, q_scale, N, gate_up))


@pytest.mark.slow
def test_gemm_int4_folded_grid(gpu, rng):
    # More than 65,535 column tiles (4-wide here): they fold into (x, z) while y keeps the token tiles.
    K, N, T = 32, 4 * MAX_GROUPS_PER_DIM + 40, 5
    q_weight, q_scale = random_q4(rng, N, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = gemm_plan(K, N, T, tm=4, tn=4)
    assert grid[1] == 2 and grid[2] > 1
    out = run_int4(gpu, "matmul_int4", consts, grid, x, q_weight, q_scale, (T, N), T)
    assert_close(out, reference(x, q_weight, q_scale, N, False))


def test_gemm_int4_leaves_rows_past_n_tokens(gpu, rng):
    # x and y are sized for 8 rows and the grid for 8, but this forward has 5 tokens.
    K, N, T, n_tokens = 64, 12, 8, 5
    q_weight, q_scale = random_q4(rng, N, K)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = gemm_plan(K, N, T, tm=4, tn=4)
    out = run_int4(gpu, "matmul_int4", consts, grid, x, q_weight, q_scale, (T, N), n_tokens)
    assert np.isnan(out[n_tokens:]).all()
    assert_close(out[:n_tokens], reference(x[:n_tokens], q_weight, q_scale, N, False))


# ---- other weight formats (GGUF Q4_0 / Q4_1 / Q8_0, f16, larger groups) ------------------------------
VARIANTS = {
    "q4_0": format_knobs("q4_0"),
    "q4_1": format_knobs("q4_1"),
    "q8_0": format_knobs("q8_0"),
    "f16": format_knobs("f16"),
    "q4_g64": dict(bits=4, zero=7, affine=False, group=64),
    "q4_1_g64": dict(bits=4, zero=0, affine=True, group=64),
    "q8_g64": dict(bits=8, zero=128, affine=False, group=64),
}


def test_format_table_matches_the_kernel_defaults():
    # The runtime's q4f16_1 pipelines pass no format; the plan defaults must be exactly q4f16_1.
    assert matvec_plan(64, 8)[0] == matvec_plan(64, 8, **FORMATS["q4f16_1"])[0]
    assert gemm_plan(64, 8, 3)[0] == gemm_plan(64, 8, 3, **FORMATS["q4f16_1"])[0]
    with pytest.raises(ValueError, match="no kernel variant"):
        format_knobs("q6_k")


def test_plans_validate_format():
    with pytest.raises(ValueError, match="BITS"):
        matvec_plan(64, 8, bits=5)
    with pytest.raises(ValueError, match="GROUP must be a positive multiple of 32"):
        gemm_plan(96, 8, 2, group=48)
    with pytest.raises(ValueError, match="multiple of 64"):
        matvec_plan(96, 8, group=64)  # K must hold whole groups
    with pytest.raises(ValueError, match="ZERO=16"):
        matvec_plan(64, 8, zero=16)
    matvec_plan(96, 8, bits=16, group=64)  # f16 has no groups: K only needs whole 32-element chunks


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize(
    "K,N,T,gate_up,last_row",
    [
        (192, 37, 1, False, False),  # N not a multiple of ROWS; 6 chunks over the workgroup
        (128, 21, 3, True, True),  # fused gate_up, LM-head row
    ],
)
def test_matvec_formats(kernel_gpu, rng, variant, K, N, T, gate_up, last_row):
    g, fmt = kernel_gpu, VARIANTS[variant]
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = matvec_plan(K, N, gate_up=gate_up, last_row=last_row, **fmt)
    out = run_int4(g, "matvec_int4", consts, grid, x, w, s, (N,), T)
    assert_close(out, reference_fmt(x[T - 1 if last_row else 0], w, s, N, gate_up, fmt))


@pytest.mark.parametrize("variant", ["q4_1", "q8_0", "f16"])
def test_matvec_formats_with_two_chunks_per_thread(kernel_gpu, rng, variant):
    # 9 chunks over 4 threads, 3 outputs per workgroup (a partial wg_sum4 call).
    g, fmt = kernel_gpu, VARIANTS[variant]
    K, N = 288, 10
    w, s = random_packed(rng, N, K, **fmt)
    x = rng.standard_normal((1, K)).astype(np.float32)
    consts, grid = matvec_plan(K, N, rows=3, wg=4, **fmt)
    out = run_int4(g, "matvec_int4", consts, grid, x, w, s, (N,), 1)
    assert_close(out, reference_fmt(x[0], w, s, N, False, fmt))


@pytest.mark.parametrize("variant", list(VARIANTS))
@pytest.mark.parametrize("T,K,N,gate_up", [(5, 128, 37, False), (67, 64, 38, True)])
def test_gemm_formats(gpu, rng, variant, T, K, N, gate_up):
    fmt = VARIANTS[variant]
    w, s = random_packed(rng, 2 * N if gate_up else N, K, **fmt)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = gemm_plan(K, N, T, gate_up=gate_up, **fmt)
    out = run_int4(gpu, "matmul_int4", consts, grid, x, w, s, (T, N), T)
    assert_close(out, reference_fmt(x, w, s, N, gate_up, fmt))


def pack_3bit(codes: np.ndarray) -> np.ndarray:
    """MLX's 3-bit layout: each row one LSB-first bitstream, code i at bits [3i, 3i + 3); u32 [N, 3K/32]."""
    n, k = codes.shape
    bits = ((codes[:, :, None].astype(np.uint64) >> np.arange(3, dtype=np.uint64)) & 1).reshape(n, 3 * k)
    return np.packbits(bits.astype(np.uint8), axis=1, bitorder="little").view(np.uint32).reshape(n, 3 * k // 32)


@pytest.mark.parametrize("K,N,gate_up,last_row",
                         [(64, 37, False, False), (192, 9, True, False), (2048, 70, False, True)])
def test_matvec_mlx_3bit_rows_read_as_stored(kernel_gpu, rng, K, N, gate_up, last_row):
    """3-bit codes straddle words: the matvec reads MLX's bitstream rows in place (no widening)."""
    rows, T = (2 * N if gate_up else N), 2
    codes = rng.integers(0, 8, (rows, K))
    w = pack_3bit(codes)
    scale_bias = np.stack([rng.uniform(0.01, 0.05, (rows, K // 64)), rng.uniform(-0.1, 0.1, (rows, K // 64))],
                          axis=-1).astype(np.float16)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = matvec_plan(K, N, gate_up=gate_up, last_row=last_row, **format_knobs("mlx3"))
    out = run_int4(kernel_gpu, "matvec_int4", consts, grid, x, w, scale_bias, (N,), T)
    sb = scale_bias.astype(np.float64)
    dense = codes * np.repeat(sb[..., 0], 64, axis=1) + np.repeat(sb[..., 1], 64, axis=1)
    y = x[T - 1 if last_row else 0].astype(np.float64) @ dense.T
    assert_close(out, silu(y[:N]) * y[N:] if gate_up else y)


# ---- the subgroup-rows decode matvec (shaders/matvec_sg.wgsl) ----------------------------------------------
@pytest.mark.parametrize("variant", [*VARIANTS, "mlx3"])
@pytest.mark.parametrize(
    "K,N,T,gate_up,last_row",
    [
        (192, 37, 1, False, False),  # N not a multiple of the workgroup's rows; 6 chunks over 8 lanes
        (128, 21, 3, True, True),  # fused gate_up, LM-head row
        (640, 90, 2, False, True),  # several chunks per lane
    ],
)
def test_matvec_sg(gpu, rng, variant, K, N, T, gate_up, last_row):
    fmt = format_knobs(variant) if variant == "mlx3" else VARIANTS[variant]
    rows = 2 * N if gate_up else N
    if variant == "mlx3":
        w = pack_3bit(rng.integers(0, 8, (rows, K)))
        s = np.stack([rng.uniform(0.01, 0.05, (rows, K // 64)), rng.uniform(-0.1, 0.1, (rows, K // 64))],
                     axis=-1).astype(np.float16)
    else:
        w, s = random_packed(rng, rows, K, **fmt)
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = matvec_sg_plan(K, N, gpu.subgroup_size, gate_up=gate_up, last_row=last_row, **fmt)
    out = run_int4(gpu, "matvec_sg", consts, grid, x, w, s, (N,), T)
    # The workgroup kernel on the same data is the reference: it is tested against numpy above, for every format.
    consts, grid = matvec_plan(K, N, gate_up=gate_up, last_row=last_row, **fmt)
    assert_close(out, run_int4(gpu, "matvec_int4", consts, grid, x, w, s, (N,), T))
    if variant != "mlx3":
        assert_close(out, reference_fmt(x[T - 1 if last_row else 0], w, s, N, gate_up, fmt))


@pytest.mark.parametrize("claimed", [1, 2, 4, 64])
def test_matvec_sg_covers_every_row_whatever_the_subgroup_size(gpu, rng, claimed):
    """The grid is sized with the probed subgroup size; a pipeline that runs with another (Intel picks per
    pipeline) must still write every row: a subgroup loops over the row blocks of its workgroup."""
    K, N = 96, 301
    w, s = random_q4(rng, N, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    consts, grid = matvec_sg_plan(K, N, claimed, wg=64, rows=3)
    out = run_int4(gpu, "matvec_sg", consts, grid, x, w, s, (N,), 1)
    assert_close(out, reference(x[0], w, s, N, False))


def test_matvec_sg_folded_grid(gpu, rng):
    K, N = 32, (MAX_GROUPS_PER_DIM + 1000) * 2
    w, s = random_q4(rng, N, K)
    x = rng.standard_normal((1, K)).astype(np.float32)
    consts, grid = matvec_sg_plan(K, N, gpu.subgroup_size, rows=1, wg=gpu.subgroup_size * 2)
    assert grid[1] > 1
    out = run_int4(gpu, "matvec_sg", consts, grid, x, w, s, (N,), 1)
    assert_close(out, reference(x[0], w, s, N, False))


def test_subgroup_rows_policy():
    assert prefers_subgroup_rows(3072, 8192, gate_up=True)  # Phi-3 gate_up: 16384 weight rows
    assert prefers_subgroup_rows(3072, 32064, gate_up=False)  # an LM head
    assert not prefers_subgroup_rows(8192, 3072, gate_up=False)  # down
    assert not prefers_subgroup_rows(3072, 9216, gate_up=False)  # QKV: even on the H200
    with pytest.raises(ValueError, match="multiple of the subgroup size"):
        matvec_sg_plan(64, 8, 48)


def test_three_bit_is_refused_outside_the_decode_matvecs():
    with pytest.raises(ValueError, match="3-bit weights run only in the decode matvecs"):
        gemm_plan(64, 8, 4, **format_knobs("mlx3"))
