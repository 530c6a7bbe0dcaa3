"""Zero-TVM vs llama.cpp on one GPU, in one run, for the four catalog architectures: phi3-mini (`phi3`), qwen3-4b
(`qwen3`), qwen3.5-4b (`qwen35`) and qwen3.6-35b-a3b-4bit (`qwen35moe`), our 3-bit MoE build reported beside the
last. Random weights: ours as engine.bench builds them, theirs Q4_0 GGUFs in llama.cpp's own layouts
(bench/llamacpp_gguf.py).

Run on the benchmark machine from the repo root (it has nvcc, cmake and ninja but no network, so the llama.cpp
source travels with the run; `bench/fetch_llamacpp.sh` makes that tarball):

    python3 bench/compare_llamacpp.py --llama-src .peer/llama.cpp-0c1e57098.tar.xz --out OUT_DIR

Steps: build llama-bench with CUDA (skipped when a build exists), write the GGUF per shape and check it against
the layout table, run `llama-bench -p 512,2048 -n 0 -d 0` and `-p 0 -n 128 -d 512` (`-ngl 99 -fa 0,1`: prefill from
an empty cache and decode after a 512-token prompt, as engine.bench measures ours), run `engine.bench.run_bench`
for the same shapes in the same job, and write compare.md / compare.json with both sides and the ratios.

Without a GPU: `--build-only` writes the tiny GGUF of each architecture and reads it back (`--full`: the real
shapes); with `--llama-bench PATH` (a CPU build) llama.cpp loads and runs each file at -ngl 0.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench import llamacpp_gguf  # noqa: E402
from engine.bench import run_bench  # noqa: E402

BUILD_FLAGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DGGML_NATIVE=OFF", "-DGGML_CUDA_NCCL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
SHAPES = ("phi3-mini", "qwen3-4b", "qwen3.5-4b", "qwen3.6-35b-a3b-4bit")
BESIDE = {"qwen3.6-35b-a3b-4bit": "qwen3.6-35b-a3b-3bit"}  # our build reported beside the Q4_0 peer
DEPTH = 512  # our decode runs after a 512-token prompt: llama-bench's tg runs at that depth too


def build_llama(src_tar: Path, work: Path) -> tuple[Path, float]:
    exe = work / "llama.cpp" / "build" / "bin" / "llama-bench"
    if exe.exists():
        return exe, 0.0
    t = time.time()
    work.mkdir(parents=True, exist_ok=True)
    with tarfile.open(src_tar) as tar:
        tar.extractall(work, filter="data")
    src = work / "llama.cpp"
    subprocess.run(["cmake", "-S", str(src), "-B", str(src / "build"), "-G", "Ninja", *BUILD_FLAGS], check=True)
    subprocess.run(["cmake", "--build", str(src / "build"), "--target", "llama-bench", "-j", str(os.cpu_count())],
                   check=True)
    return exe, time.time() - t


def llama_bench_commands(exe: Path, model: Path, ngl: int = 99, reps: int = 5, prompts: str = "512,2048",
                         gen: int = 128, depth: int = DEPTH, fa: str = "0,1", extra: tuple[str, ...] = ()) -> list:
    """The llama-bench command lines llama_bench runs: prefill at depth 0, then decode at `depth`; `extra`: more
    flags (bench/llamacpp_ncmoe.py: -ncmoe, -t)."""
    return [[str(exe), "-m", str(model), "-p", p, "-n", str(n), "-d", str(d), "-ngl", str(ngl), "-fa", fa,
             *extra, "-r", str(reps), "-o", "json"] for p, n, d in ((prompts, 0, 0), ("0", gen, depth))]


def llama_bench(exe: Path, model: Path, ngl: int = 99, reps: int = 5, prompts: str = "512,2048", gen: int = 128,
                depth: int = DEPTH, fa: str = "0,1", extra: tuple[str, ...] = ()) -> list[dict]:
    """llama-bench's JSON rows: prefill at depth 0 (as our prefill starts from an empty cache) and decode at `depth`
    (our decode runs after a `depth`-token prompt), by default both with flash attention off and on."""
    rows = []
    for cmd in llama_bench_commands(exe, model, ngl, reps, prompts, gen, depth, fa, extra):
        out = subprocess.run(cmd, capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(f"llama-bench failed on {model.name} (exit {out.returncode}): {out.stderr[-2000:]}")
        rows += json.loads(out.stdout)
    return rows


def summarize(rows: list[dict]) -> dict:
    """{(test, fa): tok/s} from llama-bench's JSON rows (tests at a depth carry it: tg128_d512)."""
    out = {}
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        test += f"_d{r['n_depth']}" if r.get("n_depth") else ""
        out[f"{test}_fa{int(r.get('flash_attn', 0))}"] = round(float(r["avg_ts"]), 1)
    return out


def build_only(args) -> None:
    """Write and check GGUFs without a GPU: the tiny config of each architecture (or the real shapes with --full),
    read back with the gguf package, and with --llama-bench EXE loaded and run by a CPU llama.cpp (-ngl 0)."""
    ok = True
    configs = ({s: llamacpp_gguf.shape_config(s) for s in args.shapes.split(",")} if args.full
               else {f"tiny-{a}": c for a, c in llamacpp_gguf.TINY.items()})
    for name, cfg in configs.items():
        path = llamacpp_gguf.write(cfg, args.work / f"{name}-q4_0.gguf")
        problems = llamacpp_gguf.check(cfg, path)
        print(f"{name}: {cfg['arch']} {path} {path.stat().st_size:,} bytes: "
              + ("layout as llama.cpp expects" if not problems else "; ".join(problems)), flush=True)
        ok &= not problems
        if args.llama_bench and not problems:
            rows = llama_bench(args.llama_bench, path, ngl=0, reps=1, prompts="32", gen=8, depth=16)
            print(f"  llama.cpp (CPU, -ngl 0) loaded and ran it: {summarize(rows)}", flush=True)
    if not ok:
        raise SystemExit("some GGUFs do not match llama.cpp's layout (above)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llama-src", type=Path, help="llama.cpp source tarball (bench/fetch_llamacpp.sh)")
    p.add_argument("--out", type=Path, help="folder for compare.md / compare.json")
    p.add_argument("--work", type=Path, default=Path("/tmp/zerotvm-peer"))
    p.add_argument("--shapes", default=",".join(SHAPES))
    p.add_argument("--skip-ours", action="store_true")
    p.add_argument("--build-only", action="store_true", help="write and check the GGUFs only (no GPU needed)")
    p.add_argument("--full", action="store_true", help="with --build-only: the real shapes, not the tiny ones")
    p.add_argument("--llama-bench", type=Path, help="with --build-only: a llama-bench binary to load the files with")
    args = p.parse_args()
    for shape in args.shapes.split(","):
        if shape not in SHAPES:
            p.error(f"--shapes: unknown shape {shape!r}; known: {', '.join(SHAPES)}")
    if args.llama_bench and not args.llama_bench.is_file():
        p.error(f"--llama-bench: no file at {args.llama_bench}")
    if args.build_only:
        return build_only(args)
    if not args.llama_src or not args.out:
        p.error("--llama-src and --out are needed for a benchmark run (or pass --build-only)")
    if not args.llama_src.is_file():
        p.error(f"--llama-src: no file at {args.llama_src}; bench/fetch_llamacpp.sh makes it")
    args.out.mkdir(parents=True, exist_ok=True)
    exe, build_s = build_llama(args.llama_src, args.work)
    report = {"llama_cpp_build_s": round(build_s, 1), "llama_cpp_source": args.llama_src.name, "depth": DEPTH,
              "shapes": {}}
    for shape in args.shapes.split(","):
        cfg = llamacpp_gguf.shape_config(shape)
        gguf = llamacpp_gguf.write(cfg, args.work / f"{shape}-q4_0.gguf")
        problems = llamacpp_gguf.check(cfg, gguf)
        if problems:
            raise SystemExit(f"{gguf}: " + "; ".join(problems))
        peer = summarize(llama_bench(exe, gguf))
        print(shape, cfg["arch"], "llama.cpp", peer, flush=True)
        entry = {"arch": cfg["arch"], "llama_cpp": peer, "ours": None}
        for key, ours_shape in (("ours", shape), ("ours_beside", BESIDE.get(shape))):
            if ours_shape and not args.skip_ours:
                entry[key] = run_bench(ours_shape, timestamps=True)
                entry[key + "_shape"] = ours_shape
                print(entry[key]["table"], flush=True)
        report["shapes"][shape] = entry
        (args.out / "compare.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "compare.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    depth = report.get("depth", DEPTH)
    lines = []
    for shape, r in report["shapes"].items():
        peer = r["llama_cpp"]
        best = {t: max(peer.get(f"{t}_fa0", 0), peer.get(f"{t}_fa1", 0))
                for t in (f"tg128_d{depth}", "pp512", "pp2048")}
        lines += [f"### {shape} (llama.cpp `{r.get('arch', '')}`, Q4_0)", "",
                  "| | ours | llama.cpp fa=0 | llama.cpp fa=1 | ratio (ours / best) |", "|---|---|---|---|---|"]
        for key in ("ours", "ours_beside"):
            ours = r.get(key)
            if key == "ours_beside" and not ours:
                continue
            label = r.get(key + "_shape", shape)
            rows = ((f"{label} decode tg128 @ {depth} tok/s", (ours or {}).get("decode_tok_s"), f"tg128_d{depth}"),
                    (f"{label} prefill pp512 tok/s", (ours or {}).get("prefill_tok_s"), "pp512"),
                    (f"{label} prefill pp2048 tok/s", (ours or {}).get("prefill_2048_tok_s"), "pp2048"))
            for name, mine, test in rows:
                ratio = f"{mine / best[test]:.2f}×" if mine and best[test] else "—"
                lines.append(f"| {name} | {mine} | {peer.get(test + '_fa0')} | {peer.get(test + '_fa1')} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
