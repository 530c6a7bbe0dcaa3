"""Chat templates rendered exactly as transformers' `apply_chat_template` renders them, and a streaming
splitter for `<think>…</think>` blocks in generated text.

The Jinja environment copies transformers' (utils/chat_template_utils.py): an ImmutableSandboxedEnvironment with
trim_blocks, lstrip_blocks and loop controls, a `tojson` that does not HTML-escape, `raise_exception`,
`strftime_now`, a safe `dict` and `namespace`, and `{% generation %}` accepted as a plain block. On top of the
sandbox, engine/chat_guard.py bounds time, sizes and recursion, and lets Stop end a render: every failure is a
ChatTemplateError naming the template's file.
"""

from __future__ import annotations

import copy
import errno
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from datetime import datetime
from functools import lru_cache
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.ext import Extension, loopcontrols
from jinja2.utils import Namespace

from engine import chat_guard
from engine.chat_guard import GuardedEnvironment, RenderGuard, TemplateAbort
from engine.errors import ModelFormatError, ZeroTVMError

REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")  # transformers aliases these to each other
MAX_TEMPLATE_CHARS = 1024**2  # real templates are a few KB (the longest known, ~30 KB); more is not a template
_cancel = threading.local()


class ChatTemplateError(ModelFormatError, ValueError):
    """A chat template that cannot compile, refused the messages, failed, or hit a limit; str() names its file.
    A ValueError too, as bad input to render() always was."""


class TemplateCancelled(ZeroTVMError):
    """Stop was pressed while a chat template rendered."""


@contextmanager
def render_cancel(check: Callable[[], bool]) -> Iterator[None]:
    """Every chat template rendered in this thread inside the block stops (TemplateCancelled) as soon as
    `check()` is true: the app's worker passes its stop flag, so Stop and close work even mid-render."""
    previous = getattr(_cancel, "check", None)
    _cancel.check = check
    try:
        yield
    finally:
        _cancel.check = previous


class _Generation(Extension):
    # Training templates mark assistant text with {% generation %}; rendering keeps the body unchanged.
    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller):
        return caller()


def _raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(format):
    if not isinstance(format, str) or len(format) > 1000:
        raise jinja2.exceptions.TemplateError("strftime_now() takes a short format string")
    return chat_guard.built(datetime.now().strftime(format), "strftime_now()")


class _TemplateDict:
    # `dict(...)` without exposing the dict type to the sandbox.
    def __call__(self, *args, **kwargs):
        return dict(*args, **kwargs)

    def fromkeys(self, *args, **kwargs):
        return dict.fromkeys(*args, **kwargs)


class _TemplateNamespace(Namespace):
    # Namespaces refuse underscore names, so a template cannot reach CPython internals through one.
    def __init__(*args, **kwargs):
        self, args = args[0], args[1:]
        attrs = dict(*args, **kwargs)
        for name in attrs:
            _TemplateNamespace._check(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name, value):
        _TemplateNamespace._check(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name):
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"chat templates cannot set {name!r} on a namespace")


def _environment() -> GuardedEnvironment:
    env = GuardedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[_Generation, loopcontrols])
    env.filters["tojson"] = chat_guard.guarded_filter("tojson", _tojson)
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, dict=_TemplateDict(),
                       namespace=_TemplateNamespace)
    return env


_ENV = _environment()


class ChatTemplate:
    """One Jinja chat template; `where` names its file (or "GGUF metadata") in error messages."""

    def __init__(self, source: str, where: str = "chat template"):
        self.source, self.where = source, where
        if not isinstance(source, str):
            raise ChatTemplateError(f"{where}: the chat template is not text but {type(source).__name__}")
        if len(source) > MAX_TEMPLATE_CHARS:
            raise ChatTemplateError(f"{where}: the chat template is {len(source):,} characters long, more than the "
                                    f"{MAX_TEMPLATE_CHARS:,} a template may have; the file is damaged or not a model's")
        try:
            with RenderGuard():  # jinja2 folds constant expressions while compiling: the same limits apply
                self.template = _compile(source)
                self.literal_text = _literal_text(source)
        except jinja2.TemplateSyntaxError as e:
            raise ChatTemplateError(f"{where}: chat template does not parse (line {e.lineno}: {e.message})") from e
        except TemplateAbort as e:
            raise ChatTemplateError(f"{where}: the chat template was refused while compiling: {e.reason}") from None
        except Exception as e:  # RecursionError, MemoryError, Python's SyntaxError for 20+ nested blocks...
            raise ChatTemplateError(f"{where}: the chat template cannot be compiled ({_why(e)})") from None

    def render(self, messages: list[dict], add_generation_prompt: bool = True, tools: list[dict] | None = None,
               documents: list[dict] | None = None, *, cancel: Callable[[], bool] | None = None,
               timeout_s: float | None = None, **variables) -> str:
        """Render prepared messages; `variables` are the special tokens plus extras such as enable_thinking.
        `cancel` (default: the render_cancel() of this thread) stops it with TemplateCancelled; any failure,
        limit included (chat_guard), is a ChatTemplateError naming the template."""
        cancel = cancel or getattr(_cancel, "check", None)
        context = dict(messages=messages, tools=tools, documents=documents,
                       add_generation_prompt=add_generation_prompt, **variables)
        try:
            with RenderGuard(chat_guard.weight(context, 1 << 31), cancel, timeout_s) as guard:
                pieces, size = [], 0
                for piece in self.template.generate(context):
                    size += len(piece)
                    if size > guard.max_value:
                        raise TemplateAbort(f"its output would be longer than {guard.max_value:,} characters")
                    pieces.append(piece)
                return "".join(pieces)
        except TemplateAbort as e:
            if e.cancelled:
                raise TemplateCancelled(f"{self.where}: rendering the chat template was stopped") from None
            raise ChatTemplateError(f"{self.where}: the chat template was stopped: {e.reason}") from None
        except jinja2.TemplateError as e:  # raise_exception() in the template, an undefined call, the sandbox
            raise ChatTemplateError(f"{self.where}: the chat template refused these messages: {e}") from e
        except Exception as e:  # TypeError on unreadable messages, RecursionError, OverflowError, MemoryError...
            raise ChatTemplateError(f"{self.where}: the chat template failed on these messages ({_why(e)})") from None


def _why(e: BaseException) -> str:
    if isinstance(e, RecursionError):
        return "it nests too deeply"
    if isinstance(e, MemoryError):
        return "it ran out of memory"
    text = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


@lru_cache(maxsize=32)
def _compile(source: str) -> jinja2.Template:
    return _ENV.from_string(source)


@lru_cache(maxsize=32)
def _literal_text(source: str) -> str:
    """The template's raw text and string constants, joined by NULs so a search cannot match across two."""
    ast = _ENV.parse(source)
    found = {n.data for n in ast.find_all(nodes.TemplateData)}
    found |= {n.value for n in ast.find_all(nodes.Const) if isinstance(n.value, str)}
    return "\0".join(sorted(found))


def prepare_messages(messages: Iterable[dict], system: str | None = None) -> list[dict]:
    """A deep copy of `messages` as transformers hands them to the template.

    Keys whose value is None are dropped, and reasoning under any of REASONING_FIELDS is copied to
    `reasoning_content` and `thinking`. `system` replaces a leading system message or is put first.
    """
    out = []
    for i, m in enumerate(messages):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError(f"message {i}: expected an object with a string 'role', got {m!r:.80}")
        try:
            m = {k: copy.deepcopy(v) for k, v in m.items() if v is not None}
        except RecursionError:
            raise ValueError(f"message {i}: its contents are nested too deeply") from None
        reasoning = next((m[k] for k in REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    if system is not None:
        if out and out[0]["role"] == "system":
            out = out[1:]
        out.insert(0, {"role": "system", "content": system})
    return out


def load_messages(path: str | Path) -> list[dict]:
    """Messages from a JSON file: a list of {"role", "content", ...} objects, or {"messages": [...]}."""
    from engine.formats.files import read_json

    path = Path(path)
    if not path.exists():  # the CLI's plain "no such file" sentence
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(path))
    data = read_json(path, "chat messages", kind=None)
    if isinstance(data, dict):
        data = data.get("messages")
    if not isinstance(data, list) or not data:
        raise ValueError(f"{path}: expected a non-empty JSON list of messages (or {{\"messages\": [...]}})")
    try:
        return prepare_messages(data)
    except ValueError as e:
        raise ValueError(f"{path}: {e}") from e


THINKING, ANSWER = "thinking", "answer"
_START = "start"  # nothing but whitespace seen yet; a think block may still open


class ThinkingSplitter:
    """Splits streamed model text into ("thinking", text) and ("answer", text) pieces.

    `thinking`: True when the prompt already opened a think block (the template wrote "<think>" after the
    assistant header), False when it closed one or the model does not think (no tags are looked for), None to
    treat a `<think>` at the very start of the output as opening one. Tags may arrive split across deltas.
    Whitespace at the start of each part and at the end of the thinking is dropped.
    """

    def __init__(self, thinking: bool | None = None, open_tag: str = "<think>", close_tag: str = "</think>"):
        self.open_tag, self.close_tag = open_tag, close_tag
        self._mode = THINKING if thinking else ANSWER if thinking is False else _START
        self._buf = ""
        self._fresh = True  # the current part has emitted nothing yet

    def feed(self, delta: str) -> list[tuple[str, str]]:
        self._buf += delta
        return self._drain(final=False)

    def flush(self) -> list[tuple[str, str]]:
        """Whatever is still held back (a partial tag, trailing whitespace) at the end of generation."""
        return self._drain(final=True)

    def _drain(self, final: bool) -> list[tuple[str, str]]:
        out: list[tuple[str, str]] = []
        while True:
            if self._fresh:
                self._buf = self._buf.lstrip()
            if self._mode == _START:
                if self._buf.startswith(self.open_tag):
                    self._buf = self._buf[len(self.open_tag):]
                    self._mode = THINKING
                    continue
                if self.open_tag.startswith(self._buf) and not final:
                    return out  # still empty, or a prefix of the open tag
                self._mode = ANSWER
            if self._mode == ANSWER:
                self._emit(out, ANSWER, self._buf)
                self._buf = ""
                return out
            end = self._buf.find(self.close_tag)
            if end >= 0:
                self._emit(out, THINKING, self._buf[:end].rstrip())
                self._buf = self._buf[end + len(self.close_tag):]
                self._mode, self._fresh = ANSWER, True
                continue
            # Hold back a possible start of the close tag and the whitespace before it.
            cut = len(self._buf) if final else len(self._buf) - _partial_suffix(self._buf, self.close_tag)
            text = self._buf[:cut].rstrip()
            self._emit(out, THINKING, text)
            self._buf = self._buf[len(text):]
            if final:
                self._buf = ""
            return out

    def _emit(self, out: list[tuple[str, str]], kind: str, text: str) -> None:
        if not text:
            return
        self._fresh = False
        if out and out[-1][0] == kind:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def generation_thinking(generation_prompt: str, open_tag: str = "<think>", close_tag: str = "</think>") -> bool | None:
    """What the generation prompt (text the template adds after the last message) says about thinking:
    True if it leaves a think block open, False if it closes one (thinking off), None if it has no tag."""
    opened, closed = generation_prompt.rfind(open_tag), generation_prompt.rfind(close_tag)
    if opened < 0 and closed < 0:
        return None
    return opened > closed
