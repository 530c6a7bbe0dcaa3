"""Tiny random Hugging Face checkpoints (phi3, llama, qwen3, qwen3_5, qwen3_5_moe) for format, converter and model
tests.

`make_tiny_hf` builds one with transformers (float32, seeded) and saves it as safetensors, plus a small
byte-level tokenizer; `cached_tiny_hf` keeps built copies under .cache/tiny-models so repeated runs
skip the torch work. Treat cached folders as read-only; copy one before editing it.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

CACHE = Path(__file__).resolve().parent.parent / ".cache" / "tiny-models"

# Hidden and intermediate sizes are multiples of 32 (the q4f16_1 group); ids 0/1/2 are pad/bos/eos.
_COMMON = dict(
    vocab_size=288, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
    max_position_embeddings=512, rms_norm_eps=1e-5, pad_token_id=0, bos_token_id=1, eos_token_id=2,
)
DEFAULTS = {
    "phi3": dict(_COMMON, num_key_value_heads=4, original_max_position_embeddings=512, rope_scaling=None,
                 tie_word_embeddings=False),
    "llama": dict(_COMMON, num_key_value_heads=2, rope_scaling=None, tie_word_embeddings=False),
    # Like Qwen3-0.6B: explicit head_dim, q/k norms, embedding shared with the LM head.
    "qwen3": dict(_COMMON, num_key_value_heads=2, head_dim=16, rope_scaling=None, tie_word_embeddings=True),
    # Qwen3.5 text model (Qwen3_5ForCausalLM, model_type qwen3_5_text) shaped like Qwen3.5-4B in miniature:
    # GDN layers around one gated full-attention layer, 2 value heads per key head (GVA), partial RoPE
    # (25% of head_dim 32 = 8 dims), tied embeddings. Weights at std 0.1 rather than 0.02: at 0.02 the GDN
    # layers moved the logits by only ~3% in all, too little for a logits test to notice a broken kernel.
    "qwen3_5": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=True,
                    initializer_range=0.1,
                    layer_types=["linear_attention", "full_attention", "linear_attention", "linear_attention"],
                    linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                    linear_value_head_dim=32, linear_conv_kernel_dim=4,
                    rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
    # Qwen3.5-MoE text model (Qwen3_5MoeForCausalLM, model_type qwen3_5_moe_text): the qwen3_5 hybrid above with
    # every MLP a MoE block of 8 experts (width 32), top-2, and a shared expert twice as wide (64), which keeps it
    # out of the expert stack (its own dispatches); two attention layers. Untied LM head, like Qwen3.6.
    "qwen3_5_moe": dict(_COMMON, num_hidden_layers=4, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False,
                        initializer_range=0.1,
                        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
                        linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                        linear_value_head_dim=32, linear_conv_kernel_dim=4, num_experts=8, num_experts_per_tok=2,
                        moe_intermediate_size=32, shared_expert_intermediate_size=64,
                        rope_parameters=dict(rope_type="default", rope_theta=10000.0, partial_rotary_factor=0.25)),
}
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}<|end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _classes(model_type: str):
    import transformers as tf

    return {
        "phi3": (tf.Phi3Config, tf.Phi3ForCausalLM),
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
        "qwen3_5": (tf.Qwen3_5TextConfig, tf.Qwen3_5ForCausalLM),
        "qwen3_5_moe": (tf.Qwen3_5MoeTextConfig, tf.Qwen3_5MoeForCausalLM),
    }[model_type]


def make_tiny_hf(model_type: str, out_dir: str | os.PathLike, seed: int = 0, tokenizer: bool = True,
                 **config_overrides) -> Path:
    """Build a tiny random `model_type` model and save it to `out_dir` (safetensors); returns the folder.

    Norm weights are random but f16-exact (0.5..1.5), so a misplaced or mis-rounded norm shows up.
    """
    import torch

    if model_type not in DEFAULTS:
        raise ValueError(f"no tiny config for {model_type!r}; have {', '.join(DEFAULTS)}")
    config_cls, model_cls = _classes(model_type)
    config = config_cls(**{**DEFAULTS[model_type], **config_overrides})
    torch.manual_seed(seed)
    model = model_cls(config).to(torch.float32).eval()
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.ndim == 1 and name.endswith("norm.weight"):
                p.copy_((0.5 + torch.rand(p.shape, generator=gen)).half().float())
        if model_type in ("qwen3_5", "qwen3_5_moe"):
            _qwen3_5_init(model, gen)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(out, safe_serialization=True)
    if tokenizer:
        write_tiny_tokenizer(out, config.vocab_size)
    return out


def _qwen3_5_init(model, gen) -> None:
    """Zero-centred norms (y = x̂·(1 + w)) get w in [-0.5, 0.5), so the baked-in +1 is exercised; slow
    GDN decays (A = exp(A_log) in [0.05, 1), dt_bias ~ N(0, 0.5)) keep the state carrying information
    across many tokens, unlike the default init's A up to 16."""
    import torch

    for name, p in model.named_parameters():
        if p.ndim == 1 and name.endswith("norm.weight") and ".linear_attn." not in name:
            p.copy_((torch.rand(p.shape, generator=gen) - 0.5).half().float())
        elif name.endswith(".A_log"):
            p.copy_(torch.log(0.05 + 0.95 * torch.rand(p.shape, generator=gen)))
        elif name.endswith(".dt_bias"):
            p.copy_(0.5 * torch.randn(p.shape, generator=gen))


def write_tiny_tokenizer(out_dir: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer.json (no merges) whose ids all fit in `vocab_size`.

    Ids 0/1/2 are <unk>/<s>/</s>; then single byte-level symbols, printable ASCII first, as many as fit.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()
    printable = [chr(c) for c in range(0x21, 0x7F)]
    symbols = printable + sorted(set(alphabet) - set(printable))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2}
    for s in symbols[: max(vocab_size - 3, 0)]:
        vocab[s] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(["<unk>", "<s>", "</s>"])
    tok.save(str(out_dir / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
        "unk_token": "<unk>", "pad_token": "<unk>", "model_max_length": 512, "chat_template": CHAT_TEMPLATE,
    }
    (out_dir / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def cached_tiny_hf(model_type: str, seed: int = 0, **config_overrides) -> Path:
    """Like make_tiny_hf, but built once per (type, seed, overrides, transformers version) and reused."""
    import transformers

    key = json.dumps([model_type, seed, config_overrides, transformers.__version__, _source_hash()],
                     sort_keys=True, default=str)
    path = CACHE / f"{model_type}-{hashlib.sha1(key.encode()).hexdigest()[:12]}"
    if not (path / "config.json").is_file():
        CACHE.mkdir(parents=True, exist_ok=True)
        # Build beside the cache and rename, so a concurrent or interrupted run never sees half a model.
        tmp = Path(tempfile.mkdtemp(dir=CACHE, prefix=".build-"))
        make_tiny_hf(model_type, tmp, seed=seed, **config_overrides)
        try:
            tmp.rename(path)
        except OSError:  # another process finished first
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def _source_hash() -> str:
    # Rebuild cached models whenever this file changes.
    return hashlib.sha1(Path(__file__).read_bytes()).hexdigest()[:8]
