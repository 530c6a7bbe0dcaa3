"""Zero-TVM vs llama.cpp on one GPU, in one run: same shapes, random 4.5-bit weights (our q4f16_1, their Q4_0).

Run on the benchmark machine from the repo root (it has nvcc, cmake and ninja but no network, so the llama.cpp
source travels with the run; `bench/fetch_llamacpp.sh` makes that tarball):

    python3 bench/compare_llamacpp.py --llama-src .peer/llama.cpp-0c1e57098.tar.xz --out OUT_DIR

Steps: build llama-bench with CUDA (skipped when a build exists), write a random-weight Q4_0 GGUF per shape with the
`gguf` package (llama.cpp's own layout for the architecture, a minimal SentencePiece vocab so it loads), run
`llama-bench -p 512,2048 -n 128 -ngl 99 -fa 0,1`, run `engine.bench.run_bench` for the same shapes, and write
compare.md / compare.json with both sides and the ratios.
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

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from engine.bench import SHAPES, run_bench  # noqa: E402

BUILD_FLAGS = ["-DGGML_CUDA=ON", "-DCMAKE_CUDA_ARCHITECTURES=90-real", "-DGGML_NATIVE=OFF", "-DGGML_CUDA_NCCL=OFF",
               "-DLLAMA_BUILD_TESTS=OFF", "-DLLAMA_BUILD_EXAMPLES=OFF", "-DLLAMA_BUILD_SERVER=OFF",
               "-DBUILD_SHARED_LIBS=OFF", "-DLLAMA_OPENSSL=OFF", "-DLLAMA_CURL=OFF", "-DCMAKE_BUILD_TYPE=Release"]
ARCH = {"phi3-mini": "phi3", "qwen3-4b": "qwen3"}


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


def _q4_0(rng, rows: int, cols: int) -> np.ndarray:
    """Random Q4_0 blocks (18 bytes per 32 weights) with a small fixed scale, as raw bytes [rows, cols/32*18]."""
    blocks = rng.integers(0, 256, size=(rows, cols // 32, 18), dtype=np.uint8)
    blocks[:, :, :2] = np.frombuffer(np.float16(0.01).tobytes(), np.uint8)
    return blocks.reshape(rows, -1)


def write_gguf(shape: str, path: Path) -> Path:
    from gguf import GGMLQuantizationType, GGUFWriter, TokenType

    d, n_layers, h, kvh, hd, ffn, vocab, eps, theta, ctx, tied, qk_norm = SHAPES[shape]
    if path.exists():
        return path
    arch = ARCH[shape]
    rng = np.random.default_rng(0)
    w = GGUFWriter(str(path), arch)
    w.add_name("zerotvm-bench")  # not "phi3…": llama.cpp would then want a Phi-3 tokenizer
    w.add_context_length(min(ctx, 4096))
    w.add_embedding_length(d)
    w.add_block_count(n_layers)
    w.add_feed_forward_length(ffn)
    w.add_head_count(h)
    w.add_head_count_kv(kvh)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(eps)
    tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tokens += [f"tok{i}" for i in range(vocab - len(tokens))]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL] + [TokenType.BYTE] * 256
    types += [TokenType.NORMAL] * (vocab - len(types))
    w.add_tokenizer_model("llama")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * vocab)
    w.add_token_types(types)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    q4 = GGMLQuantizationType.Q4_0
    ones = np.ones(d, np.float32)

    def mat(name, rows, cols):
        w.add_tensor(name, _q4_0(rng, rows, cols), raw_dtype=q4)

    mat("token_embd.weight", vocab, d)
    w.add_tensor("output_norm.weight", ones)
    if not tied:
        mat("output.weight", vocab, d)
    for i in range(n_layers):
        b = f"blk.{i}."
        w.add_tensor(b + "attn_norm.weight", ones)
        w.add_tensor(b + "ffn_norm.weight", ones)
        if arch == "phi3":
            mat(b + "attn_qkv.weight", (h + 2 * kvh) * hd, d)
            mat(b + "ffn_up.weight", 2 * ffn, d)
        else:
            mat(b + "attn_q.weight", h * hd, d)
            mat(b + "attn_k.weight", kvh * hd, d)
            mat(b + "attn_v.weight", kvh * hd, d)
            mat(b + "ffn_gate.weight", ffn, d)
            mat(b + "ffn_up.weight", ffn, d)
        if qk_norm:
            w.add_tensor(b + "attn_q_norm.weight", np.ones(hd, np.float32))
            w.add_tensor(b + "attn_k_norm.weight", np.ones(hd, np.float32))
        mat(b + "attn_output.weight", d, h * hd)
        mat(b + "ffn_down.weight", d, ffn)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def llama_bench(exe: Path, model: Path) -> list[dict]:
    cmd = [str(exe), "-m", str(model), "-p", "512,2048", "-n", "128", "-ngl", "99", "-fa", "0,1", "-r", "5",
           "-o", "json"]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return json.loads(out.stdout)


def summarize(rows: list[dict]) -> dict:
    """{(test, fa): tok/s} from llama-bench's JSON rows."""
    out = {}
    for r in rows:
        test = f"pp{r['n_prompt']}" if r["n_gen"] == 0 else f"tg{r['n_gen']}"
        out[f"{test}_fa{int(r.get('flash_attn', 0))}"] = round(float(r["avg_ts"]), 1)
    return out


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--llama-src", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--work", type=Path, default=Path("/tmp/zerotvm-peer"))
    p.add_argument("--shapes", default="phi3-mini,qwen3-4b")
    p.add_argument("--skip-ours", action="store_true")
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    exe, build_s = build_llama(args.llama_src, args.work)
    report = {"llama_cpp_build_s": round(build_s, 1), "llama_cpp_source": args.llama_src.name, "shapes": {}}
    for shape in args.shapes.split(","):
        gguf = write_gguf(shape, args.work / f"{shape}-q4_0.gguf")
        peer = summarize(llama_bench(exe, gguf))
        print(shape, "llama.cpp", peer, flush=True)
        ours = None if args.skip_ours else run_bench(shape, timestamps=True)
        if ours:
            print(ours["table"], flush=True)
        report["shapes"][shape] = {"llama_cpp": peer, "ours": ours}
        (args.out / "compare.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "compare.md").write_text(markdown(report))
    print(markdown(report))


def markdown(report: dict) -> str:
    lines = []
    for shape, r in report["shapes"].items():
        peer, ours = r["llama_cpp"], r["ours"] or {}
        best_tg = max(peer.get("tg128_fa0", 0), peer.get("tg128_fa1", 0))
        best_pp = max(peer.get("pp512_fa0", 0), peer.get("pp512_fa1", 0))
        best_pp2k = max(peer.get("pp2048_fa0", 0), peer.get("pp2048_fa1", 0))
        lines += [f"### {shape}", "", "| | Zero-TVM | llama.cpp fa=0 | llama.cpp fa=1 | ratio (ours / best) |",
                  "|---|---|---|---|---|"]
        rows = (("decode tg128 tok/s", ours.get("decode_tok_s"), "tg128", best_tg),
                ("prefill pp512 tok/s", ours.get("prefill_tok_s"), "pp512", best_pp),
                ("prefill pp2048 tok/s", ours.get("prefill_2048_tok_s"), "pp2048", best_pp2k))
        for name, mine, test, best in rows:
            ratio = f"{mine / best:.2f}×" if mine and best else "—"
            lines.append(f"| {name} | {mine} | {peer.get(test + '_fa0')} | {peer.get(test + '_fa1')} | {ratio} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
