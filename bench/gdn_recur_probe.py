"""The delta-rule recurrence alone at a hybrid shape's GDN dims: gdn_recur (workgroup memory) against gdn_recur_sg
(subgroup shuffles) over a few RSPLIT / WG choices, for decode (T = 1) and a prefill chunk, each dispatch timed
back to back (engine/bench.py dispatch_seconds). Finds the kernel's best constants on a GPU without building a
model; bench/profile_token.py (--gdn-subgroups for this kernel) times it inside the model.

    python3 bench/gdn_recur_probe.py [qwen3.5-4b] [--tokens 1 512] [--rsplit 8 4 16] [--wg 64 128 32]
"""

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine import bench  # noqa: E402
from engine.bench_hybrid import hybrid_spec  # noqa: E402
from engine.gpu import UNIFORM, Gpu  # noqa: E402
from engine.kernels import step_struct  # noqa: E402
from engine.kernels.gdn import gdn_recur_plan, gdn_recur_sg_plan  # noqa: E402


def main(gpu: Gpu, shape: str, tokens: list[int], rsplits: list[int], wgs: list[int]) -> None:
    s, _ = hybrid_spec(shape)
    kh, vh, dk, dv = s.gdn_k_heads, s.gdn_v_heads, s.gdn_k_dim, s.gdn_v_dim
    conv = 2 * kh * dk + vh * dv
    rng = np.random.default_rng(0)
    variants = [("gdn_recur", gdn_recur_plan(kh, vh, dk, dv, conv), "")]
    for r in rsplits:
        if r > gpu.subgroup_size or not gpu.use_subgroups:
            continue
        variants += [("gdn_recur_sg", gdn_recur_sg_plan(kh, vh, dk, dv, conv, r, wg=w), f"RSPLIT {r} WG {w}")
                     for w in wgs if w >= r]
    for T in tokens:
        qkv = gpu.upload("qkv", rng.standard_normal((T, conv)).astype(np.float32))
        gates = gpu.upload("gates", np.concatenate([np.full((T, vh), -0.1), rng.uniform(0, 1, (T, vh))], 1)
                           .astype(np.float32))
        state = gpu.upload("state", np.zeros((vh, dk, dv), np.float32))
        out = gpu.buffer("out", T * vh * dv * 4)
        step = gpu.buffer("step", 16, UNIFORM)
        gpu.write(step, step_struct().pack(n_tokens=T, pos0=1, out_index=0, attn_splits=1))
        for name, (consts, grid), label in variants:
            pipe = gpu.pipeline(name, consts)
            bg = gpu.bind(pipe, [qkv, gates, state, out, step], name)
            sec = bench.dispatch_seconds(gpu, pipe, bg, grid, reps=20 if T > 1 else 100)
            print(f"{shape} T={T:4d} {name:13s} {label:17s} grid {grid}: {sec * 1e6:9.1f} µs", flush=True)


if __name__ == "__main__":
    ap = argparse.ArgumentParser()
    ap.add_argument("shapes", nargs="*", default=["qwen3.5-4b"])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1, 512])
    ap.add_argument("--rsplit", type=int, nargs="+", default=[8, 4, 16])
    ap.add_argument("--wg", type=int, nargs="+", default=[64, 128, 32])
    args = ap.parse_args()
    g = Gpu()
    for shape in args.shapes:
        main(g, shape, args.tokens, args.rsplit, args.wg)
