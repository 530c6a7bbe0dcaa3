"""GPU memory while a model loads, measured (NVML) against what memfit predicts, for each bench shape.

    python bench/load_peak.py                                  # every shape below, each in a fresh process
    python bench/load_peak.py qwen3.6-35b-a3b-4bit --context 6144 --window 1e15   # A/B: never flush uploads
    python bench/load_peak.py --checkpoint /path/to/model --context 4096          # a real checkpoint folder/file

Each shape loads random weights of its real shapes (the bench's in-memory checkpoints: the same upload path as a
file, without the disk) at the catalog's default context, while a thread polls the GPU's used memory every few
milliseconds through NVML (nvidia-smi when the library is missing). Reported, relative to the memory in use once
the device is open: the peak during the load and the steady use after it (and after one prefill), next to memfit's
prediction (engine/memfit.py estimate with this GPU's traits: `gpu_bytes` steady, `load_gpu_bytes` peak, both less
`open_bytes`, the allocator block the opened device already holds), with the buffers and the allocator's overhead.
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
    est = memfit.estimate(rt.spec, rt.max_context, formats=formats, options=rt.options, traits=DeviceTraits.of(gpu))
    steady_est, peak_est = est.gpu_bytes - est.open_bytes, est.load_gpu_bytes - est.open_bytes  # as measured here
    return {"shape": shape or checkpoint, "context": rt.max_context, "upload_window": engine.gpu.UPLOAD_WINDOW,
            "reserved": reserve, "paired_stacks": pairs, "load_s": round(seconds, 1), "samples": poll.samples,
            "memory_source": used.source,
            "predicted_steady_gb": round(steady_est / 1e9, 3), "measured_steady_gb": round(steady / 1e9, 3),
            "measured_after_prefill_gb": round(after_forward / 1e9, 3),
            "predicted_peak_gb": round(peak_est / 1e9, 3), "measured_peak_gb": round(peak / 1e9, 3),
            "steady_ratio": round(steady / steady_est, 3) if steady_est else None,
            "peak_ratio": round(peak / peak_est, 3) if peak_est else None,
            "predicted_by_kind_gb": {k: round(v / 1e9, 3) for k, v in (("weights", est.weights_bytes),
                                                                        ("kv", est.kv_bytes),
                                                                        ("state", est.state_bytes),
                                                                        ("scratch", est.scratch_bytes),
                                                                        ("allocator", est.overhead_bytes),
                                                                        ("device_open", est.open_bytes))}}


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("shapes", nargs="*", help=f"bench shapes (default: {', '.join(SHAPES)})")
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
    for shape in args.shapes or list(SHAPES):
        if shape not in SHAPES:
            sys.exit(f"unknown shape {shape!r}; known: {', '.join(SHAPES)}")
        cmd = [sys.executable, __file__, shape, "--one"]
        cmd += ["--context", str(args.context)] if args.context else []
        cmd += ["--window", str(args.window)] if args.window is not None else []
        cmd += ["--no-reserve"] if args.no_reserve else []
        cmd += ["--no-pairs"] if args.no_pairs else []
        done = subprocess.run(cmd, capture_output=True, text=True)
        line = done.stdout.strip().splitlines()[-1] if done.returncode == 0 and done.stdout.strip() else None
        print(line or json.dumps({"shape": shape, "error": (done.stderr or done.stdout).strip()[-2000:]}), flush=True)
