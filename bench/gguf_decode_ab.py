"""Decode and prefill speed of the catalog's GGUF builds (Q4_K_M: the files people download), through their
stand-in files (bench/gguf_standin.py: the real tensor names, shapes and llama-quantize's type mix, random blocks),
with sets of runtime options taken in turn in one process: an A/B of the K-quant paths on those formats.

    python3 bench/gguf_decode_ab.py [qwen3-4b-q4_k_m-gguf phi3-mini-4k-q4_k_m-gguf ...] \\
        --options '{}' --options '{"q8_natural": false}' [--rounds 2] [--json OUT]

Each round loads every build once per option set (alternating, so drift hits both alike) and reports decode tok/s
(median of `--runs` decodes of 128 tokens after a 512-token prompt), the GPU ms a decode token takes (pass
timestamps) and pp512 tok/s. No tokenizer: the runtime runs on token ids.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402

from bench.gguf_standin import STANDINS, ensure  # noqa: E402

GGUF_BUILDS = [key for key in STANDINS if key.endswith("-gguf")]  # the demo's stand-in runs too, when named


def measure(gpu, path: Path, options: dict, prompt: int, decode: int, runs: int) -> dict:
    from engine import bench
    from engine.model import load_model

    model = load_model(path, gpu=gpu, max_context=prompt + decode + 16, prefill_chunk=min(prompt, 512), **options)
    rt = model.runtime
    ids = np.random.default_rng(1).integers(0, rt.spec.vocab, prompt).astype(np.uint32)
    bench.timed_decode(rt, ids[:16], 8)  # pipelines and caches warm
    out = {"decode_tok_s": round(statistics.median(bench.timed_decode(rt, ids, decode) for _ in range(runs)), 1),
           "prefill_tok_s": round(statistics.median(prompt / bench.timed_prefill(rt, ids) for _ in range(runs)), 1),
           "q8_natural": rt.plan.q8_natural, "dispatches_per_token": rt.dispatches_per_token}
    busy = bench.gpu_busy(rt, ids)
    out["gpu_ms_per_token"] = busy.get("gpu_ms_per_token")
    del model, rt
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("builds", nargs="*", default=GGUF_BUILDS, help=f"catalog GGUF keys (default: {GGUF_BUILDS})")
    ap.add_argument("--options", action="append", help="runtime options as JSON (repeat for each set; default {})")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--decode", type=int, default=128)
    ap.add_argument("--json", help="also write every measurement to this file")
    args = ap.parse_args()
    from engine.bench import git_commit
    from engine.catalog import load_catalog
    from engine.gpu import Gpu

    unknown = [b for b in args.builds if b not in STANDINS]
    if unknown:
        ap.error(f"no stand-in for {', '.join(unknown)}; have {', '.join(STANDINS)}")
    option_sets = [json.loads(o) for o in (args.options or ["{}"])]
    catalog = {e.key: e for e in load_catalog()}
    paths = {b: ensure(catalog[b])[0] for b in args.builds}  # written before the device opens
    gpu = Gpu()
    print(f"{gpu.info.name}, driver {gpu.info.driver}, commit {git_commit()}", flush=True)
    rows = []
    for r in range(args.rounds):
        for build in args.builds:
            for options in option_sets:
                m = measure(gpu, paths[build], options, args.prompt, args.decode, args.runs)
                rows.append({"round": r, "build": build, "options": options, **m})
                print(json.dumps(rows[-1]), flush=True)
    for build in args.builds:
        for options in option_sets:
            mine = [x for x in rows if x["build"] == build and x["options"] == options]
            print(f"{build} {json.dumps(options)}: decode {statistics.median(x['decode_tok_s'] for x in mine):.1f} "
                  f"tok/s, pp{args.prompt} {statistics.median(x['prefill_tok_s'] for x in mine):.0f} tok/s")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
