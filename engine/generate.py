"""Generation as a generator of responses (text delta, stats, finish reason), mlx-lm style.

The KV cache lives across calls: a new prompt prefills only the tokens after its longest common prefix
with what the cache holds, so follow-up turns, regenerate and edit never re-read the shared history.
A CancelToken stops generation between prefill pieces and decode batches (Cancelled); the cache then holds
exactly the tokens it has state for, so the next call reuses them like any cached prefix.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from engine.cancel import CancelToken, check
from engine.errors import ContextLimitError
from engine.sampling import SamplingParams


@dataclass
class PrefillProgress:
    """Between prefill pieces (stream_generate(progress=True)): prompt tokens read so far, of `total`."""

    done: int
    total: int
    seconds: float  # since the prefill started
    reused: int  # prompt tokens served from the cache, not counted in done/total

    @property
    def tps(self) -> float:
        return self.done / self.seconds if self.done and self.seconds > 0 else 0.0


@dataclass
class GenerationResponse:
    text: str  # new text since the previous response (may be "" while a character is incomplete)
    token: int | None
    prompt_tokens: int
    generation_tokens: int
    ttft_s: float  # time to first token
    prompt_tps: float  # prefilled (not reused) prompt tokens per second
    generation_tps: float  # decode tokens per second after the first token
    context_used: int  # tokens in the cache after this response
    context_limit: int
    prompt_reused: int  # prompt tokens served from the cache instead of prefilled
    finish_reason: str | None = None  # "stop", "length" or None while running


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def stream_generate(model, prompt_ids: list[int], max_tokens: int = 256, sampling: SamplingParams | None = None,
                    batch: int = 8, reuse: bool = True, cancel: CancelToken | None = None,
                    progress: bool = False) -> Iterator[GenerationResponse | PrefillProgress]:
    """Generate from `prompt_ids`, reusing the cached prefix; stops at a stop id or the limits.

    `sampling` None is greedy. The prompt must leave room for one new token, else ContextLimitError.
    `cancel`: checked between prefill pieces and between tokens; raises Cancelled (engine.cancel). `progress`: also
    yield a PrefillProgress before the prefill and after each of its pieces.
    """
    rt, tok = model.runtime, model.tokenizer
    rt.set_sampling(sampling or SamplingParams())
    prompt_ids = [int(t) for t in prompt_ids]
    limit = rt.max_context
    if len(prompt_ids) + 1 > limit:
        raise ContextLimitError(len(prompt_ids) + 1, limit)
    if not prompt_ids:
        raise ValueError("the prompt is empty")
    max_tokens = min(max_tokens, limit - len(prompt_ids))  # never run past the cache: finish "length"
    stops = set(tok.eos_ids) if tok else set()
    decoder = tok.decoder() if tok else None

    # Keep at least the last prompt token to prefill: its logits give the first new token.
    reused = min(common_prefix(rt.cached_ids, prompt_ids), len(prompt_ids) - 1, rt.n_cached) if reuse else 0
    rt.truncate(reused)
    start = time.perf_counter()
    todo = prompt_ids[reused:]
    n_prompt, count, emitted = len(prompt_ids), 0, []
    if cancel is None and not progress:
        rt.prefill(todo, out_index=0)
    else:
        # Stopped here, the cache holds the pieces submitted (n_cached, cached_ids): nothing to settle.
        if progress:
            yield PrefillProgress(0, len(todo), 0.0, reused)
        for done, total in rt.prefill_steps(todo, 0, cancel):
            if progress and done < total:
                yield PrefillProgress(done, total, time.perf_counter() - start, reused)
    first = rt.read_sampled(0)
    ttft = time.perf_counter() - start

    def response(token: int, finish: str | None) -> GenerationResponse:
        elapsed = time.perf_counter() - start - ttft
        text = "" if decoder is None or token in stops else decoder.step(token)
        if finish and decoder is not None:
            text += decoder.flush()  # a character left incomplete at the end comes out as U+FFFD
        return GenerationResponse(
            text, token, n_prompt, count, ttft, (n_prompt - reused) / max(ttft, 1e-9),
            (count - 1) / elapsed if count > 1 and elapsed > 0 else 0.0, n_prompt + len(emitted), limit, reused,
            finish)

    def settle() -> None:
        # The cache holds the prompt and every emitted token except the last one (never fed back).
        fed = emitted[:-1] if emitted else []
        rt.truncate(n_prompt + len(fed))
        rt.cached_ids = prompt_ids + fed

    gen = None
    try:
        count = 1
        emitted.append(first)
        if first in stops or max_tokens <= 1:
            yield response(first, "stop" if first in stops else "length")
            return
        yield response(first, None)
        check(cancel)
        gen = rt.decode(0, max_tokens - 1, batch=batch)
        for got in gen:
            for token in got:
                check(cancel)
                count += 1
                emitted.append(token)
                finish = "stop" if token in stops else "length" if count >= max_tokens else None
                yield response(token, finish)
                if finish:
                    return
    finally:
        if gen is not None:
            gen.close()
        settle()
