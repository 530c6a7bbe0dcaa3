"""`zerotvm` / `python -m engine`: gpus, convert, logits, prompt, generate, chat, install-demo, bench."""

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
        chosen, problem = pick_adapter(args.adapter), None
    except ZeroTVMError as e:
        chosen, problem = None, str(e)
    for a in adapters:
        mark = "*" if chosen is not None and a.index == chosen.index else " "
        usable = "" if a.backend in GOOD_BACKENDS and "shader-f16" in a.features else "  (not usable)"
        software = "  (software GPU: runs on the processor)" if a.software else ""
        print(f"{mark} {a.summary()}{software}{usable}")
        if args.verbose:
            print("    features:", ", ".join(a.features))
            keys = ("max-storage-buffer-binding-size", "max-buffer-size", "max-storage-buffers-per-shader-stage",
                    "max-compute-workgroup-storage-size", "max-compute-invocations-per-workgroup")
            print("    limits:  ", ", ".join(f"{k}={a.limits.get(k)}" for k in keys))
    if chosen is None:
        print(f"No adapter chosen: {problem}", file=sys.stderr)
    else:
        _software_notice(chosen, sys.stdout)


def _software_notice(adapter, file=None) -> None:
    """The plain warning, once per command, when the adapter in use is a software one (stderr unless `file`)."""
    if adapter is not None and adapter.software:
        from engine.speed import SOFTWARE_NOTICE_TITLE, measured_rate, software_notice

        text = software_notice(adapter.name, rate=measured_rate(adapter.key))
        print(f"\n{SOFTWARE_NOTICE_TITLE}.\n{text}", file=file or sys.stderr)


def _software_note(adapter, path: str) -> None:
    """Before generate/chat loads a model on a software adapter: one line with the speed to expect from it."""
    if adapter is None or not adapter.software:
        return
    from engine.humanize import human_rate
    from engine.library import find_entry
    from engine.memfit import estimate
    from engine.speed import DEMO_DECODE_BYTES, measured_rate, software_tps

    rate = measured_rate(adapter.key)
    entry = find_entry(path)
    decode_bytes = estimate(entry).decode_bytes if entry is not None and entry.runs else None
    what = f"from {entry.name}" if decode_bytes else "from the demo model (bigger models are slower)"
    tps = software_tps(decode_bytes or DEMO_DECODE_BYTES, rate=rate)
    how = "measured on this computer" if rate else "a rough estimate"
    print(f"Running on {adapter.name}, a software GPU (the processor does the graphics card's work): expect roughly "
          f"{human_rate(tps)} {what} ({how}). `zerotvm gpus` says how to get full speed.", file=sys.stderr)


def _chosen_adapter():
    from engine.gpu import pick_adapter

    try:
        return pick_adapter()
    except ZeroTVMError:
        return None


def cmd_convert(args) -> None:
    from engine.convert import convert_hf_to_mlc

    convert_hf_to_mlc(args.hf_dir, args.out_dir, quantization=args.format)
    print(f"wrote {args.out_dir}")


def _progress(part: int, parts: int, path: str, done: int, total: int) -> None:
    pct = 100 * done / total if total else 100.0
    shard = os.path.basename(path)  # the file being read (a shard of a multi-file checkpoint)
    print(f"\rloading {shard}: {done / 2**20:7.1f}/{total / 2**20:.1f} MiB ({pct:3.0f}%)\033[K", end="",
          file=sys.stderr, flush=True)
    if part + 1 == parts:
        print(file=sys.stderr)


def _budget(args) -> int | None:
    """The weights budget: --gpu-weights, else ZEROTVM_GPU_WEIGHTS (a bad one is named before anything is read)."""
    from engine.gpu_budget import from_env, parse_size

    return parse_size(args.gpu_weights) if args.gpu_weights is not None else from_env()


def _load(args, model: str, **options):
    """load_model with this command's --context and --gpu-weights (else ZEROTVM_GPU_WEIGHTS), on the CLI's
    progress line; says on stderr when the routed experts stream from RAM. Ctrl-C stops the load (the half-built
    runtime lets its buffers go) with one line."""
    from engine.gpu_budget import streaming_line
    from engine.model import load_model

    budget = _budget(args)
    try:
        loaded = load_model(model, max_context=args.context, on_progress=_progress, gpu_weights=budget, **options)
    except KeyboardInterrupt:
        print("\n(loading stopped)", file=sys.stderr)  # ends the progress line too
        raise
    line = streaming_line(loaded.runtime)
    if line:
        print(line, file=sys.stderr)
    return loaded


def _print_hit_rate(model) -> None:
    from engine.gpu_budget import hit_rate_line

    line = hit_rate_line(model.runtime)
    if line:
        print(line, file=sys.stderr)


def cmd_logits(args) -> None:
    from engine.library import resolve_model

    _budget(args)  # a bad budget is named before anything is read
    try:
        ids = [int(t) for t in args.ids.split(",") if t.strip()]
    except ValueError:
        raise ZeroTVMError(f"--ids must be whole numbers separated by commas, like 1,2,3 (got {args.ids!r})") from None
    if not ids:
        raise ZeroTVMError("--ids is empty; give at least one token id, like --ids 1,2,3")
    model = _load(args, resolve_model(args.model), q8_decode=not args.exact_decode)
    logits = model.logits(ids)
    _print_hit_rate(model)
    if args.out:
        np.save(args.out, logits)
        print(f"saved {logits.shape} float32 logits to {args.out}")
    else:
        np.set_printoptions(precision=4, suppress=True, linewidth=120)
        for t, row in enumerate(logits):
            top = np.argsort(-row)[:5]
            print(f"pos {t} id {ids[t]}: top-5 {top.tolist()} logits {row[top].round(4).tolist()}")


def _resolve_model(name: str | None) -> str:
    """The model argument (a path or a catalog key), or the installed default (the demo model when nothing else is
    installed)."""
    from engine.library import default_model, resolve_model

    if name:
        return str(resolve_model(name))
    found = default_model()
    if found is None:
        raise ZeroTVMError("no model installed; run `zerotvm install-demo` to set up the small demo model "
                           "(SmolLM2-135M, ~98 MB), or pass a model folder or .gguf file")
    print(f"using {found.name} ({found.path})", file=sys.stderr)
    return str(found.path)


def _chat_settings(args, model):
    """The saved chat settings (shared with the app), with this command's flags on top."""
    from dataclasses import replace

    from engine.settings import load_settings

    settings = load_settings()
    sampling = settings.sampling or model.default_sampling
    flags = {"temperature": args.temperature, "top_k": args.top_k, "top_p": args.top_p, "min_p": args.min_p,
             "repetition_penalty": args.repetition_penalty}
    sampling = replace(sampling, **{k: v for k, v in flags.items() if v is not None})
    settings = replace(settings, sampling=sampling)
    for name in ("system", "seed", "max_tokens", "context_policy"):
        if getattr(args, name) is not None:
            settings = replace(settings, **{name: getattr(args, name)})
    if args.thinking is not None:
        settings.thinking = args.thinking == "on"
    return settings


def _stats(r) -> str:
    from engine.humanize import human_duration

    reused = f", {r.prompt_reused} reused" if r.prompt_reused else ""
    return (f"[{r.generation_tokens} tokens, {r.generation_tps:.1f} tok/s, time to first token "
            f"{human_duration(r.ttft_s)}, prompt {r.prompt_tokens} tokens{reused}, context {r.context_used}/"
            f"{r.context_limit}, finish: {r.finish_reason}]")


def cmd_generate(args) -> None:
    from engine.cancel import Cancelled, CancelToken
    from engine.cli_reply import ctrl_c_cancels, print_completion, print_reply
    from engine.session import ChatSession

    _budget(args)  # a bad budget is named before anything is read
    path = _resolve_model(args.model)
    _software_note(_chosen_adapter(), path)
    model = _load(args, path, q8_decode=not args.exact_decode)
    settings = _chat_settings(args, model)
    token = CancelToken()
    try:
        with ctrl_c_cancels(token):  # Ctrl-C stops at the next prefill piece or token
            if args.raw or model.tokenizer is None or not model.tokenizer.chat_templates:
                last = print_completion(model.generate(args.prompt, max_tokens=settings.max_tokens,
                                                       sampling=settings.sampling, cancel=token, progress=True))
            else:
                last = print_reply(ChatSession(model, settings, cancel=token, progress=True).send(args.prompt))
                last = last.response if last else None
    except Cancelled:
        print("(stopped)", file=sys.stderr)
        raise KeyboardInterrupt from None  # exit status 130, as for any interrupted command
    if last:
        print(_stats(last), file=sys.stderr)
    _print_hit_rate(model)


CHAT_HELP = """commands: /new (start over)  /regen (answer again)  /system TEXT  /think on|off  /quit
Ctrl-C stops a reply; Ctrl-D or /quit leaves."""


def cmd_chat(args) -> None:
    _budget(args)  # a bad budget is named before anything is read
    path = _resolve_model(args.model)
    _software_note(_chosen_adapter(), path)
    model = _load(args, path, q8_decode=not args.exact_decode)
    try:
        _chat_loop(args, model)
    finally:
        _print_hit_rate(model)


def _chat_loop(args, model) -> None:
    from engine.cancel import Cancelled, CancelToken
    from engine.cli_reply import ctrl_c_cancels, print_reply
    from engine.session import ChatSession

    chat = ChatSession(model, _chat_settings(args, model), progress=True)
    print(f"{model.path.name}: context {model.runtime.max_context} tokens. {CHAT_HELP}", file=sys.stderr)
    while True:
        try:
            line = input(">>> ")
        except EOFError:
            print()
            return
        except KeyboardInterrupt:
            print()
            continue
        text = line.strip()
        if not text:
            continue
        command, _, rest = text.partition(" ")
        reply = None  # "send" or "regen"
        if command in ("/quit", "/exit", "/bye"):
            return
        if command == "/new":
            chat.messages.clear()
            print("(new chat)", file=sys.stderr)
        elif command == "/system":
            chat.settings.system = rest or None
            print(f"(system prompt {'set' if rest else 'cleared'})", file=sys.stderr)
        elif command == "/think" and rest in ("on", "off"):
            chat.settings.thinking = rest == "on"
        elif command == "/regen":
            reply = "regen"
        elif command.startswith("/"):
            print(CHAT_HELP, file=sys.stderr)
        else:
            reply = "send"
        if reply is None:
            continue
        gen = None
        chat.cancel = CancelToken()
        try:
            with ctrl_c_cancels(chat.cancel):  # Ctrl-C stops the reply, even while the prompt is read
                gen = chat.regenerate() if reply == "regen" else chat.send(line)
                last = print_reply(gen)
        except (Cancelled, KeyboardInterrupt) as e:
            if gen is not None:
                gen.close()
            if isinstance(e, KeyboardInterrupt):  # a second Ctrl-C may have cut a GPU submission short
                model.runtime.reset()
            print("(stopped)", file=sys.stderr)
            continue
        except (ValueError, ZeroTVMError) as e:
            print(f"error: {e}", file=sys.stderr)
            continue
        if last:
            if last.dropped_turns:
                print(f"(left the {last.dropped_turns} oldest messages out to fit the context)", file=sys.stderr)
            print(_stats(last.response), file=sys.stderr)


def cmd_install_demo(args) -> None:
    from engine import demo

    shown = []

    def progress(stage: str, done: int, total: int) -> None:
        pct = f"{100 * done / total:5.1f}%" if total else ""
        print(f"\r{stage:8s} {done / 2**20:6.1f}/{total / 2**20:.1f} MiB {pct}", end="", file=sys.stderr, flush=True)
        shown.append(stage)

    folder = demo.demo_path().parent
    if demo.is_installed(folder):
        print(f"already installed: {demo.demo_path()}")
        return
    try:
        path = demo.install_demo(on_progress=progress)
    finally:
        if shown:
            print(file=sys.stderr)  # ends the progress line, also before an error's sentence
    print(f"installed {demo.TITLE}: {path}")


def _bytes(n: float | None) -> str:
    if not n:
        return "?"
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.0f} MB"


def cmd_models(args) -> None:
    """The catalog and local models: installed state, download size and memory fit (and, on a software adapter,
    speed) on this machine."""
    from engine.catalog import all_models
    from engine.library import catalog_state
    from engine.memfit import check_fit, gpu_memory

    budget = _budget(args)  # a misspelt one is named before the adapter is asked
    adapter = _chosen_adapter()
    gpu = gpu_memory(adapter)
    software = bool(adapter and adapter.software)
    from engine.speed import measured_rate

    rate = measured_rate(adapter.key) if software else None  # a reply the app timed here beats the estimate
    rows = []
    for e in all_models():
        state, folder = catalog_state(e)
        context = args.context or e.default_context
        fit = check_fit(e, context, gpu_bytes_available=gpu.total_bytes, shared_memory=gpu.shared, software=software,
                        decode_rate=rate, gpu_weights=budget)
        rows.append({"key": e.key, "name": e.name, "size": e.total_bytes, "state": state, "runs": e.runs,
                     "context": context, "fit": fit.verdict, "fit_summary": fit.summary, "fit_message": fit.message,
                     "streams": fit.stream.sentence() if fit.stream else None,
                     "tokens_per_s": round(fit.speed.tokens_per_s, 3) if fit.speed else None,
                     "ram_warning": bool(fit.ram_warning), "path": str(folder)})
    if args.json:
        print(json.dumps(rows, indent=2))
        _software_notice(adapter)  # stderr: the JSON stays the catalog
        return
    print(f"{'key':28s} {'size':>9s}  {'state':10s} {'context':>7s}  fit")
    for r in rows:
        runs = "" if r["runs"] else "  (not runnable yet)"
        print(f"{r['key']:28s} {_bytes(r['size']):>9s}  {r['state']:10s} {r['context']:7d}  {r['fit_summary']}{runs}")
        if args.verbose or r["fit"] in ("tight", "streams", "wont_fit") or r["ram_warning"]:
            print(f"    {r['fit_message']}")
    _software_notice(adapter)


def cmd_download(args) -> None:
    import threading

    from engine.catalog import all_models, install_dir, write_generation_defaults
    from engine.hub.download import default_dest, download_model
    from engine.hub.errors import DownloadCancelled
    from engine.humanize import human_duration

    entry = next((e for e in all_models() if e.key == args.model), None)
    if entry is not None and entry.is_local:
        raise ZeroTVMError(f"{entry.name} is a model you added from your own files; there is nothing to download")
    if entry is not None and entry.is_demo:
        cmd_install_demo(args)
        return
    if entry is None and "/" not in args.model:
        keys = ", ".join(e.key for e in all_models() if not e.is_local)
        raise ZeroTVMError(f"no catalog model {args.model!r}; use one of these keys ({keys}) or a Hugging Face "
                           "repo id like owner/name")
    repo = entry.repo if entry else args.model
    revision = args.revision or (entry.revision if entry else None) or "main"
    dest = install_dir(entry) if entry else default_dest(repo)
    cancel = threading.Event()

    def progress(p) -> None:
        eta = f" {human_duration(p.eta_s)} left" if p.eta_s is not None else ""
        speed = f" {p.speed / 1e6:6.1f} MB/s" if p.speed else ""
        print(f"\r[{p.files_done}/{p.files_total}] {p.file[-40:]:40s} {_bytes(p.done):>9s}/{_bytes(p.total)}"
              f"{speed}{eta}   ", end="", file=sys.stderr, flush=True)

    try:
        path = download_model(repo, revision, dest, files=entry.files if entry else None, on_progress=progress,
                              cancel=cancel)
    except KeyboardInterrupt:
        cancel.set()
        print("\ncancelled; run the same command again to resume", file=sys.stderr)
        return
    except DownloadCancelled:
        print("\ncancelled; run the same command again to resume", file=sys.stderr)
        return
    print(file=sys.stderr)
    if entry is not None:
        write_generation_defaults(entry, path)
    print(f"installed {entry.name if entry else repo} (verified): {path}")


def cmd_remove(args) -> None:
    from engine import demo
    from engine.catalog import install_dir, remove_local
    from engine.hub.state import remove_model
    from engine.library import find_entry

    entry = find_entry(args.model)
    if entry is None:
        raise ZeroTVMError(f"there is no catalog model with the key or path {args.model!r}; run `zerotvm models` to "
                           "see the keys (a file you never added is not Zero-TVM's to delete)")
    if entry.is_local:
        remove_local(entry.key)
        print(f"forgot {entry.name} (its files at {entry.path} were left alone)")
    elif entry.is_demo:
        demo.demo_path(install_dir(entry)).unlink(missing_ok=True)
        print(f"removed {entry.name}")
    else:
        remove_model(install_dir(entry))
        print(f"removed {entry.name} from {install_dir(entry)}")


def cmd_verify(args) -> None:
    """Re-hash a downloaded model's files against the Hub's sizes and sha256; damaged files are deleted so the
    next `zerotvm download` fetches only them."""
    from engine.catalog import install_dir
    from engine.hub.state import is_installed, staging_dir, verify_installed
    from engine.library import find_entry

    entry = find_entry(args.model)
    if entry is None:
        raise ZeroTVMError(f"there is no catalog model with the key or path {args.model!r}; run `zerotvm models` to "
                           "see the keys")
    if entry.is_local:
        raise ZeroTVMError(f"{entry.name} came from your own files, so there are no Hub checksums to compare it with")
    if entry.is_demo:
        raise ZeroTVMError(f"{entry.name} is checked against its SHA-256 whenever it is installed; if it looks "
                           "damaged, run `zerotvm remove smollm2-135m-demo` and then `zerotvm install-demo`")
    if not is_installed(install_dir(entry)) and not staging_dir(install_dir(entry)).exists():
        raise ZeroTVMError(f"{entry.name} is not downloaded, so there is nothing to verify; run `zerotvm download "
                           f"{entry.key}` to get it")

    def progress(done: int, total: int) -> None:
        print(f"\rverifying {_bytes(done):>9s}/{_bytes(total)}", end="", file=sys.stderr, flush=True)

    bad = verify_installed(install_dir(entry), on_progress=progress)
    print(file=sys.stderr)
    if bad:
        raise ZeroTVMError(f"{len(bad)} damaged file(s) removed: {', '.join(bad[:5])}; run `zerotvm download "
                           f"{entry.key}` to fetch them again")
    print(f"{entry.name}: every file matches the Hub's checksum")


def cmd_token(args) -> None:
    from engine.hub.token import clear_token, get_token, keyring_problem, set_token

    env = " HF_TOKEN is set in the environment and is used instead." if os.environ.get("HF_TOKEN") else ""
    if args.action == "set":
        import getpass

        token = args.token or getpass.getpass("Hugging Face token (input hidden): ")
        set_token(token)
        print("Token saved in the system keyring.")
    elif args.action == "clear":
        problem = keyring_problem()
        if problem:
            print(f"Nothing to remove: {problem}, so no token can have been saved there.{env}")
        elif clear_token():
            print("Token removed from the system keyring.")
        else:
            print(f"Nothing to remove: no token is saved in the system keyring.{env}")
    else:
        problem = keyring_problem()
        if problem:
            print(f"No token saved: {problem}. Set the HF_TOKEN environment variable for gated models."
                  if not env else f"No token saved: {problem}.{env}")
        else:
            print("A token is saved in the system keyring." if get_token() else f"No token saved.{env}")


def cmd_prompt(args) -> None:
    from engine.chat import load_messages
    from engine.library import resolve_model
    from engine.tokenizer_loader import load_tokenizer

    thinking = None if args.thinking is None else args.thinking == "on"
    path = resolve_model(args.model)
    messages = load_messages(args.messages)  # a bad file is reported before the tokenizer is built
    prompt = load_tokenizer(path).chat_prompt(messages, system=args.system, thinking=thinking)
    print(json.dumps(prompt.ids))


def cmd_bench(args) -> None:
    from engine.bench import run_bench

    budget = _budget(args)
    options = json.loads(args.options)
    if not isinstance(options, dict):
        raise ValueError(f"--options takes a JSON object of runtime option names and values, got {args.options}")
    result = run_bench(args.shape, decode_tokens=args.decode_tokens, prompt_tokens=args.prompt_tokens,
                       runs=args.runs, long_prompt=args.long_prompt_tokens, timestamps=args.timestamps,
                       **({"gpu_weights": budget} if budget else {}), **options)
    for line in (result.get("expert_stream"), result.get("expert_cache")):  # as generate, chat and logits say it
        if line:
            print(line, file=sys.stderr)
    print(json.dumps(result, indent=2) if args.json else result["table"])


def _add_load_args(s: argparse.ArgumentParser) -> None:
    """What every command that loads a model takes: its context window and the weights budget."""
    s.add_argument("--context", type=int, help="context window in tokens (default: the model's; the KV cache is "
                                               "allocated for all of it)")
    s.add_argument("--gpu-weights", metavar="SIZE",
                   help="bytes of weights allowed on the GPU, e.g. 12G or 8192M (default: ZEROTVM_GPU_WEIGHTS, else "
                        "auto); a MoE model over it streams its experts from RAM")


def _add_chat_args(s: argparse.ArgumentParser) -> None:
    """Flags over the saved chat settings; sampling defaults come from the model (generation_config.json)."""
    s.add_argument("--max-tokens", type=int, help="longest reply in tokens (default 1024)")
    _add_load_args(s)
    s.add_argument("--exact-decode", action="store_true",
                   help="f32 activations in decode and prefill (slower); by default the 4-bit and K-quant matrix "
                        "products take int8 ones, as llama.cpp's")
    s.add_argument("--temperature", type=float, help="0 = greedy")
    s.add_argument("--top-k", type=int)
    s.add_argument("--top-p", type=float)
    s.add_argument("--min-p", type=float)
    s.add_argument("--repetition-penalty", type=float)
    s.add_argument("--seed", type=int, help="fixed seed: the same prompt gives the same reply")
    s.add_argument("--system", help="system prompt")
    s.add_argument("--thinking", choices=["on", "off"], help="reasoning on/off for models that have it (Qwen3)")
    s.add_argument("--context-policy", choices=["refuse", "drop_oldest"],
                   help="when the chat outgrows the context: refuse (default) or leave the oldest turns out")


MODEL_HELP = "catalog key (see `zerotvm models`), model folder or .gguf file"


def build_parser() -> argparse.ArgumentParser:
    from engine import get_version

    p = argparse.ArgumentParser(prog="zerotvm", description="LLMs on hand-written WGSL kernels")
    p.add_argument("--version", action="version", version=f"%(prog)s {get_version()}")
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
    s.add_argument("model", help=MODEL_HELP)
    s.add_argument("--ids", required=True, help="comma-separated token ids")
    _add_load_args(s)
    s.add_argument("--out", help="save to this .npy file instead of printing")
    s.add_argument("--exact-decode", action="store_true",
                   help="f32 activations in every matrix product (to check a model against a float64 reference); "
                        "by default the 4-bit and K-quant products take int8 ones, as llama.cpp's")
    s.set_defaults(func=cmd_logits)

    s = sub.add_parser("generate", help="answer one prompt (as a chat turn when the model has a chat template)")
    s.add_argument("model", nargs="?", help=MODEL_HELP + " (default: the installed model)")
    s.add_argument("--prompt", required=True)
    s.add_argument("--raw", action="store_true", help="complete the text as is, without the chat template")
    _add_chat_args(s)
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("chat", help="interactive multi-turn chat in the terminal")
    s.add_argument("model", nargs="?", help=MODEL_HELP + " (default: the installed model)")
    _add_chat_args(s)
    s.set_defaults(func=cmd_chat)

    s = sub.add_parser("install-demo", help="set up the small offline demo model (SmolLM2-135M-Instruct, ~98 MB)")
    s.set_defaults(func=cmd_install_demo)

    s = sub.add_parser("models", help="the model catalog: sizes, installed state and memory fit on this machine")
    s.add_argument("--context", type=int, help="context length for the fit estimate (default: each model's)")
    s.add_argument("--json", action="store_true")
    s.add_argument("-v", "--verbose", action="store_true", help="explain every fit verdict")
    s.add_argument("--gpu-weights", metavar="SIZE", help="weights budget the verdicts assume (bytes, or with K/M/G; "
                   "default: ZEROTVM_GPU_WEIGHTS, else auto): a MoE model over it streams its experts")
    s.set_defaults(func=cmd_models)

    s = sub.add_parser("download", help="download a catalog model (key) or a Hugging Face repo; resumable, verified")
    s.add_argument("model", help="catalog key (see `zerotvm models`) or owner/repo")
    s.add_argument("--revision", help="branch, tag or commit (default: the catalog's pinned commit, else main)")
    s.set_defaults(func=cmd_download)

    s = sub.add_parser("remove", help="delete a downloaded model (local models are only forgotten)")
    s.add_argument("model", help="catalog key, or the path it is installed at")
    s.set_defaults(func=cmd_remove)

    s = sub.add_parser("verify", help="re-hash a downloaded model's files against the Hub's checksums")
    s.add_argument("model", help="catalog key, or the path it is installed at")
    s.set_defaults(func=cmd_verify)

    s = sub.add_parser("token", help="the Hugging Face token in the system keyring (for gated repos)")
    s.add_argument("action", choices=["set", "clear", "status"])
    s.add_argument("token", nargs="?", help="the token (prompted for, hidden, when left out)")
    s.set_defaults(func=cmd_token)

    s = sub.add_parser("prompt", help="render a chat with the model's own template; print its token ids as JSON")
    s.add_argument("model", help=MODEL_HELP + " (for a folder, tokenizer files and configs are enough)")
    s.add_argument("--messages", required=True, help='JSON file: [{"role": ..., "content": ...}, ...]')
    s.add_argument("--thinking", choices=["on", "off"], help="set enable_thinking (Qwen3 and alike)")
    s.add_argument("--system", help="system prompt (replaces a leading system message)")
    s.set_defaults(func=cmd_prompt)

    s = sub.add_parser("bench", help="benchmark a random-weight model of a real model's shapes")
    s.add_argument("--shape", default="phi3-mini", help="phi3-mini, qwen3-4b, qwen3.5-4b, qwen3.6-35b-a3b-4bit or "
                   "qwen3.6-35b-a3b-3bit (tiny-hybrid and tiny-hybrid-moe for a quick check)")
    s.add_argument("--decode-tokens", type=int, default=128)
    s.add_argument("--prompt-tokens", type=int, default=512)
    s.add_argument("--long-prompt-tokens", type=int, default=2048, help="second prefill length (0 = skip)")
    s.add_argument("--timestamps", action="store_true", help="also measure GPU-busy time with timestamp queries")
    s.add_argument("--runs", type=int, default=5)
    s.add_argument("--gpu-weights", metavar="SIZE", help="weights budget (a MoE shape over it streams its experts; "
                                                        "bench/expert_stream.py measures that in detail)")
    s.add_argument("--options", default="{}", metavar="JSON",
                   help='runtime options (engine/runtime_options.py) as JSON, for an A/B: \'{"gate_up_q8": true}\'')
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # Mesa's Vulkan warns loudly without it
    args = build_parser().parse_args(argv)
    if args.adapter:
        from engine.gpu import choose_adapter

        choose_adapter(args.adapter)
    try:
        args.func(args)
    except ZeroTVMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except (FileNotFoundError, NotADirectoryError) as e:
        what = f"there is no such file or folder: {e.filename}" if e.filename else str(e)  # not "[Errno 2] ..."
        print(f"error: {what}; check the path and try again" if e.filename else f"error: {what}", file=sys.stderr)
        return 2
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except OSError as e:  # permissions, a full disk, a device gone: the system's own words, and the file
        where = f" ({e.filename})" if e.filename else ""
        print(f"error: {e.strerror or e}{where}; check the file and the disk, then try again", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
