"""How far the demo model's int8 decode logits fall from transformers' over equally valid f32 roundings.

    python3 bench/int8_decode_spread.py [--seeds N] [--tree PATH] [--f32]

Teacher-forces tests/test_demo_model.py's story one token at a time (runtime.logits with chunk=1, as its int8-decode
case does): once as is, then once per seed k with RoPE inverse frequency k one f32 ulp higher, a rounding the
reference's own f32 arithmetic could as well have made. Any such change re-draws the int8 roundings downstream (a
code one step off moves the next quantizer's inputs by about 1e-3, enough to move other codes), so the runs sample
the error an int8 scheme has, not one draw of it. Prints one JSON line per run (max error over the 64 positions in %
of the logit range, the mean of the per-position maxima, top-1 flips with their reference top-2 margins in %), then a
summary: runs with two or more flips (the 98% criterion over 64 positions), over the 4% bound, and the largest
reference margin a flip had. --tree measures another checkout (a git worktree of an older commit, its .cache linked).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent


def story_ids(tokenizer) -> tuple[list[int], int]:
    """The token ids of the test's chat and the index of the first logits row that predicts the answer."""
    from tests.test_demo_model import STORY

    messages = [{"role": "user", "content": "Write a short story about a lighthouse keeper."},
                {"role": "assistant", "content": STORY}]
    ids = tokenizer.chat_prompt(messages, add_generation_prompt=False).ids
    return ids, len(tokenizer.chat_prompt(messages[:1]).ids) - 1


def reference_logits(path: Path, ids: list[int]) -> np.ndarray:
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32).eval()
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0].numpy()


def load(path: Path, gpu, seed: int | None, options: dict):
    """The demo model with inverse frequency `seed` one ulp up (None: as is)."""
    from engine.model import load_model
    from engine.models.rope import Rope

    plain = Rope.at

    def nudged(self, context):
        freqs = np.array(plain(self, context), np.float32)
        freqs[seed] = np.nextafter(freqs[seed], np.float32(np.inf))
        return freqs

    Rope.at = plain if seed is None else nudged
    try:
        return load_model(path, gpu=gpu, max_context=512, **options)
    finally:
        Rope.at = plain


def per_token_logits(model, ids: list[int]) -> np.ndarray:
    model.runtime.reset()
    return model.runtime.logits(np.array(ids), chunk=1)


def score(run: np.ndarray, ref: np.ndarray) -> dict:
    span = np.abs(ref).max()
    top2 = np.sort(ref, axis=1)[:, -2:]
    flips = np.nonzero(run.argmax(1) != ref.argmax(1))[0]
    err = np.abs(run - ref).max(1) / span
    return dict(max_err=round(100 * float(err.max()), 2), mean_err=round(100 * float(err.mean()), 2),
                flips={int(i): round(100 * float((top2[i, 1] - top2[i, 0]) / span), 2) for i in flips})


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=12, help="perturbed runs (inverse frequencies 0 .. N-1)")
    ap.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose engine runs")
    ap.add_argument("--f32", action="store_true", help="f32 activations (q8_decode=False) instead of int8")
    args = ap.parse_args()
    sys.path.insert(0, str(args.tree.resolve()))
    from engine.gpu import Gpu
    from tests.helpers import demo_gguf

    path, gpu = demo_gguf(), Gpu()
    options = {"q8_decode": False} if args.f32 else {}
    model = load(path, gpu, None, options)
    ids, start = story_ids(model.tokenizer)
    ids = ids[:start + 64]
    window = slice(start, start + 64)
    ref = reference_logits(path, ids)[window]
    runs = []
    for seed in [None, *range(args.seeds)]:
        if seed is not None:
            model = None  # the previous model's buffers go before the next one loads
            model = load(path, gpu, seed, options)
        runs.append(dict(seed=seed, **score(per_token_logits(model, ids)[window], ref)))
        print(json.dumps(runs[-1]), flush=True)
    margins = [m for r in runs for m in r["flips"].values()]
    print(json.dumps(dict(runs=len(runs), two_or_more_flips=sum(len(r["flips"]) >= 2 for r in runs),
                          over_4pct=sum(r["max_err"] >= 4 for r in runs),
                          max_err_range=[min(r["max_err"] for r in runs), max(r["max_err"] for r in runs)],
                          largest_flipped_margin=max(margins, default=None))))


if __name__ == "__main__":
    main()
