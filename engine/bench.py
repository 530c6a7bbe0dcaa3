"""`zerotvm bench`: random q4f16_1 weights of a real model's shapes, built in memory, timed on this GPU.

Reports decode tok/s (after a prompt), prefill tok/s, time to first token, dispatches per token,
achieved weight-read GB/s and, from the same run, the GPU's buffer-copy bandwidth as the ceiling.
"""

from __future__ import annotations

import datetime
import os
import statistics
import subprocess
import time

import numpy as np

from engine.gpu import Gpu
from engine.models.base import DenseSpec, rope_inv_freq
from engine.transformer import DenseTransformer, tensor_shapes

SHAPES = {
    # name: dim, layers, heads, kv heads, head_dim, ffn, vocab, eps, theta, context, tied, qk_norm
    "phi3-mini": (3072, 32, 32, 32, 96, 8192, 32064, 1e-5, 10000.0, 4096, False, False),
}


def shape_spec(name: str) -> DenseSpec:
    if name not in SHAPES:
        raise ValueError(f"unknown --shape {name!r}; known: {', '.join(SHAPES)}")
    d, n_layers, h, kvh, hd, f, v, eps, theta, ctx, tied, qk = SHAPES[name]
    inv, rot = rope_inv_freq(hd, theta)
    spec = DenseSpec(d, n_layers, h, kvh, hd, f, v, eps, inv, rot, ctx, tied, qk)
    spec.names = {c: c for c in tensor_shapes(spec)}
    return spec


def random_weights(spec: DenseSpec, seed: int = 0):
    """(name, array) for every tensor; one random array per distinct shape, uploaded to separate buffers."""
    rng = np.random.default_rng(seed)
    cache: dict = {}
    for name, (shape, dtype) in tensor_shapes(spec).items():
        key = (shape, dtype, name.endswith("q_scale"))
        if key not in cache:
            if dtype == "uint32":
                cache[key] = rng.integers(0, 2**32, size=shape, dtype=np.uint32)
            elif name.endswith("q_scale"):  # keep activations finite through 32 random layers
                k = shape[1] * 32
                cache[key] = (rng.random(shape, dtype=np.float32) * 0.5 / np.sqrt(k)).astype(np.float16)
            else:
                cache[key] = (1.0 + 0.1 * rng.standard_normal(shape)).astype(np.float16)
        yield name, cache[key]


def weight_bytes_per_token(spec: DenseSpec) -> int:
    """Bytes a decode step must read: every layer matrix and the LM head, plus one embedding row."""
    total = 0
    for name, (shape, dtype) in tensor_shapes(spec).items():
        n = int(np.prod(shape)) * np.dtype(dtype).itemsize
        total += n // spec.vocab if name.startswith("embed.") else n
    return total


def copy_bandwidth(gpu: Gpu, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """Buffer-to-buffer copy rate in bytes/s counting read + write (the ceiling decode can approach)."""
    nbytes = min(nbytes, gpu.limits["max-buffer-size"] // 2 // 256 * 256)
    a, b = gpu.buffer("bw-src", nbytes), gpu.buffer("bw-dst", nbytes)
    times = []
    for _ in range(reps + 1):
        enc = gpu.device.create_command_encoder(label="bw")
        enc.copy_buffer_to_buffer(a, 0, b, 0, nbytes)
        gpu.sync()
        t = time.perf_counter()
        gpu.queue.submit([enc.finish()])
        gpu.sync()
        times.append(time.perf_counter() - t)
    a.destroy()
    b.destroy()
    return 2 * nbytes / statistics.median(times[1:])


def _timed_prefill(rt: DenseTransformer, ids: np.ndarray) -> float:
    rt.reset()
    t = time.perf_counter()
    rt.prefill(ids)
    rt.read_sampled(0)
    return time.perf_counter() - t


def _timed_decode(rt: DenseTransformer, prompt: np.ndarray, n: int) -> float:
    rt.reset()
    rt.prefill(prompt)
    rt.read_sampled(0)
    t = time.perf_counter()
    got = sum(len(b) for b in rt.decode(0, n))
    return got / (time.perf_counter() - t)


def _host_us_per_dispatch(rt: DenseTransformer, reps: int = 20) -> float:
    """Time spent recording one decode token on the CPU, divided by its dispatch count."""
    from engine.gpu import Recorder

    t = time.perf_counter()
    for _ in range(reps):
        rec = Recorder(rt.gpu, "host-cost")
        rt._record_body(rec, 1, 1)
        rec.pass_.end()
        rec.encoder.finish()
    return (time.perf_counter() - t) / reps / rec.dispatches * 1e6


def _git_commit() -> str:
    if os.environ.get("ZEROTVM_COMMIT"):  # set by bench scripts on machines that get a tree without .git
        return os.environ["ZEROTVM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_bench(shape: str = "phi3-mini", decode_tokens: int = 128, prompt_tokens: int = 512, runs: int = 5,
              gpu: Gpu | None = None) -> dict:
    gpu = gpu or Gpu()
    spec = shape_spec(shape)
    chunk = min(prompt_tokens, 512)
    rt = DenseTransformer(gpu, spec, random_weights(spec), max_context=prompt_tokens + decode_tokens + 16,
                          prefill_chunk=chunk)
    rng = np.random.default_rng(1)
    prompt = rng.integers(0, spec.vocab, prompt_tokens).astype(np.uint32)
    short = prompt[:35]
    _timed_decode(rt, prompt[:16], 8)  # warm up pipelines and caches
    decode = statistics.median(_timed_decode(rt, prompt, decode_tokens) for _ in range(runs))
    prefill = statistics.median(prompt_tokens / _timed_prefill(rt, prompt) for _ in range(runs))
    ttft = statistics.median(_timed_prefill(rt, short) for _ in range(runs))
    bw = copy_bandwidth(gpu)
    per_token = weight_bytes_per_token(spec)
    host_us = _host_us_per_dispatch(rt)
    r = {
        "date": datetime.date.today().isoformat(), "gpu": gpu.info.name, "backend": gpu.info.backend,
        "driver": gpu.info.driver, "commit": _git_commit(), "shape": shape,
        "subgroups": gpu.use_subgroups, "subgroup_size": gpu.subgroup_size,
        "decode_tok_s": round(decode, 1), "prefill_tok_s": round(prefill, 1), "prompt_tokens": prompt_tokens,
        "decode_tokens": decode_tokens, "ttft_35_ms": round(ttft * 1000, 1),
        "dispatches_per_token": rt.dispatches_per_token, "host_us_per_dispatch": round(host_us, 2),
        "weight_gb_per_token": round(per_token / 1e9, 3), "achieved_gb_s": round(decode * per_token / 1e9, 1),
        "copy_bw_gb_s": round(bw / 1e9, 1), "ceiling_tok_s": round(bw / per_token, 1),
    }
    r["pct_of_ceiling"] = round(100 * decode / r["ceiling_tok_s"], 1)
    r["table"] = "\n".join(f"{k:>22}: {v}" for k, v in r.items())
    return r
