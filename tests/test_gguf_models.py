"""GGUF models end to end: tiny random Llama/Qwen3/Phi3ForCausalLM (transformers) written as GGUF the way
llama.cpp's converter lays them out, in Q4_0, Q4_1, Q8_0 and F16, loaded with load_model → our logits vs
transformers running the same weights as ggml dequantizes them."""

import numpy as np
import pytest
from gguf import GGMLQuantizationType

from engine.model import load_model
from tests.helpers import (
    DECODE_TOL,
    cached_tiny_hf,
    compare,
    compare_int8,
    gguf_tensors,
    roundtrip,
    uses_q8,
    uses_q8_prefill,
    write_gguf,
)

pytestmark = pytest.mark.model
torch = pytest.importorskip("torch", reason="the model tests compare with transformers on torch (the test extra)")

Q = GGMLQuantizationType
CASES = {  # name: (model_type, matrix type, embedding type or None for the same)
    "llama-q4_0": ("llama", Q.Q4_0, None),
    "llama-q4_1-embed-q8_0": ("llama", Q.Q4_1, Q.Q8_0),  # the demo model's mix
    "llama-q8_0": ("llama", Q.Q8_0, None),
    "llama-f16": ("llama", Q.F16, None),
    "qwen3-q4_0": ("qwen3", Q.Q4_0, None),
    "qwen3-q8_0": ("qwen3", Q.Q8_0, None),
    "phi3-q4_1": ("phi3", Q.Q4_1, Q.F32),  # F32 matrices run on the f16 kernels
}
HF_KEYS = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
           "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
           "up": "mlp.up_proj", "down": "mlp.down_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}


def hf_to_flat(model, model_type):
    """transformers weights → the flat keys tests.helpers.gguf_tensors takes."""
    sd = {k: v.float().numpy() for k, v in model.state_dict().items()}
    cfg = model.config
    w = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        w["lm_head"] = sd["lm_head.weight"]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for ours, theirs in HF_KEYS.items():
            if p + theirs + ".weight" in sd:
                w[f"layers.{i}.{ours}"] = sd[p + theirs + ".weight"]
        if model_type == "phi3":  # fused in HF: split back into q/k/v and gate/up
            head_dim = cfg.hidden_size // cfg.num_attention_heads
            q_dim, kv_dim = cfg.num_attention_heads * head_dim, cfg.num_key_value_heads * head_dim
            qkv, gu = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
            w[f"layers.{i}.q"], w[f"layers.{i}.k"], w[f"layers.{i}.v"] = np.split(qkv, [q_dim, q_dim + kv_dim])
            w[f"layers.{i}.gate"], w[f"layers.{i}.up"] = np.split(gu, 2)
    return w


def reference_state(model, model_type, stored_types):
    """The HF state dict with every matrix replaced by ggml's round trip through its stored type."""
    sd = model.state_dict()
    for name, p in sd.items():
        if p.ndim == 2:
            t = stored_types["embed"] if "embed_tokens" in name else stored_types["matrix"]
            if t not in (Q.F32,):
                p.copy_(torch.from_numpy(roundtrip(p.numpy(), t).astype(np.float32)))
            if t in (Q.F32, Q.F16):  # our f16 kernels hold f32 matrices as f16
                p.copy_(p.half().float())


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    from transformers import AutoModelForCausalLM

    model_type, qtype, embed_type = CASES[request.param]
    hf_dir = cached_tiny_hf(model_type)
    hf = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    cfg = hf.config
    dims = dict(dim=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
                ffn=cfg.intermediate_size, vocab=cfg.vocab_size, layers=cfg.num_hidden_layers)
    tensors = gguf_tensors(model_type, hf_to_flat(hf, model_type), **dims)
    path = tmp_path_factory.mktemp(request.param) / f"{request.param}.gguf"
    embed_type = embed_type or qtype
    types = {"token_embd.weight": embed_type}
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    write_gguf(path, model_type, tensors, qtype=qtype, types=types, dims=dims, theta=float(theta),
               eps=float(cfg.rms_norm_eps))
    reference_state(hf, model_type, {"embed": embed_type, "matrix": qtype})
    return path, hf


def test_gguf_logits_match_transformers(gpu, case):
    path, hf = case
    model = load_model(path, gpu=gpu, max_context=256, prefill_chunk=64, q8_prefill=True)  # tiny: ask for int8
    ids = np.random.default_rng(0).integers(0, model.runtime.spec.vocab, 100)
    ours = model.logits(ids)
    with torch.no_grad():
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
    q8 = uses_q8(model.runtime)
    assert q8 == any(f in ("q4_0", "q4_1") for f in model.runtime.formats.values())  # 4-bit formats only
    assert uses_q8_prefill(model.runtime) == q8  # the prefill GEMMs too
    # the int8 decode matvecs (every matrix 4-bit) carry the norms; a quantize_q8 before down (gate_up_q8 is off)
    kernels = model.runtime.dispatched_kernels()
    assert ("matvec_q8_norm" in kernels) == q8
    assert "matvec_q8_rms_q8" not in kernels
    compare_int8(ours, ref) if q8 else compare(ours, ref)
    # Decode kernels (unfused QKV for non-MLC formats, per-format matvecs) agree with the prefill GEMMs.
    model.runtime.reset()
    per_token = model.runtime.logits(ids[:40], chunk=1)
    assert np.abs(per_token - ours[:40]).max() / np.abs(ours).max() < DECODE_TOL[q8]
    if q8:  # and with f32 activations everywhere: transformers' numbers, and decode computes what the GEMMs compute
        exact = load_model(path, gpu=gpu, max_context=256, prefill_chunk=64, q8_decode=False)
        full = exact.logits(ids)
        compare(full, ref)
        exact.runtime.reset()
        per_token = exact.runtime.logits(ids[:40], chunk=1)
        assert np.abs(per_token - full[:40]).max() / np.abs(full).max() < DECODE_TOL[False]
