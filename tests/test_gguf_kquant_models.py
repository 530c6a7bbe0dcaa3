"""GGUF models in the K-quants (Q2_K … Q6_K) and Q5_0 / Q5_1, alone and in the per-tensor mixes llama-quantize
writes (Q4_K_M: Q4_K matrices, Q6_K output and some attn_v / ffn_down, Q5_0 / Q8_0 where rows are not a multiple of
256), end to end through load_model, against transformers in float64 on the weights gguf.quants.dequantize gives
for the stored blocks, at every position.

The gguf package quantizes none of the K types, so their blocks are random bytes (every code, scale and minimum
occurs) with d / dmin scaled so the weights have the tiny models' spread; Q4_0 … Q8_0 blocks come from gguf's own
quantizers. The reference runs the dequantized weights, so the comparison tests our reading and arithmetic of the
blocks, not the quantization.

The reference keeps its KV cache in f16 as the runtime does, so with f32 activations (--exact-decode) only f32
against float64 rounding is left: F32_TOL of max |logit| at every position, prefill and per-token decode. With int8
activations the reference rounds the input of every product the runtime runs on int8 (per 32 elements, step
max|x|/127, to nearest): the two agree to f32 rounding (measured ≤ 5e-7) up to the first position where f32 and
float64 put an activation on either side of a half step and one code differs by one, which the KV cache carries
on; from there they stay within the model tests' int8 tolerance, DECODE_TOL[True] (measured ≤ 1.4%).
"""

import contextlib
import importlib
import zlib

import numpy as np
import pytest
from gguf import GGMLQuantizationType
from gguf.quants import dequantize as gguf_dequantize
from gguf.quants import quantize as gguf_quantize

from engine.cli import main as cli_main
from engine.formats import kquant
from engine.formats.gguf import unpermute_index
from engine.kquant_plan import BINDINGS
from engine.model import load_model
from tests.helpers import DECODE_TOL, cached_tiny_hf, gguf_tensors, kquant_raw, write_gguf

pytestmark = pytest.mark.model
torch = pytest.importorskip("torch", reason="the model tests compare with transformers on torch (the test extra)")

Q = GGMLQuantizationType
STD = 0.02  # weight spread of the random blocks, as the tiny HF models initialise theirs
# f32 against float64 over a forward: each product rounds by at most K·2^-24 of Σ|w·x| (K ≤ 512 here: 3e-5), a
# few such steps in sequence (2 layers, the head), softmax and norms adding their own ulps. Measured ≤ 2.4e-5.
F32_TOL = 2e-4


def stored_blocks(rng, arr: np.ndarray, qtype) -> np.ndarray:
    """A 2-D float tensor stored in `qtype`: K types as random blocks, the rest quantized by gguf."""
    if qtype in kquant.TAGS and kquant.TYPES[kquant.TAGS[qtype]].elements == 256:
        return kquant_raw(rng, qtype, *arr.shape, std=STD)
    return gguf_quantize(arr.astype(np.float32), qtype)


# Per case: model type, HF config overrides, the default matrix type, and per-tensor types (GGUF name → type, "*"
# for every layer) where they differ.
SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, head_dim=64)
CASES = {
    "llama-q4_k": ("llama", SHAPE, Q.Q4_K, {}),
    "llama-q2_k": ("llama", SHAPE, Q.Q2_K, {}),
    "llama-q3_k": ("llama", SHAPE, Q.Q3_K, {}),
    "phi3-q5_k-output-q6_k": ("phi3", dict(SHAPE, num_key_value_heads=4), Q.Q5_K, {"output.weight": Q.Q6_K}),
    "qwen3-q6_k": ("qwen3", SHAPE, Q.Q6_K, {}),  # tied: the Q6_K embedding is the LM head too
    "qwen3-q5_0-embed-q5_1": ("qwen3", SHAPE, Q.Q5_0, {"token_embd.weight": Q.Q5_1}),
    "llama-q5_1": ("llama", SHAPE, Q.Q5_1, {}),
    # llama-quantize Q4_K_M on a model whose FFN width (384) is not a multiple of 256: ffn_down falls back to Q5_0
    # (Q8_0 where Q6_K was due); attn_v and ffn_down of layer 0 get more bits (use_more_bits), the output Q6_K.
    "llama-q4_k_m": ("llama", dict(SHAPE, intermediate_size=384), Q.Q4_K,
                     {"output.weight": Q.Q6_K, "blk.0.attn_v.weight": Q.Q6_K, "blk.0.ffn_down.weight": Q.Q8_0,
                      "blk.1.ffn_down.weight": Q.Q5_0}),
    # Q4_K_M on a model of width 192 (Qwen2.5-0.5B, SmolLM2 are like it): every matrix with 192-wide rows falls
    # back to Q5_0, Q8_0 where Q6_K was due (the tied embedding, layer 0's attn_v); ffn_down (512 wide) stays K.
    "qwen3-q4_k_m-fallbacks": ("qwen3", dict(SHAPE, hidden_size=192, num_attention_heads=3, num_key_value_heads=1),
                               Q.Q5_0, {"token_embd.weight": Q.Q8_0, "blk.0.attn_v.weight": Q.Q8_0,
                                        "blk.0.ffn_down.weight": Q.Q6_K, "blk.1.ffn_down.weight": Q.Q4_K}),
}


def hf_to_flat(sd: dict, cfg, model_type: str) -> dict:
    """transformers weights → the flat keys tests.helpers.gguf_tensors takes."""
    keys = {"attn_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm", "q": "self_attn.q_proj",
            "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj", "gate": "mlp.gate_proj",
            "up": "mlp.up_proj", "down": "mlp.down_proj", "q_norm": "self_attn.q_norm", "k_norm": "self_attn.k_norm"}
    w = {"embed": sd["model.embed_tokens.weight"], "norm": sd["model.norm.weight"]}
    if not cfg.tie_word_embeddings:
        w["lm_head"] = sd["lm_head.weight"]
    hd = cfg.head_dim
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        w |= {f"layers.{i}.{ours}": sd[p + theirs + ".weight"] for ours, theirs in keys.items()
              if p + theirs + ".weight" in sd}
        if model_type == "phi3":
            q_dim, kv_dim = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
            qkv, gu = sd[p + "self_attn.qkv_proj.weight"], sd[p + "mlp.gate_up_proj.weight"]
            w[f"layers.{i}.q"], w[f"layers.{i}.k"], w[f"layers.{i}.v"] = np.split(qkv, [q_dim, q_dim + kv_dim])
            w[f"layers.{i}.gate"], w[f"layers.{i}.up"] = np.split(gu, 2)
    return w


def gguf_to_hf(name: str, model_type: str, cfg) -> tuple[str, int | None]:
    """The HF parameter a GGUF matrix fills, and the heads of llama.cpp's q/k row permutation to undo (or None)."""
    if name == "token_embd.weight":
        return "model.embed_tokens.weight", None
    if name == "output.weight":
        return "lm_head.weight", None
    _, i, part, _ = name.split(".")
    p = f"model.layers.{i}."
    theirs = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
              "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_down": "mlp.down_proj",
              "attn_qkv": "self_attn.qkv_proj",
              "ffn_up": "mlp.gate_up_proj" if model_type == "phi3" else "mlp.up_proj"}[part]
    heads = None
    if model_type == "llama" and part in ("attn_q", "attn_k"):
        heads = cfg.num_attention_heads if part == "attn_q" else cfg.num_key_value_heads
    return p + theirs + ".weight", heads


def build_case(name: str, folder, case: tuple | None = None):
    """(GGUF path, float64 transformers model on the stored blocks' dequantized weights, {GGUF matrix: type})."""
    from transformers import AutoModelForCausalLM

    model_type, overrides, default, types = case or CASES[name]
    hf = AutoModelForCausalLM.from_pretrained(cached_tiny_hf(model_type, **overrides), torch_dtype=torch.float32)
    hf = hf.double().eval()
    cfg = hf.config
    sd = {k: v.float().numpy() for k, v in hf.state_dict().items()}
    dims = dict(dim=cfg.hidden_size, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads,
                head_dim=cfg.head_dim, ffn=cfg.intermediate_size, vocab=cfg.vocab_size, layers=cfg.num_hidden_layers)
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    tensors = {}
    for gname, arr in gguf_tensors(model_type, hf_to_flat(sd, cfg, model_type), **dims).items():
        if arr.ndim == 1:
            tensors[gname] = arr
            continue
        qtype = types.get(gname, default)
        tensors[gname] = (stored_blocks(rng, arr, qtype), qtype)
    path = folder / f"{name}.gguf"
    theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta") or cfg.rope_theta
    write_gguf(path, model_type, tensors, dims=dims, theta=float(theta), eps=float(cfg.rms_norm_eps))
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for gname, value in tensors.items():
            if not isinstance(value, tuple):
                continue
            raw, qtype = value
            w = gguf_dequantize(raw, qtype).astype(np.float64)
            target, heads = gguf_to_hf(gname, model_type, cfg)
            if heads:  # stored row r is HF row dest[r]
                back = np.empty_like(w)
                back[unpermute_index(len(w), heads)] = w
                w = back
            params[target].copy_(torch.from_numpy(w))
    return path, hf, {g: v[1] for g, v in tensors.items() if isinstance(v, tuple)}


INT8_TYPES = {Q.Q4_0, Q.Q4_1, *kquant.TAGS}  # the stored types whose products take int8 activations


def int8_inputs(hf, model_type: str, types: dict):
    """Forward pre-hooks that round the input rows of every HF linear whose weight is stored in an INT8_TYPES type
    to int8 as quantize_q8 does (per 32-element chunk, step max|x|/127, to nearest): the reference then computes
    what the int8-activation kernels compute, in float64. Returns the hook handles."""
    def round_q8(module, args):
        x = args[0]
        chunks = x.reshape(*x.shape[:-1], -1, 32)
        step = chunks.abs().amax(-1, keepdim=True) / 127
        q = torch.where(step > 0, torch.round(chunks / torch.where(step > 0, step, 1)), 0) * step
        return (q.reshape(x.shape),)

    modules = dict(hf.named_modules())
    handles = []
    for gname, qtype in types.items():
        if qtype in INT8_TYPES:
            target = gguf_to_hf(gname, model_type, hf.config)[0].removesuffix(".weight")
            if target == "model.embed_tokens":  # the LM head when tied; the embedding itself is no product
                if not hf.config.tie_word_embeddings:
                    continue
                target = "lm_head"
            handles.append(modules[target].register_forward_pre_hook(round_q8))
    return handles


@contextlib.contextmanager
def f16_kv_cache(hf, model_type: str):
    """The reference keeps keys (after RoPE and any q/k norm) and values in f16, as the runtime's KV cache does, so
    that what is left between the two is f32 against float64 rounding."""
    module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    eager = module.eager_attention_forward
    impl = hf.config._attn_implementation

    def rounded(mod, query, key, value, *args, **kwargs):
        return eager(mod, query, key.half().to(key.dtype), value.half().to(value.dtype), *args, **kwargs)

    module.eager_attention_forward = rounded
    hf.config._attn_implementation = "eager"
    try:
        yield
    finally:
        module.eager_attention_forward = eager
        hf.config._attn_implementation = impl


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory):
    return request.param, *build_case(request.param, tmp_path_factory.mktemp(request.param))


def kq_kernels(rt) -> set[str]:
    return {k for k in rt.dispatched_kernels() + rt.dispatched_kernels(8) if "_kq" in k}


# The int8 decode matvec of each type on these tiny models, every matrix of fewer than FEW_ROWS_N outputs (so
# Q2_K / Q3_K / Q4_K on the wide kernels: engine/kquant_plan.py matvec_kq_q8_kernel; BENCH.md, K-quant int8 decode).
INT8_DECODE_KERNEL = {Q.Q2_K: "matvec_kq_q8_wide", Q.Q3_K: "matvec_kq_q8_wide", Q.Q4_K: "matvec_kq_q8_wide_vec4",
                      Q.Q5_K: "matvec_kq_q8_vec4", Q.Q6_K: "matvec_kq_q8_vec4", Q.Q5_0: "matvec_kq_q8",
                      Q.Q5_1: "matvec_kq_q8"}
INT8_DECODE_KERNELS = {k for k in BINDINGS if k.startswith("matvec_kq_q8")}  # every int8 one, whatever N picks


def int8_decode_kernels(types: dict) -> set[str]:
    """The int8 decode matvecs the model's K-quant products run; the embedding table is a product only as the tied
    LM head."""
    head = "output.weight" if "output.weight" in types else "token_embd.weight"
    return {INT8_DECODE_KERNEL[q] for g, q in types.items()
            if q in kquant.TAGS and (g != "token_embd.weight" or g == head)}


def position_errors(ours, ref) -> np.ndarray:
    """Per position: max |ours − ref| over the vocabulary, relative to max |ref| over all positions."""
    return np.abs(ours - ref).max(1) / np.abs(ref).max()


@pytest.mark.slow
def test_kquant_gguf_logits_match_float64_reference(gpu, case):
    name, path, hf, types = case
    model_type = CASES[name][0]
    ids = np.random.default_rng(0).integers(3, hf.config.vocab_size, 64)
    with torch.no_grad(), f16_kv_cache(hf, model_type):
        ref = hf(torch.tensor(ids[None])).logits[0].numpy()
        handles = int8_inputs(hf, model_type, types)
        ref_int8 = hf(torch.tensor(ids[None])).logits[0].numpy()
        for h in handles:
            h.remove()
    # f32 activations everywhere (--exact-decode), prefill GEMMs and per-token decode matvecs: the reference's
    # numbers up to f32 rounding at every position
    exact = load_model(path, gpu=gpu, max_context=128, prefill_chunk=32, q8_decode=False)
    full = exact.logits(ids)
    assert position_errors(full, ref).max() <= F32_TOL
    assert "matvec_kq" in kq_kernels(exact.runtime)
    assert not kq_kernels(exact.runtime) & INT8_DECODE_KERNELS
    exact.runtime.reset()
    per_token = exact.runtime.logits(ids[:24], chunk=1)
    assert position_errors(per_token, ref[:24]).max() <= F32_TOL
    del exact
    if name == "llama-q4_k_m":  # `zerotvm logits --exact-decode` runs that arithmetic (once: each run makes a device)
        out = path.with_suffix(".npy")
        ids_arg = ",".join(map(str, ids))
        assert cli_main(["logits", str(path), "--ids", ids_arg, "--context", "128", "--exact-decode", "--out",
                         str(out)]) == 0
        assert position_errors(np.load(out), ref).max() <= F32_TOL
    # int8 activations (the default), decode and prefill: the reference with the same int8 rounding of every int8
    # product's input. The two agree to f32 rounding until a code rounds the other way (f32 and float64 put an
    # activation on either side of a half step: one element moves by a whole step), which the KV cache carries to
    # the later positions; every position stays within the model tests' int8 tolerance.
    model = load_model(path, gpu=gpu, max_context=128, prefill_chunk=32, q8_prefill=True)
    rt = model.runtime
    ours = model.logits(ids)
    assert "matmul_kq_q8" in kq_kernels(rt)
    assert kq_kernels(rt) & INT8_DECODE_KERNELS == int8_decode_kernels(types)
    errors = position_errors(ours, ref_int8)
    assert errors.max() <= DECODE_TOL[True], np.round(errors, 5)
    rt.reset()
    per_token = rt.logits(ids[:24], chunk=1)
    errors = position_errors(per_token, ref_int8[:24])
    assert errors.max() <= DECODE_TOL[True], np.round(errors, 5)


@pytest.mark.slow
def test_kquant_vocab_tables_bound_in_parts(gpu, tmp_path, monkeypatch):
    """A K-quant embedding / LM head bigger than one storage binding (Qwen3-4B's Q6_K table is 316 MB) is bound in
    row parts, each on a 256-byte offset of both arrays (q_blocks and the split-off d): same logits, decode and
    per-token logits as the single-binding run."""
    # Tied: the Q6_K table is embedding and LM head; a vocabulary of 4096 (ids past the tiny tokenizer's are
    # fine for logits) makes it 860 KB against 106 KB for the biggest layer matrix.
    wide = ("qwen3", dict(SHAPE, vocab_size=4096, intermediate_size=256), Q.Q6_K, {})
    path, _, _ = build_case("qwen3-q6_k-wide-vocab", tmp_path, wide)
    ids = np.random.default_rng(4).integers(3, 4096, 24).tolist()
    for exact in (False, True):
        whole = load_model(path, gpu=gpu, max_context=64, q8_decode=not exact)
        ref = whole.logits(ids)
        whole.runtime.reset()
        ref_per_token = whole.runtime.logits(ids, chunk=1)
        with monkeypatch.context() as m:
            # 208 + 2 bytes a row (one 256-block: 52 words, one f16 d): 512-row parts (a multiple of 128 keeps
            # both arrays on 256-byte offsets), 8 of them
            m.setattr(gpu, "max_binding", 131072)
            split = load_model(path, gpu=gpu, max_context=64, prefill_chunk=8, q8_decode=not exact)
        assert len(split.runtime.vocab.embed_parts) == 8 and len(split.runtime.vocab.lm_decode) == 8
        np.testing.assert_allclose(split.logits(ids), ref, rtol=0, atol=F32_TOL * np.abs(ref).max())
        split.runtime.reset()
        np.testing.assert_allclose(split.runtime.logits(ids, chunk=1), ref_per_token, rtol=0,
                                   atol=F32_TOL * np.abs(ref).max())
