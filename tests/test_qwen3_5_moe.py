"""Qwen3.5-MoE / Qwen3.6 end to end: tiny random Qwen3_5MoeForCausalLM → `zerotvm convert` → the runtime
with MoE blocks vs transformers (on the dequantized weights); tiny MLX checkpoints written by mlx-lm itself
(4-bit with the 8-bit router, 3-bit experts, and a dense Qwen3.5) → load_model vs mlx-lm's own forward; decode,
chunking, multi-turn reuse and rollback; bad checkpoints fail naming the tensor; the hybrid bench harness."""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from engine.cli import main as cli_main
from engine.errors import ModelFormatError, UnsupportedModelError
from engine.formats.q4f16_1 import dequantize_q4f16_1, quantize_q4f16_1
from engine.model import load_model
from engine.models import model_module
from engine.sampling import SamplingParams
from tests.helpers import (
    DECODE_TOL,
    assert_greedy_decode_is_teacher_forced_argmax,
    assert_int8_decode_steps_match_the_full_forward,
    assert_recorded_count,
    cached_mlx,
    cached_tiny_hf,
    compare,
    tokens_of,
)

pytestmark = pytest.mark.model
torch = pytest.importorskip("torch", reason="the model tests compare with transformers on torch (the test extra)")

# ---- HF → MLC q4f16_1 ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    hf = cached_tiny_hf("qwen3_5_moe")
    out = tmp_path_factory.mktemp("qwen3_5_moe") / "mlc"
    assert cli_main(["convert", str(hf), str(out)]) == 0
    return hf, out


@pytest.fixture(scope="module")
def mlc_model(gpu, tiny):  # f32 activations: decode compared with prefill to f32 rounding (int8: test_int8_decode)
    return load_model(tiny[1], gpu=gpu, max_context=320, prefill_chunk=32,
                      split_keys=48, single_pass_keys=48, q8_decode=False)


def q4_values(a: np.ndarray) -> np.ndarray:
    """What the converter stores for a matrix or expert stack (q4f16_1 rows along the last axis)."""
    flat = a.reshape(-1, a.shape[-1])
    return dequantize_q4f16_1(*quantize_q4f16_1(flat)).reshape(a.shape)


def reference_model(hf_dir):
    """transformers on exactly the stored weights: q4f16_1-dequantized matrices and expert stacks, zero-centred
    norms as f16(1 + w) − 1, the gated norm and conv kernel f16, A_log / dt_bias bf16."""
    from transformers import AutoModelForCausalLM

    from engine.convert import _bf16_bytes

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    for name, p in model.state_dict().items():
        a = p.numpy().astype(np.float32)
        if name.endswith((".A_log", ".dt_bias")):
            a = (_bf16_bytes(a).astype(np.uint32) << 16).view(np.float32)
        elif name.endswith(("linear_attn.norm.weight", "conv1d.weight")):
            a = a.astype(np.float16).astype(np.float32)
        elif a.ndim == 1:
            a = (a + 1).astype(np.float16).astype(np.float32) - 1
        else:
            a = q4_values(a)
        p.copy_(torch.from_numpy(np.ascontiguousarray(a)))
    return model


def test_converter_stacks_experts(tiny):
    from engine.formats.mlc import MlcCheckpoint

    ckpt = MlcCheckpoint(tiny[1])
    assert ckpt.model_type == "qwen3_5_moe_text"
    assert ckpt.record("model.layers.2.mlp.moe_gate_up_proj.q_weight").shape == (8, 64, 8)  # [E, 2F, D/8]
    assert ckpt.record("model.layers.2.mlp.moe_down_proj.q_scale").shape == (8, 64, 1)  # [E, D, F/32]
    assert ckpt.record("model.layers.0.mlp.shared_expert_gate.q_weight").shape == (1, 8)
    assert "model.layers.0.mlp.gate_up_proj.q_weight" not in ckpt


def test_logits_match_transformers_at_every_position(mlc_model, tiny):
    rt = mlc_model.runtime
    moe = rt.block("moe")
    assert moe.layers == (0, 1, 2, 3) and not any(moe.stacked.values())  # shared 64 ≠ 32
    ids = np.random.default_rng(0).integers(0, rt.spec.vocab, 150)
    ours = mlc_model.logits(ids)  # 5 prefill chunks: MoE for T = 32 and T = 22
    with torch.no_grad():
        ref = reference_model(tiny[0])(torch.tensor(ids[None])).logits[0].numpy()
    compare(ours, ref)


def test_converter_reads_fused_expert_tensors(tiny, tmp_path):
    """A checkpoint holding experts.gate_up_proj [E, 2F, D] / experts.down_proj [E, D, F] (transformers 5's
    in-memory layout) converts to the same bytes as the per-expert one."""
    from safetensors.numpy import load_file, save_file

    hf = tmp_path / "hf"
    shutil.copytree(tiny[0], hf)
    (st,) = hf.glob("*.safetensors")
    t = load_file(st)
    for i in range(4):
        p = f"model.layers.{i}.mlp.experts."
        t[p + "gate_up_proj"] = np.stack([np.concatenate([t.pop(f"{p}{e}.gate_proj.weight"),
                                                          t.pop(f"{p}{e}.up_proj.weight")]) for e in range(8)])
        t[p + "down_proj"] = np.stack([t.pop(f"{p}{e}.down_proj.weight") for e in range(8)])
    save_file(t, st, metadata={"format": "pt"})
    from engine.convert import convert_hf_to_mlc

    out = convert_hf_to_mlc(hf, tmp_path / "out")
    for shard in tiny[1].glob("params_shard_*.bin"):
        assert (out / shard.name).read_bytes() == shard.read_bytes()


def test_converter_names_a_missing_expert(tiny, tmp_path):
    from safetensors.numpy import load_file, save_file

    from engine.convert import convert_hf_to_mlc

    hf = tmp_path / "hf"
    shutil.copytree(tiny[0], hf)
    (st,) = hf.glob("*.safetensors")
    t = load_file(st)
    del t["model.layers.2.mlp.experts.5.up_proj.weight"]
    save_file(t, st, metadata={"format": "pt"})
    with pytest.raises(ModelFormatError, match=r"model.layers.2.mlp.experts.5.up_proj.weight.*moe_gate_up_proj"):
        convert_hf_to_mlc(hf, tmp_path / "out")


def test_dispatch_count(mlc_model):
    rt = mlc_model.runtime
    assert rt.block("moe").dispatches_per_token() == 7 * 4  # shared expert apart: 7 a layer
    attn = len(rt.spec.attn_layers)  # mixers: GDN in_proj, conv (+ gates), recurrence, norm, out; gated attention
    gdn = rt.spec.n_layers - attn  # qkv, gate, attention_decode, o; and two norms a layer
    assert rt.dispatches_per_token == 4 + (2 + 7) * rt.spec.n_layers + 5 * gdn + 4 * attn
    assert_recorded_count(rt)


def test_qwen3_6_real_config_dispatches():
    """Qwen3.6-35B-A3B's config (text_config of the MLX build): 40 MoE layers, 10 of them attention; the shared
    expert (512 = moe_intermediate_size) is as wide as the routed ones (so it joins their stack)."""
    module = model_module("qwen3_5_moe")
    text = dict(model_type="qwen3_5_moe_text", hidden_size=2048, num_hidden_layers=40, num_attention_heads=16,
                num_key_value_heads=2, head_dim=256, vocab_size=248320, num_experts=256, num_experts_per_tok=8,
                moe_intermediate_size=512, shared_expert_intermediate_size=512, full_attention_interval=4,
                rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
    spec = module.spec(module.ModelArgs.from_dict({"model_type": "qwen3_5_moe", "text_config": text}))
    assert spec.moe_layers == tuple(range(40)) and len(spec.attn_layers) == 10 and spec.ffn_dim == 0
    assert (spec.n_experts, spec.top_k, spec.moe_ffn_dim, spec.shared_ffn_dim, spec.rot_dim) == (256, 8, 512, 512, 64)
    dense = module.spec(module.ModelArgs.from_dict({**text, "mlp_only_layers": [0, 5], "intermediate_size": 1024}))
    assert 0 not in dense.moe_layers and 5 not in dense.moe_layers and len(dense.moe_layers) == 38
    assert "layers.0.gate_up.q_weight" in dense.names and "layers.1.moe.router.q_weight" in dense.names
    with pytest.raises(UnsupportedModelError, match="intermediate_size"):
        module.spec(module.ModelArgs.from_dict({**text, "decoder_sparse_step": 2}))


# ---- MLX checkpoints written by mlx-lm ------------------------------------------------------------------------


def mlx_reference(path: Path):
    """mlx-lm's own model (the same class and config) with every weight dequantized exactly as stored, in f32:
    a function ids -> logits [T, vocab]."""
    import mlx.core as mx
    from mlx_lm.models import qwen3_5, qwen3_5_moe

    cfg = json.loads((path / "config.json").read_text())
    module = qwen3_5_moe if cfg["model_type"] == "qwen3_5_moe" else qwen3_5
    model = module.Model(module.ModelArgs.from_dict(cfg))
    raw = {}
    for f in sorted(path.glob("*.safetensors")):
        raw |= mx.load(str(f))
    weights = []
    for key, v in raw.items():
        base = key.removesuffix(".weight")
        if key.endswith((".scales", ".biases")):
            continue
        if base + ".scales" in raw:
            s, b = raw[base + ".scales"], raw[base + ".biases"]
            bits = v.shape[-1] * 32 // (s.shape[-1] * 64)
            v = mx.dequantize(v, s.astype(mx.float32), b.astype(mx.float32), 64, bits)
        weights.append((key, v.astype(mx.float32)))
    model.load_weights(weights)
    return lambda ids: np.array(model(mx.array(np.asarray(ids))[None]))[0]


@pytest.fixture(scope="module", params=["q4", "q3exp", "dense"])
def mlx_variant(request):
    return request.param, cached_mlx(request.param)


@pytest.fixture(scope="module")
def mlx_model(gpu):
    """The 4-bit MoE checkpoint, loaded once for the decode / chunking / multi-turn tests."""
    return load_model(cached_mlx("q4"), gpu=gpu, max_context=320, prefill_chunk=32,
                      split_keys=48, single_pass_keys=48, q8_decode=False)


def test_mlx_logits_match_mlx_lm_at_every_position(gpu, mlx_variant):
    variant, path = mlx_variant
    # f32 prefill: the logits are compared with mlx-lm's f32 arithmetic (with int8 activations these tiny random
    # models move by up to 65%, in decode and prefill alike: near-tied routers flip); the decode stays int8, so the
    # dispatch counts below are the default ones.
    model = load_model(path, gpu=gpu, max_context=160, prefill_chunk=32,
                       split_keys=48, single_pass_keys=48, q8_prefill=False)
    rt = model.runtime
    if variant == "dense":
        assert rt.block("moe") is None and rt.formats["embed"] == "mlx4" and rt.spec.tied_embeddings
    else:
        q3 = variant == "q3exp"  # 3-bit routed experts read as stored; the 4-bit shared expert is stored after them
        moe = rt.block("moe")
        assert moe.layers == (0, 1, 2, 3) and all(stacked != q3 for stacked in moe.stacked.values())
        assert rt.formats["layers.0.moe.router"] == rt.formats["layers.0.moe.shared_gate"] == "mlx8"
        assert rt.formats["layers.1.moe.gate_up"] == ("mlx3" if q3 else "mlx4")
        assert all(mixed == q3 for mixed in moe.mixed.values())  # so int8 decode runs it in the routed dispatches
        # the fused MoE passes (3) a layer, the 2 GDN and 2 gated attention mixers (5 and 4 dispatches), the first and
        # the final norm: the matvecs and the MoE passes carry the others (engine/blocks/moe_fused.py)
        assert rt.dispatches_per_token == 4 + 3 * 4 + 5 * 2 + 4 * 2 + 1
    ids = np.random.default_rng(5).integers(0, rt.spec.vocab, 150)
    compare(model.logits(ids), mlx_reference(path)(ids))


def test_mlx_folder_brings_tokenizer_and_sampling_defaults(mlx_model):
    assert mlx_model.tokenizer is not None and mlx_model.tokenizer.decode(mlx_model.tokenizer.encode("hi")) == "hi"
    s = mlx_model.default_sampling
    assert (s.temperature, s.top_k, s.top_p) == (0.7, 20, 0.8)  # generation_config.json
    assert mlx_model.model_type == "qwen3_5_moe_text"


# ---- decode, chunking, multi-turn (the 4-bit MoE checkpoint) ----------------------------------------------------


@pytest.mark.slow
def test_int8_decode(gpu):
    """The default decode of the MLX MoE model (int8 activations into the 4-bit attention/GDN matvecs and the LM
    head; the experts read f32): each step close to the full forward, and the dispatch count as recorded."""
    model = load_model(cached_mlx("q4"), gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48, single_pass_keys=48)
    assert_int8_decode_steps_match_the_full_forward(model, outliers=1)
    assert_recorded_count(model.runtime)


def test_int8_decode_3bit_experts(gpu):
    """The 3-bit build's default decode: its 3-bit routed experts and 4-bit shared expert in int8 (moe_matvec_q8),
    each step close to the full forward, whose prefill runs the experts as f32 grouped GEMMs (moe_gemm)."""
    model = load_model(cached_mlx("q3exp"), gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48)
    rt = model.runtime
    assert "moe_matvec" not in rt.dispatched_kernels() and "moe_gemm" in rt.dispatched_kernels(8)
    assert_int8_decode_steps_match_the_full_forward(model, outliers=1)
    assert_recorded_count(rt)


@pytest.mark.parametrize("variant", ["q4", "q3exp"])
def test_fused_moe_decode_matches_the_passes_it_replaces(gpu, variant):
    """The fused MoE decode (router on the normed residual, gate_up with the top-k, down with the combine and the next
    norm; with it every add + norm rides in the matvecs) against the passes it replaced (bench/moe_unfused.py): one
    decode step after the same prefill. Both round the same rows to int8 and route in f32, so they differ by f32
    rounding (measured ~1e-6 of max|logit|) and, where a code sits on a rounding boundary, by one step of one element
    (~0.2% of an output at K = 128)."""
    from bench.moe_unfused import unfused_moe

    kw = dict(gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48)
    fused = load_model(cached_mlx(variant), **kw)
    with unfused_moe():
        plain = load_model(cached_mlx(variant), **kw)
    assert "moe_down_q8" in fused.runtime.dispatched_kernels() and "moe_combine" in plain.runtime.dispatched_kernels()
    assert plain.runtime.dispatches_per_token - fused.runtime.dispatches_per_token == 5 * 4 - 1  # the final norm stays
    ids = np.random.default_rng(1).integers(0, fused.runtime.spec.vocab, 90)
    for n in (10, 50, 89):
        steps = []
        for model in (fused, plain):
            rt = model.runtime
            rt.reset()
            rt.logits(ids[:n])
            steps.append(rt.logits(ids[n:n + 1], chunk=1)[0])
        assert np.abs(steps[0] - steps[1]).max() <= DECODE_TOL[False] * np.abs(steps[1]).max()


@pytest.mark.parametrize("variant", ["q4", "q3exp"])
def test_int8_prefill_grouped_experts_match_int8_decode_steps(gpu, variant):
    """int8 prefill forced (the real Qwen3.6's default, dim ≥ 2048): the experts of a chunk run as int8 grouped GEMMs
    (moe_gemm_q8); each int8 decode step after a prefix stays within the int8 tolerance of the full forward."""
    model = load_model(cached_mlx(variant), gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48, q8_prefill=True)
    kernels = model.runtime.dispatched_kernels(8)
    assert "moe_gemm_q8" in kernels and "moe_gemm" not in kernels and "moe_sort" in kernels
    assert_int8_decode_steps_match_the_full_forward(model, outliers=1)
    # The gate_ups write the downs' int8 rows (q8_epilogues; shared and routed experts one width here), the attention
    # gate o's and the GDN output norm out's: the bytes a quantize_q8 each would write (two a layer), so the prefill
    # logits are the same bit for bit; only the first norm's rows and the LM head's are quantized.
    off = load_model(cached_mlx(variant), gpu=gpu, max_context=320, prefill_chunk=32, split_keys=48, q8_prefill=True,
                     q8_epilogues=False)
    layers = model.runtime.spec.n_layers
    assert off.runtime.dispatched_kernels(8).count("quantize_q8") - kernels.count("quantize_q8") == 2 * layers
    assert kernels.count("quantize_q8") == 2
    ids = np.random.default_rng(7).integers(0, model.runtime.spec.vocab, 70)
    model.runtime.reset()
    np.testing.assert_array_equal(model.logits(ids), off.logits(ids))


@pytest.mark.slow
def test_gpu_resident_greedy_decode_matches_full_forward(mlx_model):
    mlx_model.runtime.reset()
    assert_greedy_decode_is_teacher_forced_argmax(mlx_model, 160, 2, sampling=SamplingParams())


@pytest.mark.slow
def test_chunked_prefill_equals_per_token(mlx_model):
    rt = mlx_model.runtime
    ids = np.random.default_rng(1).integers(0, rt.spec.vocab, 90)
    full = mlx_model.logits(ids)
    rt.reset()
    per_token = rt.logits(ids, chunk=1)  # decode kernels: router matvec, split-K attention past 48 keys
    rt.reset()
    odd = rt.logits(ids, chunk=7)
    scale = np.abs(full).max()
    assert np.abs(per_token - full).max() / scale < 5e-3
    assert np.abs(odd - full).max() / scale < 5e-3


@pytest.mark.slow
def test_logits_after_rollback_equal_fresh_prefill(mlx_model):
    rt = mlx_model.runtime
    seq = np.random.default_rng(3).integers(3, 250, 130).tolist()
    fresh = mlx_model.logits(seq)
    tol = 1e-5 * np.abs(fresh).max()
    rt.reset()
    rt.logits(seq[:39])
    rt.logits(seq[39:40])  # token 39 alone, on the decode kernels, as the replay below runs it
    same_kernels = rt.logits(seq[40:])
    rt.reset()
    rt.prefill(seq[:40])
    list(rt.decode(0, 20, batch=4))
    rt.truncate(40)  # restore the snapshot before 39, replay one token
    # Exactly the logits of the same kernels without a rollback. (Against `fresh`, which ran token 39 on the prefill
    # kernels, they differ by those kernels' rounding: test_chunked_prefill_equals_per_token.)
    np.testing.assert_array_equal(rt.logits(seq[40:]), same_kernels)
    rt.truncate(77)
    np.testing.assert_allclose(rt.logits(seq[77:]), fresh[77:], rtol=0, atol=tol)
    rt.truncate(0)
    np.testing.assert_allclose(rt.logits(seq[:10]), fresh[:10], rtol=0, atol=tol)


def test_follow_up_turn_and_regenerate_equal_fresh(mlx_model):
    rt, greedy = mlx_model.runtime, SamplingParams()
    rt.reset()
    prompt1 = [5, 6, 7, 8, 9, 10, 11]
    answer = tokens_of(mlx_model.generate(prompt1, max_tokens=12, sampling=greedy))
    prompt2 = prompt1 + answer + [20, 21, 22]
    turn2 = list(mlx_model.generate(prompt2, max_tokens=10, sampling=greedy))
    assert turn2[0].prompt_reused == len(prompt1) + len(answer) - 1
    again = list(mlx_model.generate(prompt2, max_tokens=10, sampling=greedy))  # regenerate: the prompt snapshot
    assert again[0].prompt_reused == len(prompt2) - 1
    rt.reset()
    fresh = list(mlx_model.generate(prompt2, max_tokens=10, sampling=greedy))
    assert fresh[0].prompt_reused == 0 and tokens_of(turn2) == tokens_of(again) == tokens_of(fresh)


def test_sampled_follow_up_equals_fresh(mlx_model):
    rt, sampling = mlx_model.runtime, SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.1, seed=7)
    rt.reset()
    prompt1 = [12, 13, 14, 15, 16]
    answer = tokens_of(mlx_model.generate(prompt1, max_tokens=20, sampling=sampling))
    assert len(answer) == 20  # (no end-of-text drawn with this seed)
    prompt2 = prompt1 + answer[:13] + [40, 41]  # as if the reply had stopped after 13 tokens
    reused = list(mlx_model.generate(prompt2, max_tokens=15, sampling=sampling))
    assert reused[0].prompt_reused == len(prompt1) + 13
    rt.reset()
    assert tokens_of(reused) == tokens_of(mlx_model.generate(prompt2, max_tokens=15, sampling=sampling))


# ---- bad MLX checkpoints, through load_model --------------------------------------------------------------------


def mlx_copy(variant: str, tmp_path: Path) -> Path:
    dst = tmp_path / "model"
    shutil.copytree(cached_mlx(variant), dst)
    return dst


def drop_tensor(path: Path, key: str) -> None:
    import mlx.core as mx

    tensors = mx.load(str(path / "model.safetensors"))
    del tensors[key]
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    index = json.loads((path / "model.safetensors.index.json").read_text())
    del index["weight_map"][key]
    (path / "model.safetensors.index.json").write_text(json.dumps(index))


def edit_quantization(path: Path, change) -> None:
    cfg = json.loads((path / "config.json").read_text())
    change(cfg["quantization"])
    (path / "config.json").write_text(json.dumps(cfg))


def test_missing_expert_tensor_is_named(gpu, tmp_path):
    path = mlx_copy("q4", tmp_path)
    key = "language_model.model.layers.2.mlp.switch_mlp.up_proj.weight"
    drop_tensor(path, key)
    with pytest.raises(ModelFormatError, match=rf"model.safetensors.index.json: no tensor '{key}'"):
        load_model(path, gpu=gpu, max_context=32)


def test_wrong_bit_width_is_named(gpu, tmp_path):
    # The 3-bit build's config claims 4 bits for one expert stack: its words do not add up.
    path = mlx_copy("q3exp", tmp_path)
    module = "language_model.model.layers.1.mlp.switch_mlp.down_proj"
    edit_quantization(path, lambda q: q[module].update(bits=4))
    with pytest.raises(ModelFormatError, match=rf"model.safetensors: tensor '{module}.weight' has 6 u32 words per row, "
                       r"but 64 columns .* at 4 bits need 8: config.json's bit width does not match"):
        load_model(path, gpu=gpu, max_context=32)
    edit_quantization(path, lambda q: q[module].update(bits=7))
    with pytest.raises(UnsupportedModelError, match=rf"tensor '{module}.weight' is 7-bit"):
        load_model(path, gpu=gpu, max_context=32)


def test_truncated_shard_is_named(gpu, tmp_path):
    path = mlx_copy("q4", tmp_path)
    shard = path / "model.safetensors"
    shard.write_bytes(shard.read_bytes()[:-1000])
    with pytest.raises(ModelFormatError, match=r"model.safetensors: tensor 'language_model\..*' needs bytes up to "
                       r"\d+ but the file is \d+ bytes \(truncated download\?\)"):
        load_model(path, gpu=gpu, max_context=32)


def test_mixed_formats_in_one_fused_matrix_are_named(gpu, tmp_path):
    # k_proj 8-bit while q_proj and v_proj are 4-bit: they cannot run as the one c_attn matrix.
    import mlx.core as mx

    path = mlx_copy("dense", tmp_path)
    key = "language_model.model.layers.1.self_attn.k_proj"
    tensors = mx.load(str(path / "model.safetensors"))
    w = mx.dequantize(tensors[key + ".weight"], tensors[key + ".scales"], tensors[key + ".biases"], 64, 4)
    tensors[key + ".weight"], tensors[key + ".scales"], tensors[key + ".biases"] = mx.quantize(w, 64, 8)
    mx.save_safetensors(str(path / "model.safetensors"), tensors, metadata={"format": "mlx"})
    edit_quantization(path, lambda q: q.update({key: {"group_size": 64, "bits": 8}}))
    with pytest.raises(UnsupportedModelError, match=rf"'language_model.model.layers.1.self_attn.q_proj.weight' "
                       rf"\(mlx4, \[256, 128\]\) and '{key}.weight' \(mlx8, \[64, 128\]\) run as one matrix"):
        load_model(path, gpu=gpu, max_context=32)


def test_tensors_past_the_binding_limit_are_named(gpu):
    """As on a GPU whose storage bindings stop at 128 MiB, where Qwen3.6's expert stacks (269 MB) do not fit: a
    GpuError with the numbers, before any bind group fails. (The embedding and LM head are bound in row parts.)"""
    from engine.errors import GpuError

    path, saved = cached_mlx("q4"), gpu.max_binding
    try:
        gpu.max_binding = 8192
        with pytest.raises(GpuError, match=r"tensor layers.0.in_proj.q_weight is 24,832 bytes, but this GPU binds at "
                           r"most 8,192"):
            load_model(path, gpu=gpu, max_context=32)
        gpu.max_binding = 32768  # every matrix fits, the first expert stack (9 experts' gate_up) does not
        with pytest.raises(GpuError, match=r"layers.0.moe.gate_up needs a 73728-byte binding; this GPU allows 32768"):
            load_model(path, gpu=gpu, max_context=32)
    finally:
        gpu.max_binding = saved


def test_unquantized_hf_folder_is_refused(gpu):
    with pytest.raises(ModelFormatError, match="no 'quantization' field.*zerotvm convert"):
        load_model(cached_tiny_hf("qwen3_5_moe"), gpu=gpu, max_context=32)


# ---- bench harness --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("shape", ["tiny-hybrid", "tiny-hybrid-moe", "tiny-hybrid-moe-3bit"])
def test_bench_runs_the_tiny_hybrid_shapes(gpu, shape):
    from engine.bench import run_bench

    r = run_bench(shape, decode_tokens=8, prompt_tokens=24, runs=1, gpu=gpu, long_prompt=0)
    moe = "moe" in shape  # 3-bit routed experts: the 4-bit shared one, stored after them, joins their dispatches
    # Speeds are only checked to be real rates: on a fast GPU this tiny model's share of the ceiling rounds to 0.0%.
    assert r["decode_tok_s"] > 0 and r["prefill_tok_s"] > 0 and r["ceiling_tok_s"] > 0 and r["pct_of_ceiling"] >= 0
    q8 = 0 if moe else 4  # quantize_q8 before the MLP's down (the fused MoE gate_up writes its int8 output)
    norms = 2  # the matvecs and the fused MoE passes carry all but the first and the final norm
    # embedding, LM head, argmax; the feed-forward block a layer, 2 GDN mixers (5 dispatches), 2 gated attention (4)
    assert r["dispatches_per_token"] == 3 + norms + (3 if moe else 2) * 4 + 5 * 2 + 4 * 2 + q8
    assert r["moe_layers"] == (4 if moe else 0)
    assert r["active_gb_per_token"] > 0 and "pct_of_ceiling" in r["table"]


def test_bench_active_bytes_count_top_k_experts():
    from engine.bench_hybrid import active_bytes_per_token, hybrid_spec
    from engine.transformer import expected_tensors

    spec, formats = hybrid_spec("qwen3.6-35b-a3b-4bit")
    assert formats["layers.0.moe.router"] == formats["layers.0.moe.shared_gate"] == "mlx8"
    sizes = {n: int(np.prod(s)) * np.dtype(t).itemsize for n, (s, t) in expected_tensors(spec, formats).items()}
    routed = sum(n for k, n in sizes.items() if ".moe.gate_up." in k or ".moe.down." in k)
    embed = sizes["embed.q_weight"] + sizes["embed.q_scale"]
    assert active_bytes_per_token(spec, formats) == sum(sizes.values()) - routed + routed * 8 // 256 - embed + (
        embed // spec.vocab)
    assert 1.6e9 < active_bytes_per_token(spec, formats) < 1.7e9 < 19e9 < sum(sizes.values())


@pytest.mark.parametrize("shape", ["qwen3.6-35b-a3b-4bit", "qwen3.6-35b-a3b-3bit"])
def test_bench_real_shapes_say_when_a_binding_is_too_small(gpu, shape):
    from engine.bench import run_bench
    from engine.errors import GpuError

    # The biggest binding besides the vocabulary tables (bound in parts): the gate_up stack of 257 experts at
    # 4 bits, or of 256 at 3 bits (the 4-bit shared expert then runs apart). Qwen3.5-4B fits 128 MiB bindings.
    need = {"qwen3.6-35b-a3b-4bit": 269_484_032, "qwen3.6-35b-a3b-3bit": 201_326_592}[shape]
    if gpu.max_binding >= need:
        pytest.skip("this GPU binds the real shapes; run `zerotvm bench --shape ...` on it instead")
    what = "expert stack layers.0.moe.gate_up.q_weight"
    with pytest.raises(GpuError, match=rf"--shape {shape}: the {what} needs a {need:,}-byte storage binding, but "
                       rf"this GPU allows {gpu.max_binding:,}"):
        run_bench(shape, gpu=gpu)


@pytest.mark.slow
def test_real_qwen3_6_layer_widths_run(gpu):
    """One GDN and one attention layer at Qwen3.6-35B-A3B's real widths (d 2048, GDN 16/32 heads × 128, attention
    16/2 × 256, experts of 512 with a shared one of 512, top-8, MLX 4-bit with the 8-bit router), 16 experts
    instead of 256 so the stacks bind on a software GPU: every kernel builds and binds at these sizes, and the
    decode kernels agree with chunked prefill."""
    from engine.bench_hybrid import make_spec, random_weights
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import Transformer

    config = dict(hidden_size=2048, num_hidden_layers=2, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
                  vocab_size=1024, layer_types=["linear_attention", "full_attention"], num_experts=16,
                  num_experts_per_tok=8, moe_intermediate_size=512, shared_expert_intermediate_size=512,
                  max_position_embeddings=64,
                  rope_parameters=dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25))
    spec, formats = make_spec("qwen3_5_moe", config, "mlx")
    rt = Transformer(gpu, spec, random_weights(spec, formats), formats=formats,
                     options=RuntimeOptions(max_context=64, prefill_chunk=8))
    # embedding, first norm, LM head, argmax; GDN 5, attention 4; the fused MoE passes (3) a layer; the final norm
    assert all(rt.block("moe").stacked.values()) and rt.dispatches_per_token == 4 + 5 + 4 + 2 * 3 + 1
    assert "moe_down_q8" in rt.dispatched_kernels()
    ids = np.random.default_rng(0).integers(0, 1024, 6)
    chunked = rt.logits(ids)
    rt.reset()
    per_token = rt.logits(ids, chunk=1)
    assert np.isfinite(chunked).all() and np.abs(chunked).max() > 0
    assert np.abs(per_token - chunked).max() <= DECODE_TOL[True] * np.abs(chunked).max()
