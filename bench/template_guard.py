"""The cost of engine/chat_guard.py on real chat templates: render time with the guard (tracing, size checks)
and with the same jinja2 sandbox without it, on a 41-message chat. CPU only.

    python bench/template_guard.py [--renders 300]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from engine.chat import ChatTemplate, _raise_exception, _TemplateNamespace, _tojson

TOKENIZERS = Path(__file__).resolve().parent.parent / ".cache" / "tokenizers"


def chat(turns: int = 20) -> list[dict]:
    messages = []
    for i in range(turns):
        messages += [{"role": "user", "content": f"question {i} " * 30},
                     {"role": "assistant", "content": f"<think>hmm {i}</think>answer {i} " * 20}]
    return messages + [{"role": "user", "content": "last"}]


def unguarded(source: str):
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, namespace=_TemplateNamespace)
    return env.from_string(source)


def per_render_ms(fn, renders: int) -> float:
    fn()
    samples = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(renders // 5):
            fn()
        samples.append((time.perf_counter() - t0) / (renders // 5) * 1e3)
    return statistics.median(samples)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--renders", type=int, default=300)
    args = p.parse_args()
    messages = chat()
    variables = {"bos_token": "<s>", "eos_token": "</s>"}
    for folder in sorted(TOKENIZERS.iterdir()):
        source = json.loads((folder / "tokenizer_config.json").read_text()).get("chat_template")
        if not isinstance(source, str):
            continue
        guarded, plain = ChatTemplate(source, folder.name), unguarded(source)
        assert guarded.render(messages, True, **variables) == plain.render(messages=messages,
                                                                           add_generation_prompt=True, **variables)
        g = per_render_ms(lambda t=guarded: t.render(messages, True, **variables), args.renders)
        u = per_render_ms(lambda t=plain: t.render(messages=messages, add_generation_prompt=True, **variables),
                          args.renders)
        print(f"{folder.name:14s} guarded {g:6.3f} ms  unguarded {u:6.3f} ms  overhead {100 * (g / u - 1):+5.1f}%")


if __name__ == "__main__":
    main()
