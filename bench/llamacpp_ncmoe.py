"""llama.cpp with Qwen3.6-35B-A3B's routed experts on the CPU (`llama-bench -ngl 99 -ncmoe N`) beside our expert
streaming at the same weights budgets (issue 20): the qwen3.6-35b-a3b-4bit shape as a random-weight Q4_0 GGUF
(bench/llamacpp_gguf.py), decode tg128 after a 512-token prompt and prefill pp512, for each N.

`-ncmoe N` (llama-bench.cpp, llama.cpp 0c1e57098) puts the tensors matching `blk\\.{i}\\.ffn_(up|down|gate|gate_up)_
(ch|)exps` for i < N in CPU memory: the routed expert stacks of the first N layers. The rest of `-ngl 99` stays on
the GPU but the input layer: llama.cpp keeps token_embd on the CPU whatever -ngl says (llama-model.cpp, "very little
benefit to offloading the input layer"). So the weights on the GPU at N are every tensor of the GGUF but token_embd
and those stacks, which this computes from the GGUF's tensor sizes; per budget of ours (8, 12, 16 GiB) it runs the
smallest N whose GPU weights are at most the budget, and also N = 0 (every expert on the GPU) and N = every layer.
The CPU's experts run on `-t` threads (default: this machine's cores).

Run on the benchmark machine from the repo root (the build and the GGUF are compare_llamacpp.py's; partial results
are written after each N, Ns not started by --time-limit are recorded as skipped, and --ns runs only the Ns given):

    python3 bench/llamacpp_ncmoe.py --llama-src .peer/llama.cpp-0c1e57098.tar.xz --out OUT_DIR \
        [--ours expert_stream.json]

--ours takes bench/expert_stream.py's JSON (`--shapes qwen3.6-35b-a3b-4bit --budgets 0,16G,12G,8G --prefill 512`)
and puts our decode and prefill beside llama.cpp's at the same budget. Writes ncmoe.md and ncmoe.json.

Without a GPU: `--build-only` writes the tiny qwen35moe GGUF, checks its layout, checks its byte table against the
layout's, prints it, then prints the real shape's byte table (from the layout: the 19 GB file is not written), the N
each budget gets and the llama-bench commands a run makes; with `--llama-bench PATH` (a CPU build) llama.cpp also
loads and runs the tiny file at two N.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llamacpp_gguf  # noqa: E402
from bench.compare_llamacpp import DEPTH, build_llama, llama_bench, llama_bench_commands  # noqa: E402

SHAPE = "qwen3.6-35b-a3b-4bit"
BUDGETS = ("16G", "12G", "8G")  # bench/expert_stream.py's budgets
# llama.cpp's LLM_FFN_EXPS_REGEX after blk\.{i} (common.h llm_ffn_block_regex), the layer captured
EXPS = re.compile(r"blk\.(\d+)\.ffn_(up|down|gate|gate_up)_(ch|)exps")
INPUT = "token_embd.weight"  # llama.cpp's input layer, always on the CPU
GIB = 2**30


def gguf_tensor_bytes(path: Path) -> dict[str, int]:
    """Every tensor of a GGUF file: name -> bytes of its data."""
    from gguf import GGUFReader

    return {t.name: int(t.n_bytes) for t in GGUFReader(str(path)).tensors}


def layout_tensor_bytes(cfg: dict) -> dict[str, int]:
    """The same from bench/llamacpp_gguf.py's layout table (ggml's block sizes), without writing the file."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    out = {}
    for name, (shape, kind) in llamacpp_gguf.expected(cfg).items():
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType[kind]]
        n = 1
        for s in shape:
            n *= s
        out[name] = n // block * size
    return out


def on_cpu(name: str, n_cpu_moe: int) -> bool:
    """Whether llama.cpp at `-ngl 99 -ncmoe n_cpu_moe` keeps this tensor in CPU memory."""
    m = EXPS.search(name)
    return name == INPUT or (m is not None and int(m[1]) < n_cpu_moe)


def gpu_weight_bytes(tensors: dict[str, int], n_cpu_moe: int) -> int:
    return sum(n for name, n in tensors.items() if not on_cpu(name, n_cpu_moe))


def byte_table(tensors: dict[str, int], layers: int) -> list[dict]:
    """Per N in 0..layers: the weight bytes on the GPU and in CPU memory."""
    total = sum(tensors.values())
    return [{"n_cpu_moe": n, "gpu_bytes": (g := gpu_weight_bytes(tensors, n)), "cpu_bytes": total - g}
            for n in range(layers + 1)]


def n_for_budget(table: list[dict], budget: int) -> int | None:
    """The smallest N whose GPU weights are at most `budget` bytes (None: not even every layer's experts on the CPU
    makes them fit)."""
    return next((r["n_cpu_moe"] for r in table if r["gpu_bytes"] <= budget), None)


def runs(table: list[dict], budgets: dict[str, int], ns: list[int] | None = None) -> list[dict]:
    """The Ns to run, fewest on the CPU first (`ns`, else 0, each budget's and every layer); a row names the budgets
    it matches."""
    labels: dict[int, list[str]] = {}
    for label, size in budgets.items():
        n = n_for_budget(table, size)
        if n is not None:
            labels.setdefault(n, []).append(label)
    wanted = set(ns) if ns is not None else {0, table[-1]["n_cpu_moe"], *labels}
    return [table[n] | {"budgets": labels.get(n, [])} for n in sorted(wanted)]


def summarize(rows: list[dict]) -> dict:
    """{test: tok/s} from llama-bench's JSON rows of one N and one flash-attention setting."""
    out = {}
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        out[test + (f"_d{r['n_depth']}" if r.get("n_depth") else "")] = round(float(r["avg_ts"]), 2)
    return out


def ours_by_budget(doc: dict | None) -> dict:
    """bench/expert_stream.py's rows of SHAPE by budget label ("16G"…, "all": resident) and routing."""
    out: dict = {}
    for r in (doc or {}).get("results", []):
        if r.get("shape") == SHAPE and "decode_tok_s" in r:
            label = f"{r['budget_gib']:g}G" if r.get("budget_gib") else "all"
            out.setdefault(label, {})[r["routing"]] = r
    return out


def markdown(report: dict) -> str:
    ours = ours_by_budget(report.get("ours"))
    depth = report["depth"]
    lines = [f"### {SHAPE}: llama.cpp `-ngl 99 -ncmoe N` (Q4_0, -t {report['threads']}, -fa {report['fa']}) beside "
             "our expert streaming", "",
             "| our budget | -ncmoe N | llama.cpp weights on GPU | in CPU memory | llama.cpp tg128 @ "
             f"{depth} tok/s | llama.cpp pp512 tok/s | ours: slots | ours decode tok/s (random / skewed routing) "
             "| ours prefill tok/s |", "|---|---|---|---|---|---|---|---|---|"]
    for r in report["runs"]:
        peer = r.get("llama_cpp") or {}
        labels = r["budgets"] or (["all"] if r["n_cpu_moe"] == 0 else [])
        for label in labels or ["—"]:
            mine = ours.get(label, {})
            any_row = next(iter(mine.values()), {})
            decode = " / ".join(str(mine[k]["decode_tok_s"]) for k in ("random", "skewed", "router") if k in mine)
            prefill = (f"{any_row['prefill_tok_s']} (pp{any_row.get('prefill_tokens', '?')})"
                       if "prefill_tok_s" in any_row else "—")
            lines.append(f"| {label} | {r['n_cpu_moe']} | {r['gpu_bytes'] / GIB:.2f} GiB | {r['cpu_bytes'] / GIB:.2f}"
                         f" GiB | {peer.get(f'tg128_d{depth}', r.get('skipped', '—'))} | {peer.get('pp512', '—')} | "
                         f"{any_row.get('slots', 'all' if label == 'all' and any_row else '—')} | {decode or '—'} | "
                         f"{prefill} |")
    lines += ["", "llama.cpp's GPU weights: every GGUF tensor but token_embd and the first N layers' routed expert "
              "stacks; ours: the weights budget (bench/expert_stream.py, its decode after a 16-token prompt)."]
    return "\n".join(lines) + "\n"


def extra_flags(n: int, threads: int) -> tuple[str, ...]:
    return ("-ncmoe", str(n), "-t", str(threads))


def build_only(args, budgets: dict[str, int], ns: list[int] | None) -> None:
    cfg = llamacpp_gguf.TINY["qwen35moe"]
    path = llamacpp_gguf.write(cfg, args.work / "tiny-qwen35moe-q4_0.gguf")
    problems = llamacpp_gguf.check(cfg, path)
    if gguf_tensor_bytes(path) != layout_tensor_bytes(cfg):
        problems.append("the file's tensor sizes differ from the layout's")
    if problems:
        raise SystemExit(f"{path}: " + "; ".join(problems))
    print(f"tiny qwen35moe GGUF {path}: layout and tensor sizes as expected", flush=True)
    for r in byte_table(gguf_tensor_bytes(path), cfg["layers"]):
        print(f"  -ncmoe {r['n_cpu_moe']}: {r['gpu_bytes']:,} bytes on the GPU, {r['cpu_bytes']:,} in CPU memory")
    if args.llama_bench:
        for n in (0, cfg["layers"]):
            rows = llama_bench(args.llama_bench, path, ngl=99, reps=1, prompts="32", gen=8, depth=16, fa="0",
                               extra=extra_flags(n, args.threads))
            print(f"  llama.cpp (CPU) at -ncmoe {n} loaded and ran it: {summarize(rows)}", flush=True)
    real = llamacpp_gguf.shape_config(SHAPE)
    print(f"{SHAPE} (from the layout; a run reads the GGUF's own sizes):")
    gguf, exe = args.work / f"{SHAPE}-q4_0.gguf", args.work / "llama.cpp" / "build" / "bin" / "llama-bench"
    for r in runs(byte_table(layout_tensor_bytes(real), real["layers"]), budgets, ns):
        print(f"  -ncmoe {r['n_cpu_moe']:2d}: {r['gpu_bytes'] / GIB:6.2f} GiB on the GPU, {r['cpu_bytes'] / GIB:6.2f}"
              f" GiB in CPU memory{'  <= ' + ', '.join(r['budgets']) if r['budgets'] else ''}")
        for cmd in llama_bench_commands(exe, gguf, reps=args.reps, prompts="512", fa=args.fa,
                                        extra=extra_flags(r["n_cpu_moe"], args.threads)):
            print("    " + " ".join(cmd))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-src", type=Path, help="llama.cpp source tarball (bench/fetch_llamacpp.sh)")
    p.add_argument("--out", type=Path, help="folder for ncmoe.md / ncmoe.json")
    p.add_argument("--work", type=Path, default=Path("/tmp/zerotvm-peer"))
    p.add_argument("--budgets", default=",".join(BUDGETS), help="our weights budgets to line up with (12G, 8192M)")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="llama-bench -t (default: this machine's "
                                                                      "cores)")
    p.add_argument("--fa", default="1", choices=["0", "1"], help="llama-bench -fa (flash attention off or on)")
    p.add_argument("--reps", type=int, default=3, help="llama-bench -r")
    p.add_argument("--ours", type=Path, help="bench/expert_stream.py's JSON, to report beside llama.cpp")
    p.add_argument("--ns", help="run these N only (e.g. 24,40: the rest of a run cut short by the time limit)")
    p.add_argument("--time-limit", type=float, default=540, help="seconds from the start; Ns not started by then "
                                                                "are recorded as skipped")
    p.add_argument("--build-only", action="store_true", help="GGUF, byte table and commands only (no GPU needed)")
    p.add_argument("--llama-bench", type=Path, help="with --build-only: a llama-bench binary to run the tiny file")
    args = p.parse_args(argv)
    from engine.gpu_budget import parse_size

    try:
        budgets = {b.strip(): parse_size(b, "--budgets") for b in args.budgets.split(",") if b.strip()}
    except ValueError as e:
        p.error(str(e))
    layers = llamacpp_gguf.shape_config(SHAPE)["layers"]
    ns = args.ns.split(",") if args.ns else None
    if ns is not None and not all(n.strip().isdigit() and int(n) <= layers for n in ns):
        p.error(f"--ns: a list of N in 0..{layers}, got {args.ns!r}")
    ns = [int(n) for n in ns] if ns is not None else None
    if args.llama_bench and not args.llama_bench.is_file():
        p.error(f"--llama-bench: no file at {args.llama_bench}")
    if args.build_only:
        build_only(args, budgets, ns)
        return 0
    if not args.llama_src or not args.out:
        p.error("--llama-src and --out are needed for a benchmark run (or pass --build-only)")
    if not args.llama_src.is_file():
        p.error(f"--llama-src: no file at {args.llama_src}; bench/fetch_llamacpp.sh makes it")
    ours = json.loads(args.ours.read_text()) if args.ours else None
    started = time.time()
    args.out.mkdir(parents=True, exist_ok=True)
    exe, build_s = build_llama(args.llama_src, args.work)
    cfg = llamacpp_gguf.shape_config(SHAPE)
    gguf = llamacpp_gguf.write(cfg, args.work / f"{SHAPE}-q4_0.gguf")
    tensors = gguf_tensor_bytes(gguf)
    problems = llamacpp_gguf.check(cfg, gguf) + (
        [] if tensors == layout_tensor_bytes(cfg) else ["the file's tensor sizes differ from the layout's"])
    if problems:
        raise SystemExit(f"{gguf}: " + "; ".join(problems))
    report = {"shape": SHAPE, "llama_cpp_source": args.llama_src.name, "llama_cpp_build_s": round(build_s, 1),
              "threads": args.threads, "fa": args.fa, "reps": args.reps, "depth": DEPTH, "budgets": args.budgets,
              "gguf_bytes": sum(tensors.values()), "runs": runs(byte_table(tensors, cfg["layers"]), budgets, ns),
              "ours": ours}
    for r in report["runs"]:
        if time.time() - started > args.time_limit:
            r["skipped"] = "past --time-limit"
            continue
        rows = llama_bench(exe, gguf, ngl=99, reps=args.reps, prompts="512", fa=args.fa,
                           extra=extra_flags(r["n_cpu_moe"], args.threads))
        used = {(row.get("n_cpu_moe"), row.get("n_threads")) for row in rows}  # as llama-bench reports its runs
        if used != {(r["n_cpu_moe"], args.threads)}:
            raise SystemExit(f"llama-bench ran with (n_cpu_moe, n_threads) {sorted(used)}, not "
                             f"{(r['n_cpu_moe'], args.threads)}")
        r["llama_cpp"] = summarize(rows)
        print(f"-ncmoe {r['n_cpu_moe']} ({r['gpu_bytes'] / GIB:.2f} GiB on the GPU): {r['llama_cpp']}", flush=True)
        (args.out / "ncmoe.json").write_text(json.dumps(report, indent=2))  # what is done so far survives a kill
    (args.out / "ncmoe.json").write_text(json.dumps(report, indent=2))
    (args.out / "ncmoe.md").write_text(markdown(report))
    print(markdown(report))
    return 0


if __name__ == "__main__":
    sys.exit(main())
