"""Random-weight Q4_0 GGUFs in llama.cpp's own layouts for the four catalog architectures, for
bench/compare_llamacpp.py: `phi3`, `qwen3`, `qwen35` (Qwen3.5 hybrid: GDN + gated attention, dense MLP) and
`qwen35moe` (Qwen3.6: the same mixers, 256 routed experts top-8 and a shared expert). Tensor names, ggml shapes and
the hyperparameter keys follow llama.cpp's loaders (src/models/qwen35.cpp, qwen35moe.cpp at 0c1e57098) and its
converter (conversion/qwen.py): matrices Q4_0; norms, the GDN conv/dt/A, the router and the shared-expert gate F32,
as llama-quantize leaves them. Scales keep activations finite through random layers (the MoE router then spreads
tokens over experts as a real model does, which the speed of a MoE depends on).

`expected(cfg)` lists every tensor (name -> (numpy shape, type name)) so a writer is checked against its own table
(`check`), and the table against llama.cpp by loading the file (compare_llamacpp.py --build-only).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

Q4 = "Q4_0"
F32 = "F32"


def shape_config(shape: str) -> dict:
    """The GGUF config of a benchmark shape (engine.bench SHAPES / engine.bench_hybrid HYBRID_SHAPES)."""
    from engine.bench import SHAPES
    from engine.bench_hybrid import HYBRID_SHAPES

    if shape in SHAPES:
        d, n_layers, h, kvh, hd, ffn, vocab, eps, theta, ctx, tied, qk = SHAPES[shape]
        arch = "phi3" if shape.startswith("phi3") else "qwen3"
        return dict(arch=arch, d=d, layers=n_layers, heads=h, kv_heads=kvh, head_dim=hd, ffn=ffn, vocab=vocab,
                    eps=eps, theta=theta, ctx=min(ctx, 4096), tied=tied, qk_norm=qk)
    if shape not in HYBRID_SHAPES:
        raise ValueError(f"unknown shape {shape!r}; known: {', '.join([*SHAPES, *HYBRID_SHAPES])}")
    model_type, c, _, _ = HYBRID_SHAPES[shape]
    rope = c["rope_parameters"]
    out = dict(arch="qwen35moe" if model_type == "qwen3_5_moe" else "qwen35", d=c["hidden_size"],
               layers=c["num_hidden_layers"], heads=c["num_attention_heads"], kv_heads=c["num_key_value_heads"],
               head_dim=c["head_dim"], vocab=c["vocab_size"], eps=1e-6, theta=rope["rope_theta"], ctx=4096,
               tied=c["tie_word_embeddings"], qk_norm=True, rot=int(c["head_dim"] * rope["partial_rotary_factor"]),
               interval=c["full_attention_interval"], conv=c["linear_conv_kernel_dim"],
               k_heads=c["linear_num_key_heads"], v_heads=c["linear_num_value_heads"],
               k_dim=c["linear_key_head_dim"], v_dim=c["linear_value_head_dim"])
    if model_type == "qwen3_5_moe":
        out |= dict(experts=c["num_experts"], top_k=c["num_experts_per_tok"], expert_ffn=c["moe_intermediate_size"],
                    shared_ffn=c["shared_expert_intermediate_size"])
    else:
        out |= dict(ffn=c["intermediate_size"])
    return out


# Small configs of each architecture for --build-only: a CPU llama.cpp loads and runs them in seconds.
TINY = {
    "phi3": dict(arch="phi3", d=128, layers=2, heads=4, kv_heads=4, head_dim=32, ffn=256, vocab=512, eps=1e-5,
                 theta=10000.0, ctx=512, tied=False, qk_norm=False),
    "qwen3": dict(arch="qwen3", d=128, layers=2, heads=4, kv_heads=2, head_dim=32, ffn=256, vocab=512, eps=1e-6,
                  theta=1e6, ctx=512, tied=True, qk_norm=True),
    "qwen35": dict(arch="qwen35", d=128, layers=4, heads=2, kv_heads=1, head_dim=64, vocab=512, eps=1e-6, theta=1e7,
                   ctx=512, tied=True, qk_norm=True, rot=16, interval=4, conv=4, k_heads=1, v_heads=2, k_dim=64,
                   v_dim=64, ffn=256),
    "qwen35moe": dict(arch="qwen35moe", d=128, layers=4, heads=2, kv_heads=1, head_dim=64, vocab=512, eps=1e-6,
                      theta=1e7, ctx=512, tied=False, qk_norm=True, rot=16, interval=4, conv=4, k_heads=1, v_heads=2,
                      k_dim=64, v_dim=64, experts=8, top_k=2, expert_ffn=64, shared_ffn=64),
}


def is_recurrent(cfg: dict, i: int) -> bool:
    """llama.cpp's default layer pattern: every `interval`-th layer is full attention, the rest GDN."""
    return (i + 1) % cfg["interval"] != 0


def expected(cfg: dict) -> dict[str, tuple[tuple[int, ...], str]]:
    """Every tensor of the GGUF: name -> (numpy shape, i.e. ggml ne reversed, and type)."""
    d, h, kvh, hd, arch = cfg["d"], cfg["heads"], cfg["kv_heads"], cfg["head_dim"], cfg["arch"]
    out = {"token_embd.weight": ((cfg["vocab"], d), Q4), "output_norm.weight": ((d,), F32)}
    if not cfg["tied"]:
        out["output.weight"] = ((cfg["vocab"], d), Q4)
    hybrid = arch in ("qwen35", "qwen35moe")
    for i in range(cfg["layers"]):
        b = f"blk.{i}."
        out[b + "attn_norm.weight"] = ((d,), F32)
        out[b + ("post_attention_norm.weight" if hybrid else "ffn_norm.weight")] = ((d,), F32)
        if hybrid and is_recurrent(cfg, i):
            key, value = cfg["k_heads"] * cfg["k_dim"], cfg["v_heads"] * cfg["v_dim"]
            out |= {b + "attn_qkv.weight": ((2 * key + value, d), Q4), b + "attn_gate.weight": ((value, d), Q4),
                    b + "ssm_conv1d.weight": ((2 * key + value, cfg["conv"]), F32),
                    b + "ssm_dt.bias": ((cfg["v_heads"],), F32), b + "ssm_a": ((cfg["v_heads"],), F32),
                    b + "ssm_beta.weight": ((cfg["v_heads"], d), Q4), b + "ssm_alpha.weight": ((cfg["v_heads"], d), Q4),
                    b + "ssm_norm.weight": ((cfg["v_dim"],), F32), b + "ssm_out.weight": ((d, value), Q4)}
        elif arch == "phi3":
            out[b + "attn_qkv.weight"] = (((h + 2 * kvh) * hd, d), Q4)
            out[b + "attn_output.weight"] = ((d, h * hd), Q4)
        else:
            q_rows = h * hd * (2 if hybrid else 1)  # the hybrids' q rows carry the output gate
            out |= {b + "attn_q.weight": ((q_rows, d), Q4), b + "attn_k.weight": ((kvh * hd, d), Q4),
                    b + "attn_v.weight": ((kvh * hd, d), Q4), b + "attn_output.weight": ((d, h * hd), Q4)}
            if cfg["qk_norm"]:
                out |= {b + "attn_q_norm.weight": ((hd,), F32), b + "attn_k_norm.weight": ((hd,), F32)}
        if arch == "qwen35moe":
            E, F, Fs = cfg["experts"], cfg["expert_ffn"], cfg["shared_ffn"]
            out |= {b + "ffn_gate_inp.weight": ((E, d), F32), b + "ffn_gate_exps.weight": ((E, F, d), Q4),
                    b + "ffn_up_exps.weight": ((E, F, d), Q4), b + "ffn_down_exps.weight": ((E, d, F), Q4),
                    b + "ffn_gate_inp_shexp.weight": ((d,), F32), b + "ffn_gate_shexp.weight": ((Fs, d), Q4),
                    b + "ffn_up_shexp.weight": ((Fs, d), Q4), b + "ffn_down_shexp.weight": ((d, Fs), Q4)}
        elif arch == "phi3":
            out |= {b + "ffn_up.weight": ((2 * cfg["ffn"], d), Q4), b + "ffn_down.weight": ((d, cfg["ffn"]), Q4)}
        else:
            out |= {b + "ffn_gate.weight": ((cfg["ffn"], d), Q4), b + "ffn_up.weight": ((cfg["ffn"], d), Q4),
                    b + "ffn_down.weight": ((d, cfg["ffn"]), Q4)}
    return out


def _q4_0(rng, shape: tuple[int, ...]) -> np.ndarray:
    """Random Q4_0 blocks (18 bytes per 32 weights: f16 d, 16 bytes of nibbles) as raw bytes [..., K/32·18]; d keeps
    a row's dot product with unit activations near 0.1 (the codes' spread is ~4.6·d)."""
    *lead, k = shape
    blocks = rng.integers(0, 256, size=(*lead, k // 32, 18), dtype=np.uint8)
    blocks[..., :2] = np.frombuffer(np.float16(0.1 / (4.6 * np.sqrt(k))).tobytes(), np.uint8)
    return blocks.reshape(*lead, -1)


def _f32(rng, name: str, shape: tuple[int, ...]) -> np.ndarray:
    if name.endswith("ssm_a"):  # A = −exp(A_log), as the converter writes it
        return -rng.uniform(0.05, 1.0, shape).astype(np.float32)
    if name.endswith("ssm_dt.bias"):
        return rng.normal(0, 0.5, shape).astype(np.float32)
    if name.endswith(("ssm_conv1d.weight", "ffn_gate_inp.weight", "ffn_gate_inp_shexp.weight")):
        return rng.normal(0, 1 / np.sqrt(shape[-1]), shape).astype(np.float32)
    return np.ones(shape, np.float32)  # norms


def write(cfg: dict, path: Path) -> Path:
    """Write the GGUF of `cfg` (skipped when `path` exists). One random array per distinct (shape, role) is shared
    by every layer, so a 35B-parameter file costs one layer of random numbers."""
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType

    if path.exists():
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    arch, d, vocab = cfg["arch"], cfg["d"], cfg["vocab"]
    w = GGUFWriter(str(path), arch)
    w.add_name("zerotvm-bench")  # not "phi3…": llama.cpp would then want a Phi-3 tokenizer
    w.add_context_length(cfg["ctx"])
    w.add_embedding_length(d)
    w.add_block_count(cfg["layers"])
    w.add_head_count(cfg["heads"])
    w.add_head_count_kv(cfg["kv_heads"])
    w.add_key_length(cfg["head_dim"])
    w.add_value_length(cfg["head_dim"])
    w.add_rope_freq_base(cfg["theta"])
    w.add_layer_norm_rms_eps(cfg["eps"])
    if "ffn" in cfg:
        w.add_feed_forward_length(cfg["ffn"])
    if arch in ("qwen35", "qwen35moe"):
        w.add_rope_dimension_count(cfg["rot"])
        w.add_rope_dimension_sections([11, 11, 10, 0])  # required by the loader; text-only positions make it plain
        w.add_ssm_conv_kernel(cfg["conv"])
        w.add_ssm_state_size(cfg["k_dim"])
        w.add_ssm_group_count(cfg["k_heads"])
        w.add_ssm_time_step_rank(cfg["v_heads"])
        w.add_ssm_inner_size(cfg["v_dim"] * cfg["v_heads"])
        w.add_full_attention_interval(cfg["interval"])
    else:
        w.add_rope_dimension_count(cfg["head_dim"])
    if arch == "qwen35moe":
        w.add_expert_count(cfg["experts"])
        w.add_expert_used_count(cfg["top_k"])
        w.add_expert_feed_forward_length(cfg["expert_ffn"])
        w.add_expert_shared_feed_forward_length(cfg["shared_ffn"])
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"tok{i}" for i in range(vocab - len(tokens))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    rng = np.random.default_rng(0)
    cache: dict = {}
    for name, (shape, kind) in expected(cfg).items():
        key = (shape, kind, name.split(".", 2)[-1] if name.startswith("blk.") else name)
        if key not in cache:
            cache[key] = _q4_0(rng, shape) if kind == Q4 else _f32(rng, name, shape)
        if kind == Q4:
            w.add_tensor(name, cache[key], raw_dtype=GGMLQuantizationType.Q4_0)
        else:
            w.add_tensor(name, cache[key])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def check(cfg: dict, path: Path) -> list[str]:
    """Read the file back with the gguf package: the architecture, every tensor's name, type and shape against
    expected(cfg), and the keys llama.cpp's loader requires. Returns the problems (empty: the file is as meant)."""
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    problems = []
    arch = bytes(r.fields["general.architecture"].parts[-1]).decode()
    if arch != cfg["arch"]:
        problems.append(f"general.architecture is {arch!r}, not {cfg['arch']!r}")
    got = {t.name: (tuple(int(n) for n in reversed(t.shape)), t.tensor_type.name) for t in r.tensors}
    want = expected(cfg)
    for name in sorted(set(want) | set(got)):
        if got.get(name) != want.get(name):
            problems.append(f"{name}: file has {got.get(name)}, llama.cpp's layout wants {want.get(name)}")
    need = ["context_length", "embedding_length", "block_count", "attention.head_count", "attention.head_count_kv",
            "attention.layer_norm_rms_epsilon", "rope.dimension_count"]
    if arch in ("qwen35", "qwen35moe"):
        need += ["rope.dimension_sections", "ssm.conv_kernel", "ssm.inner_size", "ssm.state_size",
                 "ssm.time_step_rank", "ssm.group_count", "full_attention_interval"]
    if arch == "qwen35moe":
        need += ["expert_count", "expert_used_count", "expert_feed_forward_length",
                 "expert_shared_feed_forward_length"]
    problems += [f"missing key {arch}.{k}" for k in need if f"{arch}.{k}" not in r.fields]
    return problems
