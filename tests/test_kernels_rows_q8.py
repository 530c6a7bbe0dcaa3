"""The int8 epilogues of the prefill kernels before an int8 GEMM (ROWS_Q8): attention_tiled and Qwen3.5's attention
gate (attn_gate) write o's input rows, the Gated DeltaNet output norm (gdn_norm_out) out's, and the gate_up GEMMs
(matmul_q8w, matmul_kq_q8, the grouped expert moe_gemm_q8) down's, as quantize_q8 would. Each kernel
runs with ROWS_F32 and ROWS_Q8 on fresh random data into poisoned buffers, and its int8 bytes must equal, bit for bit,
quantize_q8's over the f32 rows it wrote; the runtime's variant (int8 only) must write the same bytes and the f32-only
variant the same f32 rows. Rows it does not own (past n_tokens, other slots' pairs) stay poisoned."""

import numpy as np
import pytest

from engine.formats import kquant
from engine.kernels.attention import attention_tiled_grid, attention_tiled_plan, attn_gate_plan
from engine.kernels.gdn import gdn_norm_plan
from engine.kernels.matmul import FORMATS, format_knobs, gemm_q8w_plan, quantize_q8_plan
from engine.kernels.moe import grouped_q8_plan, sort_plan
from engine.kquant_plan import gemm_kq_q8_plan, weight_buffers
from tests.helpers import (
    PAGE,
    AttentionSetup,
    kquant_raw,
    poisoned,
    quantized_rows,
    random_packed,
    random_weight,
    read,
    run,
    step_uniform,
    unpack_codes,
)

POISON_U32 = np.iinfo(np.uint32).max


def int8_buffers(gpu, rows: int, n: int):
    """Poisoned (codes u32 [rows, n/4], (scale, Σ codes) [rows, n/32, 2]) buffers."""
    return poisoned(gpu, "yq", (rows, n // 4), np.uint32), poisoned(gpu, "ym", (rows, n // 32, 2))


def read_int8(gpu, bufs, rows: int, n: int) -> tuple[np.ndarray, np.ndarray]:
    """Both buffers as u32 words (the scales' bits too)."""
    return read(gpu, bufs[0], (rows, n // 4), np.uint32), read(gpu, bufs[1], (rows, n // 32, 2), np.uint32)


def quantize_q8(gpu, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_q8 over every row of y [rows, n] (the runtime's dispatch), read back as read_int8 does."""
    rows, n = y.shape
    bufs = int8_buffers(gpu, rows, n)
    consts, grid = quantize_q8_plan(n, rows=rows)
    run(gpu, "quantize_q8", consts, [gpu.upload("x", y), *bufs, step_uniform(gpu, rows)], grid)
    return read_int8(gpu, bufs, rows, n)


def check_variants(gpu, run_variant, live: np.ndarray) -> None:
    """run_variant(rows_q8, rows_f32) -> (f32 rows [rows, n], int8 (codes, meta) as read_int8) from fresh poisoned
    outputs; the three variants against each other and against quantize_q8 on the rows `live` marks (the others
    must stay poisoned)."""
    y_both, q_both = run_variant(True, True)
    y_f32, q_none = run_variant(False, True)
    y_none, q_int8 = run_variant(True, False)
    assert np.isfinite(y_both[live]).all() and np.isnan(y_both[~live]).all()
    np.testing.assert_array_equal(y_both.view(np.uint32), y_f32.view(np.uint32))
    assert np.isnan(y_none).all(), "ROWS_F32 off wrote f32 rows"
    assert (q_none[0] == POISON_U32).all() and np.isnan(q_none[1].view(np.float32)).all(), "ROWS_Q8 off wrote int8"
    ref = quantize_q8(gpu, y_both)
    for got, want, what in zip(q_both, ref, ("codes", "(scale, Σ codes)"), strict=True):
        np.testing.assert_array_equal(got[live], want[live], err_msg=f"{what} differ from quantize_q8's")
    for got, want in zip(q_int8, q_both, strict=True):
        np.testing.assert_array_equal(got, want, err_msg="the int8-only variant writes other bytes")
    assert (q_both[0][~live] == POISON_U32).all() and np.isnan(q_both[1][~live].view(np.float32)).all()
    codes = unpack_codes(q_both[0][live].reshape(-1))
    assert np.abs(codes.astype(np.int32)).max() == 127 and len(np.unique(codes)) > 64  # real rows, not zeros


@pytest.mark.parametrize(
    "H,KVH,HD,T,pos0",
    [
        (3, 3, 96, 37, 0),  # Phi-3's head: 3 chunks a head, two token tiles, the second partly empty
        (8, 2, 128, 20, 45),  # GQA group 4 (4 heads × 8 tokens a tile), a second chunk at pos0 45
        (32, 2, 32, 3, 70),  # group 16: one chunk a head, 2 tokens a tile
    ],
)
def test_tiled_attention_rows_q8(gpu, rng, H, KVH, HD, T, pos0):
    a = AttentionSetup(gpu, rng, H, KVH, HD, T, pos0)
    rows, n = T + 1, H * HD  # one row past T must stay untouched

    def variant(rows_q8, rows_f32):
        consts = attention_tiled_plan(H, KVH, HD, PAGE, rows_q8=rows_q8, rows_f32=rows_f32)
        out, q8 = poisoned(gpu, "out", (rows, n)), int8_buffers(gpu, rows, n)
        run(gpu, "attention_tiled", consts, a.bufs + [out, step_uniform(gpu, T, pos0), *q8],
            attention_tiled_grid(consts, T))
        return read(gpu, out, (rows, n)), read_int8(gpu, q8, rows, n)

    check_variants(gpu, variant, np.arange(rows) < T)


def chunk_scaled(rng, shape) -> np.ndarray:
    """Random f32 rows whose 32-element chunks differ in scale by up to 100× (each chunk's own int8 scale matters)."""
    rows, n = shape
    return (rng.standard_normal(shape) * rng.uniform(0.1, 10, (rows, n // 32)).repeat(32, axis=1)).astype(np.float32)


@pytest.mark.parametrize(
    "N,T,wg",
    [
        (4096, 5, 256),  # Qwen3.5-4B's 16 heads of 256
        (320, 37, 256),  # the second workgroup of a row holds 2 of its 8 chunks
        (8 * 96, 3, 64),  # the runtime's workgroup of 256 threads and a smaller one
    ],
)
def test_attention_gate_rows_q8(gpu, rng, N, T, wg):
    rows = T + 1
    x, gate = chunk_scaled(rng, (rows, N)), (rng.standard_normal((rows, N)) * 4).astype(np.float32)
    inputs = [gpu.upload("x", x), gpu.upload("gate", gate)]

    def variant(rows_q8, rows_f32):
        consts, groups = attn_gate_plan(N, wg, rows_q8=rows_q8, rows_f32=rows_f32)
        y, q8 = poisoned(gpu, "y", (rows, N)), int8_buffers(gpu, rows, N)
        run(gpu, "attn_gate", consts, [*inputs, y, step_uniform(gpu, T), *q8], (groups, T))
        return read(gpu, y, (rows, N)), read_int8(gpu, q8, rows, N)

    check_variants(gpu, variant, np.arange(rows) < T)


# heads of 128 (Qwen3.5-4B's), of one chunk, and a decode token
@pytest.mark.parametrize("VH,DV,T", [(4, 128, 7), (3, 32, 5), (8, 64, 1)])
def test_gdn_norm_out_rows_q8(gpu, rng, VH, DV, T):
    rows, n, Z_OFF = T + 1, VH * DV, 24
    ROW = Z_OFF + n + 8
    x, zsrc = chunk_scaled(rng, (rows, n)), (rng.standard_normal((rows, ROW)) * 2).astype(np.float32)
    inputs = [gpu.upload("x", x), gpu.upload("z", zsrc), gpu.upload("w", rng.uniform(0.5, 1.5, DV).astype(np.float16))]

    def variant(rows_q8, rows_f32):
        y, q8 = poisoned(gpu, "y", (rows, n)), int8_buffers(gpu, rows, n)
        run(gpu, "gdn_norm_out", gdn_norm_plan(VH, DV, 1e-6, ROW, Z_OFF, rows_q8=rows_q8, rows_f32=rows_f32),
            [*inputs, y, step_uniform(gpu, T), *q8], (VH, T))
        return read(gpu, y, (rows, n)), read_int8(gpu, q8, rows, n)

    check_variants(gpu, variant, np.arange(rows) < T)


def gate_up_input(gpu, rng, rows: int, K: int, n_tokens: int):
    """Random X rows through quantize_q8, as the GEMMs take them: (xq, xm) buffers."""
    x = chunk_scaled(rng, (rows, K))
    xq, xm = poisoned(gpu, "xq", (rows, K // 4), np.uint32), poisoned(gpu, "xm", (rows, K // 32, 2))
    consts, grid = quantize_q8_plan(K, rows=n_tokens)
    run(gpu, "quantize_q8", consts, [gpu.upload("x", x), xq, xm, step_uniform(gpu, n_tokens)], grid)
    return xq, xm


def gemm_variant(gpu, shader, plan, inputs, weights, rows: int, N: int, n_tokens: int):
    """A check_variants runner for a gate_up GEMM: plan(rows_q8, rows_f32) -> (consts, grid)."""
    def variant(rows_q8, rows_f32):
        consts, grid = plan(rows_q8, rows_f32)
        assert consts["TN"] == 32  # one chunk a tile
        y, q8 = poisoned(gpu, "y", (rows, N)), int8_buffers(gpu, rows, N)
        xq, xm = inputs
        run(gpu, shader, consts, [xq, *weights, y, xm, step_uniform(gpu, n_tokens), *q8], grid)
        return read(gpu, y, (rows, N)), read_int8(gpu, q8, rows, N)

    return variant


@pytest.mark.parametrize("tag", ["q4f16_1", "q4_0", "q4_1", "mlx4"])
@pytest.mark.parametrize("rows,n_tokens,K,N,tm", [(72, 67, 128, 96, 64), (40, 37, 192, 64, 32)])
def test_gate_up_gemm_q8w_rows_q8(gpu, rng, tag, rows, n_tokens, K, N, tm):
    """Several column tiles, a partial token tile, rows past n_tokens; TM 64 (the runtime's) and 32 (4 thread rows)."""
    fmt = FORMATS[tag]
    w, s = random_packed(rng, 2 * N, K, **fmt)
    plan = lambda q8, f32: gemm_q8w_plan(K, N, rows, gate_up=True, tm=tm, rows_q8=q8, rows_f32=f32, **fmt)  # noqa: E731
    variant = gemm_variant(gpu, "matmul_q8w", plan, gate_up_input(gpu, rng, rows, K, n_tokens),
                           [gpu.upload("w", w), gpu.upload("s", s)], rows, N, n_tokens)
    check_variants(gpu, variant, np.arange(rows) < n_tokens)


@pytest.mark.parametrize("tag", ["q4_k", "q6_k", "q2_k", "q5_0"])
def test_gate_up_gemm_kq_q8_rows_q8(gpu, rng, tag):
    rows, n_tokens, N = 72, 67, 64
    K = 2 * kquant.TYPES[tag].elements * (4 if kquant.TYPES[tag].elements == 32 else 1)
    w, wh = weight_buffers(kquant.pack_rows(tag, kquant_raw(rng, kquant.TYPES[tag].qtype, 2 * N, K), K))
    weights = [gpu.upload("w", w), gpu.upload("wh", wh)]
    plan = lambda q8, f32: gemm_kq_q8_plan(tag, K, N, rows, gate_up=True, rows_q8=q8, rows_f32=f32)  # noqa: E731
    variant = gemm_variant(gpu, "matmul_kq_q8", plan, gate_up_input(gpu, rng, rows, K, n_tokens), weights,
                           rows, N, n_tokens)
    check_variants(gpu, variant, np.arange(rows) < n_tokens)


@pytest.mark.parametrize("fmt", ["mlx4", "mlx3", "q4f16_1"])
@pytest.mark.parametrize("tm", [16, 4])  # the runtime's tiles of 16 pairs, and of 4 (one thread row)
def test_grouped_expert_gate_up_rows_q8(gpu, rng, fmt, tm):
    """moe_gemm_q8's rows are (token, slot) pairs in moe_sort's order: each pair's int8 row at the pair's index, the
    pairs of slots outside the stack (n_slots of slots) and of tokens past T left alone."""
    E, T, slots, n_slots, K, N = 5, 11, 3, 2, 256, 64
    rows = T + 2
    w = random_weight(rng, (E, 2 * N, K), fmt)
    ids = np.stack([rng.permutation(E)[:slots] for _ in range(rows)]).astype(np.uint32)
    xq, xm, _ = quantized_rows(gpu, rng.standard_normal((rows, K)).astype(np.float32))
    weights = [gpu.upload("w", w["q_weight"].view(np.uint32)), gpu.upload("s", w["q_scale"])]
    consts, grid, vec4s = sort_plan(E, slots, rows, n_slots=n_slots, tm=tm, wg=16)
    order = gpu.upload("order", np.zeros(rows * n_slots, np.uint32))
    tiles = gpu.upload("tiles", np.zeros((vec4s, 4), np.uint32))
    run(gpu, "moe_sort", consts, [gpu.upload("ids", ids), order, tiles, step_uniform(gpu, T)], grid)

    def variant(rows_q8, rows_f32):
        consts, grid = grouped_q8_plan(K, N, E, rows, slots, n_slots=n_slots, gate_up=True, y_stride=N + 4, tm=tm,
                                       rows_q8=rows_q8, rows_f32=rows_f32, **format_knobs(fmt))
        assert consts["TN"] == 32
        y, q8 = poisoned(gpu, "y", (rows * slots, N + 4)), int8_buffers(gpu, rows * slots, N)
        run(gpu, "moe_gemm_q8", consts, [xq, order, tiles, *weights, y, xm, *q8], grid)
        out = read(gpu, y, (rows * slots, N + 4))
        assert np.isnan(out[:, N:]).all()  # the row's padding past N
        return np.ascontiguousarray(out[:, :N]), read_int8(gpu, q8, rows * slots, N)

    live = np.zeros((rows, slots), bool)
    live[:T, :n_slots] = True
    check_variants(gpu, variant, live.reshape(-1))


def test_plans_refuse_int8_rows_they_cannot_write():
    with pytest.raises(ValueError, match="gate_up"):
        gemm_q8w_plan(64, 64, 8, rows_q8=True)  # plain columns: not one chunk a tile by construction
    with pytest.raises(ValueError, match="multiple of 32"):
        gemm_q8w_plan(64, 48, 8, gate_up=True, rows_q8=True)  # a tile would hold half a chunk
    with pytest.raises(ValueError, match="TN = 32"):
        gemm_q8w_plan(64, 64, 8, gate_up=True, tn=64, rows_q8=True)
    with pytest.raises(ValueError, match="workgroup memory"):
        gemm_q8w_plan(64, 64, 8, gate_up=True, tm=128, rows_q8=True)  # the staging no longer fits
    with pytest.raises(ValueError, match="TN = 32"):
        gemm_kq_q8_plan("q4_k", 256, 64, 8, gate_up=True, tn=16, rows_q8=True)
    with pytest.raises(ValueError, match="f32, int8 or both"):
        gemm_q8w_plan(64, 64, 8, gate_up=True, rows_f32=False)
    with pytest.raises(ValueError, match="f32, int8 or both"):
        attention_tiled_plan(4, 4, 64, PAGE, rows_f32=False)
    with pytest.raises(ValueError, match="whole 32-element chunks"):
        attn_gate_plan(300, rows_q8=True)
    with pytest.raises(ValueError, match="whole 32-element chunks"):
        attn_gate_plan(320, 48, rows_q8=True)  # a workgroup would end inside a chunk
    with pytest.raises(ValueError, match="f32, int8 or both"):
        attn_gate_plan(320, rows_f32=False)
    with pytest.raises(ValueError, match="multiple of 32"):
        gdn_norm_plan(2, 48, 1e-6, 200, 0, rows_q8=True)
    with pytest.raises(ValueError, match="f32, int8 or both"):
        gdn_norm_plan(2, 64, 1e-6, 200, 0, rows_f32=False)
    consts, _ = gemm_q8w_plan(3072, 8192, 512, gate_up=True, rows_q8=True)  # Phi-3's gate_up
    assert (consts["TN"], consts["ROWS_Q8"], consts["ROWS_F32"]) == (32, True, False)
    assert gemm_q8w_plan(3072, 8192, 512, gate_up=True, tm=128, tn=32)[0]["TM"] == 128  # fits without staging
