"""MoE prefill kernels: the sort of routing pairs by expert (moe_sort) and the grouped expert GEMM (moe_gemm) vs
float64 numpy, outputs poisoned with NaN so an unwritten row fails."""

import numpy as np
import pytest

from engine.kernels.matmul import format_knobs
from engine.kernels.moe import grouped_plan, grouped_q8_plan, max_tiles, sort_plan
from tests.helpers import (
    assert_close,
    moe_values,
    poisoned,
    quantized_rows,
    random_weight,
    read,
    run,
    silu,
    step_uniform,
)


def run_sort(gpu, ids, experts, T, slots, slot0=0, n_slots=None, tm=4, wg=32):
    """moe_sort over the first T tokens of ids [rows, slots]: (order, tiles as [count, 4] rows)."""
    consts, grid, tile_vec4s = sort_plan(experts, slots, len(ids), slot0=slot0, n_slots=n_slots, tm=tm, wg=wg)
    n_pairs = len(ids) * consts["NSLOTS"]
    order, tiles = poisoned(gpu, "order", (n_pairs,), np.uint32), poisoned(gpu, "tiles", (tile_vec4s, 4), np.uint32)
    run(gpu, "moe_sort", consts, [gpu.upload("ids", ids.astype(np.uint32)), order, tiles, step_uniform(gpu, T)],
        grid)
    return read(gpu, order, (n_pairs,), np.uint32), read(gpu, tiles, (tile_vec4s, 4), np.uint32)


def check_sorted(order, tiles, ids, experts, T, slots, slot0, n_slots, tm):
    """order holds exactly the T·n_slots pairs, grouped by (clamped) expert in ascending expert order, and the tile
    list cuts each expert's run into ceil(count / TM) tiles of ≤ TM pairs, in order."""
    pairs = [t * slots + s for t in range(T) for s in range(slot0, slot0 + n_slots)]
    expert = {p: min(int(ids.flat[p]), experts - 1) for p in pairs}
    n = len(pairs)
    got = order[:n].tolist()
    assert sorted(got) == pairs, "order is not a permutation of the sorted slots' pairs"
    assert [expert[p] for p in got] == sorted(expert[p] for p in pairs), "pairs not grouped by expert"
    counts = np.bincount([expert[p] for p in pairs], minlength=experts)
    want = [(e, start + k, start + c) for e, (c, start) in enumerate(zip(counts, np.cumsum(counts) - counts,
                                                                            strict=True)) for k in range(0, c, tm)]
    assert tiles[0, 0] == len(want) and tiles[0, 1] == n
    assert [tuple(r) for r in tiles[1:1 + len(want), :3].tolist()] == want
    assert (tiles[1 + len(want):] == 0xFFFFFFFF).all(), "tiles past the count were written"
    assert len(want) <= max_tiles(experts, n, tm)


@pytest.mark.parametrize("experts,T,slots,slot0,n_slots,tm,wg", [
    (8, 13, 3, 0, 3, 4, 32),   # every slot; counts not multiples of TM
    (9, 21, 3, 0, 2, 4, 4),    # the routed slots of a shared-expert layout; 3 experts per scan thread
    (1, 7, 3, 2, 1, 4, 8),     # the shared expert apart: slot 2 only, a stack of one whatever the ids say
    (300, 40, 9, 0, 9, 16, 256),  # more experts than threads, most of them empty
])
def test_sort_groups_pairs_by_expert(gpu, rng, experts, T, slots, slot0, n_slots, tm, wg):
    rows = T + 3  # rows past n_tokens hold ids that must not be sorted
    ids = rng.integers(0, experts, size=(rows, slots))
    ids[0, 0] = 0xFFFFFFFF  # a bad id clamps to the last expert
    order, tiles = run_sort(gpu, ids, experts, T, slots, slot0, n_slots, tm, wg)
    check_sorted(order, tiles, ids, experts, T, slots, slot0, n_slots, tm)
    assert (order[T * n_slots:] == 0xFFFFFFFF).all(), "pairs of tokens past n_tokens were written"


def test_sort_one_expert_takes_everything(gpu):
    # All pairs on one expert: its run spans many tiles, every other expert is empty.
    T, slots, experts, tm = 10, 4, 6, 8
    ids = np.full((T, slots), 3)
    order, tiles = run_sort(gpu, ids, experts, T, slots, tm=tm)
    check_sorted(order, tiles, ids, experts, T, slots, 0, slots, tm)


def test_sort_plan_validates():
    with pytest.raises(ValueError, match="experts per stack"):
        sort_plan(2000, 2, 4)
    with pytest.raises(ValueError, match="power of two"):
        sort_plan(8, 2, 4, wg=48)
    with pytest.raises(ValueError, match="slots"):
        sort_plan(8, 2, 4, slot0=2, n_slots=1)


def run_grouped(gpu, x, ids, weight, experts, T, slots, n_slots, K, N, gate_up, x_stride, fmt, tm=4, tn=None):
    """moe_sort then moe_gemm for the first n_slots slots of T tokens: y [rows, slots, Y_STRIDE]."""
    rows = len(ids)
    consts, grid, vec4s = sort_plan(experts, slots, rows, n_slots=n_slots, tm=tm, wg=16)
    order = gpu.upload("order", np.zeros(rows * n_slots, np.uint32))
    tiles = gpu.upload("tiles", np.zeros((vec4s, 4), np.uint32))
    step = step_uniform(gpu, T)
    run(gpu, "moe_sort", consts, [gpu.upload("ids", ids.astype(np.uint32)), order, tiles, step], grid)
    consts, grid = grouped_plan(K, N, experts, rows, slots, n_slots=n_slots, gate_up=gate_up, x_slot=not gate_up,
                                x_stride=x_stride, y_stride=N + 4, tm=tm, tn=tn, **format_knobs(fmt))
    assert grid[1] == vec4s - 1  # the GEMM's grid covers the sort's largest tile list
    w = weight.get("q_weight", weight.get("weight"))
    s = weight["q_scale"] if "q_scale" in weight else np.full(4, np.nan, np.float16)
    y = poisoned(gpu, "y", (rows, slots, N + 4))
    run(gpu, "moe_gemm", consts, [gpu.upload("x", x), order, tiles, gpu.upload("w", w.view(np.uint32)),
                                  gpu.upload("s", s), y], grid)
    return read(gpu, y, (rows, slots, N + 4))


@pytest.mark.parametrize("fmt", ["mlx4", "mlx3", "mlx8", "f16", "q4f16_1"])
@pytest.mark.parametrize("gate_up", [True, False])
def test_grouped_gemm_matches_float64(gpu, rng, fmt, gate_up):
    # 5 experts over 11 tokens × 3 slots (2 sorted): runs of 0..~9 pairs in tiles of 4; N = 37 is not a multiple of
    # the column tile; K = 192 is 6 chunks (3 scale groups of 64).
    E, T, slots, n_slots, K, N = 5, 11, 3, 2, 192, 37
    rows = T + 2  # rows past n_tokens: never read into a tile, never written
    if fmt == "q4f16_1":  # its own layout: 4-bit codes, f16 scale per 32, zero point 7
        w = {"q_weight": rng.integers(0, 2**32, size=(E, 2 * N if gate_up else N, K // 8), dtype=np.uint32),
             "q_scale": rng.uniform(0.005, 0.02, size=(E, 2 * N if gate_up else N, K // 32)).astype(np.float16)}
        q = (w["q_weight"][..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
        dense = (q.reshape(*q.shape[:-2], K).astype(np.float64) - 7) * np.repeat(w["q_scale"], 32, -1)
    else:
        w = random_weight(rng, (E, 2 * N if gate_up else N, K), fmt)
        dense = moe_values(w)
    ids = np.stack([rng.permutation(E)[:slots] for _ in range(rows)])
    if gate_up:  # x row = token
        x = rng.standard_normal((rows, K)).astype(np.float32)
        xs, stride = x[:, None, :].repeat(slots, 1), None
    else:  # x row = pair, K + 32 floats apart
        xs = rng.standard_normal((rows, slots, K)).astype(np.float32)
        x, stride = np.concatenate([xs, np.zeros((rows, slots, 32), np.float32)], -1), K + 32
    out = run_grouped(gpu, x, ids, w, E, T, slots, n_slots, K, N, gate_up, stride, fmt)
    full = np.einsum("tsk,tsnk->tsn", xs.astype(np.float64), dense[ids])
    ref = silu(full[..., :N]) * full[..., N:] if gate_up else full
    assert_close(out[:T, :n_slots, :N], ref[:T, :n_slots])
    assert np.isnan(out[T:]).all() and np.isnan(out[:, n_slots:]).all() and np.isnan(out[..., N:]).all()


def test_grouped_gemm_many_pairs_per_expert(gpu, rng):
    # Two experts and 24 tokens × 2 slots: each expert's run spans several tiles of 8 (the shared-expert case), with
    # a wider column tile.
    E, T, slots, K, N = 2, 24, 2, 128, 64
    w = random_weight(rng, (E, N, K), "mlx4")
    ids = np.stack([rng.permutation(E) for _ in range(T)])
    xs = rng.standard_normal((T, slots, K)).astype(np.float32)
    out = run_grouped(gpu, xs, ids, w, E, T, slots, slots, K, N, False, K, "mlx4", tm=8, tn=32)
    ref = np.einsum("tsk,tsnk->tsn", xs.astype(np.float64), moe_values(w)[ids])
    assert_close(out[..., :N], ref)


def test_grouped_plan_validates():
    with pytest.raises(ValueError, match="multiples of 4"):
        grouped_plan(64, 8, 4, 4, 2, tm=6)
    with pytest.raises(ValueError, match="strides"):
        grouped_plan(64, 8, 4, 4, 2, x_stride=32)
    with pytest.raises(ValueError, match="tiles exceed"):
        grouped_plan(64, 8, 64, 70000, 9, tm=4)


@pytest.mark.parametrize("fmt", ["mlx4", "mlx3", "q4f16_1"])
@pytest.mark.parametrize("gate_up", [True, False])
def test_grouped_gemm_int8_matches_float64(gpu, rng, fmt, gate_up):
    # moe_gemm_q8 on int8 activations (quantize_q8's rows, dequantized for the reference): the sums are exact in
    # int32 per chunk, so only f32 rounding of the scaled partial sums remains.
    E, T, slots, n_slots, K, N = 5, 11, 3, 2, 256, 37
    rows = T + 2
    rows_n = 2 * N if gate_up else N
    if fmt == "q4f16_1":
        w = {"q_weight": rng.integers(0, 2**32, size=(E, rows_n, K // 8), dtype=np.uint32),
             "q_scale": rng.uniform(0.005, 0.02, size=(E, rows_n, K // 32)).astype(np.float16)}
        q = (w["q_weight"][..., None] >> (4 * np.arange(8, dtype=np.uint32))) & 15
        dense = (q.reshape(E, rows_n, K).astype(np.float64) - 7) * np.repeat(w["q_scale"], 32, -1)
    else:
        w = random_weight(rng, (E, rows_n, K), fmt)
        dense = moe_values(w)
    ids = np.stack([rng.permutation(E)[:slots] for _ in range(rows)])
    if gate_up:  # x row = token
        xq, xm, x_hat = quantized_rows(gpu, rng.standard_normal((rows, K)).astype(np.float32))
        xs = x_hat[:, None, :].repeat(slots, 1)
    else:  # x row = pair
        xq, xm, x_hat = quantized_rows(gpu, rng.standard_normal((rows * slots, K)).astype(np.float32))
        xs = x_hat.reshape(rows, slots, K)
    consts, grid, vec4s = sort_plan(E, slots, rows, n_slots=n_slots, tm=4, wg=16)
    order = gpu.upload("order", np.zeros(rows * n_slots, np.uint32))
    tiles = gpu.upload("tiles", np.zeros((vec4s, 4), np.uint32))
    run(gpu, "moe_sort", consts, [gpu.upload("ids", ids.astype(np.uint32)), order, tiles, step_uniform(gpu, T)],
        grid)
    consts, grid = grouped_q8_plan(K, N, E, rows, slots, n_slots=n_slots, gate_up=gate_up, x_slot=not gate_up,
                                   y_stride=N + 4, tm=4, **format_knobs(fmt))
    y = poisoned(gpu, "y", (rows, slots, N + 4))
    unused = [gpu.buffer("yq", 16), gpu.buffer("ym", 16)]  # the int8 output rows (ROWS_Q8 is off)
    run(gpu, "moe_gemm_q8", consts, [xq, order, tiles, gpu.upload("w", w["q_weight"].view(np.uint32)),
                                     gpu.upload("s", w["q_scale"]), y, xm, *unused], grid)
    out = read(gpu, y, (rows, slots, N + 4))
    full = np.einsum("tsk,tsnk->tsn", xs, dense[ids])
    ref = (silu(full[..., :N]) * full[..., N:] if gate_up else full)[:T, :n_slots]
    np.testing.assert_allclose(out[:T, :n_slots, :N], ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    assert np.isnan(out[T:]).all() and np.isnan(out[:, n_slots:]).all() and np.isnan(out[..., N:]).all()
