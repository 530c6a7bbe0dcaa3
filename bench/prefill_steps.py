"""What the app's cancellable prefill costs: prompt tokens/s read in fenced pieces (prefill_steps with a CancelToken,
the path of every app and CLI reply) against the plain prefill that queues every chunk at once, on a dense bench
shape with random weights.

    python bench/prefill_steps.py --shape qwen3-4b --prompt-tokens 512 2048 --json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    import numpy as np

    from engine.bench import git_commit, random_weights, shape_spec
    from engine.cancel import CancelToken
    from engine.gpu import Gpu
    from engine.runtime_options import RuntimeOptions
    from engine.transformer import Transformer

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", default="phi3-mini")
    p.add_argument("--prompt-tokens", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)

    gpu = Gpu()
    spec = shape_spec(args.shape)
    longest = max(args.prompt_tokens)
    rt = Transformer(gpu, spec, random_weights(spec), options=RuntimeOptions.of(max_context=longest + 16))
    ids = np.random.default_rng(1).integers(0, spec.vocab, longest).astype(np.uint32)

    def plain(n: int) -> float:
        rt.reset()
        t = time.perf_counter()
        rt.prefill(ids[:n])
        rt.read_sampled(0)
        return n / (time.perf_counter() - t)

    def stepped(n: int) -> float:
        rt.reset()
        t = time.perf_counter()
        pieces = sum(1 for _ in rt.prefill_steps(ids[:n], 0, CancelToken()))
        rt.read_sampled(0)
        stepped.pieces = pieces
        return n / (time.perf_counter() - t)

    plain(64), stepped(64)  # warm up pipelines
    rows = []
    for n in args.prompt_tokens:
        a = statistics.median(plain(n) for _ in range(args.runs))
        b = statistics.median(stepped(n) for _ in range(args.runs))
        rows.append({"prompt_tokens": n, "plain_tok_s": round(a, 1), "stepped_tok_s": round(b, 1),
                     "pieces": stepped.pieces, "stepped_vs_plain": round(b / a, 3)})
    result = {"gpu": gpu.info.name, "shape": args.shape, "commit": git_commit(), "rows": rows}
    if args.json:
        print(json.dumps(result))
    else:
        for r in rows:
            print(f"{r['prompt_tokens']:>6} tokens: plain {r['plain_tok_s']:>9.1f} tok/s, in {r['pieces']} fenced "
                  f"pieces {r['stepped_tok_s']:>9.1f} tok/s ({r['stepped_vs_plain']:.3f}x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
