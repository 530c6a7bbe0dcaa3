"""Bounds on every count and size read from a model file, checked before anything is allocated.

Model files come from the Hub, mirrors and other apps' folders: any of them may be damaged or hostile. Each
limit sits well above what real checkpoints use (the reason is beside it) and well below what would cost
gigabytes or minutes to honour. A value past a limit is refused with an error naming the file and field.
"""

from __future__ import annotations

# -- JSON (config.json, mlc-chat-config.json, manifests, safetensors indexes, tokenizer_config.json) --------
# The largest real ones (MLC manifests of 35B MoE builds, tokenizer configs listing every added token, HF
# indexes of 1,000-shard models) are a few MB; parsing more would cost Python objects many times its size.
MAX_JSON_BYTES = 64 << 20
# Real files nest under 10 levels; Python's parser recurses once per level (RecursionError near 1,000).
MAX_JSON_DEPTH = 64
# chat_template.jinja and friends: real templates are tens of KB.
MAX_TEXT_BYTES = 16 << 20

# -- safetensors -----------------------------------------------------------------------------------------
MAX_SAFETENSORS_HEADER = 100 << 20  # the safetensors format's own cap on its JSON header

# -- GGUF header -----------------------------------------------------------------------------------------
MAX_GGUF_KV = 1 << 16  # metadata keys: real files carry under 100
MAX_GGUF_TENSORS = 1 << 20  # real files hold a few thousand (experts are stacked into one tensor each)
MAX_GGUF_ARRAY = 1 << 24  # array elements: the largest real arrays are vocabularies/merges (< 1M entries)
MAX_GGUF_ARRAY_DEPTH = 8  # arrays of arrays: real files nest at most one level
MAX_GGUF_STRING = 16 << 20  # one metadata string: the longest real ones are chat templates (tens of KB)
MAX_GGUF_KEY = 1 << 16  # key length, the GGUF spec's bound
MAX_GGUF_TENSOR_NAME = 63  # ggml's GGML_MAX_NAME (64, with its terminating NUL); llama.cpp refuses longer
MAX_GGUF_DIMS = 4  # ggml's GGML_MAX_DIMS

# -- tokenizers ------------------------------------------------------------------------------------------
# Rebuilding SentencePiece merges tries every split of every token: work grows with the sum of squared token
# lengths (Llama 2's 32k vocabulary: ~1M; a 256k one: ~20M). Past this budget the vocabulary is not real.
MAX_SPM_MERGE_WORK = 1 << 28

# -- tensors and config numbers --------------------------------------------------------------------------
MAX_TENSOR_DIMS = 8  # real weights have 1 to 3 dimensions (expert stacks [E, N, K]; conv kernels [C, 1, K])

# config.json (and mlc-chat-config.json model_config, GGUF metadata mapped to the same names): the largest
# whole number accepted for each field. Released models stay far below: 126 layers (Llama-3.1-405B), hidden
# 16,384, FFN 53,248, 128 heads, head_dim 256, vocabularies of 262,144, 10M-token contexts (Llama 4 Scout), 512
# experts. Every integer field of an architecture's ModelArgs must be listed (tests/test_fuzz_formats.py).
CONFIG_LIMITS = {
    "num_hidden_layers": 1024,
    "hidden_size": 1 << 16,
    "intermediate_size": 1 << 18,
    "moe_intermediate_size": 1 << 18,
    "shared_expert_intermediate_size": 1 << 18,
    "num_attention_heads": 1024,
    "num_key_value_heads": 1024,
    "head_dim": 1024,
    "vocab_size": 1 << 22,
    "max_position_embeddings": 1 << 26,
    "original_max_position_embeddings": 1 << 26,
    "context_window_size": 1 << 26,
    "prefill_chunk_size": 1 << 26,
    "sliding_window": 1 << 26,
    "num_experts": 4096,
    "num_experts_per_tok": 4096,
    "decoder_sparse_step": 1024,
    "full_attention_interval": 1024,
    "linear_num_key_heads": 1024,
    "linear_num_value_heads": 1024,
    "linear_key_head_dim": 1024,
    "linear_value_head_dim": 1024,
    "linear_conv_kernel_dim": 64,
    "bos_token_id": 1 << 22,
    "eos_token_id": 1 << 22,
    "pad_token_id": 1 << 22,
}
MAX_UNLISTED_COUNT = 1 << 24  # any other whole-number field: a count no real config comes near
# Whole-number fields where 0 means "none" (a MoE config's dense width, no shared expert, no experts, token id 0).
CONFIG_MAY_BE_ZERO = {"intermediate_size", "shared_expert_intermediate_size", "num_experts", "sliding_window",
                      "bos_token_id", "eos_token_id", "pad_token_id"}
# tokenizer.json: real ones reach ~35 MB (262k-token vocabularies with their merges).
MAX_TOKENIZER_BYTES = 256 << 20
