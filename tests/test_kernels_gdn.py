"""Qwen3.5 kernels vs float64 numpy on fresh random data: the Gated DeltaNet chain (conv + SiLU with state,
gates, L2-normed delta-rule recurrence, gated RMSNorm), the attention output gate, and the zero-centred
norm offset (NORM_OFFSET) of the shared norm kernels. The numpy recurrence is itself pinned to
transformers' torch_recurrent / torch_chunk_gated_delta_rule."""

import numpy as np
import pytest

from engine.kernels.attention import attn_gate_plan, rope_append_consts
from engine.kernels.gdn import (
    GDN_RECUR,
    GDN_RECUR_SG,
    gdn_conv_plan,
    gdn_norm_plan,
    gdn_recur_kernel,
    gdn_recur_plan,
    gdn_recur_sg_plan,
)
from tests.helpers import (
    PAGE,
    assert_q8_matches,
    assert_q8_row,
    conv_ref,
    inv_freq_for,
    poisoned,
    read,
    rope_ref,
    run,
    softplus,
    step_uniform,
)

# ---- float64 references -------------------------------------------------------------------------------


def recur_ref(qkv, gates, state, KH, VH, DK, DV, fresh):
    """transformers' recurrent gated delta rule (use_qk_l2norm_in_kernel) in float64; GVA by repeat_interleave."""
    T, key = len(qkv), KH * DK
    x = qkv.astype(np.float64)
    q = np.repeat(x[:, :key].reshape(T, KH, DK), VH // KH, axis=1)
    k = np.repeat(x[:, key:2 * key].reshape(T, KH, DK), VH // KH, axis=1)
    v = x[:, 2 * key:2 * key + VH * DV].reshape(T, VH, DV)
    q = q / np.sqrt((q * q).sum(-1, keepdims=True) + 1e-6) / np.sqrt(DK)
    k = k / np.sqrt((k * k).sum(-1, keepdims=True) + 1e-6)
    g, beta = gates[:, :VH].astype(np.float64), gates[:, VH:].astype(np.float64)
    S = np.zeros((VH, DK, DV)) if fresh else state.astype(np.float64).reshape(VH, DK, DV).copy()
    out = np.zeros((T, VH, DV))
    for t in range(T):
        S *= np.exp(g[t])[:, None, None]
        kv = np.einsum("hij,hi->hj", S, k[t])
        S += k[t][:, :, None] * ((v[t] - kv) * beta[t][:, None])[:, None, :]
        out[t] = np.einsum("hij,hi->hj", S, q[t])
    return out.reshape(T, VH * DV), S


def rms(x, eps):
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps)


def random_proj(rng, T, KH, VH, DK, DV):
    """A random conv output row [q | k | v] and gates (g ≤ 0, β in (0, 1))."""
    conv = 2 * KH * DK + VH * DV
    qkv = rng.standard_normal((T, conv)).astype(np.float32)
    g = -rng.uniform(0.0, 1.5, (T, VH)).astype(np.float32)
    beta = rng.uniform(0.0, 1.0, (T, VH)).astype(np.float32)
    return qkv, np.concatenate([g, beta], axis=1)


# ---- the numpy reference vs transformers ---------------------------------------------------------------


@pytest.mark.model
def test_reference_recurrence_matches_transformers(rng):
    import torch
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    KH, VH, DK, DV, T = 2, 4, 16, 8, 70  # 70 tokens: two of the chunked algorithm's 64-token chunks
    qkv, gates = random_proj(rng, T, KH, VH, DK, DV)
    state = 0.3 * rng.standard_normal((VH, DK, DV))
    ours, ours_state = recur_ref(qkv, gates, state, KH, VH, DK, DV, fresh=False)
    key = KH * DK
    args = [torch.from_numpy(a).double()[None] for a in (
        qkv[:, :key].reshape(T, KH, DK), qkv[:, key:2 * key].reshape(T, KH, DK),
        qkv[:, 2 * key:].reshape(T, VH, DV))]
    g, beta = (torch.from_numpy(gates[:, i * VH:(i + 1) * VH]).double()[None] for i in range(2))
    for fn in (m.torch_recurrent_gated_delta_rule, m.torch_chunk_gated_delta_rule):
        out, final = fn(*args, g=g, beta=beta, initial_state=torch.from_numpy(state)[None],
                        output_final_state=True, use_qk_l2norm_in_kernel=True)
        np.testing.assert_allclose(out[0].reshape(T, -1).numpy(), ours, rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(final[0].numpy(), ours_state, rtol=1e-4, atol=1e-5)


# ---- GDN kernels ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("CONV,PAD,KC,T,pos0", [(256, 40, 4, 5, 9), (100, 0, 4, 1, 3), (96, 8, 4, 2, 1),
                                                 (64, 4, 4, 7, 0), (70, 6, 3, 3, 5)])
def test_gdn_conv(gpu, rng, CONV, PAD, KC, T, pos0):
    ROW = CONV + PAD  # the conv channels lead a longer in_proj row
    x = rng.standard_normal((T, ROW)).astype(np.float32)
    w = rng.standard_normal((CONV, KC)).astype(np.float16)
    state = rng.standard_normal((KC - 1, CONV)).astype(np.float32)
    if pos0 == 0:
        state[:] = np.nan  # a fresh sequence must not read the state at all
    y_ref, state_ref = conv_ref(x[:, :CONV], w, state, pos0)
    consts, grid = gdn_conv_plan(CONV, ROW, KC, 1, 0, 1)
    y, st = poisoned(gpu, "y", (T, CONV)), gpu.upload("state", state)
    run(gpu, "gdn_conv", consts, [gpu.upload("x", x), gpu.upload("w", w), st, y, step_uniform(gpu, T, pos0),
                                  *one_head_gates(gpu, T)], grid)
    np.testing.assert_allclose(read(gpu, y, (T, CONV)), y_ref, rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(read(gpu, st, (KC - 1, CONV)), state_ref.astype(np.float32))


def test_gdn_conv_chunks_equal_one_pass(gpu, rng):
    CONV, KC, T = 128, 4, 9
    x = rng.standard_normal((T, CONV)).astype(np.float32)
    w = rng.standard_normal((CONV, KC)).astype(np.float16)
    consts, grid = gdn_conv_plan(CONV, CONV, KC, 1, 0, 1)
    wb = gpu.upload("w", w)

    def conv(parts):
        st, outs, pos = gpu.upload("state", np.zeros((KC - 1, CONV), np.float32)), [], 0
        for n in parts:
            y = poisoned(gpu, "y", (n, CONV))
            run(gpu, "gdn_conv", consts, [gpu.upload("x", x[pos:pos + n]), wb, st, y, step_uniform(gpu, n, pos),
                                          *one_head_gates(gpu, n)], grid)
            outs.append(read(gpu, y, (n, CONV)))
            pos += n
        return np.concatenate(outs), read(gpu, st, (KC - 1, CONV))

    whole, whole_state = conv([T])
    for parts in ([1] * T, [2, 1, 4, 2]):
        y, st = conv(parts)
        np.testing.assert_array_equal(y, whole)
        np.testing.assert_array_equal(st, whole_state)


def one_head_gates(gpu, T):
    """gdn_conv's gate bindings for tests of the conv alone (one head: a, b read from channels 0 and 1)."""
    return [gpu.upload("a_log", np.zeros(1, np.float32)), gpu.upload("dt", np.zeros(1, np.float32)),
            gpu.buffer("gates", max(8 * T, 16))]


def test_gdn_conv_gates(gpu, rng):
    """The gates gdn_conv computes beside the conv (threads h < VH)."""
    VH, T, ROW, A_OFF, B_OFF, CONV, KC = 70, 3, 200, 50, 125, 96, 4  # VH > WG: two workgroups of gate threads
    x = rng.standard_normal((T, ROW)).astype(np.float32) * 8
    x[0, A_OFF:A_OFF + 4] = [30.0, -40.0, 19.5, -12.0]  # both softplus branches, and a tiny softplus
    a_log = np.log(rng.uniform(0.01, 16, VH)).astype(np.float32)
    dt_bias = rng.standard_normal(VH).astype(np.float32)
    consts, grid = gdn_conv_plan(CONV, ROW, KC, VH, A_OFF, B_OFF)
    gates = poisoned(gpu, "gates", (T, 2 * VH))
    w = rng.standard_normal((CONV, KC)).astype(np.float16)
    bufs = [gpu.upload("x", x), gpu.upload("w", w), gpu.upload("state", np.zeros((KC - 1, CONV), np.float32)),
            gpu.buffer("y", T * CONV * 4), step_uniform(gpu, T), gpu.upload("a_log", a_log), gpu.upload("dt", dt_bias),
            gates]
    run(gpu, "gdn_conv", consts, bufs, grid)
    a = x[:, A_OFF:A_OFF + VH].astype(np.float64) + dt_bias
    g_ref = -np.exp(a_log.astype(np.float64)) * softplus(a)
    beta_ref = 1 / (1 + np.exp(-x[:, B_OFF:B_OFF + VH].astype(np.float64)))
    got = read(gpu, gates, (T, 2 * VH))
    np.testing.assert_allclose(got[:, :VH], g_ref, rtol=2e-5, atol=1e-30)
    np.testing.assert_allclose(got[:, VH:], beta_ref, rtol=2e-6, atol=1e-7)


@pytest.mark.parametrize("KH,VH,DK,DV,T,pos0,WG,RSPLIT", [
    (2, 4, 32, 32, 6, 5, 32, 1), (1, 2, 48, 24, 3, 1, 32, 4), (2, 2, 16, 72, 1, 7, 32, 2), (2, 4, 32, 32, 4, 0, 64, 4),
    (16, 32, 128, 128, 2, 3, 128, 4), (16, 32, 128, 128, 1, 9, 32, 1), (2, 4, 40, 64, 9, 2, 128, 8)])
def test_gdn_recur(any_gpu, rng, KH, VH, DK, DV, T, pos0, WG, RSPLIT):
    consts, grid = gdn_recur_plan(KH, VH, DK, DV, 2 * KH * DK + VH * DV, wg=WG, rsplit=RSPLIT)  # DV 72: partly idle
    check_recur(any_gpu, rng, "gdn_recur", consts, grid, T, pos0)


@pytest.mark.slow  # an A/B variant, not the default path: the long pass runs it
@pytest.mark.parametrize("KH,VH,DK,DV,T,pos0,WG,RSPLIT", [
    (2, 4, 32, 32, 6, 5, 64, 8), (1, 2, 48, 24, 3, 1, 8, 4), (2, 2, 16, 72, 1, 7, 32, 2), (2, 4, 32, 32, 4, 0, 64, 4),
    (16, 32, 128, 128, 2, 3, 64, 8), (16, 32, 128, 128, 1, 9, 64, 8), (2, 4, 40, 64, 9, 2, 128, 2),
    (2, 4, 64, 40, 70, 0, 8, 8)])
def test_gdn_recur_sg(gpu, rng, KH, VH, DK, DV, T, pos0, WG, RSPLIT):
    """The subgroup-shuffle kernel (RSPLIT ≤ the subgroup size; lavapipe's is 8); WG 8: at most one subgroup a
    workgroup, DV 72 and 40: partly idle workgroups, T 70: the next token's loads run ahead past many tokens."""
    if gpu.subgroup_size < RSPLIT:
        pytest.skip(f"needs subgroups of at least {RSPLIT} lanes, the adapter has {gpu.subgroup_size}")
    consts, grid = gdn_recur_sg_plan(KH, VH, DK, DV, 2 * KH * DK + VH * DV, RSPLIT, wg=WG)
    check_recur(gpu, rng, "gdn_recur_sg", consts, grid, T, pos0)


def check_recur(g, rng, shader, consts, grid, T, pos0):
    """Run a recurrence kernel on random inputs and compare output and final state with recur_ref."""
    KH, VH, DK, DV = (consts[k] for k in ("KH", "VH", "DK", "DV"))
    qkv, gates = random_proj(rng, T, KH, VH, DK, DV)
    state = (0.3 * rng.standard_normal((VH, DK, DV))).astype(np.float32)
    if pos0 == 0:
        state[:] = np.nan  # pos0 == 0 starts from a zero state whatever the buffer holds
    out_ref, state_ref = recur_ref(qkv, gates, state, KH, VH, DK, DV, fresh=pos0 == 0)
    out, st = poisoned(g, "out", (T, VH * DV)), g.upload("state", state)
    run(g, shader, consts, [g.upload("qkv", qkv), g.upload("gates", gates), st, out, step_uniform(g, T, pos0)], grid)
    scale = np.abs(out_ref).max()
    np.testing.assert_allclose(read(g, out, (T, VH * DV)), out_ref, rtol=0, atol=2e-5 * scale)
    np.testing.assert_allclose(read(g, st, (VH, DK, DV)), state_ref, rtol=0, atol=2e-5 * np.abs(state_ref).max())


@pytest.mark.parametrize("shader", ["gdn_recur", "gdn_recur_sg"])
def test_gdn_recur_chunks_equal_one_pass(gpu, rng, shader):
    """Decode steps and prefill chunks carry the state bit for bit: a rollback's replay equals the first pass."""
    KH, VH, DK, DV, T = 2, 4, 32, 32, 9
    dims = (KH, VH, DK, DV, 2 * KH * DK + VH * DV)
    consts, grid = (gdn_recur_plan(*dims) if shader == "gdn_recur" else
                    gdn_recur_sg_plan(*dims, rsplit=min(8, gpu.subgroup_size)))
    qkv, gates = random_proj(rng, T, KH, VH, DK, DV)

    def recur(parts):
        st, outs, pos = gpu.upload("state", np.zeros((VH, DK, DV), np.float32)), [], 0
        for n in parts:
            out = poisoned(gpu, "out", (n, VH * DV))
            run(gpu, shader, consts, [gpu.upload("qkv", qkv[pos:pos + n]), gpu.upload("gates", gates[pos:pos + n]),
                                      st, out, step_uniform(gpu, n, pos)], grid)
            outs.append(read(gpu, out, (n, VH * DV)))
            pos += n
        return np.concatenate(outs), read(gpu, st, (VH, DK, DV))

    whole, whole_state = recur([T])
    for parts in ([1] * T, [2, 1, 4, 2]):
        out, st = recur(parts)
        np.testing.assert_array_equal(out, whole)
        np.testing.assert_array_equal(st, whole_state)


def test_gdn_recur_kernel_choice():
    """The shuffle kernel only where a column's lanes fit one subgroup; else the workgroup-memory kernel."""
    def chosen(dk, sg):
        k, consts, _ = gdn_recur_kernel(16, 32, dk, 128, 8192, sg)
        return k, consts["RSPLIT"]

    assert chosen(128, 32) == (GDN_RECUR_SG, 8)
    assert chosen(128, 8) == (GDN_RECUR_SG, 8)
    assert chosen(128, 4) == (GDN_RECUR_SG, 4)
    assert chosen(48, 64) == (GDN_RECUR_SG, 4)  # a thread's rows come in vec4s: 4·RSPLIT divides DK
    assert chosen(40, 32) == (GDN_RECUR_SG, 2)
    assert chosen(36, 32)[0] is GDN_RECUR
    assert gdn_recur_kernel(1, 1, 32, 3, 67, 32)[0] is GDN_RECUR  # rows of 67: q/k/v are not vec4-aligned
    assert chosen(128, 0)[0] is GDN_RECUR  # no subgroups
    assert chosen(128, 2)[0] is GDN_RECUR  # 64 rows a thread: too many registers
    with pytest.raises(ValueError, match="powers of two"):
        gdn_recur_sg_plan(2, 4, 48, 32, 320, 6)
    with pytest.raises(ValueError, match="4·RSPLIT dividing DK"):
        gdn_recur_sg_plan(2, 4, 48, 32, 320, 8)


def test_gdn_recur_wrong_gva_pairing_would_show(rng):
    """repeat_interleave (h // group) and tile (h % group) differ, so the kernel test above pins the pairing."""
    KH, VH, DK, DV, T = 2, 4, 8, 8, 3
    qkv, gates = random_proj(rng, T, KH, VH, DK, DV)
    ref, _ = recur_ref(qkv, gates, None, KH, VH, DK, DV, fresh=True)
    key = KH * DK
    swapped = qkv.copy()
    for part in (0, key):  # swap the two k-heads' q and k: with tile pairing the output would match
        a = swapped[:, part:part + DK].copy()
        swapped[:, part:part + DK] = swapped[:, part + DK:part + 2 * DK]
        swapped[:, part + DK:part + 2 * DK] = a
    assert not np.allclose(recur_ref(swapped, gates, None, KH, VH, DK, DV, fresh=True)[0], ref)


@pytest.mark.parametrize("VH,DV,T,q8", [(4, 32, 3, True), (3, 128, 2, False), (2, 48, 1, False), (3, 128, 1, True),
                                        (5, 64, 1, False)])
def test_gdn_norm_out(any_gpu, rng, VH, DV, T, q8):
    """With rows_q8 each token's row also goes to int8, as quantize_q8 defines it (a decode token's row, a prefill
    chunk's rows); without, the int8 buffers stay untouched."""
    g, eps, Z_OFF, ROW = any_gpu, 1e-6, 20, 20 + VH * DV + 9
    x = rng.standard_normal((T, VH * DV)).astype(np.float32) * 3
    zsrc = rng.standard_normal((T, ROW)).astype(np.float32) * 2
    w = rng.uniform(0.5, 1.5, DV).astype(np.float16)
    y = poisoned(g, "y", (T, VH * DV))
    chunks = max(VH * DV // 32, 1)
    xq, xm = poisoned(g, "xq", (T, chunks * 8), np.uint32), poisoned(g, "xm", (T, chunks, 2))
    bufs = [g.upload("x", x), g.upload("z", zsrc), g.upload("w", w), y, step_uniform(g, T), xq, xm]
    run(g, "gdn_norm_out", gdn_norm_plan(VH, DV, eps, ROW, Z_OFF, rows_q8=q8, rows_f32=True), bufs, (VH, T))
    z = zsrc[:, Z_OFF:Z_OFF + VH * DV].astype(np.float64).reshape(T, VH, DV)
    ref = w.astype(np.float64) * rms(x.astype(np.float64).reshape(T, VH, DV), eps) * z / (1 + np.exp(-z))
    got = read(g, y, (T, VH * DV))
    np.testing.assert_allclose(got, ref.reshape(T, -1), rtol=1e-5, atol=1e-6)
    if not q8:
        assert_q8_row(g, xq, xm, None)
        return
    codes, meta = read(g, xq, (T, chunks * 8), np.uint32), read(g, xm, (T, chunks, 2))
    for t in range(T):
        assert_q8_matches(codes[t], meta[t], got[t])


@pytest.mark.parametrize("N,T", [(4096, 1), (300, 4)])
def test_attn_gate(gpu, rng, N, T):
    x = rng.standard_normal((T, N)).astype(np.float32)
    gate = (rng.standard_normal((T, N)) * 6).astype(np.float32)
    gate[0, :2] = [-200.0, 200.0]
    consts, groups = attn_gate_plan(N)
    y = poisoned(gpu, "y", (T, N))
    xq, xm = poisoned(gpu, "xq", (8,), np.uint32), poisoned(gpu, "xm", (1, 2))
    run(gpu, "attn_gate", consts, [gpu.upload("x", x), gpu.upload("gate", gate), y, step_uniform(gpu, T), xq, xm],
        (groups, T))
    ref = x.astype(np.float64) / (1 + np.exp(-gate.astype(np.float64)))
    np.testing.assert_allclose(read(gpu, y, (T, N)), ref, rtol=1e-6, atol=1e-7)
    assert_q8_row(gpu, xq, xm, None)  # f32 rows only (rows_q8: tests/test_kernels_rows_q8.py)


# ---- NORM_OFFSET: zero-centred norms through the shared kernels --------------------------------------------


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norms_with_offset(any_gpu, rng, offset):
    g, D, T, eps = any_gpu, 96, 3, 1e-6
    r_in, delta = (rng.standard_normal((T, D)).astype(np.float32) for _ in range(2))
    w = rng.uniform(-0.5, 0.5, D).astype(np.float16)  # zero-centred weights
    consts = dict(WG=64, D=D, EPS=eps, Q8=True, NORM_OFFSET=offset)
    y = poisoned(g, "y", (T, D))
    q8 = [g.buffer("xq", D // 4), g.buffer("xm", D // 32 * 8)]
    run(g, "rms_norm", consts, [g.upload("x", r_in), g.upload("w", w), y, step_uniform(g, T), *q8], (T,))
    ref = rms(r_in.astype(np.float64), eps) * (w.astype(np.float64) + offset)
    np.testing.assert_allclose(read(g, y, (T, D)), ref, rtol=1e-5, atol=1e-6)
    r_out, y = poisoned(g, "r_out", (T, D)), poisoned(g, "y2", (T, D))
    bufs = [g.upload("r", r_in), g.upload("d", delta), g.upload("w", w), r_out, y, step_uniform(g, T), *q8]
    run(g, "add_rms_norm", consts, bufs, (T,))
    s = r_in.astype(np.float64) + delta
    np.testing.assert_allclose(read(g, y, (T, D)), rms(s, eps) * (w.astype(np.float64) + offset), rtol=1e-5,
                               atol=1e-6)


def test_rope_append_zero_centred_qk_norm_and_partial_rotary(any_gpu, rng):
    """Qwen3.5's attention front: per-head q/k norm x̂·(1 + w), then RoPE on the first ROT = HD/4 dims only."""
    g, H, KVH, HD, ROT, T, pos0, eps = any_gpu, 4, 2, 32, 8, 3, 5, 1e-6
    qkv = rng.standard_normal((T, (H + 2 * KVH) * HD)).astype(np.float32)
    qn, kn = (rng.uniform(-0.5, 0.5, HD).astype(np.float16) for _ in range(2))
    inv = inv_freq_for(ROT, 1e7)
    n_pages = -(-(pos0 + T) // PAGE)
    q_out = poisoned(g, "q", (T, H * HD))
    kc, vc = (g.upload(n, np.zeros((n_pages, KVH, PAGE, HD), np.float16)) for n in ("k", "v"))
    bufs = [g.upload("qkv", qkv), q_out, kc, vc, g.upload("pt", np.arange(n_pages, dtype=np.uint32)),
            g.upload("inv", inv), step_uniform(g, T, pos0), g.upload("qn", qn), g.upload("kn", kn)]
    consts = rope_append_consts(H, KVH, HD, ROT, PAGE, True, eps, norm_offset=1.0)
    run(g, "rope_append", consts, bufs, (T, H + 2 * KVH))
    heads = qkv.astype(np.float64).reshape(T, H + 2 * KVH, HD)
    pos = np.arange(pos0, pos0 + T)
    q_ref = rope_ref(rms(heads[:, :H], eps) * (1 + qn.astype(np.float64)), pos, inv, ROT, f32_angle=True)
    k_ref = rope_ref(rms(heads[:, H:H + KVH], eps) * (1 + kn.astype(np.float64)), pos, inv, ROT, f32_angle=True)
    np.testing.assert_allclose(read(g, q_out, (T, H, HD)), q_ref, rtol=1e-4, atol=1e-4)
    k_cache = read(g, kc, (n_pages, KVH, PAGE, HD), np.float16).astype(np.float64)
    got_k = np.stack([k_cache[p // PAGE, :, p % PAGE] for p in pos])
    np.testing.assert_allclose(got_k, k_ref, rtol=2e-3, atol=2e-3)


@pytest.mark.model
def test_partial_rotary_reference_matches_transformers(rng):
    """Our RoPE convention (rotate-half on the first ROT dims, pairs (i, i + ROT/2), the rest passed
    through) and inverse frequencies are transformers' Qwen3.5 partial rotary (text positions)."""
    import torch
    from transformers import Qwen3_5TextConfig
    from transformers.models.qwen3_5 import modeling_qwen3_5 as m

    from engine.models.base import rope_inv_freq
    cfg = Qwen3_5TextConfig(head_dim=256, num_attention_heads=2, num_key_value_heads=1, hidden_size=64,
                            rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
    rotary = m.Qwen3_5TextRotaryEmbedding(cfg)
    pos = torch.tensor([[0, 1, 7, 300, 4095]])
    cos, sin = rotary(torch.zeros(1), pos)
    x = torch.from_numpy(rng.standard_normal((1, 2, 5, 256)).astype(np.float32))
    ref, _ = m.apply_rotary_pos_emb(x, x, cos, sin)
    inv, rot = rope_inv_freq(256, 1e7, 0.25)
    assert rot == 64  # torch's scalar ** tensor and numpy's float32 power may differ in the last bit
    np.testing.assert_allclose(inv, rotary.inv_freq.numpy(), rtol=3e-7, atol=0)
    # The rotation itself, with transformers' own table (a last-bit difference grows with the position).
    ours = rope_ref(x[0].numpy().transpose(1, 0, 2), pos[0].numpy(), rotary.inv_freq.numpy(), rot, f32_angle=True)
    np.testing.assert_allclose(ours.transpose(1, 0, 2), ref[0].numpy(), rtol=1e-5, atol=1e-5)
