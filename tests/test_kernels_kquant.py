"""K-quant (Q2_K … Q6_K) and Q5_0 / Q5_1 tensors: engine/formats/kquant.py's arrays vs the gguf package, and every
K-quant kernel (decode matvec f32 / int8, prefill GEMM f32 / int8, embedding) vs float64 numpy on the weights
gguf.quants.dequantize gives for the same blocks. Blocks are random bytes with finite random f16 d / dmin (gguf
quantizes none of the K types), so every code, scale and minimum value occurs.

Tolerances come from the arithmetic. Each weight is w = a·u + b per 16 or 32 elements (shaders/kq_decode.wgsl); the
kernels sum a·Σu·x and b·Σx apart, so their f32 rounding is relative to Σ (|a·u| + |b|)·|x| (`magnitude` below),
not to |Σ w·x|, and a sum of n terms rounds by at most n·2^-24 of that.
"""

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter
from gguf.quants import dequantize as gguf_dequantize

from engine.formats import kquant
from engine.kernels import MAX_GROUPS_PER_DIM
from engine.kernels.matmul import quantize_q8_plan
from engine.kquant_plan import (
    BINDINGS,
    FEW_ROWS_N,
    embedding_kq_plan,
    gemm_kq_plan,
    gemm_kq_q8_plan,
    has_vec4_blocks,
    matvec_kq_plan,
    matvec_kq_q8_kernel,
    matvec_kq_q8_plan,
    weight_buffers,
)
from tests.helpers import poisoned, read, run, step_uniform, unpack_codes

pytestmark = pytest.mark.gpu
TAGS = list(kquant.TYPES)
U = 2.0**-24  # f32 unit roundoff


def silu(v):
    return v * 0.5 * (1 + np.tanh(v / 2))  # v·sigmoid(v) without exp overflow


# ---- random tensors and their references ---------------------------------------------------------------------
def random_raw(rng, tag, n, k):
    """ggml bytes [n, k/QK·nbytes] of an [n, k] tensor: random codes and scales, finite f16 d (and dmin / m) of
    both signs."""
    t = kquant.TYPES[tag]
    raw = rng.integers(0, 256, (n, k // t.elements * t.nbytes), dtype=np.uint8)
    blocks = raw.reshape(n, -1, t.nbytes)
    for off in kquant._HALF_FIELDS[tag]:
        d = rng.uniform(0.002, 0.02, blocks.shape[:2]) * rng.choice([-1, 1], blocks.shape[:2])
        blocks[:, :, off:off + 2] = d.astype("<f2").view(np.uint8).reshape(n, -1, 2)
    return raw


def reference(tag, raw):
    """float64 weights as ggml dequantizes them, and the per-element magnitude |a·u| + |b| the kernels round
    against: b is what the block dequantizes to with every code byte zeroed."""
    t = kquant.TYPES[tag]
    w = gguf_dequantize(raw, t.qtype).astype(np.float64)
    blocks = raw.reshape(raw.shape[0], -1, t.nbytes).copy()
    blocks[:, :, t.code_bytes[0]:t.code_bytes[1]] = 0
    b = gguf_dequantize(blocks.reshape(raw.shape), t.qtype).astype(np.float64)
    return w, np.abs(w - b) + np.abs(b)


def upload_weight(gpu, tag, raw, k):
    arrays = kquant.pack_rows(tag, raw, k)
    w, wh = weight_buffers(arrays)
    wb = gpu.upload("w", w)
    return wb, (wb if wh is w else gpu.upload("wh", wh))


def combine(y, N, gate_up):
    return silu(y[..., :N]) * y[..., N:] if gate_up else y


def assert_within(out, ref, bound, what=""):
    assert np.isfinite(out).all(), f"{what}: unwritten (NaN) or non-finite outputs"
    excess = np.abs(out - ref) - bound
    assert (excess <= 0).all(), f"{what}: error {np.abs(out - ref).max():.3e} over the bound {bound.max():.3e}"


def gate_bound(y, e, N, gate_up):
    """A bound on |silu(g)·u| rounding from bounds e on the raw outputs (|d silu| ≤ 1.1) plus its own f32 rounding."""
    if not gate_up:
        return e
    g, u = y[..., :N], y[..., N:]
    eg, eu = e[..., :N], e[..., N:]
    return 1.1 * eg * (np.abs(u) + eu) + np.abs(silu(g)) * eu + 8 * U * np.abs(silu(g) * u)


def shapes(tag, multiples):
    """K values of the given numbers of blocks (Q5_0 / Q5_1 blocks are 32 elements, the K types' 256)."""
    return [m * kquant.TYPES[tag].elements for m in multiples]


# ---- the unpacker --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tag", TAGS)
def test_pack_rows_keeps_every_byte_and_dequantizes_like_gguf(rng, tag):
    t = kquant.TYPES[tag]
    n, k = 5, 3 * t.elements
    raw = random_raw(rng, tag, n, k)
    arrays = kquant.pack_rows(tag, raw, k)
    shapes_ = kquant.packed_shapes(tag, n, k)
    assert {name: (a.shape, a.dtype.name) for name, a in arrays.items()} == shapes_
    assert sum(a.nbytes for a in arrays.values()) == raw.nbytes  # the split adds no byte
    assert (t.d_at is None) == ("q_d" not in arrays) and (t.nbytes % 4 == 0) == (t.d_at is None)
    np.testing.assert_array_equal(kquant.raw_bytes(tag, arrays), raw)
    np.testing.assert_array_equal(kquant.dequantize(tag, arrays), gguf_dequantize(raw, t.qtype))
    # Rows stay independent: fusing or reordering rows of the arrays is fusing or reordering the tensor's rows.
    order = np.array([3, 0, 4, 1, 2])
    moved = {name: a[order] for name, a in arrays.items()}
    np.testing.assert_array_equal(kquant.dequantize(tag, moved), gguf_dequantize(raw[order], t.qtype))


def test_pack_rows_takes_the_rows_gguf_reader_maps(rng, tmp_path):
    # A file written by the gguf package as llama.cpp lays tensors out; the reader's row slices go in unchanged.
    path, raws = tmp_path / "k.gguf", {}
    writer = GGUFWriter(path, "llama")
    for tag, t in kquant.TYPES.items():
        k = 2 * t.elements if t.elements == 256 else 96  # Q5_0 / Q5_1: rows that are not a multiple of 256
        raws[tag] = random_raw(rng, tag, 7, k), k
        writer.add_tensor(f"blk.0.{tag}.weight", raws[tag][0], raw_dtype=t.qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    for tensor in GGUFReader(path).tensors:
        tag = kquant.TAGS[tensor.tensor_type]
        raw, k = raws[tag]
        assert tensor.data.shape == raw.shape and list(tensor.shape) == [k, 7]
        arrays = kquant.pack_rows(tag, tensor.data[2:6], k, tensor.name)
        np.testing.assert_array_equal(kquant.raw_bytes(tag, arrays), raw[2:6])


def test_pack_rows_refuses_damaged_tensors(rng):
    raw = random_raw(rng, "q4_k", 3, 512)
    with pytest.raises(ValueError, match=r"blk\.0\.ffn_up\.weight: a Q4_K row of 512 elements is 288 bytes"):
        kquant.pack_rows("q4_k", raw[:, :-1], 512, "blk.0.ffn_up.weight")
    with pytest.raises(ValueError, match="positive multiple of 256"):
        kquant.packed_shapes("q6_k", 4, 300)
    bad = raw.copy()
    bad[2, 144 + 2:144 + 4] = np.array([np.inf], "<f2").view(np.uint8)  # dmin of row 2's second block
    with pytest.raises(ValueError, match="output.weight: row 2 has a non-finite block scale"):
        kquant.pack_rows("q4_k", bad, 512, "output.weight")
    with pytest.raises(ValueError, match="not a K-quant tag"):
        kquant.packed_shapes("iq4_xs", 4, 256)


# ---- decode matvec, f32 activations ------------------------------------------------------------------------
def run_matvec(gpu, tag, raw, x, N, gate_up, last_row=False, **plan):
    T, K = x.shape
    consts, grid = matvec_kq_plan(tag, K, N, gate_up=gate_up, last_row=last_row, **plan)
    y = poisoned(gpu, "y", (N,))
    w, wh = upload_weight(gpu, tag, raw, K)
    run(gpu, "matvec_kq", consts, [gpu.upload("x", x), w, wh, y, step_uniform(gpu, T)], grid)
    return read(gpu, y, (N,)), consts, grid


def check_f32_product(out, x, W, M, N, gate_up, terms):
    """out vs the float64 product (x rows [T, K]) with the f32 bound: `terms` roundings of Σ M·|x|."""
    y = x.astype(np.float64) @ W.T
    e = terms * U * (np.abs(x.astype(np.float64)) @ M.T)
    assert_within(out, combine(y, N, gate_up), gate_bound(y, e, N, gate_up))


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("blocks,N,gate_up,last_row", [(3, 37, False, False), (2, 21, True, True), (9, 5, False, True)])
def test_matvec_kq(any_gpu, rng, tag, blocks, N, gate_up, last_row):
    K = blocks * kquant.TYPES[tag].elements
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal((3, K)).astype(np.float32)
    out, _, _ = run_matvec(any_gpu, tag, raw, x, N, gate_up, last_row)
    # Per chunk ≤ 12 roundings (4-term dots, half sums, a·d + b·Σx), then the thread's chunk chain and the reduction.
    check_f32_product(out, x[2 if last_row else 0], W, M, N, gate_up, 12 + K // 32 + 64)


@pytest.mark.parametrize("rows,wg", [(3, 32), (1, 4), (8, 16)])
def test_matvec_kq_rows_per_workgroup(any_gpu, rng, rows, wg):
    tag, K, N = "q3_k", 768, 29  # 29 rows: the last workgroup has rows past N
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal((1, K)).astype(np.float32)
    out, consts, _ = run_matvec(any_gpu, tag, raw, x, N, False, rows=rows, wg=wg)
    assert consts["ROWS"] == rows
    check_f32_product(out, x[0], W, M, N, False, 12 + K // 32 + 64)


@pytest.mark.slow
def test_matvec_kq_folded_grid(any_gpu, rng):
    # More than 65,535 workgroups: the grid folds into (x, y) and the kernel rebuilds the group id.
    tag, K, N = "q5_1", 64, MAX_GROUPS_PER_DIM + 1000
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal((1, K)).astype(np.float32)
    out, _, grid = run_matvec(any_gpu, tag, raw, x, N, False, rows=1, wg=4)
    assert grid[1] > 1
    check_f32_product(out, x[0], W, M, N, False, 12 + K // 32 + 64)


# ---- decode matvec, int8 activations -----------------------------------------------------------------------
def quantize_x(gpu, x, natural=False):
    """quantize_q8 on the GPU (`natural`: bytes in element order, shaders/q8_codes.wgsl Q8_NATURAL): (xq, xm buffers,
    x̂ float64 [T, K] the codes stand for, per-chunk scales [T, K/32])."""
    T, K = x.shape
    xq, xm = poisoned(gpu, "xq", (T * K // 4,), np.uint32), poisoned(gpu, "xm", (T * K // 32, 2))
    consts, grid = quantize_q8_plan(K, rows=T)
    run(gpu, "quantize_q8", dict(consts, Q8_NATURAL=natural), [gpu.upload("x", x), xq, xm, step_uniform(gpu, T)],
        grid)
    codes = unpack_codes(read(gpu, xq, (T * K // 4,), np.uint32), natural).reshape(T, K)
    scale = read(gpu, xm, (T * K // 32, 2))[:, 0].astype(np.float64).reshape(T, K // 32)
    return xq, xm, codes * np.repeat(scale, 32, axis=1), scale


def check_int8_product(out, x, x_hat, scale, W, M, N, gate_up, terms):
    """out vs the float64 product on x̂ (f32 rounding only), and vs the product on x within the int8 rounding."""
    y_hat = x_hat @ W.T
    e = terms * U * (np.abs(x_hat) @ M.T)
    assert_within(out, combine(y_hat, N, gate_up), gate_bound(y_hat, e, N, gate_up), "on x̂")
    # |x̂ − x| ≤ s·(1/2 + 127·2^-22) per chunk of scale s = max|x|/127 (round to nearest, f32 1/s), so
    # |Σ w·(x̂ − x)| ≤ Σ |w|·0.50004·s.
    y = x.astype(np.float64) @ W.T
    e_int8 = e + 0.50004 * np.repeat(scale, 32, axis=-1) @ np.abs(W).T
    assert_within(out, combine(y, N, gate_up), gate_bound(y, e_int8, N, gate_up), "on x")


def scaled_activations(rng, T, K):
    """Activations whose chunks differ in scale by 300×, with an all-zero chunk (scale 0)."""
    x = rng.standard_normal((T, K)) * rng.uniform(0.1, 30, (T, K // 32)).repeat(32, axis=1)
    x[:, 32:64] = 0
    return x.astype(np.float32)


def run_matvec_q8(gpu, tag, raw, x_row, N, gate_up, subgroup_size=None, vec4=None, chunks=None, wide=None,
                  natural=False, **plan):
    """The int8 decode matvec on x_row quantized by quantize_q8; `natural`: both in element order (Q8_NATURAL)."""
    K = x_row.shape[0]
    xq, xm, x_hat, scale = quantize_x(gpu, x_row[None], natural)
    consts, grid = matvec_kq_q8_plan(tag, K, N, subgroup_size or gpu.subgroup_size, gate_up=gate_up, vec4=vec4,
                                     chunks=chunks, wide=wide, **plan)
    y = poisoned(gpu, "y", (N,))
    w, wh = upload_weight(gpu, tag, raw, K)
    run(gpu, matvec_kq_q8_kernel(tag, vec4, chunks, wide, n=N), dict(consts, Q8_NATURAL=natural),
        [xq, w, wh, y, xm], grid)
    return read(gpu, y, (N,)), x_hat[0], scale[0], grid


def assert_int8_matvec(gpu, rng, tag, K, N, gate_up, **plan):
    """The type's int8 decode kernel (run_matvec_q8 with `plan`) on fresh random blocks and activations against
    float64 on the dequantized weights: integer sums are exact; then ≤ 8 roundings per chunk (the scales' products
    and sums), the lane's chunk chain and subgroupAdd."""
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, 1, K)[0]
    out, x_hat, scale, _ = run_matvec_q8(gpu, tag, raw, x, N, gate_up, **plan)
    check_int8_product(out, x, x_hat, scale, W, M, N, gate_up, 8 + K // 32 + 64)


# Each type's default for these N (below FEW_ROWS_N: the wide kernels for Q2_K, Q3_K, Q4_K), and those three's
# kernel from FEW_ROWS_N outputs (wide=False: matvec_kq_q8_chunks, Q4_K's matvec_kq_q8).
@pytest.mark.parametrize("tag,wide", [(t, None) for t in TAGS] + [("q2_k", False), ("q3_k", False), ("q4_k", False)])
@pytest.mark.parametrize("blocks,N,gate_up", [(3, 37, False), (2, 21, True), (8, 6, False)])
def test_matvec_kq_q8(gpu, rng, tag, wide, blocks, N, gate_up):
    K = blocks * kquant.TYPES[tag].elements
    assert_int8_matvec(gpu, rng, tag, K, N, gate_up, wide=wide)


@pytest.mark.parametrize("tag", ["q2_k", "q3_k", "q4_k", "q5_k", "q6_k"])
@pytest.mark.parametrize("blocks,N,rows,gate_up", [(1, 9, 1, False), (5, 13, 3, False), (3, 7, 4, True)])
def test_matvec_kq_q8_rows_and_block_counts(gpu, rng, tag, blocks, N, rows, gate_up):
    # K a multiple of 256 only (1, 3, 5 blocks: the items or chunks a lane takes of a row are not a multiple of the
    # lanes, and one block has fewer than a subgroup has lanes), odd N, and ROWS that leave rows past N in the last
    # subgroup. The kernels of FEW_ROWS_N outputs and more (wide=False: Q2_K and Q3_K on matvec_kq_q8_chunks, the
    # others on the item kernels); test_matvec_kq_q8_wide takes the wide kernels through the same shapes.
    K = blocks * 256
    assert_int8_matvec(gpu, rng, tag, K, N, gate_up, rows=rows, wide=False)


@pytest.mark.parametrize("tag,vec4", [("q4_k", True), ("q5_k", True), ("q6_k", True), ("q6_k", False),
                                      ("q5_0", False), ("q5_1", False)])
@pytest.mark.parametrize("blocks,N,gate_up", [(3, 37, False), (2, 11, True)])
@pytest.mark.parametrize("stage", [False, pytest.param(True, marks=pytest.mark.slow)])  # True: an A/B variant
def test_matvec_kq_q8_item_kernels_staged_or_not(gpu, rng, tag, vec4, blocks, N, gate_up, stage):
    # STAGE off (the default: each lane orders its activations itself) and on (the row staged per workgroup, an A/B
    # that measured slower on the H200), both timed by bench/kquant_probe.py --variants.
    K = blocks * kquant.TYPES[tag].elements
    assert_int8_matvec(gpu, rng, tag, K, N, gate_up, vec4=vec4, stage=stage)


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("batch", [2, 4])
@pytest.mark.parametrize("blocks,N,gate_up", [(3, 37, False), (5, 11, True)])
def test_matvec_kq_q8_batched_items_and_chunks(gpu, rng, tag, batch, blocks, N, gate_up):
    # BATCH items (Q2_K / Q3_K: chunks of matvec_kq_q8_chunks) a lane per pass: rows whose items end mid-pass, the
    # clamped tail loaded and not summed (a bench/kquant_probe.py --variants A/B).
    K = blocks * kquant.TYPES[tag].elements
    assert_int8_matvec(gpu, rng, tag, K, N, gate_up, wide=False, batch=batch)


@pytest.mark.parametrize("tag", [t for t in TAGS if has_vec4_blocks(t)])
@pytest.mark.parametrize("gate_up", [False, True])
def test_matvec_kq_q8_u32_kernel_reads_the_vec4_types_too(gpu, rng, tag, gate_up):
    # matvec_kq_q8 (u32 loads) takes the vec4 types too: bench/kquant_probe.py's --variants compare the two.
    K, N = 768, 19
    assert_int8_matvec(gpu, rng, tag, K, N, gate_up, vec4=False)


# One type per kernel: vec4, u32, chunks (the wide kernels: test_matvec_kq_q8_wide_covers_every_row_...).
@pytest.mark.parametrize("tag,chunks", [("q6_k", None), ("q5_1", None), ("q2_k", True)])
@pytest.mark.parametrize("claimed", [1, 4, 64])
def test_matvec_kq_q8_covers_every_row_whatever_the_subgroup_size(gpu, rng, tag, chunks, claimed):
    K, N = 512, 301
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal(K).astype(np.float32)
    out, x_hat, scale, _ = run_matvec_q8(gpu, tag, raw, x, N, False, claimed, wg=64, rows=3, chunks=chunks)
    check_int8_product(out, x, x_hat, scale, W, M, N, False, 8 + K // 32 + 64)


@pytest.mark.slow
def test_matvec_kq_q8_folded_grid(gpu, rng):
    tag, K, N = "q5_0", 32, (MAX_GROUPS_PER_DIM + 1000) * 2
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal(K).astype(np.float32)
    out, x_hat, scale, grid = run_matvec_q8(gpu, tag, raw, x, N, False, wg=gpu.subgroup_size * 2, rows=1)
    assert grid[1] > 1
    check_int8_product(out, x, x_hat, scale, W, M, N, False, 8 + K // 32 + 64)


@pytest.mark.slow
@pytest.mark.parametrize("tag,knobs", [("q6_k", {}), ("q2_k", {"chunks": True}),
                                       ("q3_k", {"wide": True, "split": 1})])
def test_matvec_kq_q8_folded_grid_one_row_a_workgroup(gpu, rng, tag, knobs):
    # One row a workgroup: more than 65,535 workgroups fold into (x, y); the vec4 kernel with Q6_K's split-off d,
    # matvec_kq_q8_chunks and matvec_kq_q8_wide.
    K, N = 256, MAX_GROUPS_PER_DIM + 1000
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal(K).astype(np.float32)
    out, x_hat, scale, grid = run_matvec_q8(gpu, tag, raw, x, N, False, wg=gpu.subgroup_size, rows=1, **knobs)
    assert grid[1] > 1
    check_int8_product(out, x, x_hat, scale, W, M, N, False, 8 + K // 32 + 64)


# ---- matvec_kq_q8_wide (Q2_K, Q3_K) and matvec_kq_q8_wide_vec4 (Q4_K): their defaults below FEW_ROWS_N outputs ---
# Their integer sums are exact (|sc·Σ u·xq| ≤ 15·16·3·127 < 2^17, |(s − 32)·Σ (u − 4)·xq| ≤ 32·16·4·127 < 2^19,
# Q4_K's per chunk ≤ 63·32·15·127 < 2^22, so the MAGIC bias turns them into f32 exactly); an element then passes ≤ 7
# roundings in its item (≤ 4 chained FMAs over the sub-blocks, xs·Σ xq, the d / dmin products and their
# difference), ≤ K/64 in the lane's item chain and ≤ 63 in subgroupAdd: within the 8 + K/32 + 64 roundings the
# other int8 kernels are held to.
WIDE_TERMS = {k: 8 + k // 32 + 64 for k in (256, 512, 768, 1280, 3072)}
WIDE = ["q2_k", "q3_k", "q4_k"]


@pytest.mark.parametrize("tag", WIDE)
@pytest.mark.parametrize("blocks,N,rows,gate_up", [(1, 9, None, False), (3, 37, None, False), (5, 13, 3, False),
                                                   (2, 21, None, True), (12, 11, 1, False), (3, 7, 4, True)])
def test_matvec_kq_q8_wide(gpu, rng, tag, blocks, N, rows, gate_up):
    # Fresh blocks, activations of chunk scales 300× apart with an all-zero chunk, K = 256·blocks (1 block: fewer items
    # than lanes; 12: more than a subgroup's), N and ROWS leaving rows past N in the last subgroup; y starts as NaN.
    K = blocks * 256
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, 1, K)[0]
    out, x_hat, scale, _ = run_matvec_q8(gpu, tag, raw, x, N, gate_up, wide=True, rows=rows)
    check_int8_product(out, x, x_hat, scale, W, M, N, gate_up, WIDE_TERMS[K])


@pytest.mark.parametrize("tag", WIDE)
@pytest.mark.parametrize("blocks,N,gate_up", [(2, 19, False), (3, 10, True)])
def test_matvec_kq_q8_wide_equals_the_default_kernel(gpu, rng, tag, blocks, N, gate_up):
    # The same int8 row and blocks through the wide kernel and a kernel it is timed against (matvec_kq_q8_chunks,
    # Q4_K's matvec_kq_q8_vec4): the same exact integer sums, so they differ only by their f32 roundings, each within
    # the bound above of the exact product on x̂ (hence within twice it of each other).
    K = blocks * 256
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, 1, K)[0]
    wide, x_hat, _, _ = run_matvec_q8(gpu, tag, raw, x, N, gate_up, wide=True)
    knobs = {"vec4": True} if tag == "q4_k" else {"chunks": True}
    default, x_hat2, _, _ = run_matvec_q8(gpu, tag, raw, x, N, gate_up, **knobs)
    assert (x_hat == x_hat2).all()
    y_hat = x_hat @ W.T
    e = WIDE_TERMS[K] * U * (np.abs(x_hat) @ M.T)
    assert_within(wide, default, 2 * gate_bound(y_hat, e, N, gate_up), "wide vs default")


# Every int8 kernel a K-quant matrix can run, by its plan knobs: the default for few and many outputs, Q4_K's three
# loads, the chunk kernels, and the staged and batched item loops.
INT8_VARIANTS = [dict(wide=None), dict(wide=False), dict(vec4=False), dict(chunks=True), dict(wide=False, stage=True),
                 dict(wide=False, batch=2)]


def int8_variants(tag):
    out = []
    for knobs in INT8_VARIANTS:
        if "vec4" in knobs and not has_vec4_blocks(tag) or "chunks" in knobs and tag not in ("q2_k", "q3_k"):
            continue
        if "stage" in knobs and tag in ("q2_k", "q3_k"):  # the item kernels' option
            continue
        out.append(knobs)
    return out


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("blocks,N,gate_up", [(3, 37, False), (2, 10, True)])
def test_int8_rows_in_element_order_give_every_kernel_the_same_sums(gpu, rng, tag, blocks, N, gate_up):
    # The same row quantized in element order (Q8_NATURAL, what a model of K-quant products writes) and in
    # matvec_q8's: every int8 kernel then skips reordering bytes, and its integer sums, hence its outputs, are the
    # same bit for bit; the element-order run also meets the float64 reference's bound on its own.
    K = blocks * kquant.TYPES[tag].elements
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, 1, K)[0]
    for knobs in int8_variants(tag):
        ours, x_hat, scale, _ = run_matvec_q8(gpu, tag, raw, x, N, gate_up, natural=True, **knobs)
        pack, x_hat2, _, _ = run_matvec_q8(gpu, tag, raw, x, N, gate_up, **knobs)
        assert (x_hat == x_hat2).all()  # the same codes, laid out apart
        np.testing.assert_array_equal(ours, pack, err_msg=str(knobs))
        check_int8_product(ours, x, x_hat, scale, W, M, N, gate_up, 8 + K // 32 + 64)
    xs = scaled_activations(rng, 5, K)
    ours, x_hat, scale, _ = run_gemm_q8(gpu, tag, raw, xs, N, gate_up, natural=True)
    pack, _, _, _ = run_gemm_q8(gpu, tag, raw, xs, N, gate_up)
    np.testing.assert_array_equal(ours, pack)
    check_int8_product(ours, xs, x_hat, scale, W, M, N, gate_up, 6 * (K // 32) + 4)


@pytest.mark.parametrize("tag", WIDE)
@pytest.mark.parametrize("claimed,split", [(1, None), (4, None), (64, None), (64, 16)])
def test_matvec_kq_q8_wide_covers_every_row_whatever_the_subgroup_size(gpu, rng, tag, claimed, split):
    # The plan takes BLOCKS and SPLIT from the claimed subgroup size; the GPU's real one must still cover every row
    # (16 segments at 64: a smaller subgroup takes them in turns).
    K, N = 512, 301
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal(K).astype(np.float32)
    out, x_hat, scale, _ = run_matvec_q8(gpu, tag, raw, x, N, False, claimed, wg=64, rows=3, wide=True, split=split)
    check_int8_product(out, x, x_hat, scale, W, M, N, False, WIDE_TERMS[K])


@pytest.mark.parametrize("tag", WIDE)
@pytest.mark.parametrize("blocks,N,rows,gate_up,split", [(1, 23, 1, False, 1), (3, 37, 2, False, 2),
                                                         (5, 11, 3, True, 4), (2, 9, 1, True, 8)])
def test_matvec_kq_q8_wide_splits(gpu, rng, tag, blocks, N, rows, gate_up, split):
    # SPLIT each way (1: most lanes of a 1-block row idle; 8: segments of fewer lanes than a row has items).
    K = blocks * 256
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, 1, K)[0]
    out, x_hat, scale, _ = run_matvec_q8(gpu, tag, raw, x, N, gate_up, rows=rows, wide=True, split=split)
    check_int8_product(out, x, x_hat, scale, W, M, N, gate_up, WIDE_TERMS[K])


@pytest.mark.slow
@pytest.mark.parametrize("tag", WIDE)
def test_matvec_kq_q8_wide_folded_grid(gpu, rng, tag):
    # One row a workgroup (one subgroup, SPLIT 1, ROWS 1): more than 65,535 workgroups fold into (x, y).
    K, N = 256, MAX_GROUPS_PER_DIM + 1000
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal(K).astype(np.float32)
    out, x_hat, scale, grid = run_matvec_q8(gpu, tag, raw, x, N, False, wg=gpu.subgroup_size, rows=1, wide=True,
                                            split=1)
    assert grid[1] > 1
    check_int8_product(out, x, x_hat, scale, W, M, N, False, WIDE_TERMS[K])


# ---- prefill GEMM, f32 activations -------------------------------------------------------------------------
def run_gemm(gpu, tag, raw, x, N, gate_up, n_tokens=None, rows=None, **plan):
    T, K = x.shape
    consts, grid = gemm_kq_plan(tag, K, N, T, gate_up=gate_up, **plan)
    ys = consts["YS"]
    y = poisoned(gpu, "y", (T, ys))
    w, wh = upload_weight(gpu, tag, raw, K)
    run(gpu, "matmul_kq", consts, [gpu.upload("x", x), w, wh, y, step_uniform(gpu, n_tokens or T)], grid)
    return read(gpu, y, (T, ys)), grid


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("T,blocks,N,gate_up", [(3, 2, 37, False), (70, 3, 130, False), (5, 2, 38, True)])
def test_gemm_kq(gpu, rng, tag, T, blocks, N, gate_up):
    K = blocks * kquant.TYPES[tag].elements
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal((T, K)).astype(np.float32)
    out, _ = run_gemm(gpu, tag, raw, x, N, gate_up)
    # The staged weight rounds once or twice (a·u + b), then one FMA chain over all of K.
    check_f32_product(out, x, W, M, N, gate_up, K + 4)


@pytest.mark.parametrize("gate_up", [False, True])
def test_gemm_kq_writes_only_live_rows_and_its_columns(gpu, rng, gate_up):
    # A buffer of 8 rows with 5 tokens this forward, and a slice of N columns in rows YS wide.
    tag, T, K, N, n_tokens, ys = "q2_k", 8, 512, 21, 5, 29
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal((T, K)).astype(np.float32)
    out, _ = run_gemm(gpu, tag, raw, x, N, gate_up, n_tokens=n_tokens, tm=4, tn=4, y_stride=ys)
    assert np.isnan(out[n_tokens:]).all() and np.isnan(out[:, N:]).all()
    check_f32_product(out[:n_tokens, :N], x[:n_tokens], W, M, N, gate_up, K + 4)


@pytest.mark.slow
def test_gemm_kq_folded_grid(gpu, rng):
    # More than 65,535 column tiles (4-wide here): they fold into (x, z) while y keeps the token tiles.
    tag, K, N, T = "q5_0", 32, 4 * MAX_GROUPS_PER_DIM + 40, 5
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = rng.standard_normal((T, K)).astype(np.float32)
    out, grid = run_gemm(gpu, tag, raw, x, N, False, tm=4, tn=4)
    assert grid[1] == 2 and grid[2] > 1
    check_f32_product(out, x, W, M, N, False, K + 4)


# ---- prefill GEMM, int8 activations ------------------------------------------------------------------------
def run_gemm_q8(gpu, tag, raw, x, N, gate_up, n_tokens=None, natural=False, **plan):
    T, K = x.shape
    xq, xm, x_hat, scale = quantize_x(gpu, x, natural)
    consts, grid = gemm_kq_q8_plan(tag, K, N, T, gate_up=gate_up, **plan)
    ys = consts["YS"]
    y = poisoned(gpu, "y", (T, ys))
    w, wh = upload_weight(gpu, tag, raw, K)
    unused = [gpu.buffer("yq", 16), gpu.buffer("ym", 16)]  # the int8 output rows (not with these plans)
    run(gpu, "matmul_kq_q8", dict(consts, Q8_NATURAL=natural),
        [xq, w, wh, y, xm, step_uniform(gpu, n_tokens or T), *unused], grid)
    return read(gpu, y, (T, ys)), x_hat, scale, grid


@pytest.mark.parametrize("tag", TAGS)
@pytest.mark.parametrize("T,blocks,N,gate_up", [(3, 2, 37, False), (70, 3, 130, False), (5, 2, 38, True)])
def test_gemm_kq_q8(gpu, rng, tag, T, blocks, N, gate_up):
    K = blocks * kquant.TYPES[tag].elements
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, T, K)
    out, x_hat, scale, _ = run_gemm_q8(gpu, tag, raw, x, N, gate_up)
    # Exact integer sums; per chunk ≤ 6 roundings (xs·a, the half's two FMAs, xs·Σ xq), chained over K/32 chunks.
    check_int8_product(out, x, x_hat, scale, W, M, N, gate_up, 6 * (K // 32) + 4)


@pytest.mark.parametrize("tag,blocks,plan", [
    ("q5_1", 3, {}),  # 3 chunks: KC falls back to 1
    ("q6_k", 1, dict(kc=4, tm=32, tn=32)),  # a whole super-block per step
    ("q4_k", 1, dict(kc=1)),
    ("q3_k", 1, dict(tm=32, tn=128)),  # 256 threads as 8 × 32
    ("q5_k", 1, dict(tm=128, tn=32)),
    ("q2_k", 1, dict(tm=16, tn=16)),  # 16 threads: each stages several items
])
def test_gemm_kq_q8_tile_options(gpu, rng, tag, blocks, plan):
    T, N, K = 37, 45, blocks * kquant.TYPES[tag].elements
    for gate_up in (False, True):
        raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
        W, M = reference(tag, raw)
        if gate_up and "tn" in plan:  # the same staged weight rows: half as many outputs
            plan = dict(plan, tn=plan["tn"] // 2)
        x = scaled_activations(rng, T, K)
        out, x_hat, scale, _ = run_gemm_q8(gpu, tag, raw, x, N, gate_up, **plan)
        check_int8_product(out, x, x_hat, scale, W, M, N, gate_up, 6 * (K // 32) + 4)


@pytest.mark.parametrize("gate_up", [False, True])
def test_gemm_kq_q8_writes_only_live_rows_and_its_columns(gpu, rng, gate_up):
    tag, T, K, N, n_tokens, ys = "q6_k", 8, 256, 21, 5, 29
    raw = random_raw(rng, tag, 2 * N if gate_up else N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, T, K)
    out, x_hat, scale, _ = run_gemm_q8(gpu, tag, raw, x, N, gate_up, n_tokens=n_tokens, tm=4, tn=4, y_stride=ys)
    assert np.isnan(out[n_tokens:]).all() and np.isnan(out[:, N:]).all()
    check_int8_product(out[:n_tokens, :N], x[:n_tokens], x_hat[:n_tokens], scale[:n_tokens], W, M, N, gate_up,
                       6 * (K // 32) + 4)


@pytest.mark.slow
def test_gemm_kq_q8_folded_grid(gpu, rng):
    tag, K, N, T = "q5_0", 32, 4 * MAX_GROUPS_PER_DIM + 40, 5
    raw = random_raw(rng, tag, N, K)
    W, M = reference(tag, raw)
    x = scaled_activations(rng, T, K)
    x[:, 32:64] = 1  # K is one chunk: keep it live
    out, x_hat, scale, grid = run_gemm_q8(gpu, tag, raw, x, N, False, tm=4, tn=4)
    assert grid[1] == 2 and grid[2] > 1
    check_int8_product(out, x, x_hat, scale, W, M, N, False, 6 * (K // 32) + 4)


# ---- embedding -----------------------------------------------------------------------------------------------
def run_embedding(gpu, tag, raw, tokens, D, vocab, **plan):
    T = len(tokens)
    consts, grid = embedding_kq_plan(tag, D, vocab, T, **plan)
    x = poisoned(gpu, "x", (T, D))
    w, wh = upload_weight(gpu, tag, raw, D)
    run(gpu, "embedding_kq", consts, [gpu.upload("t", tokens), w, wh, x, step_uniform(gpu, T)], grid)
    return read(gpu, x, (T, D))


@pytest.mark.parametrize("tag", TAGS)
def test_embedding_kq(gpu, rng, tag):
    vocab, D = 45, 2 * kquant.TYPES[tag].elements
    raw = random_raw(rng, tag, vocab, D)
    W, M = reference(tag, raw)
    tokens = np.array([vocab - 1, 0, *rng.integers(0, vocab, 4), 7 + vocab], np.uint32)
    out = run_embedding(gpu, tag, raw, tokens, D, vocab)
    assert (out[-1] == 0).all()  # an id outside the vocabulary embeds as zeros
    # a·u + b rounds once or twice: within 2 ulp of the magnitude, as ggml's own d·q − m does.
    assert_within(out[:-1], W[tokens[:-1]], 4 * U * M[tokens[:-1]], tag)


def test_embedding_kq_in_parts(gpu, rng):
    # The table bound as rows [0, 20) and [20, 45): each dispatch writes its own tokens, part 0 the zeros.
    tag, vocab, D = "q6_k", 45, 256
    raw = random_raw(rng, tag, vocab, D)
    W, M = reference(tag, raw)
    tokens = np.array([3, 30, 99, 19, 20, 44], np.uint32)
    first = run_embedding(gpu, tag, raw[:20], tokens, D, vocab, row0=0, nrows=20)
    second = run_embedding(gpu, tag, raw[20:], tokens, D, vocab, row0=20, nrows=25)
    mine = np.array([True, False, True, True, False, False])
    assert np.isnan(first[~mine]).all() and np.isnan(second[mine]).all()
    assert (first[2] == 0).all()
    both = np.where(mine[:, None], first, second)
    live = tokens < vocab
    assert_within(both[live], W[tokens[live]], 4 * U * M[tokens[live]])


# ---- plans -----------------------------------------------------------------------------------------------------
def test_plans_refuse_what_they_cannot_run():
    with pytest.raises(ValueError, match="multiple of 256 for q4_k"):
        matvec_kq_plan("q4_k", 96, 8)
    with pytest.raises(ValueError, match="multiple of 32 for q5_0"):
        gemm_kq_plan("q5_0", 48, 8, 4)
    with pytest.raises(ValueError, match="multiple of the subgroup size"):
        matvec_kq_q8_plan("q6_k", 256, 8, 48)
    with pytest.raises(ValueError, match="not whole 16-byte units"):
        matvec_kq_q8_kernel("q2_k", vec4=True)
    with pytest.raises(ValueError, match="q3_k runs matvec_kq_q8_wide or matvec_kq_q8_chunks only"):
        matvec_kq_q8_kernel("q3_k", vec4=False)
    with pytest.raises(ValueError, match="matvec_kq_q8_chunks reads Q2_K and Q3_K only"):
        matvec_kq_q8_kernel("q4_k", chunks=True)
    with pytest.raises(ValueError, match="matvec_kq_q8_sub, which is gone"):
        matvec_kq_q8_kernel("q2_k", chunks=False)
    with pytest.raises(ValueError, match="split is matvec_kq_q8_wide's knob"):
        matvec_kq_q8_plan("q4_k", 256, FEW_ROWS_N, 32, split=2)
    with pytest.raises(ValueError, match="split is matvec_kq_q8_wide's knob"):
        matvec_kq_q8_plan("q2_k", 256, 8, 32, chunks=True, split=2)
    with pytest.raises(ValueError, match="no stage"):
        matvec_kq_q8_plan("q2_k", 256, 8, 32, chunks=True, stage=False)
    with pytest.raises(ValueError, match="workgroup memory"):
        matvec_kq_q8_plan("q4_k", 11520, 8, 32, wide=False, stage=True)
    # Staging fits 16 KiB beside the reduction's WG vec4s up to K = 11264 at WG = 128; the default stages nothing.
    assert matvec_kq_q8_plan("q4_k", 11264, 8, 32, vec4=False, stage=True)[0]["STAGE"]
    assert not any(matvec_kq_q8_plan(t, K, FEW_ROWS_N, 32)[0]["STAGE"] for t in ("q4_k", "q6_k", "q5_0")
                   for K in (256, 11264))
    assert "STAGE" not in matvec_kq_q8_plan("q3_k", 256, FEW_ROWS_N, 32)[0]  # matvec_kq_q8_chunks
    assert matvec_kq_q8_kernel("q2_k", chunks=True).name == "matvec_kq_q8_chunks"
    # The faster kernel per type and output count on the H200 (BENCH.md, K-quant int8 decode matvecs): below
    # FEW_ROWS_N outputs the wide kernels for Q2_K, Q3_K, Q4_K (3072 outputs), from it the others (9216).
    few = {"q2_k": "matvec_kq_q8_wide", "q3_k": "matvec_kq_q8_wide", "q4_k": "matvec_kq_q8_wide_vec4",
           "q5_k": "matvec_kq_q8_vec4", "q6_k": "matvec_kq_q8_vec4", "q5_0": "matvec_kq_q8", "q5_1": "matvec_kq_q8"}
    many = {**few, "q2_k": "matvec_kq_q8_chunks", "q3_k": "matvec_kq_q8_chunks", "q4_k": "matvec_kq_q8"}
    for n, want in ((1, few), (3072, few), (FEW_ROWS_N - 1, few), (FEW_ROWS_N, many), (9216, many)):
        assert {t: matvec_kq_q8_kernel(t, n=n).name for t in TAGS} == want, n
    # The plan takes the same kernel's constants from N: SPLIT only for the wide kernels, BATCH only for the others.
    for t in TAGS:
        for n in (3072, 9216):
            consts = matvec_kq_q8_plan(t, 3072, n, 32)[0]
            assert ("SPLIT" in consts) == matvec_kq_q8_kernel(t, n=n).name.startswith("matvec_kq_q8_wide"), (t, n)
            assert ("BATCH" in consts) != ("SPLIT" in consts), (t, n)
    # wide= overrides N either way; the other knobs name their kernel at any N; no knob and no n: no choice.
    assert matvec_kq_q8_kernel("q3_k", wide=True, n=9216).name == "matvec_kq_q8_wide"
    assert matvec_kq_q8_kernel("q4_k", wide=False, n=3072).name == "matvec_kq_q8"
    assert matvec_kq_q8_kernel("q4_k", vec4=True, n=3072).name == "matvec_kq_q8_vec4"
    assert matvec_kq_q8_kernel("q2_k", chunks=True, n=3072).name == "matvec_kq_q8_chunks"
    assert "SPLIT" in matvec_kq_q8_plan("q3_k", 3072, 9216, 32, wide=True)[0]
    assert "BATCH" in matvec_kq_q8_plan("q4_k", 3072, 3072, 32, wide=False)[0]
    assert "BATCH" in matvec_kq_q8_plan("q4_k", 3072, 3072, 32, vec4=True)[0]
    with pytest.raises(ValueError, match="depends on the output count"):
        matvec_kq_q8_kernel("q2_k")
    assert matvec_kq_q8_kernel("q6_k").name == "matvec_kq_q8_vec4"  # not a wide type: no n needed
    # One row a subgroup below FEW_ROWS_N outputs (rows 1 measured faster there on the H200), else two (one with
    # gate_up's paired rows).
    assert [matvec_kq_q8_plan("q4_k", 8192, n, 32, gate_up=g)[0]["ROWS"] for n, g in
            ((3072, False), (8191, False), (8192, False), (9216, False), (9216, True))] == [1, 1, 2, 2, 1]
    # The vec4 kernel reads a block's words 16 bytes at a time from a 16-byte boundary: whole 16-byte blocks only.
    assert [t for t in TAGS if has_vec4_blocks(t)] == ["q4_k", "q5_k", "q6_k"]
    with pytest.raises(ValueError, match="power of two"):
        matvec_kq_plan("q2_k", 256, 8, wg=48)
    with pytest.raises(ValueError, match="not a K-quant tag"):
        matvec_kq_plan("q4_0", 256, 8)
    with pytest.raises(ValueError, match="do not fit"):
        embedding_kq_plan("q4_k", 256, 10, row0=4, nrows=8)
    with pytest.raises(ValueError, match="KC=3"):
        gemm_kq_q8_plan("q4_k", 256, 8, 4, kc=3)
    with pytest.raises(ValueError, match="workgroup memory"):
        gemm_kq_q8_plan("q4_k", 1024, 8, 4, tm=128, tn=32, kc=4)
    assert set(BINDINGS) == {"matvec_kq", "matvec_kq_q8_wide", "matvec_kq_q8_wide_vec4", "matvec_kq_q8_chunks",
                             "matvec_kq_q8", "matvec_kq_q8_vec4", "matmul_kq", "matmul_kq_q8", "embedding_kq"}
    # matvec_kq_q8_wide(_vec4): Q2_K / Q3_K / Q4_K only, no staging, one knob for one kernel; SPLIT keeps whole
    # subgroups on a row set unless a row has at most half a subgroup's 64-element items.
    assert [matvec_kq_q8_kernel(t, wide=True).name for t in ("q2_k", "q3_k", "q4_k")] == [
        "matvec_kq_q8_wide", "matvec_kq_q8_wide", "matvec_kq_q8_wide_vec4"]
    with pytest.raises(ValueError, match="reads Q2_K, Q3_K, Q4_K only"):
        matvec_kq_q8_kernel("q6_k", wide=True)
    with pytest.raises(ValueError, match="name different kernels"):
        matvec_kq_q8_plan("q3_k", 256, 8, 32, wide=True, chunks=True)
    with pytest.raises(ValueError, match="name different kernels"):
        matvec_kq_q8_kernel("q4_k", vec4=True, wide=True)
    with pytest.raises(ValueError, match="no stage"):
        matvec_kq_q8_plan("q3_k", 256, 8, 32, wide=True, stage=False)
    with pytest.raises(ValueError, match="SPLIT must be one of"):
        matvec_kq_q8_plan("q2_k", 256, 8, 32, wide=True, split=32)
    assert {K: matvec_kq_q8_plan("q2_k", K, 8, 32, wide=True)[0]["SPLIT"] for K in (256, 1024, 3072, 8192)} == {
        256: 8, 1024: 2, 3072: 1, 8192: 1}
    consts, grid = matvec_kq_q8_plan("q3_k", 3072, 9216, 32, wide=True)
    assert (consts["ROWS"], consts["BLOCKS"], consts["SPLIT"], grid) == (2, 4, 1, (1152, 1))
    assert "STAGE" not in consts and "HALVES" not in consts
    assert matvec_kq_q8_plan("q4_k", 3072, 8, 32, wide=True)[0]["BW"] == 36
