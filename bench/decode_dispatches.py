"""Dispatches per decode token of the bench shapes (greedy, attention in one pass), and per block.

    python3 bench/decode_dispatches.py [phi3-mini qwen3-4b qwen3.5-4b ...] [--layers A B] [--options JSON]
        [--splits N]

With --layers the models are built with A and B layers of the real widths and the count is extrapolated per layer
to the full depth (a software GPU cannot hold the full models quickly); without it, the full models are built.
--options: RuntimeOptions fields as JSON, for an A/B (e.g. '{"gate_up_q8": true}'). --splits: the decode token of
split-K attention in N partitions (past single_pass_keys keys) instead of the one-pass one (one dispatch a layer
either way with fused_split_decode, the default; '{"fused_split_decode": false}' for the three kernels); with
--layers the line also counts the quantize_q8 dispatches.
Prints one JSON line per shape.
"""

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import bench, bench_hybrid  # noqa: E402
from engine.gpu import Gpu  # noqa: E402
from engine.runtime_options import RuntimeOptions  # noqa: E402
from engine.transformer import Transformer  # noqa: E402

OPTIONS = RuntimeOptions(max_context=256, prefill_chunk=16)


def token_kernels(rt, splits: int) -> list[str]:
    """The kernel of each dispatch of one greedy decode token with attention in `splits` partitions."""
    return [item[0].label for item in rt.decode_plan(splits).items]


def extrapolate(na: int, nb: int, a: int, b: int, full: int) -> int:
    """A count at `full` layers from its values at a and b layers (linear in the layers)."""
    return na + (nb - na) * (full - a) // (b - a)


def build(gpu: Gpu, shape: str, layers: int | None, options: RuntimeOptions = OPTIONS):
    """The runtime of `shape` with `layers` layers (None: its own) and its full depth."""
    if shape in bench_hybrid.HYBRID_SHAPES:
        model_type, config, layout, bits = bench_hybrid.HYBRID_SHAPES[shape]
        name = f"{shape}@{layers}" if layers else shape
        bench_hybrid.HYBRID_SHAPES[name] = (model_type, dict(config, num_hidden_layers=layers or
                                                             config["num_hidden_layers"]), layout, bits)
        spec, formats = bench_hybrid.hybrid_spec(name)
        full = config["num_hidden_layers"]
        return Transformer(gpu, spec, bench_hybrid.random_weights(spec, formats), formats=formats,
                           options=options), full
    dims = list(bench.SHAPES[shape])
    full = dims[1]
    name = f"{shape}@{layers}" if layers else shape
    bench.SHAPES[name] = tuple(dims[:1] + [layers or full] + dims[2:])
    spec = bench.shape_spec(name)
    return Transformer(gpu, spec, bench.random_weights(spec), options=options), full


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="*", default=["phi3-mini", "qwen3-4b", "qwen3.5-4b"])
    p.add_argument("--layers", nargs=2, type=int, metavar=("A", "B"),
                   help="build A and B layers and extrapolate (hybrids: a multiple of the attention interval, 4)")
    p.add_argument("--options", default="{}", help="RuntimeOptions fields as JSON")
    p.add_argument("--splits", type=int, default=1, help="split-K partitions of decode attention (1: one pass)")
    args = p.parse_args()
    options = RuntimeOptions.of(OPTIONS, **json.loads(args.options))
    gpu = Gpu()
    for shape in args.shapes:
        if args.layers:
            a, b = args.layers
            rt, full = build(gpu, shape, a, options)
            ka = token_kernels(rt, args.splits)
            del rt
            rt, _ = build(gpu, shape, b, options)
            kb = token_kernels(rt, args.splits)
            del rt
            qa, qb = ka.count("quantize_q8"), kb.count("quantize_q8")
            print(json.dumps({"shape": shape, "splits": args.splits,
                              "dispatches_per_token": extrapolate(len(ka), len(kb), a, b, full),
                              "extrapolated_from": {a: len(ka), b: len(kb)},
                              "quantize_q8": extrapolate(qa, qb, a, b, full), "kernels": sorted(set(ka))}), flush=True)
        elif args.splits != 1:
            raise SystemExit("--splits needs --layers")
        else:
            rt, _ = build(gpu, shape, None, options)
            print(json.dumps({"shape": shape, "dispatches_per_token": rt.dispatches_per_token,
                              "blocks": {r["block"]: r["dispatches_per_token"] for r in rt.report()}}), flush=True)
            del rt
