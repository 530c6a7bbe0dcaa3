"""`zerotvm` / `python -m engine`: gpus, convert, logits, prompt, generate, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from engine.errors import ZeroTVMError


def cmd_gpus(args) -> None:
    from engine.gpu import GOOD_BACKENDS, list_adapters, pick_adapter

    adapters = list_adapters()
    try:
        chosen = pick_adapter(args.adapter).index
    except ZeroTVMError:
        chosen = None
    for a in adapters:
        mark = "*" if a.index == chosen else " "
        usable = "" if a.backend in GOOD_BACKENDS and "shader-f16" in a.features else "  (not usable)"
        print(f"{mark} {a.summary()}{usable}")
        if args.verbose:
            print("    features:", ", ".join(a.features))
            keys = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
                    "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")
            print("    limits:  ", ", ".join(f"{k}={a.limits.get(k)}" for k in keys))
    if chosen is None:
        print("no usable adapter", file=sys.stderr)


def cmd_convert(args) -> None:
    from engine.convert import convert_hf_to_mlc

    convert_hf_to_mlc(args.hf_dir, args.out_dir, quantization=args.format)
    print(f"wrote {args.out_dir}")


def _progress(shard: int, shards: int, path: str, done: int, total: int) -> None:
    print(f"\rloading shard {shard + 1}/{shards} {done / 2**20:7.1f}/{total / 2**20:.1f} MiB", end="",
          file=sys.stderr, flush=True)
    if shard + 1 == shards and done >= total:
        print(file=sys.stderr)


def cmd_logits(args) -> None:
    from engine.model import load_model

    ids = [int(t) for t in args.ids.split(",") if t.strip()]
    model = load_model(args.model, on_progress=_progress)
    logits = model.logits(ids)
    if args.out:
        np.save(args.out, logits)
        print(f"saved {logits.shape} float32 logits to {args.out}")
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        for t, row in enumerate(logits):
            top = np.argsort(-row)[:5]
            print(f"pos {t} id {ids[t]}: top-5 {top.tolist()} logits {row[top].round(4).tolist()}")


def cmd_generate(args) -> None:
    from engine.model import load_model

    model = load_model(args.model, on_progress=_progress)
    last = None
    for r in model.generate(args.prompt, max_tokens=args.max_tokens):
        print(r.text, end="", flush=True)
        last = r
    print()
    if last:
        print(f"[{last.generation_tokens} tokens, {last.generation_tps:.1f} tok/s, "
              f"time to first token {last.ttft_s * 1000:.0f} ms, prompt {last.prompt_tokens} tokens, "
              f"finish: {last.finish_reason}]", file=sys.stderr)


def cmd_prompt(args) -> None:
    from engine.chat import load_messages
    from engine.tokenizer import load_tokenizer

    thinking = None if args.thinking is None else args.thinking == "on"
    prompt = load_tokenizer(args.model).chat_prompt(load_messages(args.messages), system=args.system,
                                                    thinking=thinking)
    print(json.dumps(prompt.ids))


def cmd_bench(args) -> None:
    from engine.bench import run_bench

    result = run_bench(args.shape, decode_tokens=args.decode_tokens, prompt_tokens=args.prompt_tokens,
                       runs=args.runs)
    print(json.dumps(result, indent=2) if args.json else result["table"])


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="zerotvm", description="LLMs on hand-written WGSL kernels")
    p.add_argument("--adapter", help="GPU adapter index or name (or set ZEROTVM_ADAPTER)")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("gpus", help="list GPU adapters with backend, type, features and limits")
    s.add_argument("-v", "--verbose", action="store_true")
    s.set_defaults(func=cmd_gpus)

    s = sub.add_parser("convert", help="convert a Hugging Face safetensors checkpoint to MLC q4f16_1")
    s.add_argument("hf_dir")
    s.add_argument("out_dir")
    s.add_argument("--format", default="q4f16_1", choices=["q4f16_1"])
    s.set_defaults(func=cmd_convert)

    s = sub.add_parser("logits", help="teacher-forced float32 logits for every position")
    s.add_argument("model")
    s.add_argument("--ids", required=True, help="comma-separated token ids")
    s.add_argument("--out", help="save to this .npy file instead of printing")
    s.set_defaults(func=cmd_logits)

    s = sub.add_parser("generate", help="stream a greedy completion")
    s.add_argument("model")
    s.add_argument("--prompt", required=True)
    s.add_argument("--max-tokens", type=int, default=128)
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("prompt", help="render a chat with the model's own template; print its token ids as JSON")
    s.add_argument("model", help="model folder (tokenizer files and configs are enough) or .gguf file")
    s.add_argument("--messages", required=True, help='JSON file: [{"role": ..., "content": ...}, ...]')
    s.add_argument("--thinking", choices=["on", "off"], help="set enable_thinking (Qwen3 and alike)")
    s.add_argument("--system", help="system prompt (replaces a leading system message)")
    s.set_defaults(func=cmd_prompt)

    s = sub.add_parser("bench", help="benchmark a random-weight model of a real model's shapes")
    s.add_argument("--shape", default="phi3-mini")
    s.add_argument("--decode-tokens", type=int, default=128)
    s.add_argument("--prompt-tokens", type=int, default=512)
    s.add_argument("--runs", type=int, default=5)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # Mesa's Vulkan warns loudly without it
    args = build_parser().parse_args(argv)
    if args.adapter:
        os.environ["ZEROTVM_ADAPTER"] = args.adapter
    try:
        args.func(args)
    except ZeroTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
