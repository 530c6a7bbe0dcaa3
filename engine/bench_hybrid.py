"""`zerotvm bench` for the hybrids: random weights of Qwen3.5-4B's (GDN + gated attention, dense MLP, MLC q4f16_1)
or Qwen3.6-35B-A3B's shapes (GDN + gated attention, 256 experts top-8 plus a shared one, MLX affine 4-bit with
the 8-bit router) built in memory and run on the Transformer; engine/bench.py's run_bench hands these shapes
over here and shares its timers and bandwidth probes.

Decode reads only part of a MoE model's weights, so the ceiling is the copy bandwidth over the *active* bytes
per token: every attention/GDN matrix, the router, top-k of the routed experts plus the shared one, the LM head
and one embedding row. The 3-bit build's routed experts stay 3-bit on the GPU (mlx3, read as stored by the
decode matvecs); its shared expert is 4-bit, so it runs apart from the routed stack. A GPU whose largest
storage binding cannot hold a tensor or an expert stack gets a GpuError naming both numbers before anything
is built.
"""

from __future__ import annotations

import datetime
import statistics

import numpy as np

from engine import bench
from engine.blocks.moe import shared_joins_stack
from engine.errors import GpuError
from engine.gpu import Gpu
from engine.kernels.matmul import FORMATS
from engine.models import model_module
from engine.runtime_options import RuntimeOptions
from engine.transformer import Transformer, expected_tensors

_ROPE = dict(rope_type="default", rope_theta=1e7, partial_rotary_factor=0.25)
_GDN = dict(linear_num_key_heads=16, linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128,
            linear_conv_kernel_dim=4, full_attention_interval=4)
_QWEN36 = dict(hidden_size=2048, num_hidden_layers=40, num_attention_heads=16, num_key_value_heads=2, head_dim=256,
               vocab_size=248320, tie_word_embeddings=False, num_experts=256, num_experts_per_tok=8,
               moe_intermediate_size=512, shared_expert_intermediate_size=512, max_position_embeddings=262144,
               rope_parameters=_ROPE, **_GDN)
_TINY = dict(hidden_size=128, num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=64,
             vocab_size=512, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=64,
             linear_value_head_dim=64, linear_conv_kernel_dim=4, full_attention_interval=2,
             max_position_embeddings=4096, rope_parameters=_ROPE)
# name: (model_type, config, weight layout ("mlc": q4f16_1; "mlx": mlx4 with an 8-bit router), experts' stored bits)
HYBRID_SHAPES = {
    "qwen3.5-4b": ("qwen3_5", dict(hidden_size=2560, intermediate_size=9216, num_hidden_layers=32,
                                   num_attention_heads=16, num_key_value_heads=4, head_dim=256, vocab_size=248320,
                                   tie_word_embeddings=True, max_position_embeddings=262144, rope_parameters=_ROPE,
                                   **_GDN), "mlc", None),
    "qwen3.6-35b-a3b-4bit": ("qwen3_5_moe", _QWEN36, "mlx", 4),
    "qwen3.6-35b-a3b-3bit": ("qwen3_5_moe", _QWEN36, "mlx", 3),
    # Smoke-test sizes (tests run them on a software GPU).
    "tiny-hybrid": ("qwen3_5", dict(_TINY, intermediate_size=192, tie_word_embeddings=True), "mlc", None),
    "tiny-hybrid-moe": ("qwen3_5_moe", dict(_TINY, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=64,
                                            shared_expert_intermediate_size=64, tie_word_embeddings=False),
                        "mlx", 4),
}
HYBRID_SHAPES["tiny-hybrid-moe-3bit"] = (*HYBRID_SHAPES["tiny-hybrid-moe"][:3], 3)


def hybrid_spec(name: str):
    """(spec, formats) for a hybrid shape; canonical names map to themselves."""
    model_type, config, layout, expert_bits = HYBRID_SHAPES[name]
    return make_spec(model_type, config, layout, expert_bits)


def make_spec(model_type: str, config: dict, layout: str, expert_bits: int | None = 4):
    module = model_module(model_type)
    spec = module.spec(module.ModelArgs.from_dict(dict(config)))
    formats = {}
    if layout == "mlx":
        matrices = [n.removesuffix(".q_weight") for n in expected_tensors(spec) if n.endswith(".q_weight")]
        formats = {m: "mlx8" if m.endswith((".moe.router", ".moe.shared_gate")) else "mlx4" for m in matrices}
        if expert_bits == 3:  # routed expert stacks as the MLX reader keeps them
            formats |= {m: "mlx3" for m in matrices if m.endswith((".moe.gate_up", ".moe.down"))}
    spec.names = {c: c for c in expected_tensors(spec, formats)}
    return spec, formats


def random_weights(spec, formats: dict[str, str], seed: int = 0):
    """(name, array) for every tensor; one random array per distinct shape and role, shared by every layer."""
    rng = np.random.default_rng(seed)
    cache: dict = {}
    for name, (shape, dtype) in expected_tensors(spec, formats).items():
        matrix, _, role = name.rpartition(".")
        key = (shape, dtype, role, formats.get(matrix))
        if key not in cache:
            cache[key] = random_tensor(rng, name, shape, dtype, formats)
        yield name, cache[key]


def random_tensor(rng, name: str, shape: tuple, dtype: str, formats: dict[str, str]) -> np.ndarray:
    if dtype == "uint32":
        return rng.integers(0, 2**32, size=shape, dtype=np.uint32)
    if name.endswith("q_scale"):  # keep activations finite through 40 random layers, whatever the code width
        fmt = FORMATS[formats.get(name.rsplit(".", 1)[0], "q4f16_1")]
        k = shape[-2 if fmt["affine"] else -1] * fmt["group"]
        s = rng.random(shape[:-1] if fmt["affine"] else shape, dtype=np.float32) * 0.5 / np.sqrt(k)
        if not fmt["affine"]:
            return s.astype(np.float16)
        s *= 16 / 2 ** fmt["bits"]
        return np.stack([s, -s * 2 ** (fmt["bits"] - 1)], axis=-1).astype(np.float16)  # (scale, centring bias)
    if name.endswith("A_log"):
        return np.log(rng.uniform(0.05, 1, shape)).astype(np.float32)
    if name.endswith("dt_bias"):
        return rng.normal(0, 0.5, shape).astype(np.float32)
    if name.endswith("conv1d"):
        return rng.normal(0, 0.3, shape).astype(np.float16)
    return (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float16)


def _nbytes(shape: tuple, dtype: str) -> int:
    return int(np.prod(shape)) * np.dtype(dtype).itemsize


def active_bytes_per_token(spec, formats: dict[str, str]) -> int:
    """Weight bytes one decode token reads: everything but the routed expert stacks (top_k of E of those) and
    the embedding (one row; the whole of it when it doubles as the LM head)."""
    total = 0
    for name, (shape, dtype) in expected_tensors(spec, formats).items():
        n = _nbytes(shape, dtype)
        if name.startswith("embed."):
            total += n // spec.vocab + (n if spec.tied_embeddings else 0)
        elif ".moe.gate_up." in name or ".moe.down." in name:
            total += n * spec.top_k // spec.n_experts
        else:
            total += n
    return total


def check_bindings(name: str, spec, formats: dict[str, str], gpu: Gpu) -> None:
    """GpuError, with the numbers, when a tensor or expert stack exceeds the GPU's largest storage binding."""
    shapes = expected_tensors(spec, formats)
    fmt = {k: formats.get(f"layers.0.moe.{k}") for k in ("gate_up", "down", "shared_gate_up", "shared_down")}
    stack = shared_joins_stack(spec.moe_ffn_dim, spec.shared_ffn_dim, (fmt["gate_up"], fmt["down"]),
                               (fmt["shared_gate_up"], fmt["shared_down"]))
    need = {}
    for tensor, (shape, dtype) in shapes.items():
        if tensor.startswith(("embed.", "lm_head.")):
            continue  # the vocabulary tables are bound in row parts
        n = _nbytes(shape, dtype)
        if stack and (".moe.gate_up." in tensor or ".moe.down." in tensor):
            n = n * (spec.n_experts + 1) // spec.n_experts
        need[tensor] = n
    worst = max(need, key=need.get)
    if need[worst] > gpu.max_binding:
        what = "expert stack" if ".moe." in worst else "tensor"
        raise GpuError(f"--shape {name}: the {what} {worst} needs a {need[worst]:,}-byte storage binding, but this "
                       f"GPU allows {gpu.max_binding:,} (max-storage-buffer-binding-size); "
                       f"{sum(n > gpu.max_binding for n in need.values())} tensors are too large for it")


def run_hybrid_bench(shape: str, decode_tokens: int = 128, prompt_tokens: int = 512, runs: int = 5,
                     gpu: Gpu | None = None, long_prompt: int = 2048, timestamps: bool = False,
                     probe_bytes: int = 1 << 30, **runtime_options) -> dict:
    """One hybrid shape's numbers (the keys engine/bench.py reports, plus the MoE ones)."""
    gpu = gpu or Gpu()
    spec, formats = hybrid_spec(shape)
    check_bindings(shape, spec, formats, gpu)
    longest = max(prompt_tokens, long_prompt)
    options = RuntimeOptions.of(max_context=longest + decode_tokens + 16, prefill_chunk=min(prompt_tokens, 512),
                                **runtime_options)
    rt = Transformer(gpu, spec, random_weights(spec, formats), formats=formats, options=options)
    prompt_all = np.random.default_rng(1).integers(0, spec.vocab, longest).astype(np.uint32)
    prompt = prompt_all[:prompt_tokens]
    bench.timed_decode(rt, prompt[:16], 8)  # warm up pipelines and caches
    decode = statistics.median(bench.timed_decode(rt, prompt, decode_tokens) for _ in range(runs))
    prefill = statistics.median(prompt_tokens / bench.timed_prefill(rt, prompt) for _ in range(runs))
    prefill_long = statistics.median(long_prompt / bench.timed_prefill(rt, prompt_all[:long_prompt])
                                     for _ in range(max(1, runs // 2))) if long_prompt else None
    busy = bench.gpu_busy(rt, prompt) if timestamps else {}
    bw = max(bench.copy_bandwidth(gpu, probe_bytes), bench.copy_kernel_bandwidth(gpu, probe_bytes))
    active = active_bytes_per_token(spec, formats)
    gdn = rt.block("gated_deltanet")
    state = 2 * gdn.state_bytes if gdn else 0  # the GDN conv and recurrent states, read and written every token
    host_us = bench.host_us_per_dispatch(rt)
    r = {
        "date": datetime.date.today().isoformat(), "gpu": gpu.info.name, "backend": gpu.info.backend,
        "driver": gpu.info.driver, "commit": bench.git_commit(), "shape": shape, "options": runtime_options,
        "weights": "MLC q4f16_1" if not formats else
        f"MLX affine: mlx4, 8-bit router, experts stored at {HYBRID_SHAPES[shape][3]} bits",
        "decode_tok_s": round(decode, 1), "prefill_tok_s": round(prefill, 1), "prompt_tokens": prompt_tokens,
        **({f"prefill_{long_prompt}_tok_s": round(prefill_long, 1)} if prefill_long else {}),
        "decode_tokens": decode_tokens, "dispatches_per_token": rt.dispatches_per_token,
        "moe_layers": len(spec.moe_layers),
        "experts": f"{spec.top_k} of {spec.n_experts} + shared" if spec.moe_layers else None,
        "active_gb_per_token": round(active / 1e9, 4), "state_mb_per_token": round(state / 1e6, 1),
        "achieved_gb_s": round(decode * active / 1e9, 1), "copy_bw_gb_s": round(bw / 1e9, 1),
        "ceiling_tok_s": round(bw / active, 1), "host_us_per_dispatch": round(host_us, 2),
        "host_ms_per_token": round(host_us * rt.dispatches_per_token / 1000, 3), **busy,
    }
    r["pct_of_ceiling"] = round(100 * decode / r["ceiling_tok_s"], 1)
    return bench.finish(r, rt)
