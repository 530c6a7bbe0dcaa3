"""Tokenizer on the `tokenizers` library: encode, chat prompts from the model's own template, stop ids, and a
streaming decoder that never splits a UTF-8 character.

Chat prompts equal transformers' `apply_chat_template(..., tokenize=True)` token for token, with one deliberate
difference: control tokens typed in message text ("<|im_end|>" in a user message) are encoded as plain text,
never as the control token. Before rendering, each control token in a message's strings is replaced by one
private-use character, which no template string method can split. A prompt without placeholders is encoded
in one pass, exactly as transformers does; otherwise the text between placeholders is encoded normally and
each placeholder as its token's plain text. That is transformers 5's `sanitize_control_tokens=True`, piece
by piece, so the ids equal its output. Control tokens are the special added tokens plus the added tokens the
template itself writes (like Qwen3's <think>, <tool_call>); in assistant messages only special tokens are
escaped, so the template can still find the <think> blocks of earlier answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from tokenizers import AddedToken
from tokenizers import Tokenizer as HFTokenizer

from engine.chat import ChatTemplate, ThinkingSplitter, generation_thinking, prepare_messages
from engine.errors import ModelFormatError
from engine.formats.files import read_json, read_text
from engine.formats.limits import MAX_TOKENIZER_BYTES

# Turn terminators: when the template writes one, the model ends its answer with it, so it is a stop token.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|eom_id|>", "<|end|>", "<end_of_turn>", "<|endofturn|>")
_PLACEHOLDER_BASE = 0xF0000  # Supplementary Private Use Area-A: one character per added token


@dataclass
class ChatPrompt:
    ids: list[int]
    text: str  # the rendered prompt; decode(ids, skip_special_tokens=False) gives it back (normalized)
    generation_prompt: str  # what the template appended after the last message (e.g. "<|im_start|>assistant\n")
    thinking: bool | None  # True: the prompt opened a think block; False: it closed one; None: no tag

    def splitter(self) -> ThinkingSplitter:
        """A thinking/answer splitter for the text generated after this prompt."""
        return ThinkingSplitter(self.thinking)


class Tokenizer:
    def __init__(self, tok: HFTokenizer, eos_ids: list[int], source: str, *,
                 chat_templates: dict[str, ChatTemplate] | None = None,
                 special_tokens: dict[str, str] | None = None, extra_special_tokens: list[str] | None = None,
                 chat_control_tokens: list[str] | None = None):
        """`special_tokens`: template variables (bos_token, ...); they and `extra_special_tokens` count as special
        even where tokenizer.json does not mark them. `chat_control_tokens`: the added tokens to escape in user
        text besides special ones; None means those the chat template writes."""
        tok.no_truncation()  # some tokenizer.json files ship a truncation length; prompts must never be cut
        tok.no_padding()
        self.tok, self.eos_ids, self.source = tok, eos_ids, source
        self.chat_templates = chat_templates or {}
        self.special_tokens = special_tokens or {}  # template variables: bos_token, eos_token, ...
        self._added = tok.get_added_tokens_decoder()  # id -> AddedToken
        self._specials = {t.content for t in self._added.values() if t.special}
        self._specials |= set(self.special_tokens.values()) | set(extra_special_tokens or ())
        self._chat_control_tokens = chat_control_tokens
        self._escaper: _Escaper | None = None

    @classmethod
    def from_dir(cls, folder: str | Path) -> Tokenizer:
        """tokenizer.json plus tokenizer_config.json, chat_template.jinja and generation_config.json if present."""
        folder = Path(folder)
        path = folder / "tokenizer.json"
        if not path.exists():
            raise ModelFormatError(f"{folder}: no tokenizer.json")
        try:
            tok = HFTokenizer.from_str(read_text(path, "tokenizer", MAX_TOKENIZER_BYTES))
        except ModelFormatError:
            raise
        except Exception as e:
            raise ModelFormatError(f"{path}: not a valid tokenizer ({str(e)[:300]})") from None
        config = _read_json(folder / "tokenizer_config.json")
        special = _special_tokens(config)
        templates = _templates_from_dir(folder, config)
        candidates = []
        for name in ("generation_config.json", "config.json", "mlc-chat-config.json"):
            candidates += _ids(_read_json(folder / name).get("eos_token_id"))
        eos_ids = _stop_ids(tok, candidates, special.get("eos_token"), templates)
        extra = config.get("extra_special_tokens", config.get("additional_special_tokens"))
        extra = [t for t in map(_token_text, extra if isinstance(extra, list) else []) if t]
        control = config.get("chat_control_tokens")
        return cls(tok, eos_ids, str(path), chat_templates=templates, special_tokens=special,
                   extra_special_tokens=extra, chat_control_tokens=control if isinstance(control, list) else None)

    @classmethod
    def from_parts(cls, tokenizer_json: str, chat_template: str | None = None, bos: str | None = None,
                   eos: str | None = None, eos_ids: list[int] | None = None, source: str = "GGUF") -> Tokenizer:
        """For loaders without a tokenizer folder (GGUF: tokenizer.json built from the vocabulary, the
        `tokenizer.chat_template` string, tokenizer.ggml.eos_token_id / eot_token_id). Stop ids not in this
        vocabulary, or naming ordinary tokens, are dropped."""
        try:
            tok = HFTokenizer.from_str(tokenizer_json)
        except Exception as e:
            raise ModelFormatError(f"{source}: not a valid tokenizer ({str(e)[:300]})") from None
        special = {k: v for k, v in (("bos_token", bos), ("eos_token", eos)) if v is not None}
        templates = {"default": ChatTemplate(chat_template, f"{source} chat template")} if chat_template else {}
        return cls(tok, _stop_ids(tok, list(eos_ids or []), eos, templates), source, chat_templates=templates,
                   special_tokens=special)

    @property
    def vocab_size(self) -> int:
        return self.tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def decoder(self, skip_special_tokens: bool = True) -> StreamDecoder:
        """A streaming decoder: `.step(id)` returns new text ("" mid-character), `.flush()` the rest."""
        return StreamDecoder(self.tok, skip_special_tokens)

    def chat_template(self, name: str | None = None) -> ChatTemplate:
        if not self.chat_templates:
            raise ModelFormatError(f"{self.source}: the model has no chat template")
        if name is None and len(self.chat_templates) == 1:
            return next(iter(self.chat_templates.values()))
        key = name or "default"
        if key not in self.chat_templates:
            raise ValueError(f"{self.source}: no chat template named {key!r}; have {sorted(self.chat_templates)}")
        return self.chat_templates[key]

    def render_chat(self, messages: list[dict], *, system: str | None = None, thinking: bool | None = None,
                    add_generation_prompt: bool = True, template: str | None = None, **variables) -> str:
        """The prompt text, as transformers' apply_chat_template(tokenize=False) renders it."""
        chat = self.chat_template(template)
        return chat.render(prepare_messages(messages, system), add_generation_prompt,
                           **self._variables(thinking, variables))

    def chat_prompt(self, messages: list[dict], *, system: str | None = None, thinking: bool | None = None,
                    add_generation_prompt: bool = True, template: str | None = None,
                    **variables) -> ChatPrompt:
        """Render `messages` with the model's own template and encode it; control tokens typed in the messages
        stay plain text. `thinking` sets the template's enable_thinking (None leaves it unset); `variables` are
        passed to the template as well."""
        chat = self.chat_template(template)
        escaper = self._get_escaper()
        escaped = escaper.escape_messages(prepare_messages(messages, system), chat)
        variables = self._variables(thinking, variables)
        text = chat.render(escaped, add_generation_prompt, **variables)
        head = chat.render(escaped, False, **variables) if add_generation_prompt else text
        generation_prompt = escaper.unescape(text[len(head):]) if text.startswith(head) else ""
        return ChatPrompt(escaper.encode(text), escaper.unescape(text), generation_prompt,
                          generation_thinking(generation_prompt))

    def _variables(self, thinking: bool | None, variables: dict) -> dict:
        if thinking is not None:
            variables = {"enable_thinking": thinking, **variables}
        return {**self.special_tokens, **variables}  # explicit variables win, as in transformers

    def _get_escaper(self) -> _Escaper:
        if self._escaper is None:
            self._escaper = _Escaper(self.tok, self._added, self._specials, self._chat_control_tokens)
        return self._escaper


class _Escaper:
    """Replaces control tokens in message strings by placeholder characters, and encodes rendered prompts
    with each placeholder as its token's plain text (transformers' encode_marked_chat, piece by piece)."""

    def __init__(self, tok: HFTokenizer, added: dict[int, AddedToken], specials: set[str],
                 chat_control_tokens: list[str] | None):
        self.tok, self.special, self.chat_control_tokens = tok, specials, chat_control_tokens
        tokens = [t for _, t in sorted(added.items())]
        self.placeholder = {t.content: chr(_PLACEHOLDER_BASE + i) for i, t in enumerate(tokens)}
        self.content = {p: c for c, p in self.placeholder.items()}
        last = chr(_PLACEHOLDER_BASE + max(len(tokens) - 1, 0))
        self._any_placeholder = re.compile(f"[{chr(_PLACEHOLDER_BASE)}-{last}]")
        self._split = re.compile(f"([{chr(_PLACEHOLDER_BASE)}-{last}])")
        self._patterns: dict[tuple[str, bool], re.Pattern] = {}

    def escape_messages(self, messages: list[dict], chat: ChatTemplate) -> list[dict]:
        full = self._pattern(chat, assistant=False)
        specials = self._pattern(chat, assistant=True)
        return [self._escape(m, specials if m.get("role") == "assistant" else full) for m in messages]

    def _pattern(self, chat: ChatTemplate, assistant: bool) -> re.Pattern:
        key = (chat.source, assistant)
        if key not in self._patterns:
            # Like transformers: special tokens, plus added tokens the template writes (not whitespace ones).
            def control_token(c: str) -> bool:
                if c in self.special:
                    return True
                if assistant:
                    return False
                if self.chat_control_tokens is not None:
                    return c in self.chat_control_tokens
                return c in chat.literal_text and not c.isspace()

            control = [c for c in self.placeholder if control_token(c)]
            control.sort(key=len, reverse=True)  # a token wins over the tokens inside it
            self._patterns[key] = re.compile("|".join(map(re.escape, control)) or "(?!)")
        return self._patterns[key]

    def _escape(self, value, pattern: re.Pattern):
        if isinstance(value, str):
            value = self._any_placeholder.sub("", value)  # no forged placeholders
            return pattern.sub(lambda m: self.placeholder[m.group(0)], value)
        if isinstance(value, dict):
            return {k: self._escape(v, pattern) for k, v in value.items()}  # keys are not escaped
        if isinstance(value, (list, tuple)):
            return [self._escape(v, pattern) for v in value]
        return value

    def unescape(self, text: str) -> str:
        return self._any_placeholder.sub(lambda m: self.content[m.group(0)], text)

    def encode(self, text: str) -> list[int]:
        """Prompt ids: the text between placeholders encoded normally (so the template's control tokens are
        tokens), each placeholder as plain text. Without placeholders this is one ordinary encode."""
        pieces = self._split.split(text)  # [text, placeholder, text, ..., text]
        ids = self._encode(pieces[0])
        newline = self._encode("\n")
        for i, piece in enumerate(pieces[1:], start=1):
            if not piece:
                continue
            if i % 2:
                token = self.content[piece]
                plain = self._after_newline(self._no_added_tokens, token, newline)
                if self.tok.token_to_id(token) in plain:
                    raise ValueError(f"cannot encode {token!r} as text: the vocabulary itself makes it the token")
                ids += plain
            else:
                ids += self._after_newline(self._encode, piece, newline)
        return ids

    def _encode(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    @staticmethod
    def _after_newline(encode, text: str, newline: list[int]) -> list[int]:
        # A piece continues the text before it: encode it after a newline, then drop the newline, so that a
        # SentencePiece normalizer adds no word-start "▁" (transformers' trick; falls back if the newline merges).
        ids = encode("\n" + text)
        return ids[len(newline):] if ids[:len(newline)] == newline else encode(text)

    def _no_added_tokens(self, text: str) -> list[int]:
        # The tokenizer pipeline minus added-token matching: normalize, pre-tokenize, run the model.
        if self.tok.normalizer is not None:
            text = self.tok.normalizer.normalize_str(text)
        pieces = [p for p, _ in self.tok.pre_tokenizer.pre_tokenize_str(text)] if self.tok.pre_tokenizer else [text]
        return [t.id for p in pieces for t in self.tok.model.tokenize(p)]


class StreamDecoder:
    """Incremental decode: text is released only up to the end of a complete character.

    Each step decodes a short window that starts one release back, and returns what the newest ids add to it;
    the overlap keeps word-start spaces that a decoder drops at the start of a sequence. A window ending in
    U+FFFD (an unfinished UTF-8 sequence) is held until more ids arrive or flush() is called.
    """

    def __init__(self, tok: HFTokenizer, skip_special_tokens: bool = True):
        self.tok, self.skip = tok, skip_special_tokens
        self.ids: list[int] = []
        self._prefix = self._read = 0

    def step(self, token_id: int) -> str:
        self.ids.append(token_id)
        return self._release(final=False)

    def flush(self) -> str:
        """The held-back tail, even if it is not a complete character (shown as U+FFFD)."""
        return self._release(final=True)

    def _release(self, final: bool) -> str:
        before = self.tok.decode(self.ids[self._prefix:self._read], skip_special_tokens=self.skip)
        text = self.tok.decode(self.ids[self._prefix:], skip_special_tokens=self.skip)
        if len(text) <= len(before) or (text.endswith("\ufffd") and not final):
            return ""
        self._prefix, self._read = self._read, len(self.ids)
        return text[len(before):]


def _read_json(path: Path) -> dict:
    """An optional JSON object beside the tokenizer: {} when absent or not an object."""
    data = read_json(path, "tokenizer/generation settings", default={}, kind=None)
    return data if isinstance(data, dict) else {}


def _ids(value) -> list[int]:
    values = value if isinstance(value, list) else [value]
    return [v for v in values if isinstance(v, int) and not isinstance(v, bool)]


def _token_text(value) -> str | None:
    # tokenizer_config stores a token as a string or as an AddedToken object {"content": ...}.
    value = value.get("content") if isinstance(value, dict) else value
    return value if isinstance(value, str) else None


def _special_tokens(config: dict) -> dict[str, str]:
    """Template variables transformers takes from tokenizer_config: every `*_token` entry holding a token
    (bos_token, eos_token, model-specific ones like image_token) and named `extra_special_tokens`."""
    extra = config.get("extra_special_tokens")
    named = {**(extra if isinstance(extra, dict) else {}), **{k: v for k, v in config.items() if k.endswith("_token")}}
    out = {k: _token_text(v) for k, v in named.items()}
    return {k: v for k, v in out.items() if v is not None}


def _templates_from_dir(folder: Path, config: dict) -> dict[str, ChatTemplate]:
    """Like transformers: chat_template.jinja and additional_chat_templates/*.jinja win over tokenizer_config's
    `chat_template` (a string, or a list of {"name", "template"}); chat_template.json is the last resort."""
    found: dict[str, ChatTemplate] = {}
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        found["default"] = ChatTemplate(read_text(jinja, "chat template"), str(jinja))
    extra = folder / "additional_chat_templates"
    for path in sorted(extra.glob("*.jinja")) if extra.is_dir() else []:
        found[path.stem] = ChatTemplate(read_text(path, "chat template"), str(path))
    if found:
        return found
    where = str(folder / "tokenizer_config.json")
    value = config.get("chat_template")
    if value is None:
        where = str(folder / "chat_template.json")
        value = _read_json(folder / "chat_template.json").get("chat_template")
    if isinstance(value, str):
        return {"default": ChatTemplate(value, where)}
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("name"), str) and t["name"]
                   and isinstance(t.get("template"), str) for t in value):
            raise ModelFormatError(f"{where}: chat_template list entries need a 'name' and a 'template', both text")
        return {t["name"]: ChatTemplate(t["template"], f"{where} ({t['name']})") for t in value}
    return {}


def _stop_ids(tok: HFTokenizer, candidates: list[int], eos: str | None,
              templates: dict[str, ChatTemplate]) -> list[int]:
    """Stop ids that really belong to this vocabulary.

    A configured id is kept only if it is an added token (or the eos token): configs copied from another model
    carry stale ids that are out of range or, worse, name ordinary tokens in this vocabulary. The eos token
    and any turn terminator the chat template writes (<|im_end|> for ChatML) are stops too.
    """
    added = set(tok.get_added_tokens_decoder())
    vocab = tok.get_vocab_size(with_added_tokens=True)
    eos_id = tok.token_to_id(eos) if eos else None
    ids = {i for i in candidates if 0 <= i < vocab and (i in added or i == eos_id)}
    if eos_id is not None:
        ids.add(eos_id)
    literal = "\0".join(t.literal_text for t in templates.values())
    for name in END_OF_TURN:
        i = tok.token_to_id(name)
        if i in added and name in literal:
            ids.add(i)
    return sorted(ids)
