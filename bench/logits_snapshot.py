"""Record what the runtime computes on the tiny models, to compare two commits bit for bit.

    python bench/logits_snapshot.py OUT.npz                # record with this tree's engine
    python bench/logits_snapshot.py OUT.npz --compare A.npz  # record, then compare with an earlier record

Runs every tiny architecture (dense phi3/llama/qwen3 MLC, the Qwen3.5 hybrid, Qwen3.5-MoE as MLC and as MLX 4-bit /
3-bit-expert folders, random-weight tiny bench shapes, the demo GGUF when installed) under three arithmetic settings
(default int8 decode; f32 activations; int8 prefill forced) through the public API only: chunked logits (prefill
GEMMs), per-token logits (decode kernels, split-K attention past 48 keys), greedy and sampled decoding (plan replay,
argmax, sampler) and a rollback (truncate, state snapshots). It also records dispatches per decode token. Uses only
calls that exist before and after the runtime's block restructure, so one script records both sides.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

OPTIONS = {  # setting -> load_model keyword options (all: 256-token context, 32-row chunks, split-K past 48 keys)
    "int8": {},
    "f32": {"q8_decode": False},
    "int8-prefill": {"q8_prefill": True},
}
BASE = dict(max_context=256, prefill_chunk=32, split_keys=48)


def tiny_models(tmp: Path) -> dict[str, Path]:
    """name -> checkpoint path: tiny HF models converted to MLC, the cached MLX test folders, the demo GGUF."""
    from engine.convert import convert_hf_to_mlc

    try:
        from tests.helpers import cached_tiny_hf
    except ImportError:  # a tree from before tests/helpers.py
        from tests.tiny_models import cached_tiny_hf

    out = {}
    hf = {"phi3": ("phi3", dict(vocab_size=250)), "llama": ("llama", dict(vocab_size=300, rope_theta=500000.0)),
          "qwen3": ("qwen3", dict(vocab_size=290)), "qwen3_5": ("qwen3_5", {}), "qwen3_5_moe": ("qwen3_5_moe", {})}
    for name, (model_type, overrides) in hf.items():
        mlc = tmp / name
        convert_hf_to_mlc(cached_tiny_hf(model_type, **overrides), mlc)
        out[name] = mlc
    for variant in ("q4", "q3exp"):
        found = sorted((ROOT / ".cache" / "test-mlx").glob(f"e2e-{variant}-mlx*"))
        if found:
            out[f"mlx-{variant}"] = found[-1]
    demo = sorted((ROOT / ".cache" / "demo" / "models").glob("*.gguf"))
    if demo:
        out["demo-gguf"] = demo[0]
    return out


def bench_runtime(gpu, shape: str, options: dict):
    """A tiny random-weight bench shape on the hybrid runtime, built the way `zerotvm bench` builds it."""
    import zlib

    from engine import bench_hybrid

    spec, formats = bench_hybrid.hybrid_spec(shape)
    # Each tensor drawn from its own name's seed, so the weights do not depend on the order the runtime lists them in.
    draw = getattr(bench_hybrid, "random_tensor", None) or bench_hybrid._random  # its name before the restructure
    weights = [(name, draw(np.random.default_rng(zlib.crc32(name.encode())), name, shape_, dtype, formats))
               for name, (shape_, dtype) in sorted(_tensor_shapes(spec, formats).items())]
    try:  # after the restructure: one Transformer
        from engine.runtime_options import RuntimeOptions
        from engine.transformer import Transformer

        return Transformer(gpu, spec, weights, formats=formats, options=RuntimeOptions(**{**BASE, **options}))
    except ImportError:
        from engine.hybrid import HybridTransformer

        base = dict(BASE)
        return HybridTransformer(gpu, spec, weights, base.pop("max_context"), formats=formats, **base, **options)


def _tensor_shapes(spec, formats):
    try:
        from engine.transformer import expected_tensors

        return expected_tensors(spec, formats)
    except ImportError:
        from engine.hybrid import hybrid_tensor_shapes

        return hybrid_tensor_shapes(spec, formats)


def exercise(rt, record: dict, key: str, short: bool = False) -> None:
    from engine.sampling import SamplingParams

    vocab = rt.spec.vocab
    ids = np.random.default_rng(11).integers(3, vocab, 100).astype(np.uint32)
    n = 40 if short else 100
    rt.set_sampling(SamplingParams())
    rt.reset()
    record[f"{key}/logits-chunked"] = rt.logits(ids[:n])
    rt.reset()
    record[f"{key}/logits-per-token"] = rt.logits(ids[:n], chunk=1)
    rt.reset()
    rt.prefill(ids[:60])
    first = rt.read_sampled(0)
    record[f"{key}/greedy"] = np.array([first] + [t for b in rt.decode(0, 8 if short else 24) for t in b], np.int64)
    rt.set_sampling(SamplingParams(temperature=0.8, top_k=20, top_p=0.9, repetition_penalty=1.1, seed=7))
    rt.reset()
    rt.prefill(ids[:60])
    first = rt.read_sampled(0)
    record[f"{key}/sampled"] = np.array([first] + [t for b in rt.decode(0, 8 if short else 24) for t in b], np.int64)
    rt.set_sampling(SamplingParams())
    rt.reset()
    rt.prefill(ids[:40])
    rt.read_sampled(0)
    list(rt.decode(0, 10))
    rt.truncate(30)
    record[f"{key}/after-rollback"] = rt.logits(ids[30:50])
    record[f"{key}/dispatches_per_token"] = np.array(rt.dispatches_per_token)


def record_all(out: Path, only: list[str] | None) -> dict:
    from engine.gpu import Gpu
    from engine.model import load_model

    gpu = Gpu()
    record: dict[str, np.ndarray] = {}
    with tempfile.TemporaryDirectory() as tmp:
        models = tiny_models(Path(tmp))
        for name, path in models.items():
            for setting, opts in OPTIONS.items():
                if only and name not in only:
                    continue
                if name == "demo-gguf" and setting != "int8":
                    continue  # 30 layers on a software GPU: one setting is enough
                t = time.perf_counter()
                model = load_model(path, gpu=gpu, **BASE, **opts)
                exercise(model.runtime, record, f"{name}/{setting}", short=name == "demo-gguf")
                del model
                print(f"{name}/{setting}: {time.perf_counter() - t:.1f} s", file=sys.stderr, flush=True)
        for shape in ("tiny-hybrid", "tiny-hybrid-moe", "tiny-hybrid-moe-3bit"):
            for setting, opts in OPTIONS.items():
                if only and shape not in only:
                    continue
                exercise(bench_runtime(gpu, shape, opts), record, f"{shape}/{setting}")
                print(f"{shape}/{setting} done", file=sys.stderr, flush=True)
    np.savez_compressed(out, **record)
    return record


def compare(new: dict, old_path: Path) -> int:
    old = dict(np.load(old_path))
    bad = 0
    for key in sorted(set(old) | set(new)):
        if key not in new or key not in old:
            print(f"{key}: only in {'the old' if key in old else 'the new'} record")
            bad += 1
            continue
        a, b = old[key], new[key]
        if a.shape == b.shape and np.array_equal(a, b):
            if key.endswith("dispatches_per_token"):
                print(f"{key}: {int(a)}")
            continue
        bad += 1
        if key.endswith("dispatches_per_token"):
            print(f"{key}: {int(a)} -> {int(b)}")
        elif a.shape != b.shape:
            print(f"{key}: shape {a.shape} -> {b.shape}")
        else:
            diff = float(np.abs(a.astype(np.float64) - b).max())
            scale = max(float(np.abs(a).max()), 1e-30)
            print(f"{key}: DIFFERS, max |diff| {diff:.3g} ({diff / scale:.3g} of max), {int(np.sum(a != b))} of "
                  f"{a.size} elements")
    print(f"{len(set(old) | set(new)) - bad} identical, {bad} different")
    return 1 if bad else 0


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", type=Path)
    p.add_argument("--compare", type=Path, help="an earlier record to compare with")
    p.add_argument("--only", nargs="+", help="model names to run (default: all)")
    args = p.parse_args()
    rec = record_all(args.out, args.only)
    sys.exit(compare(rec, args.compare) if args.compare else 0)
