"""The per-matrix types llama-quantize writes for a GGUF file type (llama.cpp's llama_tensor_get_type, the dense
llama / phi3 / qwen3 subset), as the runtime names them: memfit plans a catalog GGUF build from these without its
file, so the buffers it counts are the ones loading that file creates.

A K-type in a matrix whose rows are not whole 256-element super-blocks falls back as llama-quantize does (Q4_K to
Q5_0, Q5_K to Q5_1, Q6_K to Q8_0); norms stay F32 (run as f16, the runtime's default for vectors).
"""

from __future__ import annotations

QK_K = 256
FALLBACK = {"q4_k": "q5_0", "q5_k": "q5_1", "q6_k": "q8_0"}
FILE_TYPES = ("Q4_K_M", "Q4_1")  # the catalog's GGUF builds (general.file_type 15 and 3)


def use_more_bits(layer: int, layers: int) -> bool:
    """llama-quantize's layers that get the larger type in a _M mix: the first and last eighth, every third between."""
    return layer < layers // 8 or layer >= 7 * layers // 8 or (layer - layers // 8) % 3 == 2


def _fit(kind: str, cols: int) -> str:
    return FALLBACK.get(kind, kind) if cols % QK_K else kind


def file_type_formats(file_type: str, architecture: str, dims: dict) -> dict[str, str]:
    """Runtime format per canonical matrix (embed, lm_head, layers.i.qkv / o / gate_up / down) of a `file_type` file of
    this architecture and catalog dims; a fused qkv whose parts differ lists q, k, v."""
    if file_type not in FILE_TYPES:
        raise ValueError(f"GGUF file type {file_type!r}: known are {', '.join(FILE_TYPES)}")
    d, n = dims["hidden_size"], dims["num_layers"]
    attn, ffn, tied = dims["num_heads"] * dims["head_dim"], dims["ffn_dim"], dims.get("tied_embeddings", False)
    # The output matrix (or the tied embedding standing in for it): Q6_K, or Q8_0 where rows are not whole blocks.
    head = "q8_0" if d % QK_K else "q6_k"
    if file_type == "Q4_1":
        out = {"embed": head if tied else "q4_1"} | ({} if tied else {"lm_head": head})
        for i in range(n):
            for m in ("qkv", "o", "gate_up", "down"):
                out[f"layers.{i}.{m}"] = "q4_1"
        return out
    out = {"embed": head if tied else _fit("q4_k", d)} | ({} if tied else {"lm_head": head})
    for i in range(n):
        more = use_more_bits(i, n)
        if architecture == "phi3":  # one fused attn_qkv tensor: Q5_K in a Q4_K_M file
            out[f"layers.{i}.qkv"] = _fit("q5_k", d)
        else:  # attn_q, attn_k, attn_v: v gets Q6_K in the use_more_bits layers
            q = _fit("q4_k", d)
            v = _fit("q6_k" if more else "q4_k", d)
            out[f"layers.{i}.qkv"] = q if v == q else f"{q},{q},{v}"
        out[f"layers.{i}.o"] = _fit("q4_k", attn)
        out[f"layers.{i}.gate_up"] = _fit("q4_k", d)
        out[f"layers.{i}.down"] = _fit("q6_k" if more else "q4_k", ffn)
    return out
