"""Dispatches per prefill chunk of the bench shapes, by kernel, extrapolated to the full depth from models built with
A and B layers of the real widths (a software GPU cannot hold the full models quickly; as decode_dispatches.py).

    python3 bench/prefill_dispatches.py [phi3-mini qwen3-4b ...] [--chunk 512] [--layers 1 2]
        [--options '{"q8_epilogues": false}']

`--options`: RuntimeOptions fields as JSON (the A/B of a prefill variant). Prints one JSON line per shape.
"""

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.decode_dispatches import build, extrapolate  # noqa: E402
from engine.gpu import Gpu  # noqa: E402
from engine.runtime_options import RuntimeOptions  # noqa: E402


def kernels(gpu: Gpu, shape: str, layers: int, options: RuntimeOptions) -> tuple[collections.Counter, int]:
    """(dispatches of one prefill chunk by kernel, the shape's full depth) of `shape` built with `layers` layers."""
    rt, full = build(gpu, shape, layers, options)
    counts = collections.Counter(rt.dispatched_kernels(options.prefill_chunk))
    del rt
    return counts, full


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["phi3-mini", "qwen3-4b"])
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--layers", nargs=2, type=int, default=(1, 2), metavar=("A", "B"),
                   help="layers of the two builds (hybrids: multiples of the attention interval, 4)")
    p.add_argument("--options", default="{}", help="RuntimeOptions fields as JSON")
    args = p.parse_args()
    options = RuntimeOptions.of(max_context=args.chunk + 64, prefill_chunk=args.chunk, **json.loads(args.options))
    gpu = Gpu()
    a, b = args.layers
    for shape in args.shapes:
        ka, full = kernels(gpu, shape, a, options)
        kb, _ = kernels(gpu, shape, b, options)
        per_layer = {k: (kb[k] - ka[k]) / (b - a) for k in sorted(set(ka) | set(kb)) if kb[k] != ka[k]}
        total = {k: extrapolate(ka[k], kb[k], a, b, full) for k in sorted(set(ka) | set(kb))}
        print(json.dumps({"shape": shape, "chunk": args.chunk, "options": json.loads(args.options),
                          "prefill_dispatches": sum(total.values()), "per_layer": per_layer, "kernels": total}),
              flush=True)
