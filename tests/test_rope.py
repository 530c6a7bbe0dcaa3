"""RoPE scaling (engine/models/rope.py, rope_append's ROPE_SCALE) vs transformers and llama.cpp's files.

- Tables: every variant's inverse frequencies and attention factor vs transformers' ROPE_INIT_FUNCTIONS on real-
  sized configs (Llama-3.1's llama3, Qwen3's YaRN with and without an explicit or mscale attention factor, partial
  rotary, Phi-3-mini-128k's LongRoPE short and long, linear), to 4 ulps (numpy's and torch's f32 pow differ in
  the last bit for some exponents).
- Kernel: rope_append with ROPE_SCALE vs float64 numpy: q and k scaled, v not.
- Whole models: tiny random Llama (llama3, linear), Qwen3 (YaRN) and Phi-3 (LongRoPE) converted to q4f16_1 vs
  transformers on the dequantized weights at every position. LongRoPE in both regimes: a context within the original
  one (short factors: transformers' rule agrees for any sequence that fits) and a longer context (long factors: it
  agrees for a whole sequence processed at once). The rule itself: transformers switches tables when its sequence
  passes the original context, so its cached keys (short) and later queries (long) disagree — its incremental
  logits drift from its own one-shot ones — while ours, fixed at load like llama.cpp's, decode as they prefill.
- GGUF: rope_freqs (Llama 3), rope_factors_long/short + attn_factor (Phi-3), rope.scaling yarn (Qwen3) read back
  to the table transformers computes from the Hugging Face config of the same model.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
from gguf import GGUFWriter

from engine.cli import main as cli_main
from engine.formats.gguf import GgufCheckpoint
from engine.formats.q4f16_1 import dequantize_q4f16_1, quantize_q4f16_1
from engine.model import load_model
from engine.models import model_module
from tests.helpers import (
    DECODE_TOL,
    DIMS,
    PAGE,
    cached_tiny_hf,
    compare,
    gguf_tensors,
    hf_weights,
    inv_freq_for,
    poisoned,
    read,
    rope_ref,
    step_uniform,
)

torch = pytest.importorskip("torch", reason="the RoPE tests compare with transformers on torch (the test extra)")
transformers = pytest.importorskip("transformers")


# ---- tables -----------------------------------------------------------------------------------------------------

def hf_rope(config, seq_len=None):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv, attention = ROPE_INIT_FUNCTIONS[config.rope_parameters["rope_type"]](config, "cpu", seq_len=seq_len)
    return inv.numpy(), attention


def assert_ulps(ours: np.ndarray, theirs: np.ndarray, ulps: int = 4) -> None:
    """f32 tables equal to `ulps` units in the last place: numpy's and torch's f32 pow each round within an ulp of
    θ^x but not alike (the last bit differs for some exponents), and the product, reciprocal or blend after it
    carries that into a result of different magnitude (measured: up to 3 ulp for LongRoPE's 1 / (factor · θ^x))."""
    assert ours.dtype == np.float32 and ours.shape == theirs.shape
    off = np.abs(ours.astype(np.float64) - theirs) / np.spacing(np.abs(theirs).astype(np.float32))
    assert off.max() <= ulps, f"{int((off > ulps).sum())} of {off.size} frequencies off by up to {off.max():.1f} ulp"


def our_rope(config):
    cfg = config.to_dict()
    module = model_module(cfg["model_type"])
    return module.spec(module.ModelArgs.from_dict(cfg, "config.json"))


def phi3_factors(n, seed):
    rng = np.random.default_rng(seed)
    return (1.0 + rng.random(n) * 0.2).round(6).tolist(), (1.0 + rng.random(n) * 60).round(6).tolist()


def table_configs():
    t = transformers
    short, long = phi3_factors(48, 3)
    return {
        "llama3 (Llama-3.1-8B)": t.LlamaConfig(
            hidden_size=4096, num_attention_heads=32, max_position_embeddings=131072,
            rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                 high_freq_factor=4.0, original_max_position_embeddings=8192)),
        "linear": t.LlamaConfig(hidden_size=2048, num_attention_heads=32,
                                rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=4.0)),
        "yarn (Qwen3-4B, 128k)": t.Qwen3Config(
            hidden_size=2560, num_attention_heads=32, head_dim=128, max_position_embeddings=131072,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=4.0, original_max_position_embeddings=32768)),
        "yarn attention_factor": t.Qwen3Config(
            hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=64, max_position_embeddings=65536,
            rope_parameters=dict(rope_type="yarn", rope_theta=1e6, factor=2.0, original_max_position_embeddings=32768,
                                 attention_factor=0.8, beta_fast=16.0, beta_slow=2.0)),
        "yarn mscale": t.Qwen3Config(
            hidden_size=1024, num_attention_heads=16, num_key_value_heads=8, head_dim=64,
            max_position_embeddings=163840,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0,
                                 mscale_all_dim=0.707, original_max_position_embeddings=4096)),
        "yarn partial rotary": t.LlamaConfig(
            hidden_size=1024, num_attention_heads=8, max_position_embeddings=32768,
            rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=8.0, partial_rotary_factor=0.5,
                                 original_max_position_embeddings=4096)),
        "longrope (Phi-3-mini-128k)": t.Phi3Config(
            hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_scaling=dict(type="longrope", short_factor=short, long_factor=long)),
        "longrope explicit factors": t.Phi3Config(
            hidden_size=3072, num_attention_heads=32, max_position_embeddings=131072,
            original_max_position_embeddings=4096,
            rope_scaling=dict(type="longrope", short_factor=short, long_factor=long, factor=16.0,
                              attention_factor=1.25)),
    }


@pytest.mark.model
@pytest.mark.parametrize("case", list(table_configs()))
def test_tables_match_transformers(case):
    config = table_configs()[case]
    spec = our_rope(config)
    rope = spec.rope
    inv, attention = hf_rope(config)
    assert_ulps(rope.inv_freq, inv)
    assert rope.scale == pytest.approx(attention, rel=1e-12)
    if "longrope" in case:
        original = config.rope_parameters["original_max_position_embeddings"]
        long_inv, _ = hf_rope(config, seq_len=original + 1)
        assert_ulps(rope.long_inv_freq, long_inv)
        assert rope.at(original) is rope.inv_freq and rope.at(original + 1) is rope.long_inv_freq
        assert spec.inv_freq is rope.long_inv_freq  # the spec's own context is 128k: past the original 4k
        spec.use_context(4096)
        assert spec.inv_freq is rope.inv_freq
    assert spec.rope_scale == rope.scale


def test_unsupported_and_damaged_scaling_is_named():
    from engine.errors import ModelFormatError, UnsupportedModelError
    from engine.models.rope import rope_table

    with pytest.raises(UnsupportedModelError, match="x.json: RoPE scaling 'dynamic'"):
        rope_table(64, 1e4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}, where="x.json")
    with pytest.raises(ModelFormatError, match="'rope_scaling.short_factor' must list 32 positive numbers"):
        rope_table(64, 1e4, rope_scaling={"type": "longrope", "short_factor": [1.0] * 31, "long_factor": [1.0] * 32},
                   original_max_position_embeddings=4096, where="x.json")
    with pytest.raises(ModelFormatError, match="'rope_scaling.factor' is nan"):
        rope_table(64, 1e4, rope_scaling={"rope_type": "linear", "factor": float("nan")}, where="x.json")


# ---- kernels --------------------------------------------------------------------------------------------------

def dispatch(gpu, pipe, buffers, grid):
    from engine.gpu import Recorder

    rec = Recorder(gpu, "test-rope-scale")
    rec.dispatch(pipe, gpu.bind(pipe, buffers, "test-rope-scale"), *grid)
    rec.submit()
    gpu.sync()


@pytest.mark.gpu
@pytest.mark.parametrize("scale", [1.0, 1.2119, 0.8])
def test_rope_append_scales_cos_and_sin(gpu, rng, scale):
    """q and k rotate with cos·s and sin·s (the pairs past ROT and v untouched), at positions across two pages."""
    from engine.kernels.attention import ROPE_APPEND, rope_append_consts

    g = gpu
    H, KVH, HD, ROT, T, pos0 = 4, 2, 64, 48, 5, 14
    consts = rope_append_consts(H, KVH, HD, ROT, PAGE, False, 1e-6, rope_scale=scale)
    inv_freq = inv_freq_for(ROT)
    qkv = rng.standard_normal((T, (H + 2 * KVH) * HD)).astype(np.float32)
    q_out = poisoned(g, "q_out", (T, H * HD))
    shape = (2, KVH, PAGE, HD)
    k_cache, v_cache = poisoned(g, "k", shape, np.float16), poisoned(g, "v", shape, np.float16)
    norms = [g.upload("qn", np.ones(HD, np.float16)), g.upload("kn", np.ones(HD, np.float16))]
    buffers = [g.upload("qkv", qkv), q_out, k_cache, v_cache, g.upload("pt", np.array([1, 0], np.uint32)),
               g.upload("inv_freq", inv_freq), step_uniform(g, T, pos0), *norms]
    dispatch(g, g.pipeline(ROPE_APPEND, consts), buffers, (T, H + 2 * KVH))

    heads = qkv.reshape(T, H + 2 * KVH, HD).astype(np.float64)
    positions = np.arange(pos0, pos0 + T)

    def scaled(x):
        out = rope_ref(x, positions, inv_freq, ROT)
        out[..., :ROT] = (out[..., :ROT] * scale)  # cos and sin both carry the factor: the rotated dims scale
        return out

    q_ref, k_ref, v_ref = scaled(heads[:, :H]), scaled(heads[:, H:H + KVH]), heads[:, H + KVH:]
    np.testing.assert_allclose(read(g, q_out, (T, H, HD)), q_ref, rtol=1e-5, atol=1e-5)
    k, v = read(g, k_cache, shape, np.float16), read(g, v_cache, shape, np.float16)
    for t, p in enumerate(positions):
        page = 1 - p // PAGE  # the page table maps logical page 0 to physical 1 and 1 to 0
        tol = 2e-3 * max(np.abs(k_ref).max(), 1)
        np.testing.assert_allclose(k[page, :, p % PAGE], k_ref[t], atol=tol)
        np.testing.assert_allclose(v[page, :, p % PAGE], v_ref[t], atol=tol)


# ---- whole models -----------------------------------------------------------------------------------------------

SHORT8, LONG8 = [1.0, 1.05, 1.1, 1.2, 1.3, 1.5, 1.7, 2.0], [1.0, 1.5, 2.5, 4.0, 6.0, 9.0, 14.0, 20.0]
MODELS = {
    "llama-llama3": ("llama", dict(max_position_embeddings=1024, rope_scaling=dict(
        rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))),
    "llama-linear": ("llama", dict(rope_scaling=dict(rope_type="linear", factor=4.0))),
    "qwen3-yarn": ("qwen3", dict(max_position_embeddings=512, rope_scaling=dict(
        rope_type="yarn", factor=4.0, original_max_position_embeddings=32))),
    "phi3-longrope": ("phi3", dict(max_position_embeddings=128, original_max_position_embeddings=32,
                                   rope_scaling=dict(type="longrope", short_factor=SHORT8, long_factor=LONG8))),
}


def reference_model(hf_dir):
    """transformers on our dequantized q4f16_1 weights and f16 norms: only our arithmetic differs."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    for name, p in model.state_dict().items():
        if name.endswith("norm.weight") or "layernorm" in name:
            p.copy_(p.half().float())
        elif p.ndim == 2:
            qw, qs = quantize_q4f16_1(p.numpy())
            p.copy_(torch.from_numpy(dequantize_q4f16_1(qw, qs)))
    return model


@pytest.fixture(scope="module", params=list(MODELS))
def scaled_model(request, tmp_path_factory):
    model_type, overrides = MODELS[request.param]
    hf_dir = cached_tiny_hf(model_type, **overrides)
    out = tmp_path_factory.mktemp(request.param) / "mlc"
    assert cli_main(["convert", str(hf_dir), str(out)]) == 0
    return request.param, hf_dir, out


def hf_logits(model, ids):
    with torch.no_grad():
        return model(torch.tensor(ids[None])).logits[0].numpy()


@pytest.mark.model
@pytest.mark.gpu
@pytest.mark.slow
def test_scaled_models_match_transformers_at_every_position(gpu, scaled_model):
    name, hf_dir, mlc = scaled_model
    ref_model = reference_model(hf_dir)
    rng = np.random.default_rng(7)
    if name != "phi3-longrope":
        model = load_model(mlc, gpu=gpu, max_context=160, prefill_chunk=64, q8_decode=False, q8_prefill=False)
        assert model.runtime.spec.rope_scale == pytest.approx(
            {"qwen3-yarn": 0.1 * math.log(4.0) + 1}.get(name, 1.0))
        ids = rng.integers(0, model.runtime.spec.vocab, 150)
        compare(model.logits(ids), hf_logits(ref_model, ids))
        return
    # LongRoPE within the original context (32): short factors, for every sequence that fits.
    short = load_model(mlc, gpu=gpu, max_context=32, prefill_chunk=16, q8_decode=False, q8_prefill=False)
    ids = rng.integers(0, short.runtime.spec.vocab, 32)
    compare(short.logits(ids), hf_logits(ref_model, ids))
    # A longer context (128): long factors, as transformers uses for a whole sequence past 32 tokens.
    long = load_model(mlc, gpu=gpu, max_context=128, prefill_chunk=64, q8_decode=False, q8_prefill=False)
    assert long.runtime.spec.rope_scale == pytest.approx(math.sqrt(1 + math.log(128 / 32) / math.log(32)))
    ids = rng.integers(0, long.runtime.spec.vocab, 100)
    one_shot = hf_logits(ref_model, ids)
    ours = long.logits(ids)
    compare(ours, one_shot)

    # The rule: transformers rotated its cached keys with the short factors while the sequence was short, then
    # queries with the long ones; its incremental logits drift from its own one-shot logits past position 32,
    # by far more than the same incremental run drifts (f32 noise) while every position stays in one regime.
    drift = incremental_drift(ref_model, ids[:100], 32, one_shot)
    noise = incremental_drift(ref_model, ids[:32], 16, hf_logits(ref_model, ids[:32]))
    # Ours, one table for the whole context: decoding token by token gives the prefill's logits.
    long.runtime.reset()
    per_token = long.runtime.logits(ids, chunk=1)
    ours_drift = np.abs(per_token - ours).max() / np.abs(ours).max()
    assert ours_drift < DECODE_TOL[False], ours_drift
    assert drift > 100 * max(noise, 1e-7) and drift > 1e-3, (drift, noise)


def incremental_drift(model, ids, prefix: int, one_shot: np.ndarray) -> float:
    """transformers fed `prefix` tokens, then one token at a time with its KV cache: the largest difference of
    those logits from its one-shot logits of the whole sequence, relative to their max magnitude."""
    with torch.no_grad():
        out = model(torch.tensor(ids[None, :prefix]), use_cache=True)
        past, steps = out.past_key_values, []
        for t in range(prefix, len(ids)):
            out = model(torch.tensor(ids[None, t:t + 1]), past_key_values=past, use_cache=True)
            past = out.past_key_values
            steps.append(out.logits[0, -1].numpy())
    return float(np.abs(np.stack(steps) - one_shot[prefix:]).max() / np.abs(one_shot).max())


# ---- GGUF -------------------------------------------------------------------------------------------------------

def write_rope_gguf(path, arch, rng, meta: dict, extra_tensors: dict | None = None, context: int = 512):
    """A tiny GGUF laid out as llama.cpp's converter writes it, with rope metadata and factor tensors."""
    w = hf_weights(rng, arch, **DIMS)
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(context)
    writer.add_embedding_length(DIMS["dim"])
    writer.add_block_count(DIMS["layers"])
    writer.add_feed_forward_length(DIMS["ffn"])
    writer.add_head_count(DIMS["heads"])
    writer.add_head_count_kv(DIMS["kv_heads"])
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_key_length(DIMS["head_dim"])
    writer.add_value_length(DIMS["head_dim"])
    for key, value in meta.items():
        getattr(writer, key)(value)
    for name, arr in {**gguf_tensors(arch, w, **DIMS), **(extra_tensors or {})}.items():
        writer.add_tensor(name, arr.astype(np.float32 if arr.ndim == 1 else np.float16))  # F32 vectors, F16 matrices
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_spec(path):
    ckpt = GgufCheckpoint(path)
    module = model_module(ckpt.config["model_type"])
    return module.spec(module.ModelArgs.from_dict(ckpt.config, str(path)))


def llama3_freq_factors(hd, theta, factor, low, high, original):
    """rope_freqs as llama.cpp's convert_hf_to_gguf.py computes it for a llama3 config (LlamaModel)."""
    freqs = 1.0 / (theta ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
    out = []
    for freq in freqs.tolist():
        wavelen = 2 * math.pi / freq
        if wavelen < original / high:
            out.append(1.0)
        elif wavelen > original / low:
            out.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            out.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(out, np.float32)


@pytest.mark.model
def test_gguf_rope_freqs_match_transformers_llama3(tmp_path, rng):
    hd, theta = DIMS["head_dim"], 500000.0
    factors = llama3_freq_factors(hd, theta, 8.0, 1.0, 4.0, 64)
    path = write_rope_gguf(tmp_path / "l.gguf", "llama", rng, {"add_rope_freq_base": theta},
                           {"rope_freqs.weight": factors})
    config = transformers.LlamaConfig(hidden_size=DIMS["dim"], num_attention_heads=DIMS["heads"], rope_parameters=dict(
        rope_type="llama3", rope_theta=theta, factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
        original_max_position_embeddings=64))
    inv, _ = hf_rope(config)
    spec = gguf_spec(path)
    # Divisors rounded to f32 by the converter, then divided out: a few f32 roundings from transformers' blend.
    np.testing.assert_allclose(spec.inv_freq, inv, rtol=4e-7)
    assert spec.rope_scale == 1.0 and not np.allclose(spec.inv_freq, inv_freq_for(hd, theta))  # scaled at all


@pytest.mark.model
def test_gguf_longrope_matches_transformers_phi3(tmp_path, rng):
    hd = DIMS["head_dim"]
    attn = math.sqrt(1 + math.log(512 / 32) / math.log(32))  # what convert_hf_to_gguf.py writes for Phi-3
    path = write_rope_gguf(tmp_path / "p.gguf", "phi3", rng, {
        "add_rope_freq_base": 10000.0, "add_rope_scaling_orig_ctx_len": 32, "add_rope_scaling_attn_factors": attn,
        "add_rope_dimension_count": hd},
        {"rope_factors_long.weight": np.array(LONG8, np.float32),
         "rope_factors_short.weight": np.array(SHORT8, np.float32)})
    config = transformers.Phi3Config(hidden_size=DIMS["dim"], num_attention_heads=DIMS["heads"],
                                     max_position_embeddings=512, original_max_position_embeddings=32,
                                     rope_scaling=dict(type="longrope", short_factor=SHORT8, long_factor=LONG8))
    short, attention = hf_rope(config)
    long, _ = hf_rope(config, seq_len=33)
    spec = gguf_spec(path)
    assert_ulps(spec.rope.inv_freq, short)
    assert_ulps(spec.rope.long_inv_freq, long)
    assert spec.inv_freq is spec.rope.long_inv_freq  # the file's context (512) passes the original 32
    assert spec.rope_scale == pytest.approx(attention, rel=1e-7)  # stored as f32


@pytest.mark.model
def test_gguf_yarn_matches_transformers_qwen3(tmp_path, rng):
    from gguf import RopeScalingType

    path = write_rope_gguf(tmp_path / "q.gguf", "qwen3", rng, {
        "add_rope_freq_base": 1e6, "add_rope_scaling_type": RopeScalingType.YARN, "add_rope_scaling_factor": 4.0,
        "add_rope_scaling_orig_ctx_len": 32})
    config = transformers.Qwen3Config(hidden_size=DIMS["dim"], num_attention_heads=DIMS["heads"],
                                      head_dim=DIMS["head_dim"], max_position_embeddings=512, rope_parameters=dict(
                                          rope_type="yarn", rope_theta=1e6, factor=4.0,
                                          original_max_position_embeddings=32))
    inv, attention = hf_rope(config)
    spec = gguf_spec(path)
    assert_ulps(spec.inv_freq, inv)
    assert spec.rope_scale == pytest.approx(attention, rel=1e-12) and attention > 1
