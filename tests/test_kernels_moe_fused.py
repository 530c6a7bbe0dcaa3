"""The fused MoE decode passes (engine/blocks/moe_fused.py) vs float64 numpy on poisoned outputs: moe_router_norm (the
router on the residual normed on the fly), moe_gate_up_q8 (top-k in the kernel, gate_up on the norm's int8 row
without 1/rms, its outputs written in int8) and moe_down_q8 (down of every slot, the weighted sum, the residual add
and the next norm's int8 row), on 4-bit stacks, 3-bit stacks with the 4-bit shared expert after them, and MLC's
zero-point format."""

import numpy as np
import pytest

from engine.kernels.matmul import FORMATS, norm_pack_layout
from engine.kernels.moe import decode_pack_layout, down_q8_plan, gate_up_q8_plan, router_norm_plan
from tests.helpers import (
    assert_q8_matches,
    moe_values,
    poisoned,
    random_packed,
    random_weight,
    read,
    reference_dequantize_fmt,
    reference_quantize_q8,
    reference_route,
    route_tolerance,
    run,
    silu,
    unpack_codes,
)

EPS = 1e-6
# The f32 dot products of K ≤ 512 random-sign terms drift ~1e-6 of max|y| (test_kernels_matmul's argument); a wrong
# code, expert or slot moves an output by 1e-3 of it or more.
F32_TOL = 2e-5


def pack_codes(codes: np.ndarray) -> np.ndarray:
    """int8 codes in element order -> the kernels' u32 words (unpack_codes' inverse: per 8 elements, the even ones
    then the odd ones)."""
    c = codes.astype(np.int8).reshape(-1, 4, 8)
    out = np.empty((c.shape[0], 4, 2, 4), np.int8)
    out[:, :, 0], out[:, :, 1] = c[:, :, 0::2], c[:, :, 1::2]
    return out.reshape(-1).view(np.uint32)


def q8_row(v: np.ndarray):
    """(u32 codes, (scale, Σ codes) f32 pairs, the dequantized row in float64) of a row quantized as the kernels do."""
    q, scale, total = reference_quantize_q8(v)
    pairs = np.stack([scale.astype(np.float32), total.astype(np.float32)], axis=1)
    return pack_codes(q), pairs, q.astype(np.float64) * np.repeat(pairs[:, 0].astype(np.float64), 32)


def random_matrix(rng, rows: int, K: int, fmt: str):
    """(w u32, s f16, dequantized float64 [rows, K]) of a random matrix in `fmt` (MLX 3-bit rows through the MLX
    reader's own dequantize)."""
    if fmt == "mlx3":
        pw = random_weight(rng, (rows, K), fmt)
        return pw["q_weight"], pw["q_scale"], moe_values(pw)
    w, s = random_packed(rng, rows, K, **FORMATS[fmt])
    return w, s, reference_dequantize_fmt(w, s, **FORMATS[fmt])


def expert_stack(rng, E: int, rows: int, K: int, fmt: str, shared: bool, mixed: bool):
    """(w u32, s f16, dequantized float64 [E (+ 1), rows, K], (MIXED_W, MIXED_S)): E routed experts in `fmt` and,
    with `shared`, expert E: in the stack, or (mixed) 4-bit rows after a 3-bit stack at 256-byte offsets."""
    w, s, dense = zip(*[random_matrix(rng, rows, K, fmt) for _ in range(E + (shared and not mixed))], strict=True)
    w, s, dense = np.concatenate([a.reshape(-1) for a in w]), np.concatenate([a.reshape(-1) for a in s]), list(dense)
    if not mixed:
        return w, s, np.stack(dense), (0, 0)
    ws, ss, shared_dense = random_matrix(rng, rows, K, "mlx4")
    wr, sr = -(-w.size // 64) * 64, -(-s.size // 128) * 128
    w = np.concatenate([w, np.zeros(wr - w.size, np.uint32), ws.reshape(-1)])
    s = np.concatenate([s, np.zeros(sr - s.size, np.float16), ss.reshape(-1)])
    return w, s, np.stack(dense + [shared_dense]), (wr, sr)


def fmt_knobs(fmt: str) -> dict:
    return {k: FORMATS[fmt][k] for k in ("bits", "zero", "affine", "group")}


# ---- router on the normed residual ---------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,D,N,offset", [("mlx8", 256, 9, 0.0), ("mlx4", 192, 37, 1.0), ("q4f16_1", 128, 257, 0.0)])
def test_router_norm_matches_float64(any_gpu, rng, fmt, D, N, offset):
    """The logits of x = r · 1/rms · (nw + offset), 1/rms from the given Σ r² per chunk (not from r: the kernel must
    take the epilogue's sums), N not a multiple of the workgroup's rows."""
    w, s = random_packed(rng, N, D, **FORMATS[fmt])
    r = (rng.standard_normal(D) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, D).astype(np.float16) - np.float16(offset)
    ss = (rng.random(D // 32) * 300).astype(np.float32)
    consts, grid = router_norm_plan(D, N, EPS, offset, **fmt_knobs(fmt))
    y = poisoned(any_gpu, "logits", (N,))
    run(any_gpu, "moe_router_norm", consts, [any_gpu.upload("r", r), any_gpu.upload("nw", nw),
                                             any_gpu.upload("ss", ss), any_gpu.upload("w", w), any_gpu.upload("s", s),
                                             y], grid)
    inv = 1 / np.sqrt(ss.astype(np.float64).sum() / D + EPS)
    x = r.astype(np.float64) * inv * (nw.astype(np.float64) + offset)
    ref = reference_dequantize_fmt(w, s, **FORMATS[fmt]) @ x
    got = read(any_gpu, y, (N,))
    np.testing.assert_allclose(got, ref, rtol=0, atol=F32_TOL * np.abs(ref).max())


# ---- gate_up with the top-k ---------------------------------------------------------------------------------------
def run_gate_up(gpu, rng, fmt, E, top_k, shared, mixed, norm_topk, D=256, F=64, logits=None, slot_ids=None):
    """One fused gate_up dispatch on random inputs: (ids, weights, codes [slots, F], pairs [slots, F/32, 2], the
    float64 reference activations [slots, F], the reference route). `slot_ids`: STREAM, the slots' experts."""
    slots = top_k + shared
    w, s, dense, offsets = expert_stack(rng, E, 2 * F, D, fmt, shared, mixed)
    v = (rng.standard_normal(D) * 2).astype(np.float32)  # the norm's row without 1/rms
    codes, pairs, v_hat = q8_row(v)
    ss = (rng.random(D // 32) * 40).astype(np.float32)
    pack = norm_pack_layout(D)
    nq = np.zeros(pack["bytes"] // 4, np.uint32)
    nq[:D // 4] = codes
    nq[pack["META"]:pack["META"] + D // 16] = pairs.reshape(-1).view(np.uint32)
    nq[pack["SS"]:pack["SS"] + D // 32] = ss.view(np.uint32)
    if logits is None:
        logits = (rng.standard_normal(E + shared) * 2).astype(np.float32)
    act_pack = decode_pack_layout(F, slots)
    experts = E + shared
    consts, grid = gate_up_q8_plan(D, F, experts, E, top_k, shared, norm_topk, gpu.subgroup_size, EPS, pack,
                                   act_pack, mixed=offsets, max_threads=1024, stream=slot_ids is not None,
                                   **fmt_knobs(fmt))
    assert grid == (F // 32, 1, slots)
    act = poisoned(gpu, "act", (act_pack["words"],), np.uint32)
    slots_buf = poisoned(gpu, "slot_ids", (slots,), np.uint32) if slot_ids is None else gpu.upload("slot_ids", slot_ids)
    run(gpu, "moe_gate_up_q8", consts, [gpu.upload("nq", nq), gpu.upload("logits", logits), gpu.upload("w", w),
                                        gpu.upload("s", s), act, slots_buf], grid)
    out = read(gpu, act, (act_pack["words"],), np.uint32)
    ids_ref, w_ref = reference_route(logits[None], E, top_k, shared, norm_topk)
    inv = 1 / np.sqrt(ss.astype(np.float64).sum() / D + EPS)
    h = dense[ids_ref[0] if slot_ids is None else slot_ids] @ (v_hat * inv)  # [slots, 2F]
    ref = silu(h[:, :F]) * h[:, F:]
    a = act_pack
    return (out[a["AIDS"]:a["AIDS"] + slots], out[a["AWTS"]:a["AWTS"] + slots].view(np.float32),
            unpack_codes(out[:slots * F // 4]).reshape(slots, F),
            out[a["AMETA"]:a["AMETA"] + slots * F // 16].view(np.float32).reshape(slots, F // 32, 2), ref,
            (logits, ids_ref, w_ref))


def assert_int8_activations(codes, pairs, ref):
    """The int8 chunks hold `ref` to its rounding: every code within half a step (plus the kernels' 2.5-ULP scale and
    a near-tie code, 2^-12 of a step) of ref, after the f32 error of the products that made it; scales from the
    chunk's max|ref|; the code sums exact."""
    atol = F32_TOL * np.abs(ref).max()
    scale = pairs[..., 0].astype(np.float64)
    amax = np.abs(ref).reshape(*scale.shape, 32).max(-1)
    assert (np.abs(scale * 127 - amax) <= atol + 2.5 * 2.0**-23 * amax).all()
    step = np.repeat(scale, 32, axis=-1)
    assert (np.abs(codes * step - ref) <= step * (0.5 + 2.0**-12) + atol).all()
    np.testing.assert_array_equal(codes.reshape(*scale.shape, 32).sum(-1), pairs[..., 1])


@pytest.mark.parametrize("fmt,shared,mixed,norm_topk", [
    ("mlx4", True, False, True),  # Qwen3.6 4-bit: the shared expert stacked as expert E
    ("mlx3", True, True, True),  # Qwen3.6 3-bit: the 4-bit shared expert after the 3-bit stack
    ("q4f16_1", False, False, False),  # no shared expert, no renormalisation, MLC's zero-point codes
])
def test_gate_up_q8_matches_float64(gpu, rng, fmt, shared, mixed, norm_topk):
    E, top_k = 8, 3
    ids, weights, codes, pairs, ref, (logits, ids_ref, w_ref) = run_gate_up(gpu, rng, fmt, E, top_k, shared, mixed,
                                                                            norm_topk)
    np.testing.assert_array_equal(ids, ids_ref[0])  # selection compares logits: exact
    tol = route_tolerance(logits[None], ids_ref, E, top_k, shared, norm_topk)[0]
    assert (np.abs(weights - w_ref[0]) <= tol * w_ref[0]).all()
    assert_int8_activations(codes, pairs, ref)


def test_gate_up_q8_streamed_reads_the_cache_slots(gpu, rng):
    """STREAM: the slots' experts are the cache slots the host wrote (handed to down in place of the ids); the weights
    are the kernel's own route's."""
    E, top_k = 8, 3
    slot_ids = np.array([6, 0, 3, E], np.uint32)
    ids, weights, codes, pairs, ref, (logits, ids_ref, w_ref) = run_gate_up(gpu, rng, "mlx4", E, top_k, True, False,
                                                                            True, slot_ids=slot_ids)
    np.testing.assert_array_equal(ids, slot_ids)
    tol = route_tolerance(logits[None], ids_ref, E, top_k, True, True)[0]
    assert (np.abs(weights - w_ref[0]) <= tol * w_ref[0]).all()
    assert_int8_activations(codes, pairs, ref)


def test_gate_up_q8_routes_ties_to_the_lower_index(gpu, rng):
    """A five-way tie for the top three places of 16 experts: the three lowest ids, weight 1/3 each."""
    E, top_k = 16, 3
    logits = np.zeros(E + 1, np.float32)
    logits[[3, 6, 9, 12, 15]] = 2.0
    ids, weights, codes, pairs, ref, (_, ids_ref, w_ref) = run_gate_up(gpu, rng, "mlx4", E, top_k, True, False,
                                                                       True, logits=logits)
    assert ids.tolist() == ids_ref[0].tolist() == [3, 6, 9, E]
    tol = route_tolerance(logits[None], ids_ref, E, top_k, True, True)[0]
    assert (np.abs(weights - w_ref[0]) <= tol * w_ref[0]).all() and np.allclose(w_ref[0, :top_k], 1 / 3)
    assert_int8_activations(codes, pairs, ref)


# ---- down with the combine and the next norm ---------------------------------------------------------------------
@pytest.mark.parametrize("fmt,F,mixed,norm,offset", [("mlx4", 128, False, True, 0.0), ("mlx3", 320, True, True, 1.0),
                                                    ("q4f16_1", 352, False, False, 0.0)])
def test_down_q8_matches_float64(gpu, rng, fmt, F, mixed, norm, offset):
    """Σ_s w_s · down_{e_s}(act_s) (+ r_in, and the next norm's int8 row and Σ out² with `norm`), an out-of-range id
    read as the last expert, every slot's expert through one workgroup per 32 outputs; rows of 4, 10 and 11 chunks
    (within one batch of loads, and a partial last batch)."""
    E, slots, D = 6, 4, 96
    w, s, dense, offsets = expert_stack(rng, E, D, F, fmt, True, mixed)
    acts = (rng.standard_normal((slots, F)) * 3).astype(np.float32)
    rows = [q8_row(a) for a in acts]
    ids = np.array([4, 0xFFFFFFFF, 1, E], np.uint32)  # the bad id clamps to expert E (the shared one)
    route_w = rng.uniform(0.1, 1.0, slots).astype(np.float32)
    a = decode_pack_layout(F, slots)
    act = np.zeros(a["words"], np.uint32)
    act[:slots * F // 4] = np.concatenate([c for c, _, _ in rows])
    act[a["AMETA"]:a["AIDS"]] = np.concatenate([p for _, p, _ in rows]).reshape(-1).view(np.uint32)
    act[a["AIDS"]:a["AWTS"]], act[a["AWTS"]:] = ids, route_w.view(np.uint32)
    r_in = (rng.standard_normal(D) * 3).astype(np.float32)
    nw = rng.uniform(0.5, 1.5, D).astype(np.float16) - np.float16(offset)
    pack = norm_pack_layout(D)
    consts, grid = down_q8_plan(F, D, E + 1, slots, norm, offset, pack, a, gpu.subgroup_size, mixed=offsets,
                                max_threads=1024, **fmt_knobs(fmt))
    out, nq = poisoned(gpu, "out", (D,)), poisoned(gpu, "nq", (pack["bytes"] // 4,), np.uint32)
    run(gpu, "moe_down_q8", consts, [gpu.upload("act", act), gpu.upload("w", w), gpu.upload("s", s), out,
                                     gpu.upload("r_in", r_in), gpu.upload("nw", nw), nq], grid)
    experts = np.minimum(ids, E)
    y = np.stack([dense[e] @ x_hat for e, (_, _, x_hat) in zip(experts, rows, strict=True)])  # [slots, D]
    ref = route_w.astype(np.float64) @ y + (r_in if norm else 0)
    got = read(gpu, out, (D,))
    atol = F32_TOL * (np.abs(route_w) @ np.abs(y).max(1) + np.abs(r_in).max() * norm)
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol)
    words = read(gpu, nq, (pack["bytes"] // 4,), np.uint32)
    if not norm:  # the last layer: the sum only, the norm row untouched
        assert (words == 0xFFFFFFFF).all()
        return
    meta = words[pack["META"]:pack["META"] + D // 16].view(np.float32).reshape(-1, 2)
    v = (got.astype(np.float64) * (nw.astype(np.float64) + offset)).astype(np.float32)
    assert_q8_matches(words[:D // 4], meta, v)
    ss = words[pack["SS"]:pack["SS"] + D // 32].view(np.float32)
    np.testing.assert_allclose(ss, (got.astype(np.float64).reshape(-1, 32) ** 2).sum(1), rtol=1e-6)


def test_fused_plans_refuse_what_they_cannot_run():
    pack, act = norm_pack_layout(128), decode_pack_layout(48, 3)
    knobs = fmt_knobs("mlx4")
    assert gate_up_q8_plan(128, 48, 9, 8, 2, True, True, 32, EPS, pack, act, **knobs) is None  # F not whole chunks
    assert down_q8_plan(64, 48, 9, 3, True, 0.0, pack, act, 32, **knobs) is None  # D not whole chunks
    big = decode_pack_layout(4096, 9)  # 9 slots of 4096 int8 activations: more than a workgroup holds
    assert down_q8_plan(4096, 128, 9, 9, True, 0.0, pack, big, 32, **knobs) is None
    with pytest.raises(ValueError, match="3-bit stack"):
        down_q8_plan(64, 128, 9, 3, True, 0.0, pack, decode_pack_layout(64, 3), 32, mixed=(64, 128), **knobs)
    with pytest.raises(ValueError, match="BITS"):
        down_q8_plan(64, 128, 9, 3, True, 0.0, pack, decode_pack_layout(64, 3), 32, **fmt_knobs("mlx8"))
