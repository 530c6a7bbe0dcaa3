"""Qwen3.6-35B-A3B with its routed experts streamed from host memory through the GPU expert cache, at weights
budgets of 8, 12 and 16 GiB and unlimited (every expert resident): decode tok/s, the cache's hit rate, upload GB/s
and bytes per token, with random routing and with a skewed one; the 4-bit and the 3-bit-expert shapes, random
weights (engine/bench_hybrid.py: one random array per shape and role, shared by every layer, so the host holds one
layer's expert stacks and every layer gathers from them).

Routing: the router's own picks are replaced, after the per-layer readback, by draws (ExpertStream.route); the
combine weights stay the router's, so the work per token is unchanged.
- random: top_k distinct experts uniformly at random per token and layer (the worst case for any cache).
- skewed: top_k distinct experts drawn without replacement with weights from a lognormal popularity curve whose
  spread is fitted to a published measurement of Qwen3-MoE routing: on Qwen3-30B-A3B (128 experts, top-8) a
  narrow single-domain workload (~8k tokens of Python) needed 58 of 128 experts (45%) to cover 90% of the routing
  mass, a diverse one 65/128 (51%); the hottest expert took 6.3% / 4.3% of it (llama-imatrix per-expert counts,
  gpu-container handbook, "Routing De-risk", https://mcp-tool-shop-org.github.io/gpu-container/handbook/derisk/).
  One parameter cannot match both numbers (a Zipf curve with 45% coverage gives its top expert ~25%): the fit keeps
  the 90%-coverage share (the figure a cache size maps to), so its hottest expert is hotter than measured. The hot
  experts differ per layer (a random permutation each). The draws are independent token to token, with none of
  the temporal locality real text has. The JSON records the coverage the draws reached.

    python3 bench/expert_stream.py --json expert_stream.json
    python3 bench/expert_stream.py --json small.json --shapes small-moe --budgets 0,slots:48,slots:16 --breakdown

--breakdown adds the host seconds per decode token by phase (ExpertStream.seconds: recording, submits, waiting for
the routing's readback and reading it, the benchmark's routing draws and their write to the GPU ("route", not part of
the product's work), the policy, staging waits, gathers, recording the copies, slot writes; "other" is the rest of
the token's wall time). The mappings are waited for by non-blocking device polls on the calling thread (engine/
mapping.py PolledMap, expert_cache.MAP_WAIT's default); --wait thread waits through wgpu-py's poll thread instead,
and --poll-here (implies --wait thread) by a blocking poll on the calling thread (the A/B behind Gpu.wait_map). The
small shapes run on a software GPU, where waits hold the GPU's compute but host phases are host costs.
A budget "slots:N" leaves N cache slots per layer.

Fits in about 5 minutes on one H200 (two shapes × four budgets, 64 decode tokens per run after a 24-token warm-up,
one 256-token prefill per streamed budget).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import time
from statistics import NormalDist

import numpy as np

from engine import bench
from engine.bench_hybrid import _TINY, hybrid_spec, make_spec, random_weights
from engine.blocks.expert_cache import PHASES
from engine.blocks.moe import MoeFfn
from engine.gpu import Gpu
from engine.gpu_budget import parse_size
from engine.runtime_options import RuntimeOptions
from engine.transformer import RuntimePlan, Transformer

SHAPES = ("qwen3.6-35b-a3b-4bit", "qwen3.6-35b-a3b-3bit")
BUDGETS = ("0", "16G", "12G", "8G")  # 0: unlimited (every expert resident)
# Qwen3.6's layer count and routing (40 MoE layers, top-8 + the shared expert) at toy widths: the host's per-layer
# structure on a software GPU.
SMALL = dict(_TINY, num_hidden_layers=40, full_attention_interval=4, num_experts=64, num_experts_per_tok=8,
             moe_intermediate_size=64, shared_expert_intermediate_size=64, tie_word_embeddings=False)
MEASURED_COVERAGE = 0.45  # share of experts holding 90% of the routing mass (narrow workload, see above)


def popularity(E: int, coverage: float = MEASURED_COVERAGE) -> tuple[np.ndarray, float]:
    """(lognormal popularity over E experts, hottest first, whose top `coverage` share holds 90% of the mass; its
    sigma), by bisection on sigma."""
    z = np.array([NormalDist().inv_cdf((i + 0.5) / E) for i in range(E)])[::-1]

    def share(sigma):
        p = np.exp(sigma * z)
        p /= p.sum()
        return (np.searchsorted(np.cumsum(p), 0.9) + 1) / E, p

    lo, hi = 0.0, 5.0
    for _ in range(60):
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if share(mid)[0] > coverage else (lo, mid)
    return share(hi)[1], hi


def coverage_of(counts: np.ndarray) -> float:
    """Share of experts (hottest first) holding 90% of the selections."""
    c = np.sort(counts)[::-1].astype(np.float64)
    return float((np.searchsorted(np.cumsum(c) / c.sum(), 0.9) + 1) / len(c))


class Router:
    """Draws top_k distinct experts per token and layer: uniformly, or with weights p (Gumbel top-k)."""

    def __init__(self, E: int, top_k: int, layers, skewed: bool, seed: int = 0):
        self.rng, self.E, self.k = np.random.default_rng(seed), E, top_k
        p, self.sigma = popularity(E) if skewed else (np.full(E, 1 / E), 0.0)
        self.logp = {i: np.log(p[self.rng.permutation(E)]) for i in layers}  # hot experts differ per layer
        self.counts = {i: np.zeros(E, np.int64) for i in layers}
        self._blocks: dict[int, tuple[np.ndarray, int]] = {}  # layer -> (drawn rows, the next one to give)

    BLOCK = 64  # single tokens' draws made at once per layer: one draw a call cost more host time than the policy

    def __call__(self, layer: int, T: int) -> np.ndarray:
        if T > 1:
            ids = self._draw(layer, T)
            np.add.at(self.counts[layer], ids.reshape(-1), 1)
            return ids
        block, at = self._blocks.get(layer, (None, self.BLOCK))
        if at == self.BLOCK:
            block, at = self._draw(layer, self.BLOCK), 0
        self._blocks[layer] = (block, at + 1)
        self.counts[layer][block[at]] += 1  # a row's experts are distinct
        return block[at:at + 1]

    def _draw(self, layer: int, T: int) -> np.ndarray:
        g = self.logp[layer] + self.rng.gumbel(size=(T, self.E))
        return np.argpartition(-g, self.k, axis=1)[:, :self.k].astype(np.uint32)

    def coverage(self) -> float:
        return float(np.mean([coverage_of(c) for c in self.counts.values() if c.sum()]))


def shape_spec(shape: str):
    return make_spec("qwen3_5_moe", SMALL, "mlx", 4) if shape == "small-moe" else hybrid_spec(shape)


def budget_bytes(text: str, spec, formats) -> int | None:
    """A --budgets entry in bytes: 0 (None: unlimited), a size, or slots:N (the budget leaving N slots a layer)."""
    text = text.strip()
    if text == "0":
        return None
    if not text.startswith("slots:"):
        return parse_size(text, "--budgets")
    plan = RuntimePlan(spec, formats, RuntimeOptions.of(max_context=2048, prefill_chunk=512))
    moe = next(b for b in plan.blocks if isinstance(b, MoeFfn))
    return plan.memory()["weights"] - (moe.E - int(text[6:])) * moe.routed_expert_bytes()


def timed_decode(rt: Transformer, st, prompt: np.ndarray, n: int) -> tuple[float, float]:
    """(decode tok/s, wall seconds) of n tokens after the prompt; the stream's counters cover the decode only."""
    rt.reset()
    rt.prefill(prompt)
    rt.read_sampled(0)
    if st:
        st.reset_counters()
    t = time.perf_counter()
    got = sum(len(b) for b in rt.decode(0, n))
    wall = time.perf_counter() - t
    return got / wall, wall


def run(gpu: Gpu, shape: str, budget: int | None, tokens: int, warmup: int, prefill: int, policy: str,
        breakdown: bool = False) -> list[dict]:
    spec, formats = shape_spec(shape)
    options = RuntimeOptions.of(max_context=2048, prefill_chunk=512, gpu_weights=budget, expert_policy=policy)
    started = time.perf_counter()
    rt = Transformer(gpu, spec, random_weights(spec, formats), formats=formats, options=options)
    built = time.perf_counter() - started
    st = rt.plan.streaming
    prompt = np.random.default_rng(1).integers(0, spec.vocab, max(prefill, 16)).astype(np.uint32)
    out = []
    for routing in ("random", "skewed") if st else ("router",):
        r = {"shape": shape, "budget_gib": round(budget / 2**30, 6) if budget else None, "routing": routing,
             "policy": policy, "build_s": round(built, 1)}
        router = None
        if st:
            router = Router(spec.n_experts, spec.top_k, st.layers, routing == "skewed")
            st.route = router
            r |= {"slots": st.slots, "experts": st.E, "resident_share": round(st.resident_share(), 3),
                  "expert_mb": round(st.expert_bytes() / 1e6, 3), "sigma": round(router.sigma, 3)}
        timed_decode(rt, st, prompt[:16], warmup)  # fills the cache, builds the pipelines
        tps, wall = timed_decode(rt, st, prompt[:16], tokens)
        r["decode_tok_s"] = round(tps, 2)
        if st:
            n = tokens
            if breakdown:
                ms = {p: round(1e3 * st.seconds[p] / n, 3) for p in PHASES}
                r["host_ms_per_token"] = ms | {"other": round(1e3 * wall / n - sum(ms.values()), 3),
                                               "wall": round(1e3 * wall / n, 3)}
            r |= {"hit_rate": round(st.hit_rate(), 4), "misses_per_token": round(st.misses / n, 1),
                  "upload_mb_per_token": round(st.uploaded_bytes / n / 1e6, 1),
                  "upload_gb_s": round(st.uploaded_bytes / st.upload_seconds / 1e9, 2) if st.upload_seconds else None,
                  "upload_share_of_time": round(st.upload_seconds * tps / n, 3),
                  "coverage_90": round(router.coverage(), 3)}
            if prefill:
                st.reset_counters()
                r["prefill_tok_s"] = round(prefill / bench.timed_prefill(rt, prompt[:prefill]), 1)
                r["prefill_hit_rate"] = round(st.hit_rate(), 4)
        elif prefill:
            r["prefill_tok_s"] = round(prefill / bench.timed_prefill(rt, prompt[:prefill]), 1)
        if prefill:
            r["prefill_tokens"] = prefill
        print(json.dumps(r), file=sys.stderr, flush=True)
        out.append(r)
    for b in [rt.ws, *rt.blocks]:
        b.release()
    gpu.sync()
    return out


def poll_here(gpu: Gpu, promise) -> None:
    """The variant --poll-here measures: poll the device on this thread until every submitted command buffer is done
    (the mapping's callback then fires here), instead of waiting for wgpu-py's poll thread."""
    if getattr(promise, "_state", None) == "pending" and hasattr(gpu.device, "_poll_wait"):
        gpu.device._poll_wait()
    promise.sync_wait()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--json", required=True, help="write the results here")
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--budgets", default=",".join(BUDGETS), help="weights budgets (12G, 8192M, bytes); 0 = unlimited")
    p.add_argument("--tokens", type=int, default=64)
    p.add_argument("--warmup", type=int, default=24)
    p.add_argument("--prefill", type=int, default=256, help="prompt tokens of the prefill run (0 = skip)")
    p.add_argument("--policy", default="lfu", choices=["lfu", "lru"], help="the expert cache's eviction policy")
    p.add_argument("--breakdown", action="store_true", help="host ms per decode token by phase")
    p.add_argument("--poll-here", action="store_true", help="A/B: wait for mappings by polling the device on the "
                                                             "calling thread instead of through wgpu-py's poll thread")
    p.add_argument("--wait", choices=["thread", "polled"], help="A/B: how the routing readbacks and staging "
                   "buffers are waited for (default: engine/blocks/expert_cache.py's MAP_WAIT; engine/mapping.py)")
    p.add_argument("--gather-threads", type=int, help="A/B: threads that gather missed experts (default: "
                                                     "engine/blocks/expert_cache.py's GATHER_THREADS)")
    p.add_argument("--min-thread-kib", type=int, help="A/B: the least bytes (KiB) a gather thread gets (default: "
                   "engine/blocks/expert_cache.py's MIN_THREAD_BYTES)")
    p.add_argument("--time-limit", type=float, default=390, help="seconds; configurations not started by then are "
                                                                "recorded as skipped (the run must fit 8 minutes)")
    args = p.parse_args(argv)
    started = time.perf_counter()
    gpu = Gpu()
    from engine.blocks import expert_cache
    if args.gather_threads:
        expert_cache.GATHER_THREADS = args.gather_threads
    if args.min_thread_kib:
        expert_cache.MIN_THREAD_BYTES = args.min_thread_kib * 1024
    if args.wait or args.poll_here:
        expert_cache.MAP_WAIT = "thread" if args.poll_here else args.wait
    if args.poll_here:
        gpu.wait_map = lambda promise: poll_here(gpu, promise)
    results = []
    for shape in args.shapes.split(","):
        for budget in args.budgets.split(","):
            size = budget_bytes(budget, *shape_spec(shape))
            if time.perf_counter() - started > args.time_limit:
                results.append({"shape": shape, "budget": budget, "skipped": "past --time-limit"})
                continue
            results += run(gpu, shape, size, args.tokens, args.warmup, args.prefill, args.policy, args.breakdown)
            with open(args.json, "w", encoding="utf-8") as f:  # what is done so far survives a kill
                json.dump({"partial": True, "results": results}, f, indent=1)
    doc = {"date": datetime.date.today().isoformat(), "gpu": gpu.info.name, "backend": gpu.info.backend,
           "driver": gpu.info.driver, "commit": bench.git_commit(), "poll_here": args.poll_here,
           "gather_threads": args.gather_threads,
           "min_thread_bytes": expert_cache.MIN_THREAD_BYTES, "wait": expert_cache.MAP_WAIT, "results": results}
    with open(args.json, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
    print(f"{'shape':22s} {'budget':>7s} {'routing':8s} {'slots':>5s} {'tok/s':>7s} {'hits':>6s} {'MB/tok':>7s} "
          f"{'GB/s':>5s} {'prefill':>8s}")
    for r in results:
        if "skipped" in r:
            print(f"{r['shape']:22s} {r['budget']:>7s} skipped (time limit)")
            continue
        budget = f"{r['budget_gib']:.3g}G" if r["budget_gib"] is not None else "all"
        hits = f"{100 * r['hit_rate']:.1f}%" if "hit_rate" in r else "-"
        print(f"{r['shape']:22s} {budget:>7s} {r['routing']:8s} {r.get('slots', '-')!s:>5s} {r['decode_tok_s']:7.1f} "
              f"{hits:>6s} {r.get('upload_mb_per_token', '-')!s:>7s} {r.get('upload_gb_s', '-')!s:>5s} "
              f"{r.get('prefill_tok_s', '-')!s:>8s}")
    if args.breakdown:
        print("host ms per decode token: " + " ".join(f"{p:>12s}" for p in (*PHASES, "other", "wall")))
        for r in results:
            if "host_ms_per_token" in r:
                print(f"{r['shape'][:12]:12s} {r['budget_gib']:.3g}G {r['routing']:7s} "
                      + " ".join(f"{v:12.3f}" for v in r["host_ms_per_token"].values()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
