"""A chat: the conversation, the model's chat template, sampling settings and the context policy.

The app's worker and `zerotvm chat` both drive a ChatSession and only iterate what it yields. The KV cache
outlives each reply, so a follow-up, a regenerate or an edit prefills only what differs from the cached
prefix (engine/generate.py). Messages are never deleted to make room: the "drop_oldest" policy only leaves
the oldest turns out of the prompt, and says how many it left out.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

from engine.cancel import Cancelled, CancelToken
from engine.errors import ContextLimitError, ZeroTVMError
from engine.generate import GenerationResponse, PrefillProgress, stream_generate
from engine.sampling import SamplingParams

POLICIES = ("refuse", "drop_oldest")


@dataclass
class ChatSettings:
    system: str | None = None  # replaces the template's default system prompt when set
    thinking: bool | None = None  # enable_thinking for templates that have it (Qwen3); None = template default
    max_tokens: int = 1024  # per reply
    sampling: SamplingParams | None = None  # None: the model's defaults (generation_config / GGUF metadata)
    seed: int | None = None  # None: a fresh seed per reply, so regenerate gives a new answer
    context_policy: str = "refuse"  # when the prompt does not fit: "refuse" or "drop_oldest"
    reply_reserve: int = 256  # tokens kept free for the reply when checking that a prompt fits

    def __post_init__(self) -> None:
        if self.context_policy not in POLICIES:
            raise ValueError(f"context_policy must be one of {POLICIES}, got {self.context_policy!r}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")


@dataclass
class ChatEvent:
    """One step of a reply: new thinking and answer text, the generation stats, and the prompt's fit. With
    ChatSession.progress, the prompt's reading comes first as events whose `progress` is set (response None)."""

    thinking: str
    answer: str
    response: GenerationResponse | None
    dropped_turns: int = 0  # oldest messages left out of the prompt to fit the context
    progress: PrefillProgress | None = None

    @property
    def finish_reason(self) -> str | None:
        return self.response.finish_reason if self.response is not None else None


@dataclass
class ChatSession:
    model: object
    settings: ChatSettings = field(default_factory=ChatSettings)
    messages: list[dict] = field(default_factory=list)
    cancel: CancelToken | None = None  # Stop: the reply ends with Cancelled at the next piece or token
    progress: bool = False  # also yield the prompt's reading (ChatEvent.progress)

    def send(self, text: str) -> Iterator[ChatEvent]:
        """Add a user message and stream the reply. On refusal the message is taken back out."""
        self.messages.append({"role": "user", "content": text})
        return self._reply(undo_user=True)

    def regenerate(self) -> Iterator[ChatEvent]:
        """Replace the last reply with a new one (a fresh seed unless the settings fix one)."""
        if self.messages and self.messages[-1]["role"] == "assistant":
            self.messages.pop()
        if not self.messages or self.messages[-1]["role"] != "user":
            raise ValueError("nothing to regenerate: the chat does not end with a user message")
        return self._reply()

    def edit(self, index: int, text: str) -> Iterator[ChatEvent]:
        """Change user message `index`, forget everything after it, and answer it again."""
        if not 0 <= index < len(self.messages) or self.messages[index]["role"] != "user":
            raise ValueError(f"message {index} is not a user message")
        self.messages[index] = {**self.messages[index], "content": text}
        del self.messages[index + 1:]
        return self._reply()

    # ---- internals -----------------------------------------------------------------------------
    def _prompt(self):
        """The rendered prompt of the messages that fit, and how many oldest messages were left out."""
        tok, s = self.model.tokenizer, self.settings
        if tok is None:
            raise ZeroTVMError(f"{self.model.path}: the model has no tokenizer, so it cannot chat")
        limit = self.model.runtime.max_context
        reserve = min(s.reply_reserve, s.max_tokens, limit // 2)
        messages, dropped = list(self.messages), 0
        while True:
            prompt = tok.chat_prompt(messages, system=s.system, thinking=s.thinking)
            if len(prompt.ids) + reserve <= limit:
                return prompt, dropped
            # Drop the oldest exchange (up to the next user message), never the last user message.
            first = next((i for i, m in enumerate(messages) if m["role"] != "system"), None)
            nxt = next((i for i in range(first + 1, len(messages)) if messages[i]["role"] == "user"), None) \
                if first is not None else None
            if s.context_policy != "drop_oldest" or nxt is None:
                raise ContextLimitError(len(prompt.ids), limit, reserve)
            dropped += nxt - first
            del messages[first:nxt]

    def _reply(self, undo_user: bool = False) -> Iterator[ChatEvent]:
        from engine.chat import TemplateCancelled, render_cancel

        token = self.cancel
        try:
            # Stop also ends a chat template still rendering (engine/chat_guard.py checks between steps).
            with render_cancel(lambda: token.cancelled) if token is not None else nullcontext():
                prompt, dropped = self._prompt()
        except BaseException as e:
            if undo_user:
                self.messages.pop()
            if isinstance(e, TemplateCancelled) and token is not None and token.cancelled:
                raise Cancelled from None
            raise
        return self._stream(prompt, dropped)

    def _stream(self, prompt, dropped: int) -> Iterator[ChatEvent]:
        s = self.settings
        sampling = s.sampling or self.model.default_sampling
        sampling = replace(sampling, seed=s.seed if s.seed is not None else random.getrandbits(63))
        splitter = prompt.splitter()
        thinking, answer, produced = [], [], False
        reply = {"role": "assistant", "content": ""}
        self.messages.append(reply)
        try:
            for r in stream_generate(self.model, prompt.ids, s.max_tokens, sampling, cancel=self.cancel,
                                     progress=self.progress):
                if isinstance(r, PrefillProgress):
                    yield ChatEvent("", "", None, dropped, progress=r)
                    continue
                parts = splitter.feed(r.text) + (splitter.flush() if r.finish_reason else [])
                t = "".join(text for kind, text in parts if kind == "thinking")
                a = "".join(text for kind, text in parts if kind == "answer")
                thinking.append(t)
                answer.append(a)
                produced = True
                reply["content"] = "".join(answer)
                if any(thinking):
                    reply["reasoning_content"] = "".join(thinking)
                yield ChatEvent(t, a, r, dropped)
        finally:  # stopped or cancelled: keep what was generated; cancelled before any token: no reply
            if not produced:
                self.messages.remove(reply)
