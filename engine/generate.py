"""Generation as a generator of responses (text delta, stats, finish reason), mlx-lm style."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response (may be "" while a character is incomplete)
    token: int | None
    prompt_tokens: int
    generation_tokens: int
    ttft_s: float  # time to first token
    prompt_tps: float
    generation_tps: float  # decode tokens per second after the first token
    finish_reason: str | None = None  # "stop", "length" or None while running


def stream_generate(model, prompt_ids: list[int], max_tokens: int = 256,
                    batch: int = 8) -> Iterator[GenerationResponse]:
    """Greedy generation from `prompt_ids`; the cache is rebuilt from scratch (reuse arrives with chat)."""
    rt, tok = model.runtime, model.tokenizer
    stops = set(tok.eos_ids) if tok else set()
    decoder = tok.stream() if tok else None
    rt.reset()
    start = time.perf_counter()
    rt.prefill(prompt_ids, out_index=0)
    first = rt.read_sampled(0)
    ttft = time.perf_counter() - start
    n_prompt = len(prompt_ids)
    count = 0

    def response(token: int | None, finish: str | None) -> GenerationResponse:
        elapsed = time.perf_counter() - start - ttft
        text = "" if token is None or decoder is None or token in stops else (decoder.step(tok.tok, token) or "")
        return GenerationResponse(text, token, n_prompt, count, ttft, n_prompt / max(ttft, 1e-9),
                                  (count - 1) / elapsed if count > 1 and elapsed > 0 else 0.0, finish)

    count = 1
    if first in stops or max_tokens <= 1:
        rt.truncate(n_prompt)
        yield response(first, "stop" if first in stops else "length")
        return
    yield response(first, None)
    fed = n_prompt + 1  # prompt plus every emitted token that the decoder has fed back
    gen = rt.decode(0, max_tokens - 1, batch=batch)
    try:
        for got in gen:
            for token in got:
                count += 1
                if token in stops:
                    rt.truncate(fed)
                    yield response(token, "stop")
                    return
                final = count >= max_tokens
                yield response(token, "length" if final else None)
                if final:
                    rt.truncate(fed)
                    return
                fed += 1
    finally:
        gen.close()
        rt.truncate(fed)
