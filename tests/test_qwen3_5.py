"""Qwen3.5 hybrid end to end: tiny random Qwen3_5ForCausalLM → `zerotvm convert` → the runtime vs
transformers (on the dequantized weights), decode vs full forward, chunking, multi-turn reuse and rollback
through the recurrent-state snapshots, and clear errors for bad checkpoints."""

import json
import shutil

import numpy as np
import pytest

from engine.cancel import Cancelled, CancelToken
from engine.cli import main as cli_main
from engine.convert import _bf16_bytes, convert_hf_to_mlc
from engine.errors import ModelFormatError, UnsupportedModelError, ZeroTVMError
from engine.formats.mlc import MlcCheckpoint
from engine.formats.q4f16_1 import dequantize_q4f16_1, quantize_q4f16_1
from engine.model import load_model
from engine.models import model_module
from engine.runtime_options import RuntimeOptions
from engine.sampling import SamplingParams
from engine.transformer import Transformer, expected_tensors
from tests.helpers import (
    DECODE_TOL,
    INT8_GEMMS,
    assert_greedy_decode_is_teacher_forced_argmax,
    assert_int8_decode_steps_match_the_full_forward,
    assert_recorded_count,
    cached_tiny_hf,
    compare,
    tokens_of,
)

pytestmark = pytest.mark.model
torch = pytest.importorskip("torch", reason="the model tests compare with transformers on torch (the test extra)")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = cached_tiny_hf("qwen3_5")
    out = tmp_path_factory.mktemp("qwen3_5") / "mlc"
    assert cli_main(["convert", str(hf), str(out), "--format", "q4f16_1"]) == 0
    return hf, out


@pytest.fixture(scope="module")
def model(gpu, tiny):
    # decode attention: one fused dispatch up to 48 keys, split-K past them; chunk 32: prompts span several chunks.
    # f32 activations: the reuse/rollback tests compare decode with prefill to f32 rounding (the int8 default is
    # tested by test_int8_decode below).
    return load_model(tiny[1], gpu=gpu, max_context=320, prefill_chunk=32,
                      split_keys=48, single_pass_keys=48, q8_decode=False)


def reference_model(hf_dir):
    """transformers on exactly the stored weights: q4f16_1-dequantized matrices, zero-centred norms as
    f16(1 + w) − 1 (the converter bakes the +1), the gated norm and conv kernel f16, A_log / dt_bias bf16."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for name, p in model.state_dict().items():
        a = p.numpy().astype(np.float32)
        if name.endswith((".A_log", ".dt_bias")):
            a = (_bf16_bytes(a).astype(np.uint32) << 16).view(np.float32)
        elif name.endswith("linear_attn.norm.weight") or a.ndim == 3:
            a = a.astype(np.float16).astype(np.float32)
        elif a.ndim == 1:
            a = (a + 1).astype(np.float16).astype(np.float32) - 1
        else:
            a = dequantize_q4f16_1(*quantize_q4f16_1(a))
        p.copy_(torch.from_numpy(np.ascontiguousarray(a)))
    return model


# ---- numerics -------------------------------------------------------------------------------------------


def test_logits_match_transformers_at_every_position(model, tiny):
    ids = np.random.default_rng(0).integers(0, model.runtime.spec.vocab, 150)
    ours = model.logits(ids)  # 150 tokens: 5 prefill chunks, 10 KV pages, GDN state carried across chunks
    with torch.no_grad():
        ref = reference_model(tiny[0])(torch.tensor(ids[None])).logits[0].numpy()
    compare(ours, ref)
    recur = {b.p_recur.label for b in model.runtime.blocks if b.name == "gated_deltanet"}
    assert recur == {"gdn_recur"}  # the kernel compared (the shuffle kernel is an A/B only: bench/gdn_subgroups.py)


def test_conv_runs_leave_the_logits_bit_for_bit(gpu, tiny, model):
    """A prefill chunk's conv split into runs (2 at chunk 32; 8) computes what one thread per channel does: the
    same logits bit for bit over prefill chunks of 32 and 7 tokens, the state carried across them."""
    ids = np.random.default_rng(3).integers(0, model.runtime.spec.vocab, 71)
    gdn = [b for b in model.runtime.blocks if b.name == "gated_deltanet"]
    assert [b.conv_runs for b in gdn] == [2] and gdn[0].p_conv_runs is not gdn[0].p_conv
    ref = model.logits(ids)
    for runs in (1, 8):
        other = load_model(tiny[1], gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48, single_pass_keys=48,
                           q8_decode=False, gdn_conv_runs=runs)
        np.testing.assert_array_equal(other.logits(ids), ref)


def test_untied_lm_head(gpu, tmp_path):
    hf = cached_tiny_hf("qwen3_5", seed=1, tie_word_embeddings=False)
    assert cli_main(["convert", str(hf), str(tmp_path / "mlc")]) == 0
    # f32 activations: this compares with transformers' arithmetic (int8 ones move this model's logits ~5%)
    model = load_model(tmp_path / "mlc", gpu=gpu, max_context=64, prefill_chunk=16, q8_decode=False)
    assert "lm_head.q_weight" in model.runtime.spec.names.values()
    ids = np.random.default_rng(2).integers(0, model.runtime.spec.vocab, 24)
    with torch.no_grad():
        ref = reference_model(hf)(torch.tensor(ids[None])).logits[0].numpy()
    compare(model.logits(ids), ref)


@pytest.mark.slow
def test_chunked_prefill_equals_per_token(model):
    rt = model.runtime
    ids = np.random.default_rng(1).integers(0, rt.spec.vocab, 90)
    full = model.logits(ids)
    rt.reset()
    per_token = rt.logits(ids, chunk=1)  # decode kernels: matvecs, split-K attention past 48 keys
    rt.reset()
    odd = rt.logits(ids, chunk=7)
    scale = np.abs(full).max()
    assert np.abs(per_token - full).max() / scale < 5e-3
    assert np.abs(odd - full).max() / scale < 5e-3


@pytest.mark.slow
def test_gpu_resident_greedy_decode_matches_teacher_forced_argmax(model):
    model.runtime.reset()
    assert_greedy_decode_is_teacher_forced_argmax(model, 160, 2)


def test_int8_decode(gpu, tiny):
    """The default decode (int8 activations into the 4-bit matvecs): each step close to the full forward, and one
    quantize_q8 a layer, before down (head and value dims are multiples of 32: the norms, the decode attention and the
    GDN output norm write the other int8 inputs; gate_up_q8, which folds down's into gate_up, is off by default); the
    mixers' and MLP's last matvecs carry the add + norm after them (matvec_q8_norm), so only the final norm remains,
    as recorded."""
    model = load_model(tiny[1], gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48, single_pass_keys=48)
    assert_int8_decode_steps_match_the_full_forward(model)
    rt = model.runtime
    attn = len(rt.spec.attn_layers)
    # embedding, first and final norm, LM head, argmax; per layer the MLP's gate_up, quantize_q8, down; a GDN mixer
    # in_proj, conv (+ gates), recurrence, norm, out; a gated attention mixer qkv, gate, attention_decode, o
    assert rt.dispatches_per_token == 5 + 8 * (rt.spec.n_layers - attn) + 7 * attn
    assert rt.dispatched_kernels().count("quantize_q8") == rt.spec.n_layers
    # split-K decode (past 48 keys): one dispatch a layer still (attention_decode_split gates and writes o's int8 row)
    split = [item[0].label for item in rt.decode_plan(2).items]
    assert split.count("attention_decode_split") == attn and len(split) == rt.dispatches_per_token
    assert split.count("quantize_q8") == rt.spec.n_layers  # before down only
    # the three kernels (fused_split_decode off): the attention gate writes o's int8 row itself
    apart = load_model(tiny[1], gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48, single_pass_keys=48,
                       fused_split_decode=False).runtime
    split = [item[0].label for item in apart.decode_plan(2).items]
    assert split.count("attn_gate") == attn and split.count("quantize_q8") == rt.spec.n_layers
    assert_recorded_count(rt)


@pytest.mark.slow  # four loads
@pytest.mark.parametrize("variant", ["serial", "batched", "lanes"])
@pytest.mark.parametrize("q8", [False, True], ids=["f32-x", "int8-x"])
def test_fused_split_decode_matches_the_split_k_kernels(gpu, tiny, q8, variant):
    """The gated attention's split-K decode in one dispatch (fused_split_decode: attention_decode_split, which also
    applies the gate and writes o's int8 row) against rope_append + split attention + combine + attn_gate, past
    single_pass_keys = 16: per-token logits equal to f32 rounding (the partials sum their keys in another order; the
    combine's order over splits is the same), and the f32 decode still close to the full forward."""
    ids = np.random.default_rng(6).integers(0, 200, 100)
    runs = {}
    for fused in (False, True):
        rt = load_model(tiny[1], gpu=gpu, max_context=128, prefill_chunk=32, split_keys=16, single_pass_keys=16,
                        q8_decode=q8, fused_split_decode=fused, decode_attention=variant).runtime
        kernels = [item[0].label for item in rt.decode_plan(7).items]
        attn = len(rt.spec.attn_layers)
        assert kernels.count("attention_decode_split") == (attn if fused else 0)
        assert kernels.count("attn_gate") == kernels.count("rope_append") == (0 if fused else attn)
        assert len(kernels) == rt.dispatches_per_token + (0 if fused else 3 * attn)
        runs[fused] = rt.logits(ids, chunk=1)
        if fused:
            rt.reset()
            full = rt.logits(ids)
    scale = np.abs(full).max()
    if q8:
        # A whole int8 decode is not comparable to f32 rounding: one int8 code of o's input moved by the partials'
        # other summation order is amplified by 100 steps of the recurrence (lavapipe 2e-7, the H100 1%). Each step
        # of the fused path is held to the int8 step tolerance of the full forward instead.
        fused_model = load_model(tiny[1], gpu=gpu, max_context=128, prefill_chunk=32, split_keys=16,
                                 single_pass_keys=16, q8_decode=True, fused_split_decode=True,
                                 decode_attention=variant)
        assert_int8_decode_steps_match_the_full_forward(fused_model)
        return
    assert np.abs(runs[True] - runs[False]).max() / scale < 1e-4  # measured 9e-7
    assert np.abs(runs[True] - full).max() / scale < 5e-3  # decode vs the f32 prefill: test_int8_decode's check


def test_int8_prefill_rounds_as_int8_decode(gpu, tiny):
    """Every dense projection of the hybrid (GDN in_proj and out, attention qkv, gate and o, the MLP) prefills
    with int8 activations (matmul_q8w) as it decodes (matvec_q8), and each decode step after an int8 prefill stays
    within the int8 step tolerance of the full int8 forward. Not to f32 rounding: the two paths sum their f32
    parts in different orders, so a code near a rounding boundary can land one step apart on another GPU."""
    model = load_model(tiny[1], gpu=gpu, max_context=320, prefill_chunk=32, split_keys=320, q8_prefill=True)
    rt = model.runtime
    kernels = rt.dispatched_kernels(8)
    attention_layers = len(rt.spec.attn_layers)
    # 2 projections per GDN mixer, 3 per attention mixer (qkv, gate, o), 2 per MLP, the LM head
    gemms = sum(k in INT8_GEMMS for k in kernels)
    assert "matmul_int4" not in kernels and gemms == 4 * rt.spec.n_layers + attention_layers + 1
    # The prefill's norms write hidden's rows in int8 (one quantize_q8 after the first norm does it), gate_up down's,
    # the attention gate o's and the GDN output norm out's, so only the LM head (after the final norm) quantizes its
    # rows besides; gate reuses qkv's.
    assert kernels.count("quantize_q8") == 2
    assert_int8_decode_steps_match_the_full_forward(model)


def test_int8_prefill_epilogues_keep_the_logits(gpu, tiny):
    """With int8 prefill GEMMs the attention gate writes o's int8 rows and the GDN output norm out's (RuntimeOptions
    q8_epilogues, with the MLP's gate_up down's): the bytes quantize_q8 would write (tests/test_kernels_rows_q8.py),
    so the prefill logits are the same bit for bit, over chunks full and partial, with a quantize_q8 fewer a mixer."""
    opts = dict(gpu=gpu, max_context=320, prefill_chunk=32, q8_prefill=True)
    on, off = load_model(tiny[1], **opts), load_model(tiny[1], q8_epilogues=False, **opts)
    layers = on.runtime.spec.n_layers
    quantizes = lambda m: m.runtime.dispatched_kernels(32).count("quantize_q8")  # noqa: E731
    assert quantizes(on) == 2 and quantizes(off) == 2 + 2 * layers  # each mixer's and each MLP's
    ids = np.random.default_rng(4).integers(0, on.runtime.spec.vocab, 75)  # chunks of 32, 32 and 11 rows
    np.testing.assert_array_equal(on.logits(ids), off.logits(ids))


def test_int8_decode_quantizes_only_before_down(gpu, tiny):
    """The first norm writes the int8 row layer 0's GDN in_proj or attention qkv and gate read, the final norm the LM
    head's, the matvecs ending each mixer and MLP (matvec_q8_norm) the next norm's row (without 1/rms) for the rest;
    the decode attention o's and the GDN output norm out's: a decode token quantizes only before down and runs one
    add + norm; with gate_up_q8 (an A/B) gate_up writes down's row too (matvec_q8_rms_q8) and no quantize_q8 runs."""
    rt = load_model(tiny[1], gpu=gpu, max_context=64).runtime
    kernels = rt.dispatched_kernels()
    assert kernels.count("quantize_q8") == rt.spec.n_layers and kernels.count("add_rms_norm") == 1
    assert kernels.count("matvec_q8_norm") == 2 * rt.spec.n_layers - 1
    assert "matvec_q8_rms_q8" not in kernels
    assert_recorded_count(rt)
    rt = load_model(tiny[1], gpu=gpu, max_context=64, gate_up_q8=True).runtime
    kernels = rt.dispatched_kernels()
    assert "quantize_q8" not in kernels and kernels.count("matvec_q8_rms_q8") == rt.spec.n_layers
    assert_recorded_count(rt)


def test_dispatch_count(model):
    rt = model.runtime
    attn = len(rt.spec.attn_layers)  # f32: a GDN layer 5 + 4, a gated attention layer 4 + 4 (test_int8_decode)
    assert rt.dispatches_per_token == 4 + 9 * (rt.spec.n_layers - attn) + 8 * attn
    assert_recorded_count(rt)


def test_norm_offset_runs_raw_zero_centred_norms(gpu, tiny, model):
    """The same model with the +1 taken out of its norm weights and NORM_OFFSET = 1 in the kernels."""
    ckpt = MlcCheckpoint(tiny[1])
    module = model_module(ckpt.model_type)
    spec = module.spec(module.ModelArgs.from_dict(ckpt.model_config))
    spec.norm_offset = 1.0
    centred = ("layernorm.weight", "q_norm.weight", "k_norm.weight", "model.norm.weight")

    def raw(weights):
        for name, arr in weights:
            yield name, (arr.astype(np.float32) - 1).astype(np.float16) if name.endswith(centred) else arr

    # f32 activations, as the model it is compared with
    options = RuntimeOptions(max_context=64, prefill_chunk=32, q8_decode=False)
    rt = Transformer(gpu, spec, raw(ckpt.load(list(spec.names.values()))), options=options)
    ids = [5, 9, 200, 7, 31, 64, 2, 8]
    np.testing.assert_array_equal(rt.logits(ids), model.logits(ids))


# ---- multi-turn reuse and rollback ---------------------------------------------------------------------------


def test_logits_after_rollback_equal_fresh_prefill(model):
    rt = model.runtime
    rng = np.random.default_rng(3)
    seq = rng.integers(3, 250, 130).tolist()
    fresh = model.logits(seq)
    tol = 5e-5 * np.abs(fresh).max()  # replayed tokens may run the decode kernels: f32 rounding, measured 4e-5
    rt.reset()
    rt.prefill(seq[:40])  # snapshot before position 39
    list(rt.decode(0, 20, batch=4))  # state now past 60, on tokens that are not seq's
    rt.truncate(40)  # no snapshot at 40: restore 39, replay one token
    assert rt.pending_replay == 39
    np.testing.assert_allclose(rt.logits(seq[40:]), fresh[40:], rtol=0, atol=tol)
    rt.truncate(77)  # behind the state again: back to 39, replay 38 tokens from cached_ids
    assert rt.pending_replay == 39
    np.testing.assert_allclose(rt.logits(seq[77:]), fresh[77:], rtol=0, atol=tol)
    rt.truncate(0)
    np.testing.assert_allclose(rt.logits(seq[:10]), fresh[:10], rtol=0, atol=tol)


def test_a_prefill_stopped_between_pieces_keeps_a_state_the_next_turn_continues(model):
    """The recurrent state after a Stop is the state of exactly the pieces kept: answering the same prompt then
    reads only the rest and gives the fresh run's tokens."""
    from engine.generate import stream_generate

    rt = model.runtime
    rt.reset()
    seq = np.random.default_rng(5).integers(3, 250, 120).tolist()
    token = CancelToken()
    with pytest.raises(Cancelled):
        for p in stream_generate(model, seq, 10, cancel=token, progress=True):
            if p.done >= 32:
                token.cancel()
    kept = rt.n_cached
    assert 32 <= kept < len(seq) - 1 and rt.cached_ids == seq[:kept] and rt.pending_replay is None
    resumed = list(stream_generate(model, seq, 10))
    assert resumed[-1].prompt_reused == kept
    rt.reset()
    assert tokens_of(resumed) == tokens_of(stream_generate(model, seq, 10))


def test_follow_up_turn_prefills_only_new_tokens(model):
    rt = model.runtime
    rt.reset()
    prompt1 = [5, 6, 7, 8, 9, 10, 11]
    answer = tokens_of(model.generate(prompt1, max_tokens=12))
    prompt2 = prompt1 + answer + [20, 21, 22]
    turn2 = list(model.generate(prompt2, max_tokens=10))
    assert turn2[0].prompt_reused == len(prompt1) + len(answer) - 1
    rt.reset()
    fresh = list(model.generate(prompt2, max_tokens=10))
    assert fresh[0].prompt_reused == 0
    assert tokens_of(turn2) == tokens_of(fresh)


def test_sampled_follow_up_equals_fresh(model):
    """Seeded sampling draws by (seed, position): a reused cache must give the same text as a fresh one."""
    rt, sampling = model.runtime, SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=5)
    rt.reset()
    prompt1 = [12, 13, 14, 15, 16]
    answer = tokens_of(model.generate(prompt1, max_tokens=20, sampling=sampling))
    prompt2 = prompt1 + answer[:13] + [40, 41]  # as if the reply had stopped after 13 tokens
    reused = list(model.generate(prompt2, max_tokens=15, sampling=sampling))
    assert reused[0].prompt_reused == len(prompt1) + 13
    rt.reset()
    assert tokens_of(reused) == tokens_of(model.generate(prompt2, max_tokens=15, sampling=sampling))


def test_regenerate_and_edit_equal_fresh(model):
    rt = model.runtime
    rt.reset()
    prompt = [30, 31, 32, 33, 34, 35]
    first = tokens_of(model.generate(prompt, max_tokens=40))
    again = list(model.generate(prompt, max_tokens=40))  # resumes at the prompt snapshot
    assert again[0].prompt_reused == len(prompt) - 1 and tokens_of(again) == first
    edited = prompt[:3] + [99, 98] + first[:7]  # diverges inside the first prompt: replay from 0
    ours = list(model.generate(edited, max_tokens=20))
    assert ours[0].prompt_reused == 3
    rt.reset()
    assert tokens_of(ours) == tokens_of(model.generate(edited, max_tokens=20))


def test_stopping_mid_batch_keeps_the_state_consistent(model):
    """The Stop button (or a stop token) ends a reply while decode batches run ahead: settle() truncates
    behind the recurrent state, which then comes back from a decode snapshot plus a short replay."""
    rt = model.runtime
    rt.reset()
    prompt = list(range(40, 70))
    gen = model.generate(prompt, max_tokens=100)
    taken = [next(gen).token for _ in range(37)]
    gen.close()
    assert rt.cached_ids == prompt + taken[:-1] and rt.n_cached == len(prompt) + 36
    assert rt.pending_replay == 64  # the decode snapshot at position 64, two tokens to replay
    follow = prompt + taken + [50, 51]
    reused = list(model.generate(follow, max_tokens=12))
    assert reused[0].prompt_reused == len(prompt) + 36
    rt.reset()
    assert tokens_of(reused) == tokens_of(model.generate(follow, max_tokens=12))


def test_truncate_without_ids_fails_clearly(model):
    rt = model.runtime
    rt.reset()
    rt.prefill([5, 6, 7, 8])
    list(rt.decode(0, 10, batch=4))  # decoded ids are not in cached_ids until a caller sets them
    rt.truncate(rt.n_cached - 2)
    with pytest.raises(ZeroTVMError, match="token ids after 4 are unknown"):
        rt.logits([9])
    rt.reset()


def test_snapshot_memory_is_bounded(model):
    rt = model.runtime
    rt.reset()
    for turn in range(4):
        list(model.generate([7 + turn] * 5 + list(range(20, 20 + 10 * turn)), max_tokens=40))
    gdn = rt.block("gated_deltanet")
    snaps = gdn.snapshots()
    assert len(snaps) <= gdn.snapshot_slots and gdn.free_slots() + len(snaps) == gdn.snapshot_slots
    assert all(q <= rt.n_cached for q, _ in snaps)


# ---- config and bad input -------------------------------------------------------------------------------------


def test_model_args_read_nested_and_interval_configs():
    module = model_module("qwen3_5")
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=8, num_attention_heads=4, vocab_size=300,
                num_key_value_heads=2, head_dim=32, full_attention_interval=4,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
    spec = module.spec(module.ModelArgs.from_dict({"model_type": "qwen3_5", "tie_word_embeddings": True,
                                                   "text_config": text}))
    assert spec.attn_layers == (3, 7) and spec.rot_dim == 8 and spec.tied_embeddings
    assert "lm_head.q_weight" not in spec.names.values()
    with pytest.raises(UnsupportedModelError, match="layer_types"):
        module.spec(module.ModelArgs.from_dict({**text, "layer_types": ["linear_attention"] * 3}))


def test_missing_tensor_is_named(gpu, tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny[1], bad)
    manifest = bad / "ndarray-cache.json"
    data = json.loads(manifest.read_text())
    for shard in data["records"]:
        shard["records"] = [r for r in shard["records"] if r["name"] != "model.layers.2.linear_attn.dt_bias"]
    manifest.write_text(json.dumps(data))
    with pytest.raises(ModelFormatError, match="model.layers.2.linear_attn.dt_bias"):
        load_model(bad, gpu=gpu, max_context=32)


def test_wrong_shape_is_named(gpu, tiny, tmp_path):
    bad = tmp_path / "bad"
    shutil.copytree(tiny[1], bad)
    manifest = bad / "ndarray-cache.json"
    text = manifest.read_text()
    data = json.loads(text)
    rec = next(r for s in data["records"] for r in s["records"] if r["name"].endswith("0.linear_attn.conv1d_weight"))
    conv, _, k = rec["shape"]
    rec["shape"] = [conv // 2, 1, 2 * k]  # same bytes, wrong shape
    manifest.write_text(json.dumps(data))
    expected = r"model.layers.0.linear_attn.conv1d_weight: expected float16\[256, 1, 4\], found float16\[128, 1, 8\]"
    with pytest.raises(ModelFormatError, match=expected):
        load_model(bad, gpu=gpu, max_context=32)


def test_converter_names_a_missing_hf_tensor(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(tiny[0], hf)
    (st,) = hf.glob("*.safetensors")
    tensors = load_file(st)
    del tensors["model.layers.3.linear_attn.A_log"]
    save_file(tensors, st, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match="model.layers.3.linear_attn.A_log"):
        convert_hf_to_mlc(hf, tmp_path / "out")


def test_converter_reads_multimodal_checkpoints(tiny, tmp_path):
    """Qwen3_5ForConditionalGeneration layout: text under model.language_model., config under text_config,
    vision tower and MTP weights left out; the result equals the text-only conversion byte for byte."""
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    hf.mkdir()
    (st,) = tiny[0].glob("*.safetensors")
    tensors = {k.replace("model.", "model.language_model.", 1): v for k, v in load_file(st).items()}
    tensors["model.visual.patch_embed.proj.weight"] = np.zeros((4, 4), np.float32)
    tensors["mtp.fc.weight"] = np.zeros((4, 4), np.float32)
    save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    text = json.loads((tiny[0] / "config.json").read_text())
    config = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text, "vision_config": {}}
    (hf / "config.json").write_text(json.dumps(config))
    out = convert_hf_to_mlc(hf, tmp_path / "out")
    shards = sorted(p.name for p in out.glob("params_shard_*.bin"))
    assert shards == sorted(p.name for p in tiny[1].glob("params_shard_*.bin"))
    for name in shards:
        assert (out / name).read_bytes() == (tiny[1] / name).read_bytes()
    assert json.loads((out / "mlc-chat-config.json").read_text())["model_type"] == "qwen3_5"


@pytest.mark.slow
def test_real_qwen3_5_4b_layer_shapes_run(gpu):
    """One GDN and one attention layer at Qwen3.5-4B's real widths (d 2560, GDN 16/32 heads × 128, attention
    16/4 × 256 with 64 rotary dims; the MLP, which is the dense models' own, kept narrow to stay quick on a
    software GPU), random weights: every kernel builds and binds at these sizes, and the decode kernels agree
    with chunked prefill."""
    from engine.models.qwen3_5 import ModelArgs
    from engine.models.qwen3_5 import spec as make_spec

    args = ModelArgs.from_dict(dict(
        hidden_size=2560, intermediate_size=256, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=4,
        head_dim=256, vocab_size=1024, layer_types=["linear_attention", "full_attention"], max_position_embeddings=64,
        rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)))
    spec = make_spec(args)
    assert (spec.conv_dim, spec.rot_dim) == (8192, 64)
    spec.names = {c: c for c in expected_tensors(spec)}
    rng = np.random.default_rng(0)

    def weights():
        for name, (shape, dtype) in expected_tensors(spec).items():
            if dtype == "uint32":
                yield name, rng.integers(0, 2**32, size=shape, dtype=np.uint32)
            elif name.endswith("q_scale"):
                yield name, (rng.random(shape) * 0.5 / np.sqrt(shape[1] * 32)).astype(np.float16)
            elif name.endswith("A_log"):
                yield name, np.log(rng.uniform(0.05, 1, shape)).astype(np.float32)
            elif name.endswith("dt_bias"):
                yield name, rng.normal(0, 0.5, shape).astype(np.float32)
            else:
                yield name, rng.normal(1.0 if "norm" in name else 0.0, 0.3, shape).astype(np.float16)

    rt = Transformer(gpu, spec, weights(), options=RuntimeOptions(max_context=64, prefill_chunk=16))
    # one add + norm and a quantize_q8 before each down: as test_int8_decode counts them
    assert rt.dispatches_per_token == 5 + 8 + 7
    ids = rng.integers(0, 1024, 6)  # the GEMM path is slow on a software GPU: one 6-row chunk
    chunked = rt.logits(ids)
    rt.reset()
    per_token = rt.logits(ids, chunk=1)
    assert np.isfinite(chunked).all()
    assert np.abs(per_token - chunked).max() <= DECODE_TOL[True] * np.abs(chunked).max()


def test_split_k_norm_matvecs_keep_the_int8_decode_steps(gpu, tiny):
    """The mixers' and MLP's last matvecs split along K (norm_matvec_splits=4: matvec_q8_norm_split in place of every
    matvec_q8_norm, the attention's o, the GDN's out and down alike): each int8 decode step within the int8 step
    tolerance of the full forward."""
    model = load_model(tiny[1], gpu=gpu, max_context=128, prefill_chunk=32, norm_matvec_splits=4)
    kernels = model.runtime.dispatched_kernels()
    assert kernels.count("matvec_q8_norm_split") == 2 * model.runtime.spec.n_layers - 1
    assert "matvec_q8_norm" not in kernels
    assert_int8_decode_steps_match_the_full_forward(model)
