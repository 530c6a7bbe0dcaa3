"""Whole-model checks: tiny random Phi3/Llama/Qwen3ForCausalLM → `zerotvm convert` → our logits vs transformers.

The reference runs transformers in float32 with the dequantized q4f16_1 weights, so the only
differences left are ours: kernel arithmetic, f16 KV cache, RoPE, paging, chunking.
"""

import numpy as np
import pytest

from engine.cli import main as cli_main
from engine.formats.q4f16_1 import dequantize_q4f16_1, quantize_q4f16_1
from engine.model import load_model
from tests.helpers import (
    DECODE_TOL,
    assert_greedy_decode_is_teacher_forced_argmax,
    cached_tiny_hf,
    compare,
    compare_int8,
    uses_q8,
    uses_q8_prefill,
)

pytestmark = pytest.mark.model
torch = pytest.importorskip("torch", reason="the model tests compare with transformers on torch (the test extra)")

CONFIGS = {
    "phi3": ("phi3", dict(vocab_size=250)),  # vocab not a multiple of 32
    "phi3-gqa": ("phi3", dict(vocab_size=320, num_key_value_heads=2, hidden_size=128, num_attention_heads=4,
                              intermediate_size=160)),
    "llama": ("llama", dict(vocab_size=300, rope_theta=500000.0)),
    "qwen3": ("qwen3", dict(vocab_size=290)),  # tied embeddings, q/k norms, head_dim 16 ≠ hidden/heads
}


def reference_model(hf_dir, mlc):
    """transformers model whose weights are our dequantized ones (norms as stored: f16; the tiny
    models' norms are random but f16-exact, so a norm wired to the wrong place shows up)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    state = model.state_dict()
    for name, p in state.items():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(p.half().float())
        elif p.ndim == 2:  # quantize exactly as the converter does, then use the dequantized values
            qw, qs = quantize_q4f16_1(p.numpy())
            p.copy_(torch.from_numpy(dequantize_q4f16_1(qw, qs)))
    return model


@pytest.fixture(scope="module", params=list(CONFIGS))
def tiny(request, tmp_path_factory):
    model_type, overrides = CONFIGS[request.param]
    hf_dir = cached_tiny_hf(model_type, **overrides)
    out = tmp_path_factory.mktemp(request.param) / "mlc"
    assert cli_main(["convert", str(hf_dir), str(out), "--format", "q4f16_1"]) == 0
    return hf_dir, out


@pytest.mark.parametrize("q8", [False, True], ids=["f32-x", "int8-x"])
def test_logits_match_transformers_at_every_position(gpu, tiny, q8):
    hf_dir, mlc = tiny
    # These tiny models are below Q8_PREFILL_MIN_DIM: int8 prefill is asked for explicitly.
    model = load_model(mlc, gpu=gpu, max_context=256, prefill_chunk=64, q8_decode=q8, q8_prefill=q8)
    assert uses_q8_prefill(model.runtime) == q8
    # With int8 prefill the norms write hidden's rows in int8: the GEMMs reading hidden record no quantize_q8; nor
    # does down (gate_up writes its rows in int8) or o where the tiled attention writes its rows (head_dim 32 only).
    rt = model.runtime
    def steps(block, layer, m):
        return [what for _, _, what in block.lin[layer][m].prefill_steps]

    assert rt.ws.hidden_rows_q8 == q8
    o_quantized = q8 and rt.spec.head_dim % 32 != 0
    for i in (0, 1):
        mixer, ffn = rt.plan.mixer_of[i], rt.plan.ffn_of[i]
        assert steps(mixer, i, "qkv") == steps(ffn, i, "gate_up") == steps(ffn, i, "down") == ["gemm"]
        assert steps(mixer, i, "o") == (["quantize", "gemm"] if o_quantized else ["gemm"])
    ref_model = reference_model(hf_dir, mlc)
    ids = np.random.default_rng(0).integers(0, model.runtime.spec.vocab, 150)
    ours = model.logits(ids)  # 150 tokens span ~10 KV pages and 3 prefill chunks
    with torch.no_grad():
        ref = ref_model(torch.tensor(ids[None])).logits[0].numpy()
    compare_int8(ours, ref) if q8 else compare(ours, ref)


@pytest.mark.slow
@pytest.mark.parametrize("variant", ["serial", "batched", "lanes"])
@pytest.mark.parametrize("q8", [False, True], ids=["f32-x", "int8-x"])
def test_decode_equals_full_forward_and_chunking(gpu, tiny, q8, variant):
    _, mlc = tiny
    # single_pass_keys=48: decode attention is one fused dispatch up to 48 keys, then split-K partitions of 48.
    model = load_model(mlc, gpu=gpu, max_context=320, prefill_chunk=64,
                       split_keys=48, single_pass_keys=48, q8_decode=q8, decode_attention=variant)
    assert uses_q8(model.runtime) == q8
    rt = model.runtime
    ids = np.random.default_rng(1).integers(0, rt.spec.vocab, 160)
    full = model.logits(ids)
    rt.reset()
    per_token = rt.logits(ids, chunk=1)  # the decode kernels: matvecs, RoPE + append of one row, split-K
    rt.reset()
    odd_chunks = rt.logits(ids, chunk=7)
    scale = np.abs(full).max()
    assert np.abs(per_token - full).max() / scale < DECODE_TOL[q8]
    assert np.abs(odd_chunks - full).max() / scale < 5e-3  # chunks of 7 run the GEMMs, as the full forward does


@pytest.mark.slow  # every tiny architecture, twice
@pytest.mark.parametrize("q8_prefill", [False, True], ids=["f32-prefill", "int8-prefill"])
def test_int8_prefill_rounds_as_int8_decode(gpu, tiny, q8_prefill):
    """matmul_q8w (prefill) and matvec_q8 (decode) both round every 4-bit matrix input to int8. They are not
    compared with each other: their f32 parts sum in different orders, a code near a rounding boundary can land
    one step apart, and a random tiny model amplifies that (0.8–3% of max|logit| on an H200, 0 on lavapipe). Each
    is compared with the f32 arithmetic instead: within the int8 tolerance and, int8 rounding being far coarser
    than f32's, more than 1e-3 away. With q8_prefill=False the prefill is the f32 arithmetic itself."""
    _, mlc = tiny
    model = load_model(mlc, gpu=gpu, max_context=320, prefill_chunk=64, split_keys=320, q8_prefill=q8_prefill)
    rt = model.runtime
    assert uses_q8(rt) and uses_q8_prefill(rt) == q8_prefill
    exact = load_model(mlc, gpu=gpu, max_context=320, prefill_chunk=64, split_keys=320, q8_decode=False)
    assert not uses_q8(exact.runtime) and not uses_q8_prefill(exact.runtime)
    ids = np.random.default_rng(1).integers(0, rt.spec.vocab, 160)
    ref = exact.logits(ids)
    full = model.logits(ids)
    rt.reset()
    per_token = rt.logits(ids, chunk=1)
    scale = np.abs(ref).max()
    assert 1e-3 < np.abs(per_token - ref).max() / scale < DECODE_TOL[True]
    if q8_prefill:
        assert 1e-3 < np.abs(full - ref).max() / scale < DECODE_TOL[True]
    else:  # the f32 prefill kernels (built with other options, so compiled apart): f32 rounding only
        assert np.abs(full - ref).max() / scale < DECODE_TOL[False]


def test_int8_prefill_epilogues_keep_the_logits(gpu, tiny):
    """With int8 prefill GEMMs the kernels before two of them write their int8 rows themselves (RuntimeOptions
    q8_epilogues): the gate_up GEMM down's, and the tiled attention o's where head_dim is a multiple of 32 (phi3-gqa's
    32, not the others' 16). They write the bytes quantize_q8 would (tests/test_kernels_rows_q8.py), so the prefill
    logits are the same bit for bit, over chunks full and partial, with those quantize_q8 dispatches gone."""
    _, mlc = tiny
    opts = dict(gpu=gpu, max_context=320, prefill_chunk=64, q8_prefill=True)
    on, off = load_model(mlc, **opts), load_model(mlc, q8_epilogues=False, **opts)
    s = on.runtime.spec
    quantizes = lambda m: m.runtime.dispatched_kernels(64).count("quantize_q8")  # noqa: E731
    assert quantizes(off) - quantizes(on) == s.n_layers * (1 + (s.head_dim % 32 == 0))
    ids = np.random.default_rng(2).integers(0, s.vocab, 150)  # chunks of 64, 64 and 22 rows
    np.testing.assert_array_equal(on.logits(ids), off.logits(ids))


def test_int8_decode_quantizes_only_the_rows_no_kernel_wrote(gpu, tiny):
    """The kernels before the int8 matvecs write their int8 rows: the first and final norms; o and down the next
    norm's row without 1/rms (matvec_q8_norm, which also adds the residual: no add + norm dispatch in between), read by
    qkv and gate_up (matvec_q8_rms); the one-dispatch decode attention o's where head_dim is a multiple of 32 (these
    tiny models' 16 is not). So an int8 decode token adds a quantize_q8 before down (gate_up_q8, which folds it into
    gate_up, is off by default: test below) and before such an o, and runs one add + norm (the final one) where the
    f32 token runs two a layer."""
    _, mlc = tiny
    int8 = load_model(mlc, gpu=gpu, max_context=64).runtime
    f32 = load_model(mlc, gpu=gpu, max_context=64, q8_decode=False).runtime
    n_layers, s = int8.spec.n_layers, int8.spec
    o_quantized = n_layers * (s.head_dim % 32 != 0)
    kernels = int8.dispatched_kernels()
    assert kernels.count("quantize_q8") == n_layers + o_quantized and kernels.count("add_rms_norm") == 1
    assert kernels.count("matvec_q8_rms") == kernels.count("matvec_q8_norm") == 2 * n_layers - 1
    assert "matvec_q8_rms_q8" not in kernels
    assert kernels.count("matvec_q8") == 3  # layer 0's qkv (after the first norm), the last down, the LM head
    assert kernels.count("attention_decode") == n_layers and "rope_append" not in kernels
    assert int8.dispatches_per_token == f32.dispatches_per_token - (2 * n_layers - 1) + n_layers + o_quantized \
        == len(kernels)
    assert "quantize_q8" not in f32.dispatched_kernels() and "matvec_q8" not in f32.dispatched_kernels()


@pytest.mark.slow  # an A/B variant, not the default path: the long pass runs it
def test_gate_up_int8_row_leaves_the_decode_logits_bit_for_bit(gpu, tiny):
    """gate_up writing down's int8 row itself (matvec_q8_rms_q8, gate_up_q8=True: an A/B, slower on the H200) against
    the quantize_q8 dispatch it replaces (the default): one dispatch a layer fewer and the same decode logits to the
    bit (the same f32 sums, and the int8 row quantize_q8 would write; tests/test_kernels_q8_norm.py checks each
    kernel)."""
    _, mlc = tiny
    fused = load_model(mlc, gpu=gpu, max_context=96, gate_up_q8=True).runtime
    apart = load_model(mlc, gpu=gpu, max_context=96).runtime
    n_layers = fused.spec.n_layers
    assert apart.dispatched_kernels().count("matvec_q8_rms_q8") == 0
    assert apart.dispatches_per_token == fused.dispatches_per_token + n_layers
    ids = np.random.default_rng(5).integers(0, fused.spec.vocab, 70)
    np.testing.assert_array_equal(fused.logits(ids, chunk=1), apart.logits(ids, chunk=1))
    fused.reset()
    apart.reset()
    np.testing.assert_array_equal(fused.logits(ids), apart.logits(ids))  # prefill: the same GEMMs either way


@pytest.mark.slow  # every tiny architecture, four loads
@pytest.mark.parametrize("variant", ["serial", "batched", "lanes"])
@pytest.mark.parametrize("q8", [False, True], ids=["f32-x", "int8-x"])
def test_fused_split_decode_matches_the_split_k_kernels(gpu, tiny, q8, variant):
    """Split-K decode in one dispatch a layer (fused_split_decode: attention_decode_split) against rope_append + split
    attention + combine, past single_pass_keys = 16 (up to 7 splits of 16 keys): per-token logits equal to f32
    rounding, not bit for bit (the partials sum their keys in another order and block size; the combine's order over
    splits is the same), and the decode still equal to the full forward."""
    _, mlc = tiny
    ids = np.random.default_rng(6).integers(0, 250, 110)
    runs = {}
    for fused in (False, True):
        model = load_model(mlc, gpu=gpu, max_context=128, prefill_chunk=64, split_keys=16, single_pass_keys=16,
                           q8_decode=q8, fused_split_decode=fused, decode_attention=variant)
        rt = model.runtime
        kernels = [item[0].label for item in rt.decode_plan(7).items]
        assert kernels.count("attention_decode_split") == (rt.spec.n_layers if fused else 0)
        assert ("rope_append" in kernels) == (not fused)
        assert len(kernels) == rt.dispatches_per_token + (0 if fused else 2 * rt.spec.n_layers)
        runs[fused] = rt.logits(ids, chunk=1)
        if fused:
            rt.reset()
            full = rt.logits(ids)
    scale = np.abs(full).max()
    # f32: the attention outputs differ by a few f32 ulps (measured ≤ 1e-6 of the largest logit, 0 for head_dim 16);
    # int8: such a difference may also move one int8 code of o's input by one step
    assert np.abs(runs[True] - runs[False]).max() / scale < (DECODE_TOL[False] if q8 else 1e-4)
    assert np.abs(runs[True] - full).max() / scale < DECODE_TOL[q8]


@pytest.mark.parametrize("q8", [False, True], ids=["f32-x", "int8-x"])
def test_gpu_resident_greedy_decode_matches_teacher_forced_argmax(gpu, tiny, q8):
    _, mlc = tiny
    model = load_model(mlc, gpu=gpu, max_context=256, prefill_chunk=32, q8_decode=q8)
    assert uses_q8(model.runtime) == q8
    assert_greedy_decode_is_teacher_forced_argmax(model, 40, 1)


def test_cli_logits_writes_npy(gpu, tiny, tmp_path):
    _, mlc = tiny
    out = tmp_path / "l.npy"
    assert cli_main(["logits", str(mlc), "--ids", "1,2,3", "--out", str(out)]) == 0
    logits = np.load(out)
    assert logits.shape[0] == 3 and logits.dtype == np.float32


def test_mlc_qwen3_builds_naming_qkv_either_way_load_the_same(gpu, tmp_path):
    out = tmp_path / "qwen3"
    assert cli_main(["convert", str(cached_tiny_hf("qwen3")), str(out)]) == 0
    ids = [3, 4, 5, 6, 7]
    c_attn = load_model(out, gpu=gpu, max_context=64).logits(ids)
    manifest = next(p for p in (out / "ndarray-cache.json", out / "tensor-cache.json") if p.exists())
    manifest.write_text(manifest.read_text().replace(".self_attn.c_attn.", ".self_attn.qkv_proj."))
    np.testing.assert_array_equal(load_model(out, gpu=gpu, max_context=64).logits(ids), c_attn)


@pytest.mark.parametrize("model_type", ["qwen3", "phi3"])  # tied embedding (one table, two uses) and untied
def test_vocabulary_matrices_split_across_bindings(gpu, tmp_path, monkeypatch, model_type):
    """An embedding / LM head bigger than one storage binding (Qwen3-4B's is 194 MB; some GPUs bind 128 MiB) is
    bound in row parts: logits, decode and sampling equal the single-binding run."""
    out = tmp_path / model_type
    assert cli_main(["convert", str(cached_tiny_hf(model_type)), str(out)]) == 0
    ids = np.random.default_rng(4).integers(0, 288, 24).tolist()
    assert max(ids) >= 256  # some tokens live in the second part of the table
    whole = load_model(out, gpu=gpu, max_context=64)
    assert whole.runtime.vocab.lm_decode[0][0].label == "matvec_q8"  # the parts below: int8-activation matvecs
    ref = whole.logits(ids)
    ref_tokens = [r.token for r in whole.generate(ids[:5], max_tokens=8)]
    whole.runtime.reset()
    ref_per_token = whole.runtime.logits(ids, chunk=1)
    monkeypatch.setattr(gpu, "max_binding", 8192)  # 256-row parts of the 64-wide q4 tables (K/2 = 32 B per row)
    split = load_model(out, gpu=gpu, max_context=64, prefill_chunk=8)
    assert len(split.runtime.vocab.embed_parts) == 2 and len(split.runtime.vocab.lm_decode) == 2
    got = split.logits(ids)
    np.testing.assert_allclose(got, ref, rtol=0, atol=2e-3 * np.abs(ref).max())
    split.runtime.reset()
    assert [r.token for r in split.generate(ids[:5], max_tokens=8)] == ref_tokens
    split.runtime.reset()
    per_token = split.runtime.logits(ids, chunk=1)
    np.testing.assert_allclose(per_token, ref_per_token, rtol=0, atol=2e-3 * np.abs(ref).max())


class Cancelled(Exception):
    pass


def test_a_load_cancelled_from_its_progress_callback_stops_there(gpu, tiny):
    """The loader's progress callback is the cancel point: its exception ends the load (no model, the device
    still usable for the next one)."""
    _, mlc = tiny
    calls = []

    def cancel(*args):
        calls.append(args)
        raise Cancelled

    with pytest.raises(Cancelled):
        load_model(mlc, gpu=gpu, max_context=64, on_progress=cancel)
    assert len(calls) == 1
    assert load_model(mlc, gpu=gpu, max_context=64).logits([1, 2, 3]).shape[0] == 3


def test_prefill_reports_each_chunk_and_stops_where_its_callback_raises(gpu, tiny):
    _, mlc = tiny
    model = load_model(mlc, gpu=gpu, max_context=256, prefill_chunk=32)
    rt, ids = model.runtime, list(range(3, 103))
    seen = []
    rt.reset()
    rt.prefill(ids, on_chunk=lambda done, total: seen.append((done, total)))
    assert seen == [(32, 100), (64, 100), (96, 100), (100, 100)]

    def stop_after_two(done, total):
        if done == 64:
            raise Cancelled

    rt.reset()
    with pytest.raises(Cancelled):
        rt.prefill(ids, on_chunk=stop_after_two)
    assert rt.n_cached == 64 and rt.cached_ids == ids[:64]  # the cache holds the chunks done
    resumed = rt.logits(ids[64:])  # and goes on from there
    fresh = model.logits(ids)
    np.testing.assert_allclose(resumed, fresh[64:], rtol=0, atol=1e-5 * np.abs(fresh).max())


def test_split_k_norm_matvecs_keep_the_int8_decode(gpu, tiny):
    """o and down split along K (norm_matvec_splits=3: matvec_q8_norm_split, 3 workgroups a chunk, or one a block of
    K where it has fewer; the last of a chunk sums the partials) in place of every matvec_q8_norm: per-token decode
    logits equal to the unsplit decode's to f32 rounding, not bit for bit (each output sums its K in another
    order, which may also move an int8 code of the next norm's row by one step), and still equal to the full
    forward to the int8 decode tolerance."""
    _, mlc = tiny
    ids = np.random.default_rng(7).integers(0, 250, 80)
    runs = {}
    for splits in (1, 3):
        rt = load_model(mlc, gpu=gpu, max_context=96, prefill_chunk=32, norm_matvec_splits=splits).runtime
        kernels = rt.dispatched_kernels()
        carried = 2 * rt.spec.n_layers - 1  # every o and down but the last (K ≥ 64 here: at least 2 splits each)
        assert kernels.count("matvec_q8_norm_split") == (carried if splits > 1 else 0)
        assert kernels.count("matvec_q8_norm") == (0 if splits > 1 else carried)
        runs[splits] = rt.logits(ids, chunk=1)
    rt.reset()
    full = rt.logits(ids)
    scale = np.abs(full).max()
    assert np.abs(runs[3] - runs[1]).max() / scale < DECODE_TOL[False]
    assert np.abs(runs[3] - full).max() / scale < DECODE_TOL[True]
