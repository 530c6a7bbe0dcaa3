"""GPU memory while a model loads, measured (NVML) against what memfit predicts, for each bench shape and catalog GGUF.

    python bench/load_peak.py                                  # every shape and GGUF build, each in a fresh process
    python bench/load_peak.py qwen3.6-35b-a3b-4bit --context 6144 --window 1e15   # A/B: never flush uploads
    python bench/load_peak.py llama3.2-3b-q4_k_m-gguf          # one catalog GGUF build, through its stand-in file
    python bench/load_peak.py --checkpoint /path/to/model --context 4096          # a real checkpoint folder/file

Each shape loads random weights of its real shapes (the bench's in-memory checkpoints: the same upload path as a
file, without the disk) at the catalog's default context, while a thread polls the GPU's used memory every few
milliseconds through NVML (nvidia-smi when the library is missing). Reported, relative to the memory in use once
the device is open: the peak during the load and the steady use after it (and after one prefill), next to memfit's
prediction (engine/memfit.py estimate with this GPU's traits: `gpu_bytes` steady, `load_gpu_bytes` peak, both less
`open_bytes`, the allocator block the opened device already holds), with the buffers and the allocator's overhead.

A catalog GGUF build (bench/gguf_standin.py STANDINS) loads a stand-in file through load_model, as `--checkpoint`
does: the real file's tensor names, shapes and GGML types with random blocks, written once into .cache/load_peak/
before the device opens (`write_s`; 0 when it was there). Its `predicted_*` are memfit's estimate of the catalog
entry, the figure the model picker shows (planned from the catalog's dims, weights as the catalog records them);
`file_plan_*` are memfit's estimate of the loaded spec and formats (what the other shapes report as predicted), and
`weights_bytes` sets the catalog's weight figure beside the stand-in's tensors and the file plan's, with a note when
the catalog's figure is not the stand-in's.

`--window` sets the upload staging window in bytes (engine/gpu.py UPLOAD_WINDOW) for an A/B of the flushing;
`--no-reserve` makes the buffers as the checkpoint streams in instead of largest first (Gpu.reserve off: the A/B of
the reservation; memfit then does not model the order); `--no-pairs` keeps every MoE expert stack in its own buffer
(engine/blocks/moe_pairs.py off: the A/B of the paired stacks; memfit plans the same).
NVIDIA GPUs only (the H200 the benchmarks run on).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.gguf_standin import STANDINS  # noqa: E402 (after the path)

# bench shape -> the catalog entry whose default context it loads at
SHAPES = {"phi3-mini": "phi3-mini-4k-q4f16_1", "qwen3-4b": "qwen3-4b-q4f16_1", "qwen3.5-4b": "qwen3.5-4b-q4f16_1",
          "qwen3.6-35b-a3b-4bit": "qwen3.6-35b-a3b-mlx-4bit", "qwen3.6-35b-a3b-3bit": "qwen3.6-35b-a3b-mlx-q3"}


class UsedMemory:
    """The GPU's used bytes: NVML through ctypes, else nvidia-smi (slower, so fewer samples)."""

    def __init__(self, index: int = 0):
        self.index, self._nvml = index, None
        try:
            nvml = ctypes.CDLL("libnvidia-ml.so.1")
            if nvml.nvmlInit_v2() == 0:
                self._handle = ctypes.c_void_p()
                if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(self._handle)) == 0:
                    self._nvml = nvml
        except OSError:
            pass

    def __call__(self) -> int:
        if self._nvml is not None:
            info = (ctypes.c_ulonglong * 3)()  # nvmlMemory_t: total, free, used
            if self._nvml.nvmlDeviceGetMemoryInfo(self._handle, ctypes.byref(info)) == 0:
                return int(info[2])
        out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i",
                              str(self.index)], capture_output=True, text=True, timeout=10, check=True).stdout
        return int(out.strip().splitlines()[0]) * 2**20

    @property
    def source(self) -> str:
        return "NVML" if self._nvml is not None else "nvidia-smi"


class Poller:
    """Samples used memory in a thread; peak() since the last reset."""

    def __init__(self, used: UsedMemory, every: float = 0.005):
        self.used, self.every, self._peak, self._stop = used, every, 0, threading.Event()
        self.samples = 0
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self._peak = max(self._peak, self.used())
            self.samples += 1
            time.sleep(self.every)

    def reset(self) -> None:
        self._peak = self.used()

    def peak(self) -> int:
        return max(self._peak, self.used())

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def one(shape: str | None, checkpoint: str | None, context: int | None, window: float | None,
        reserve: bool = True, pairs: bool = True) -> dict:
    import numpy as np

    import engine.gpu
    from engine import bench, bench_hybrid, memfit
    from engine.blocks import DeviceTraits
    from engine.catalog import load_catalog
    from engine.gpu import Gpu
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import Transformer

    if window is not None:
        engine.gpu.UPLOAD_WINDOW = int(window)
    if not reserve:
        Gpu.reserve = lambda self, needs: None
    if not pairs:
        from engine.blocks import moe_pairs

        moe_pairs.PAIR_RANGE = (0, 0)
    gguf_entry, write_s = None, 0.0
    if shape in STANDINS:  # written before the device opens: the file is not part of the load
        from bench.gguf_standin import ensure

        gguf_entry = {e.key: e for e in load_catalog()}[shape]
        path, write_s = ensure(gguf_entry)
        checkpoint, context = str(path), context or gguf_entry.default_context
    used = UsedMemory()
    gpu = Gpu()
    gpu.sync()
    poll = Poller(used)
    time.sleep(0.2)
    base = used()
    poll.reset()
    t = time.perf_counter()
    if checkpoint:
        from engine.model import load_model

        model = load_model(checkpoint, gpu=gpu, max_context=context)
        rt, formats = model.runtime, model.runtime.formats
    else:
        entry = {e.key: e for e in load_catalog()}[SHAPES[shape]]
        context = context or entry.default_context
        if shape in bench_hybrid.HYBRID_SHAPES:
            spec, formats = bench_hybrid.hybrid_spec(shape)
            weights = bench_hybrid.random_weights(spec, formats)
        else:
            spec, formats = bench.shape_spec(shape), {}
            weights = bench.random_weights(spec)
        rt = Transformer(gpu, spec, weights, formats=formats, options=RuntimeOptions(max_context=context))
    seconds = time.perf_counter() - t
    gpu.sync()
    time.sleep(0.2)
    peak, steady = poll.peak() - base, used() - base
    rt.prefill(np.arange(16, dtype=np.uint32) % rt.spec.vocab)
    rt.read_sampled(0)
    time.sleep(0.2)
    after_forward = used() - base
    poll.stop()
    traits = DeviceTraits.of(gpu)
    est = memfit.estimate(rt.spec, rt.max_context, formats=formats, options=rt.options, traits=traits)
    out = {"shape": shape or checkpoint, "context": rt.max_context, "upload_window": engine.gpu.UPLOAD_WINDOW,
           "reserved": reserve, "paired_stacks": pairs, "load_s": round(seconds, 1), "samples": poll.samples,
           "memory_source": used.source, "measured_steady_gb": round(steady / 1e9, 3),
           "measured_after_prefill_gb": round(after_forward / 1e9, 3), "measured_peak_gb": round(peak / 1e9, 3)}
    if gguf_entry is None:
        return out | _predicted("predicted", est, steady, peak)
    from bench.gguf_standin import uploaded_bytes

    by_entry = memfit.estimate(gguf_entry, rt.max_context, options=rt.options, traits=traits)
    weights = {"catalog": gguf_entry.weights_bytes, "stand_in_tensors": uploaded_bytes(gguf_entry),
               "file_plan": est.weights_bytes}
    out |= {"checkpoint": checkpoint, "write_s": round(write_s, 1), **_predicted("predicted", by_entry, steady, peak),
            **_predicted("file_plan", est, steady, peak), "weights_bytes": weights}
    if len(set(weights.values())) > 1:  # the comparison must say whose weights it predicted
        out["weights_note"] = "the catalog's weight figure is not the stand-in's tensor bytes (weights_bytes)"
    return out


def _predicted(prefix: str, est, steady: int, peak: int) -> dict:
    """memfit's steady and peak figures (as measured here: less the opened device's block), their ratios to the
    measured ones, and the steady figure by kind."""
    steady_est, peak_est = est.gpu_bytes - est.open_bytes, est.load_gpu_bytes - est.open_bytes
    ratio = "" if prefix == "predicted" else f"{prefix}_"  # steady_ratio / peak_ratio: the keys earlier runs wrote
    return {f"{prefix}_steady_gb": round(steady_est / 1e9, 3), f"{prefix}_peak_gb": round(peak_est / 1e9, 3),
            f"{ratio}steady_ratio": round(steady / steady_est, 3) if steady_est else None,
            f"{ratio}peak_ratio": round(peak / peak_est, 3) if peak_est else None,
            f"{prefix}_by_kind_gb": {k: round(v / 1e9, 3) for k, v in (("weights", est.weights_bytes),
                                                                         ("kv", est.kv_bytes),
                                                                         ("state", est.state_bytes),
                                                                         ("scratch", est.scratch_bytes),
                                                                         ("allocator", est.overhead_bytes),
                                                                         ("device_open", est.open_bytes))}}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", help=f"bench shapes and catalog GGUF builds (default: all: "
                                              f"{', '.join([*SHAPES, *STANDINS])})")
    p.add_argument("--checkpoint", help="load this model folder / .gguf instead of random weights")
    p.add_argument("--context", type=int, help="KV cache tokens (default: the catalog's default context)")
    p.add_argument("--window", type=float, help="upload staging window in bytes (engine/gpu.py UPLOAD_WINDOW)")
    p.add_argument("--no-reserve", action="store_true", help="make buffers in checkpoint order (Gpu.reserve off)")
    p.add_argument("--no-pairs", action="store_true", help="every MoE expert stack in its own buffer")
    p.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a child process: one load
    args = p.parse_args()
    if args.one or args.checkpoint:
        shape = None if args.checkpoint else args.shapes[0]
        print(json.dumps(one(shape, args.checkpoint, args.context, args.window, not args.no_reserve,
                             not args.no_pairs)), flush=True)
        sys.exit(0)
    for shape in args.shapes or [*SHAPES, *STANDINS]:
        if shape not in SHAPES and shape not in STANDINS:
            sys.exit(f"unknown shape {shape!r}; known: {', '.join([*SHAPES, *STANDINS])}")
        cmd = [sys.executable, __file__, shape, "--one"]
        cmd += ["--context", str(args.context)] if args.context else []
        cmd += ["--window", str(args.window)] if args.window is not None else []
        cmd += ["--no-reserve"] if args.no_reserve else []
        cmd += ["--no-pairs"] if args.no_pairs else []
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
        print(line or json.dumps({"shape": shape, "error": (done.stderr or done.stdout).strip()[-2000:]}), flush=True)
