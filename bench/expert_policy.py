"""The expert cache's eviction policy, measured on the CPU: hit rates of LRU and LFU (engine/blocks/expert_cache.py
SlotMap) for Qwen3.6-35B-A3B's cache sizes at weights budgets of 8, 12 and 16 GiB (slots from the runtime's own
plan), under random routing and under the skewed routing of bench/expert_stream.py (its Router: a lognormal
popularity fitted to a published Qwen3-MoE measurement). Decode: one token at a time, top-8 of 256 per layer.

    python3 bench/expert_policy.py [--tokens 3000] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from expert_stream import Router  # noqa: E402

from engine.bench_hybrid import hybrid_spec  # noqa: E402
from engine.blocks.expert_cache import SlotMap  # noqa: E402
from engine.blocks.moe import MoeFfn  # noqa: E402
from engine.runtime_options import RuntimeOptions  # noqa: E402
from engine.transformer import RuntimePlan, expert_slots  # noqa: E402


def slots_at(shape: str, gib: int) -> int:
    spec, formats = hybrid_spec(shape)
    plan = RuntimePlan(spec, formats, RuntimeOptions(max_context=6144))
    moe = next(b for b in plan.blocks if isinstance(b, MoeFfn))
    return expert_slots(plan, moe, gib * 2**30)


def hit_rate(slots: int, policy: str, skewed: bool, tokens: int, warmup: int, layers: int = 4) -> float:
    router = Router(256, 8, range(layers), skewed, seed=1)
    maps = {i: SlotMap(256, slots, policy) for i in range(layers)}
    for t in range(warmup + tokens):
        if t == warmup:
            for m in maps.values():
                m.hits = m.misses = 0
        for i in range(layers):
            maps[i].assign(router(i, 1)[0])
    hits = sum(m.hits for m in maps.values())
    return hits / (hits + sum(m.misses for m in maps.values()))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=3000)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--json")
    args = p.parse_args(argv)
    rows = []
    for shape in ("qwen3.6-35b-a3b-4bit", "qwen3.6-35b-a3b-3bit"):
        for gib in (8, 12, 16):
            slots = slots_at(shape, gib)
            if slots is None:
                continue
            for routing in ("random", "skewed"):
                row = {"shape": shape, "budget_gib": gib, "slots": slots, "routing": routing}
                for policy in ("lru", "lfu"):
                    row[policy] = round(hit_rate(slots, policy, routing == "skewed", args.tokens, args.warmup), 4)
                print(json.dumps(row), flush=True)
                rows.append(row)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
