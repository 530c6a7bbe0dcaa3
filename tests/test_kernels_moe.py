"""MoE kernels (router top-k, expert matvec, combine) vs float64 numpy, and the whole MoE block vs transformers'
Qwen3_5MoeSparseMoeBlock (and mlx-lm's SparseMoeBlock without renormalisation) on weights that are exactly
representable in our packed layouts: random codes and f16 (scale, bias) pairs, dequantized for the reference.
"""

import numpy as np
import pytest

from engine.gpu import Recorder
from engine.kernels.matmul import format_knobs
from engine.kernels.moe import combine_plan, expert_plan, expert_q8_plan, router_plan
from tests.helpers import (
    assert_close,
    moe_block,
    moe_values,
    poisoned,
    quantized_rows,
    random_weight,
    read,
    record_moe_block,
    reference_route,
    route_tolerance,
    run,
    silu,
    step_uniform,
)


# ---- router ----------------------------------------------------------------------------------------
def run_router(gpu, logits, E, top_k, shared, norm, wg=64):
    T = len(logits)
    slots = top_k + shared
    consts, grid = router_plan(E, top_k, shared, norm, T, wg=wg)
    ids, w = poisoned(gpu, "ids", (T, slots), np.uint32), poisoned(gpu, "w", (T, slots))
    run(gpu, "moe_router", consts, [gpu.upload("logits", logits.astype(np.float32)), ids, w, step_uniform(gpu, T)],
        grid)
    return read(gpu, ids, (T, slots), np.uint32), read(gpu, w, (T, slots))


@pytest.mark.parametrize("E,top_k,shared,norm,wg", [
    (8, 2, True, True, 64),  # fewer experts than threads
    (40, 4, False, True, 8),  # 5 logits per thread
    (200, 8, True, False, 64),  # E not a multiple of WG, no renormalisation
    (256, 8, True, True, 64),  # Qwen3.6's router
])
def test_router_matches_float64(any_gpu, rng, E, top_k, shared, norm, wg):
    logits = (rng.standard_normal((3, E + shared)) * 2).astype(np.float32)
    ids, w = run_router(any_gpu, logits, E, top_k, shared, norm, wg)
    ref_ids, ref_w = reference_route(logits, E, top_k, shared, norm)
    np.testing.assert_array_equal(ids, ref_ids)  # selection compares logits: exact
    assert (np.abs(w - ref_w) <= route_tolerance(logits, ref_ids, E, top_k, shared, norm) * ref_w).all()


def test_router_ties_go_to_the_lower_index(any_gpu):
    E, top_k = 24, 4
    logits = np.zeros((3, E + 1), np.float32)
    logits[0, [5, 9, 17, 20, 22]] = 3.0  # five-way tie for four places: 5, 9, 17, 20 win
    logits[1, :E] = 1.0  # all equal: 0..3, each weight 1/4 after renormalisation
    logits[2, [2, 11, 12, 23]] = [4.0, 2.0, 2.0, 2.0]  # 2 first, then the tie 11, 12, 23 in index order
    logits[:, E] = [0.0, 2.0, -1.0]
    ids, w = run_router(any_gpu, logits, E, top_k, True, True, wg=8)
    assert ids[:, :top_k].tolist() == [[5, 9, 17, 20], [0, 1, 2, 3], [2, 11, 12, 23]]
    assert (ids[:, top_k] == E).all()
    ref_ids, ref_w = reference_route(logits, E, top_k, True, True)
    np.testing.assert_array_equal(ids, ref_ids)
    assert (np.abs(w - ref_w) <= route_tolerance(logits, ref_ids, E, top_k, True, True) * ref_w).all()


def test_router_leaves_rows_past_n_tokens(gpu, rng):
    E, top_k = 16, 2
    logits = rng.standard_normal((4, E + 1)).astype(np.float32)
    consts, grid = router_plan(E, top_k, True, True, 4)
    ids, w = poisoned(gpu, "ids", (4, 3), np.uint32), poisoned(gpu, "w", (4, 3))
    run(gpu, "moe_router", consts, [gpu.upload("logits", logits), ids, w, step_uniform(gpu, 2)], grid)
    assert np.isnan(read(gpu, w, (4, 3))[2:]).all()
    assert (read(gpu, ids, (4, 3), np.uint32)[2:] == 0xFFFFFFFF).all()


def test_router_plan_validates():
    with pytest.raises(ValueError, match="top_k"):
        router_plan(4, 5, False, True, 1)
    with pytest.raises(ValueError, match="power of two"):
        router_plan(8, 2, False, True, 1, wg=48)


# ---- expert matvec -----------------------------------------------------------------------------------
def run_experts(gpu, consts, grid, x, ids, weight, y_shape, n_tokens):
    arrays = weight
    w = arrays.get("q_weight", arrays.get("weight"))
    s = arrays["q_scale"] if "q_scale" in arrays else np.full(4, np.nan, np.float16)
    y = poisoned(gpu, "y", y_shape)
    buffers = [gpu.upload("x", x), gpu.upload("ids", ids.astype(np.uint32)), gpu.upload("w", w.view(np.uint32)),
               gpu.upload("s", s), y, step_uniform(gpu, n_tokens)]
    run(gpu, "moe_matvec", consts, buffers, grid)
    return read(gpu, y, y_shape)


@pytest.mark.parametrize("fmt", ["mlx4", "mlx8", "f16"])
@pytest.mark.parametrize("gate_up", [True, False])
def test_expert_matvec(any_gpu, rng, fmt, gate_up):
    E, T, slots, K, N = 6, 3, 3, 192, 37  # N not a multiple of ROWS; 6 chunks over the workgroup
    w = random_weight(rng, (E, 2 * N if gate_up else N, K), fmt)
    ids = np.stack([rng.permutation(E)[:slots] for _ in range(T)])
    if gate_up:  # x row = token
        x = rng.standard_normal((T, K)).astype(np.float32)
        xs = x[:, None, :].repeat(slots, 1)
    else:  # x row = (token, slot), rows padded to a stride of K + 32
        xs = rng.standard_normal((T, slots, K)).astype(np.float32)
        x = np.concatenate([xs, np.zeros((T, slots, 32), np.float32)], -1)
    consts, grid = expert_plan(K, N, E, T, slots, gate_up=gate_up, x_slot=not gate_up,
                               x_stride=None if gate_up else K + 32, **format_knobs(fmt))
    out = run_experts(any_gpu, consts, grid, x, ids, w, (T, slots, N), T)
    full = np.einsum("tsk,tsnk->tsn", xs.astype(np.float64), moe_values(w)[ids])
    ref = silu(full[..., :N]) * full[..., N:] if gate_up else full
    assert_close(out, ref)


@pytest.mark.parametrize("rows,wg", [(3, 4), (8, 64)])
def test_expert_matvec_other_shapes(any_gpu, rng, rows, wg):
    # 3 rows over 4 threads: two or three chunks per thread and a partial wg_sum4; 8 rows over 64 threads:
    # most threads idle (K has 10 chunks).
    E, T, slots, K, N = 4, 2, 2, 320, 23
    w = random_weight(rng, (E, 2 * N, K), "mlx4")
    ids = np.array([[3, 1], [0, 2]])
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = expert_plan(K, N, E, T, slots, gate_up=True, rows=rows, wg=wg, **format_knobs("mlx4"))
    out = run_experts(any_gpu, consts, grid, x, ids, w, (T, slots, N), T)
    full = np.einsum("tk,tsnk->tsn", x.astype(np.float64), moe_values(w)[ids])
    assert_close(out, silu(full[..., :N]) * full[..., N:])


def test_expert_matvec_slot_range_and_stack_of_one(any_gpu, rng):
    # The shared expert run apart: slot 2 of 3 only, a stack of one expert whatever the ids say (here the
    # shared id 5 and garbage), y rows of stride 40 with N = 32: every other element stays NaN.
    T, slots, K, N = 2, 3, 64, 32
    w = random_weight(rng, (1, 2 * N, K), "mlx4")
    ids = np.array([[0, 3, 5], [4, 1, 0xFFFFFFFF]])
    x = rng.standard_normal((T, K)).astype(np.float32)
    consts, grid = expert_plan(K, N, 1, T, slots, slot0=2, n_slots=1, gate_up=True, y_stride=40,
                               **format_knobs("mlx4"))
    assert grid[1:] == (T, 1)  # tokens in y, the one slot in z
    out = run_experts(any_gpu, consts, grid, x, ids, w, (T, slots, 40), T)
    full = x.astype(np.float64) @ moe_values(w)[0].T
    assert_close(out[:, 2, :N], silu(full[:, :N]) * full[:, N:])
    assert np.isnan(out[:, :2]).all() and np.isnan(out[:, 2, N:]).all()


def test_combine(gpu, rng):
    T, slots, D = 3, 4, 24
    y = rng.standard_normal((T, slots, D)).astype(np.float32)
    w = rng.uniform(0, 1, (T, slots)).astype(np.float32)
    residual = rng.standard_normal((T, D)).astype(np.float32)
    for accumulate in (False, True):
        consts, grid = combine_plan(D, slots, T, accumulate, wg=4)
        out = gpu.upload("out", residual)
        run(gpu, "moe_combine", consts, [gpu.upload("y", y), gpu.upload("w", w), out, step_uniform(gpu, T)], grid)
        ref = np.einsum("ts,tsd->td", w.astype(np.float64), y) + (residual if accumulate else 0)
        assert_close(read(gpu, out, (T, D)), ref, 1e-6)


# ---- the whole block -----------------------------------------------------------------------------------
DIMS = dict(E=8, top_k=2, D=128, F=64)


def random_moe(rng, E, D, F, shared, shared_fmt="mlx4", routed_fmt="mlx4"):
    """MoE weights in our layouts as MlxCheckpoint.moe_weights keys them (router 8-bit like MLX's)."""
    w = {"gate": random_weight(rng, (E, D), "mlx8", 0.03),
         "switch_mlp.gate_proj": random_weight(rng, (E, F, D), routed_fmt),
         "switch_mlp.up_proj": random_weight(rng, (E, F, D), routed_fmt),
         "switch_mlp.down_proj": random_weight(rng, (E, D, F), routed_fmt, 0.03)}
    if shared:
        w |= {"shared_expert.gate_proj": random_weight(rng, (shared, D), shared_fmt),
              "shared_expert.up_proj": random_weight(rng, (shared, D), shared_fmt),
              "shared_expert.down_proj": random_weight(rng, (D, shared), shared_fmt, 0.03),
              "shared_expert_gate": random_weight(rng, (1, D), "mlx8", 0.03)}
    return w


def transformers_moe(weights, E, top_k, D, F, shared):
    """transformers' Qwen3_5MoeSparseMoeBlock (always renormalises the top-k) in float64 on the same values."""
    torch = pytest.importorskip("torch")
    from transformers.models.qwen3_5_moe.configuration_qwen3_5_moe import Qwen3_5MoeTextConfig
    from transformers.models.qwen3_5_moe.modeling_qwen3_5_moe import Qwen3_5MoeSparseMoeBlock

    cfg = Qwen3_5MoeTextConfig(hidden_size=D, moe_intermediate_size=F, shared_expert_intermediate_size=shared,
                               num_experts=E, num_experts_per_tok=top_k)
    cfg._experts_implementation = "eager"
    block = Qwen3_5MoeSparseMoeBlock(cfg).double()
    v = {k: torch.from_numpy(moe_values(w)) for k, w in weights.items()}
    with torch.no_grad():
        block.gate.weight.copy_(v["gate"])
        block.experts.gate_up_proj.copy_(torch.cat([v["switch_mlp.gate_proj"], v["switch_mlp.up_proj"]], 1))
        block.experts.down_proj.copy_(v["switch_mlp.down_proj"])
        for p in ("gate_proj", "up_proj", "down_proj"):
            getattr(block.shared_expert, p).weight.copy_(v[f"shared_expert.{p}"])
        block.shared_expert_gate.weight.copy_(v["shared_expert_gate"])
    return lambda x: block(torch.from_numpy(x.astype(np.float64))[None]).detach().numpy()[0]


def run_block(gpu, weights, x, top_k, norm=True, max_tokens=8):
    block, ws = moe_block(gpu, [weights], top_k, norm, max_tokens)
    out, dispatches = record_moe_block(gpu, block, ws, x)
    # T > 1 rows: router, top-k, the sorts and grouped GEMMs, combine
    assert dispatches == (3 + len(block.passes[0]["grouped"]) if len(x) > 1 else block.dispatches_per_token())
    return block, out


@pytest.mark.model
@pytest.mark.parametrize("T", [1, 5])
@pytest.mark.parametrize("shared", [64, 128])  # 64 = F: stacked as expert E; 128: its own dispatches
def test_moe_block_matches_transformers(any_gpu, rng, T, shared):
    E, top_k, D, F = DIMS.values()
    weights = random_moe(rng, E, D, F, shared)
    x = rng.standard_normal((T, D)).astype(np.float32)
    block, out = run_block(any_gpu, weights, x, top_k)
    assert block.stacked[0] == (shared == F) and block.dispatches_per_token() == (5 if shared == F else 7)
    assert_close(out, transformers_moe(weights, E, top_k, D, F, shared)(x))


@pytest.mark.model
def test_moe_block_shared_expert_in_another_format(gpu, rng):
    # An 8-bit shared expert cannot join the 4-bit stack: it runs apart even at the experts' size.
    E, top_k, D, F = DIMS.values()
    weights = random_moe(rng, E, D, F, F, shared_fmt="mlx8")
    x = rng.standard_normal((3, D)).astype(np.float32)
    block, out = run_block(gpu, weights, x, top_k)
    assert not block.stacked[0]
    assert_close(out, transformers_moe(weights, E, top_k, D, F, F)(x))


@pytest.mark.model
@pytest.mark.parametrize("T", [1, 4])
def test_moe_block_without_renormalisation_matches_mlx_lm(gpu, rng, T):
    # mlx-lm's Qwen3-Next/Qwen3.5 SparseMoeBlock honours norm_topk_prob (transformers' always renormalises).
    mx = pytest.importorskip("mlx.core")
    from mlx_lm.models.qwen3_5 import SparseMoeBlock, TextModelArgs

    E, top_k, D, F = 16, 4, 128, 64
    weights = random_moe(rng, E, D, F, F)
    block = SparseMoeBlock(TextModelArgs(hidden_size=D, num_experts=E, num_experts_per_tok=top_k,
                                         moe_intermediate_size=F, shared_expert_intermediate_size=F,
                                         norm_topk_prob=False))
    v = {k: mx.array(moe_values(w).astype(np.float32)) for k, w in weights.items()}
    block.gate.weight, block.shared_expert_gate.weight = v["gate"], v["shared_expert_gate"]
    for p in ("gate_proj", "up_proj", "down_proj"):
        getattr(block.switch_mlp, p).weight = v[f"switch_mlp.{p}"]
        getattr(block.shared_expert, p).weight = v[f"shared_expert.{p}"]
    x = rng.standard_normal((T, D)).astype(np.float32)
    ref = np.array(block(mx.array(x)[None]))[0]
    _, out = run_block(gpu, weights, x, top_k, norm=False)
    assert_close(out, ref, 2e-4)  # mlx-lm computes in f32 too


def reference_moe(weights, x, top_k, norm):
    """float64 numpy: softmax router, stable top-k, SwiGLU experts, optional sigmoid-gated shared expert."""
    v = {k: moe_values(w) for k, w in weights.items()}
    x = x.astype(np.float64)
    logits = x @ v["gate"].T
    p = np.exp(logits - logits.max(1, keepdims=True))
    p /= p.sum(1, keepdims=True)
    out = np.zeros_like(x)
    for t in range(len(x)):
        ids = np.argsort(-logits[t], kind="stable")[:top_k]
        w = p[t, ids] / (p[t, ids].sum() if norm else 1)
        for e, we in zip(ids, w, strict=True):
            h = silu(v["switch_mlp.gate_proj"][e] @ x[t]) * (v["switch_mlp.up_proj"][e] @ x[t])
            out[t] += we * (v["switch_mlp.down_proj"][e] @ h)
    if "shared_expert_gate" in v:
        h = silu(x @ v["shared_expert.gate_proj"].T) * (x @ v["shared_expert.up_proj"].T)
        out += 1 / (1 + np.exp(-x @ v["shared_expert_gate"].T)) * (h @ v["shared_expert.down_proj"].T)
    return out


@pytest.mark.parametrize("T", [1, 3])
def test_moe_block_without_shared_expert(any_gpu, rng, T):
    # Qwen3-MoE style: top-k experts only, slots = k.
    E, top_k, D, F = 12, 3, 128, 64
    weights = random_moe(rng, E, D, F, 0)
    x = rng.standard_normal((T, D)).astype(np.float32)
    block, out = run_block(any_gpu, weights, x, top_k, norm=False)
    assert not block.shared and block.slots == top_k and block.dispatches_per_token() == 5
    assert_close(out, reference_moe(weights, x, top_k, norm=False))


@pytest.mark.model
def test_reference_moe_agrees_with_transformers(rng):
    # The numpy reference used above is itself checked against transformers once (whose router softmax
    # runs in f32 even in a float64 model: hence not 1e-12).
    E, top_k, D, F = DIMS.values()
    weights = random_moe(rng, E, D, F, F)
    x = rng.standard_normal((3, D)).astype(np.float32)
    assert_close(reference_moe(weights, x, top_k, True), transformers_moe(weights, E, top_k, D, F, F)(x), 1e-6)


def test_two_layers_share_scratch(gpu, rng):
    # Two MoE layers of one block, recorded back to back (layer 1 reads layer 0's output): each uses its own
    # weights through the one set of scratch buffers.
    E, top_k, D, F = DIMS.values()
    w1, w2 = random_moe(rng, E, D, F, F), random_moe(rng, E, D, F, F)
    x = rng.standard_normal((3, D)).astype(np.float32)
    block, ws = moe_block(gpu, [w1, w2], top_k, max_tokens=4)
    # logits, ids, weights, act, y and the prefill sort's order and tiles: once
    assert sum(n.label.startswith("moe.") for n in block.needs()) == 7
    out, _ = record_moe_block(gpu, block, ws, x, layers=(0, 1))
    assert_close(out, reference_moe(w2, reference_moe(w1, x, top_k, True), top_k, True))


def test_moe_block_names_a_chunk_too_large_for_its_slots():
    from engine.blocks.linear import Arithmetic
    from engine.blocks.moe import MoeFfn
    from engine.errors import UnsupportedModelError

    ar = Arithmetic(int8=True, int8_prefill=True, norm_int8=True, subgroup_rows=True, subgroup_size=32)
    with pytest.raises(UnsupportedModelError, match="prefill_chunk ≤ 3855"):
        MoeFfn(128, 64, 16, 64, 64, (0,), {}, ar, 4096)  # 17 slots × 4096 rows


def test_moe_block_refuses_too_many_tokens(gpu, rng):
    E, top_k, D, F = DIMS.values()
    block, _ = moe_block(gpu, [random_moe(rng, E, D, F, 0)], top_k, max_tokens=2)
    with pytest.raises(ValueError, match="outside 1..2"):
        block.record(Recorder(gpu, "t"), 0, 3)


# ---- int8-activation experts (decode) ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["mlx4", "mlx3"])
@pytest.mark.parametrize("gate_up", [True, False])
def test_expert_matvec_int8(gpu, rng, gate_up, fmt):
    E, slots, K, N = 6, 3, 192, 37
    w = random_weight(rng, (E, 2 * N if gate_up else N, K), fmt)
    ids = rng.permutation(E)[:slots]
    if gate_up:  # one x row for every slot
        xq, xm, x_hat = quantized_rows(gpu, rng.standard_normal((1, K)).astype(np.float32))
        xs = x_hat.repeat(slots, 0)
    else:  # a row per slot, K + 32 floats apart
        xq, xm, xs = quantized_rows(gpu, rng.standard_normal((slots, K)).astype(np.float32), K + 32)
    consts, grid = expert_q8_plan(K, N, E, slots, gpu.subgroup_size, gate_up=gate_up, x_slot=not gate_up,
                                  **format_knobs(fmt))
    y = poisoned(gpu, "y", (slots, N))
    run(gpu, "moe_matvec_q8", consts, [xq, gpu.upload("ids", ids.astype(np.uint32)),
                                        gpu.upload("w", w["q_weight"].view(np.uint32)), gpu.upload("s", w["q_scale"]),
                                        y, xm], grid)
    full = np.einsum("sk,snk->sn", xs, moe_values(w)[ids])
    ref = silu(full[..., :N]) * full[..., N:] if gate_up else full
    np.testing.assert_allclose(read(gpu, y, (slots, N)), ref, rtol=0, atol=2e-5 * np.abs(ref).max())


@pytest.mark.parametrize("shared", [64, 128])  # stacked as expert E, or its own passes
def test_moe_block_int8_decode(gpu, rng, shared):
    """A decode token through the block's int8 passes (x quantized by the block itself here; in a model the norm
    writes it): close to transformers within the int8 rounding, with the quantize dispatches counted."""
    E, top_k, D, F = DIMS.values()
    weights = random_moe(rng, E, D, F, shared)
    x = rng.standard_normal((1, D)).astype(np.float32)
    f32_block, _ = moe_block(gpu, [weights], top_k, max_tokens=4)
    block, ws = moe_block(gpu, [weights], top_k, max_tokens=4, int8=True)
    got, dispatches = record_moe_block(gpu, block, ws, x)
    # one quantize for x, one for each down's slot rows
    assert dispatches == block.dispatches_per_token() == f32_block.dispatches_per_token() + (2 if shared == F else 3)
    assert "moe_matvec_q8" in [pipe.label for pipe, _, _ in block.passes[0]["decode"]]
    ref = transformers_moe(weights, E, top_k, D, F, shared)(x)
    assert np.abs(got - ref).max() <= 3e-2 * np.abs(ref).max()


def test_moe_block_int8_decode_3bit_experts(gpu, rng):
    """Qwen3.6's 3-bit build in miniature: 3-bit routed experts beside a 4-bit shared expert of the same width, stored
    after the routed stack: int8 decode runs routed and shared slots in one moe_matvec_q8 dispatch per stack (as many
    dispatches as the f32 block's separate passes: the two quantizes replace the shared expert's two), prefill binds
    the shared rows as a stack of one."""
    E, top_k, D, F = DIMS.values()
    weights = random_moe(rng, E, D, F, F, routed_fmt="mlx3")
    x = rng.standard_normal((1, D)).astype(np.float32)
    f32_block, _ = moe_block(gpu, [weights], top_k, max_tokens=4)
    block, ws = moe_block(gpu, [weights], top_k, max_tokens=4, int8=True)
    assert not block.stacked[0] and block.mixed[0] and not f32_block.mixed[0]
    got, dispatches = record_moe_block(gpu, block, ws, x)
    assert dispatches == block.dispatches_per_token() == f32_block.dispatches_per_token() == 7
    labels = [pipe.label for pipe, _, _ in block.passes[0]["decode"]]
    assert labels == ["quantize_q8", "moe_matvec_q8", "quantize_q8", "moe_matvec_q8"]
    ref = reference_moe(weights, x, top_k, True)
    assert np.abs(got - ref).max() <= 3e-2 * np.abs(ref).max()
    rows = rng.standard_normal((3, D)).astype(np.float32)  # prefill: grouped GEMMs, the shared rows bound as a view
    got, _ = record_moe_block(gpu, block, ws, rows)
    assert_close(got, reference_moe(weights, rows, top_k, True))


def test_expert_matvec_int8_3bit_stack_with_4bit_expert_after_it(gpu, rng):
    # moe_matvec_q8 with MIXED_W/MIXED_S: slots routed to 3-bit experts and the shared slot (id E) to the 4-bit rows
    # stored after the stack at 256-byte-aligned offsets; a bad id clamps to that last expert.
    E, K, N = 5, 128, 24
    routed, shared = random_weight(rng, (E, 2 * N, K), "mlx3"), random_weight(rng, (2 * N, K), "mlx4")
    wr, sr = -(-routed["q_weight"].size // 64) * 64, -(-routed["q_scale"].size // 128) * 128
    w = np.zeros(wr + shared["q_weight"].size, np.uint32)
    s = np.zeros(sr + shared["q_scale"].size, np.float16)
    w[:routed["q_weight"].size], w[wr:] = routed["q_weight"].reshape(-1), shared["q_weight"].reshape(-1)
    s[:routed["q_scale"].size], s[sr:] = routed["q_scale"].reshape(-1), shared["q_scale"].reshape(-1)
    ids = np.array([3, 0, 0xFFFFFFFF, E], np.uint32)
    xq, xm, x_hat = quantized_rows(gpu, rng.standard_normal((1, K)).astype(np.float32))
    consts, grid = expert_q8_plan(K, N, E + 1, 4, gpu.subgroup_size, gate_up=True, mixed=(wr, sr),
                                  **format_knobs("mlx3"))
    y = poisoned(gpu, "y", (4, N))
    run(gpu, "moe_matvec_q8", consts, [xq, gpu.upload("ids", ids), gpu.upload("w", w), gpu.upload("s", s), y, xm],
        grid)
    dense = np.concatenate([moe_values(routed), moe_values(shared)[None]])[[3, 0, E, E]]
    full = np.einsum("k,snk->sn", x_hat[0], dense)
    ref = silu(full[:, :N]) * full[:, N:]
    np.testing.assert_allclose(read(gpu, y, (4, N)), ref, rtol=0, atol=2e-5 * np.abs(ref).max())
    with pytest.raises(ValueError, match="3-bit stack"):
        expert_q8_plan(K, N, E + 1, 4, 32, mixed=(wr, sr), **format_knobs("mlx4"))


@pytest.mark.parametrize("routed_fmt,shared", [("mlx4", 64), ("mlx3", 64), ("mlx4", 128)])
def test_moe_block_int8_prefill(gpu, rng, routed_fmt, shared):
    """Prefill rows through the int8 grouped GEMMs (moe_gemm_q8): x quantized once, every pair's activations once
    (per down pass where their K differ), within the int8 rounding of the float64 reference. With int8_epilogues the
    gate_ups write the pairs' int8 rows themselves where every pass has one width (shared == F): no quantize of the
    activations, and the same output bit for bit (the bytes quantize_q8 writes)."""
    E, top_k, D, F = DIMS.values()
    weights = random_moe(rng, E, D, F, shared, routed_fmt=routed_fmt)
    x = rng.standard_normal((5, D)).astype(np.float32)
    outs = []
    for epilogues in (False, True):
        block, ws = moe_block(gpu, [weights], top_k, max_tokens=8, int8=True, int8_prefill=True,
                              int8_epilogues=epilogues)
        got, dispatches = record_moe_block(gpu, block, ws, x)
        labels = [pipe.label for pipe, _, _, _ in block.passes[0]["grouped"]]
        fused = epilogues and shared == F
        assert block.grouped[0]["rows_q8"] == fused
        # x; the pairs' activations (twice when the shared width differs), unless the gate_ups wrote them
        quantizes = 1 + (0 if fused else 1 if shared == F else 2)
        assert labels.count("quantize_q8") == quantizes and "moe_gemm" not in labels
        assert labels.count("moe_gemm_q8") == (2 if block.stacked[0] else 4)
        assert dispatches == 3 + len(labels)
        ref = reference_moe(weights, x, top_k, True)
        assert np.abs(got - ref).max() <= 3e-2 * np.abs(ref).max()
        outs.append(got)
        block.release()
        ws.release()
    np.testing.assert_array_equal(outs[0], outs[1])
