"""Dispatches per decode token and per prefill chunk for the benchmark shapes, recorded on whatever GPU is at hand
(lavapipe too): a MoE shape is built with fewer experts (`--experts`, default 16), which changes no count.

    python3 bench/dispatch_counts.py qwen3.6-35b-a3b-4bit qwen3.6-35b-a3b-3bit --json [--moe-unfused]
        [--options '{"q8_epilogues": false}']

`--moe-unfused`: the MoE decode before its fused passes (bench/moe_unfused.py). `decode_kernels` counts the decode
token's dispatches by kernel; `--options`: RuntimeOptions fields as JSON (an A/B of a variant).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.moe_unfused import unfused_moe  # noqa: E402
from engine.bench_hybrid import HYBRID_SHAPES, make_spec, random_weights  # noqa: E402
from engine.gpu import Gpu  # noqa: E402
from engine.runtime_options import RuntimeOptions  # noqa: E402
from engine.transformer import Transformer  # noqa: E402


def counts(gpu: Gpu, shape: str, experts: int, chunk: int, options: dict | None = None) -> dict:
    if shape not in HYBRID_SHAPES:
        raise SystemExit(f"unknown shape {shape!r}; known: {', '.join(HYBRID_SHAPES)}")
    model_type, config, layout, bits = HYBRID_SHAPES[shape]
    config = dict(config, **({"num_experts": experts} if "num_experts" in config else {}))
    spec, formats = make_spec(model_type, config, layout, bits)
    rt = Transformer(gpu, spec, random_weights(spec, formats), formats=formats,
                     options=RuntimeOptions.of(max_context=chunk + 64, prefill_chunk=chunk, **(options or {})))
    prefill = rt.dispatched_kernels(chunk)
    decode = collections.Counter(rt.dispatched_kernels())
    return {"shape": shape, "experts": config.get("num_experts"), "decode_dispatches": rt.dispatches_per_token,
            "decode_kernels": dict(decode.most_common()),
            "prefill_chunk": chunk, "prefill_dispatches": len(prefill),
            "prefill_quantize_q8": prefill.count("quantize_q8"),
            "prefill_moe_kernels": {k: v for k, v in collections.Counter(prefill).items() if k.startswith("moe")}}


if __name__ == "__main__":
    p = argparse.ArgumentParser()
    p.add_argument("shapes", nargs="+")
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--chunk", type=int, default=512)
    p.add_argument("--json", action="store_true")
    p.add_argument("--moe-unfused", action="store_true", help="the MoE decode before its fused passes")
    p.add_argument("--options", default="{}", help="RuntimeOptions fields as JSON")
    args = p.parse_args()
    gpu = Gpu()
    for shape in args.shapes:
        with unfused_moe(args.moe_unfused):
            r = counts(gpu, shape, args.experts, args.chunk, json.loads(args.options))
        print(json.dumps(r) if args.json else r, flush=True)
