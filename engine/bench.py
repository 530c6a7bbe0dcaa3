"""`zerotvm bench`: random q4f16_1 weights of a real model's shapes, built in memory, timed on this GPU.

Reports decode tok/s (after a prompt), prefill tok/s at two prompt lengths, time to first token, dispatches
per token, host µs per dispatch, achieved weight-read GB/s and, from the same run, two bandwidth ceilings:
wgpu's buffer copy and a vec4 copy kernel. With `timestamps`, also the GPU-busy fraction of decode
(pass timestamps; off by default because the queries themselves cost a little).
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
from engine.runtime_options import RuntimeOptions
from engine.transformer import Transformer, expected_tensors

SHAPES = {
    # name: dim, layers, heads, kv heads, head_dim, ffn, vocab, eps, theta, context, tied, qk_norm
    "phi3-mini": (3072, 32, 32, 32, 96, 8192, 32064, 1e-5, 10000.0, 4096, False, False),
    "qwen3-4b": (2560, 36, 32, 8, 128, 9728, 151936, 1e-6, 1000000.0, 40960, True, True),
}


def shape_spec(name: str) -> DenseSpec:
    if name not in SHAPES:
        raise ValueError(f"unknown --shape {name!r}; known: {', '.join(SHAPES)}")
    d, n_layers, h, kvh, hd, f, v, eps, theta, ctx, tied, qk = SHAPES[name]
    inv, rot = rope_inv_freq(hd, theta)
    spec = DenseSpec(d, n_layers, h, kvh, hd, f, v, eps, inv, rot, ctx, tied, qk)
    spec.names = {c: c for c in expected_tensors(spec)}
    return spec


def random_weights(spec: DenseSpec, seed: int = 0):
    """(name, array) for every tensor; one random array per distinct shape, uploaded to separate buffers."""
    rng = np.random.default_rng(seed)
    cache: dict = {}
    for name, (shape, dtype) in expected_tensors(spec).items():
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
    for name, (shape, dtype) in expected_tensors(spec).items():
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


def dispatch_seconds(gpu: Gpu, pipeline, bind_group, grid: tuple, reps: int = 100, tries: int = 3) -> float:
    """Seconds per dispatch of one kernel, dispatched `reps` times back to back in one pass (so each includes the
    barrier to the next), best of `tries` submissions. The bench/ profilers share it. `bind_group` may be a list,
    taken in turn (weights in several copies, so that a matrix smaller than the L2 cache is not read from it)."""
    from engine.gpu import Recorder

    groups = bind_group if isinstance(bind_group, list) else [bind_group]
    best = float("inf")
    for _ in range(tries):
        rec = Recorder(gpu, "timed")
        for i in range(reps):
            rec.dispatch(pipeline, groups[i % len(groups)], *grid)
        gpu.sync()
        t = time.perf_counter()
        rec.submit()
        gpu.sync()
        best = min(best, (time.perf_counter() - t) / reps)
    return best


def timestamp_period(gpu: Gpu) -> float:
    """Nanoseconds per resolved timestamp tick: wgpu-native resolves raw ticks (WebGPU's nanoseconds only with its
    automatic normalization); 1.0 where wgpu-py does not expose the queue's period."""
    try:
        from wgpu.backends.wgpu_native._api import lib

        return float(lib.wgpuQueueGetTimestampPeriod(gpu.queue._internal))
    except (ImportError, AttributeError):
        return 1.0


class PassTimer:
    """GPU seconds of one pass of a kernel dispatched `reps` times back to back, from the pass's begin/end
    timestamps (so no submit, wait or readback is counted, unlike dispatch_seconds' wall clock); the wall clock
    where the device has no timestamp-query. One sample per call: the caller takes medians over interleaved rounds."""

    def __init__(self, gpu: Gpu):
        import wgpu

        from engine.gpu import READBACK

        self.gpu = gpu
        self.timestamps = "timestamp-query" in gpu.device.features
        if self.timestamps:
            self.qs = gpu.device.create_query_set(label="pass-timer", type=wgpu.QueryType.timestamp, count=2)
            self.resolved = gpu.device.create_buffer(label="pass-timer-resolved", size=16,
                                                     usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
            self.out = gpu.buffer("pass-timer-read", 16, READBACK)
            self.ns_per_tick = timestamp_period(gpu)

    def seconds(self, pipeline, bind_group, grid: tuple, reps: int) -> float:
        """Seconds per dispatch over one pass of `reps` dispatches (`bind_group` may be a list, taken in turn)."""
        import wgpu

        from engine.gpu import Recorder

        groups = bind_group if isinstance(bind_group, list) else [bind_group]
        stamps = {"query_set": self.qs, "beginning_of_pass_write_index": 0, "end_of_pass_write_index": 1} \
            if self.timestamps else None
        rec = Recorder(self.gpu, "timed-pass", stamps)
        for i in range(reps):
            rec.dispatch(pipeline, groups[i % len(groups)], *grid)
        self.gpu.sync()
        t = time.perf_counter()
        rec.submit()
        if not self.timestamps:
            self.gpu.sync()
            return (time.perf_counter() - t) / reps
        enc = self.gpu.device.create_command_encoder(label="pass-timer-resolve")
        enc.resolve_query_set(self.qs, 0, 2, self.resolved, 0)
        enc.copy_buffer_to_buffer(self.resolved, 0, self.out, 0, 16)
        self.gpu.queue.submit([enc.finish()])
        self.out.map_sync(mode=wgpu.MapMode.READ)
        begin, end = (int(v) for v in np.frombuffer(self.out.read_mapped(0, 16), np.uint64))
        self.out.unmap()
        if end <= begin:
            raise RuntimeError(f"pass timestamps out of order ({begin} → {end})")
        return (end - begin) * self.ns_per_tick * 1e-9 / reps


def copy_kernel_bandwidth(gpu: Gpu, nbytes: int = 1 << 30, reps: int = 5) -> float:
    """A vec4<u32> copy kernel's rate (read + write): what a compute shader can stream on this GPU."""
    from engine.gpu import Recorder
    from engine.kernels import fold_grid

    nbytes = min(nbytes, gpu.max_binding // 256 * 256, gpu.limits["max-buffer-size"] // 2 // 256 * 256)
    a, b = gpu.buffer("bwk-src", nbytes), gpu.buffer("bwk-dst", nbytes)
    wg, per_thread = 256, 4  # each thread copies 4 vec4 (64 bytes)
    groups = -(-nbytes // (16 * per_thread * wg))
    grid = fold_grid(groups)
    pipe = gpu.pipeline("copy", dict(WG=wg, PER_THREAD=per_thread, N4=nbytes // 16, GRID_X=grid[0]))
    bg = gpu.bind(pipe, [a, b], "copy")
    times = []
    for _ in range(reps + 1):
        rec = Recorder(gpu, "bw-kernel")
        rec.dispatch(pipe, bg, *grid)
        gpu.sync()
        t = time.perf_counter()
        rec.submit()
        gpu.sync()
        times.append(time.perf_counter() - t)
    a.destroy()
    b.destroy()
    return 2 * nbytes / statistics.median(times[1:])


def gpu_busy(rt: Transformer, prompt: np.ndarray, n: int = 64) -> dict:
    """Decode `n` tokens one pass each with pass timestamps: GPU time per token and busy fraction of wall time."""
    import wgpu

    from engine.gpu import READBACK, Recorder

    g = rt.gpu
    if "timestamp-query" not in g.device.features:
        return {"gpu_busy": None, "gpu_ms_per_token": None}
    qs = g.device.create_query_set(label="decode-timestamps", type=wgpu.QueryType.timestamp, count=2 * n)
    resolved = g.device.create_buffer(label="timestamps", size=16 * n,
                                      usage=wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC)
    out = g.buffer("timestamps-read", 16 * n, READBACK)
    rt.reset()
    rt.prefill(prompt)
    rt.read_sampled(0)
    t = time.perf_counter()
    for j in range(n):
        rec = Recorder(g, "decode-ts", {"query_set": qs, "beginning_of_pass_write_index": 2 * j,
                                        "end_of_pass_write_index": 2 * j + 1})
        rt.record_decode_token(rec, 1 + j)
        rec.submit()
    g.sync()
    wall = time.perf_counter() - t
    enc = g.device.create_command_encoder(label="resolve")
    enc.resolve_query_set(qs, 0, 2 * n, resolved, 0)
    enc.copy_buffer_to_buffer(resolved, 0, out, 0, 16 * n)
    g.queue.submit([enc.finish()])
    out.map_sync(mode=wgpu.MapMode.READ)
    stamps = np.frombuffer(out.read_mapped(0, 16 * n), np.uint64).reshape(n, 2).astype(np.float64)
    out.unmap()
    busy_ns = float(np.sum(stamps[:, 1] - stamps[:, 0]))
    return {"gpu_busy": round(busy_ns / 1e9 / wall, 3), "gpu_ms_per_token": round(busy_ns / n / 1e6, 3),
            "wall_ms_per_token": round(wall / n * 1e3, 3)}


def timed_prefill(rt: Transformer, ids: np.ndarray) -> float:
    rt.reset()
    t = time.perf_counter()
    rt.prefill(ids)
    rt.read_sampled(0)
    return time.perf_counter() - t


def timed_decode(rt: Transformer, prompt: np.ndarray, n: int) -> float:
    rt.reset()
    rt.prefill(prompt)
    rt.read_sampled(0)
    t = time.perf_counter()
    got = sum(len(b) for b in rt.decode(0, n))
    return got / (time.perf_counter() - t)


def host_us_per_dispatch(rt: Transformer, reps: int = 20) -> float:
    """Time spent recording one decode token on the CPU (replaying its captured plan, as decode does), divided by its
    dispatch count."""
    from engine.gpu import Recorder

    plan = rt.decode_plan(1)
    t = time.perf_counter()
    for _ in range(reps):
        rec = Recorder(rt.gpu, "host-cost")
        rec.replay(plan)
        rec.pass_.end()
        rec.encoder.finish()
    return (time.perf_counter() - t) / reps / rec.dispatches * 1e6


def git_commit() -> str:
    if os.environ.get("ZEROTVM_COMMIT"):  # set by bench scripts on machines that get a tree without .git
        return os.environ["ZEROTVM_COMMIT"]
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              timeout=5).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def run_bench(shape: str = "phi3-mini", decode_tokens: int = 128, prompt_tokens: int = 512, runs: int = 5,
              gpu: Gpu | None = None, long_prompt: int = 2048, timestamps: bool = False, **runtime_options) -> dict:
    """One shape's numbers; runtime_options are RuntimeOptions fields (e.g. q8_decode=False)."""
    from engine.bench_hybrid import HYBRID_SHAPES, run_hybrid_bench

    if shape in HYBRID_SHAPES:  # Qwen3.5 / Qwen3.6: engine/bench_hybrid.py
        return run_hybrid_bench(shape, decode_tokens, prompt_tokens, runs, gpu, long_prompt, timestamps,
                                **runtime_options)
    gpu = gpu or Gpu()
    spec = shape_spec(shape)
    chunk = min(prompt_tokens, 512)
    longest = max(prompt_tokens, long_prompt)
    options = RuntimeOptions.of(max_context=longest + decode_tokens + 16, prefill_chunk=chunk, **runtime_options)
    rt = Transformer(gpu, spec, random_weights(spec), options=options)
    rng = np.random.default_rng(1)
    prompt_all = rng.integers(0, spec.vocab, longest).astype(np.uint32)
    prompt = prompt_all[:prompt_tokens]
    short = prompt[:35]
    timed_decode(rt, prompt[:16], 8)  # warm up pipelines and caches
    decode = statistics.median(timed_decode(rt, prompt, decode_tokens) for _ in range(runs))
    prefill = statistics.median(prompt_tokens / timed_prefill(rt, prompt) for _ in range(runs))
    prefill_long = statistics.median(long_prompt / timed_prefill(rt, prompt_all[:long_prompt])
                                     for _ in range(max(1, runs // 2))) if long_prompt else None
    ttft = statistics.median(timed_prefill(rt, short) for _ in range(runs))
    busy = gpu_busy(rt, prompt) if timestamps else {}
    bw = copy_bandwidth(gpu)
    bw_kernel = copy_kernel_bandwidth(gpu)
    per_token = weight_bytes_per_token(spec)
    host_us = host_us_per_dispatch(rt)
    r = {
        "date": datetime.date.today().isoformat(), "gpu": gpu.info.name, "backend": gpu.info.backend,
        "driver": gpu.info.driver, "commit": git_commit(), "shape": shape, "options": runtime_options,
        "subgroups": gpu.use_subgroups, "subgroup_size": gpu.subgroup_size,
        "decode_tok_s": round(decode, 1), "prefill_tok_s": round(prefill, 1), "prompt_tokens": prompt_tokens,
        **({f"prefill_{long_prompt}_tok_s": round(prefill_long, 1)} if prefill_long else {}),
        "decode_tokens": decode_tokens, "ttft_35_ms": round(ttft * 1000, 1),
        "dispatches_per_token": rt.dispatches_per_token, "host_us_per_dispatch": round(host_us, 2),
        "weight_gb_per_token": round(per_token / 1e9, 3), "achieved_gb_s": round(decode * per_token / 1e9, 1),
        "copy_bw_gb_s": round(bw / 1e9, 1), "copy_kernel_bw_gb_s": round(bw_kernel / 1e9, 1),
        "ceiling_tok_s": round(max(bw, bw_kernel) / per_token, 1),
        "host_ms_per_token": round(host_us * rt.dispatches_per_token / 1000, 3), **busy,
    }
    r["pct_of_ceiling"] = round(100 * decode / r["ceiling_tok_s"], 1)
    return finish(r, rt)


def block_table(rt: Transformer) -> str:
    """One line per block: layers, dispatches per decode token, GPU MB by kind."""
    lines = [f"{'block':>22}  layers  dispatches  weights MB  kv MB  state MB  scratch MB"]
    for b in rt.report():
        lines.append(f"{b['block']:>22}  {b['layers']:>6}  {b['dispatches_per_token']:>10}  "
                     f"{b['weights'] / 1e6:>10.1f}  {b['kv'] / 1e6:>5.1f}  {b['state'] / 1e6:>8.1f}  "
                     f"{b['scratch'] / 1e6:>10.1f}")
    return "\n".join(lines)


def finish(r: dict, rt: Transformer) -> dict:
    """The result with the per-block report and a printable table."""
    from engine.gpu_budget import hit_rate_line, streaming_line

    if rt.plan.streaming is not None:  # under a weights budget: the share cached and the hit rate of every run
        r["expert_stream"], r["expert_cache"] = streaming_line(rt), hit_rate_line(rt)
    r["blocks"] = rt.report()
    shown = {k: v for k, v in r.items() if k != "blocks"}
    r["table"] = "\n".join(f"{k:>22}: {v}" for k, v in shown.items()) + "\n" + block_table(rt)
    return r
