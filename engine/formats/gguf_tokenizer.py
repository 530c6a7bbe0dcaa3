"""The tokenizer of a GGUF file, rebuilt from its metadata as a `tokenizers` tokenizer.json.

A GGUF carries no tokenizer.json: llama.cpp's converter stores the vocabulary under tokenizer.ggml.* keys, and
llama.cpp rebuilds the tokenizer from them (src/llama-vocab.cpp). We rebuild the same tokenizer for the
`tokenizers` library, so it runs like a model folder's: read_tokenizer gives the parts that
engine.tokenizer.Tokenizer.from_parts takes (engine/tokenizer_loader.py joins the two: neither imports the other):

- "gpt2": byte-level BPE from `tokens` and `merges`. The split before BPE is not in the file; `pre` names it,
  and PRE_TOKENIZERS holds the model family's own pre-tokenizer for each name we know (the regexes llama.cpp
  runs, in their tokenizer.json form). Unknown names are refused rather than guessed.
- "llama": SentencePiece BPE from `tokens` and `scores` (Llama 2, Phi-3). llama.cpp merges the adjacent pair
  whose result scores highest; a BPE model does the same when its merges are ranked by that score. Characters
  missing from the vocabulary fall back to <0xNN> byte tokens, and `add_space_prefix` puts "▁" before the text
  and after every special token, as llama.cpp (and Llama 2's own tokenizer.json) do.

Token types 2 (unknown) and 3 (control) become special added tokens, type 4 (user-defined, like <think>)
plain added tokens: all are matched whole in the text, as llama.cpp matches them.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import NamedTuple

from engine.errors import ModelFormatError
from engine.formats.gguf import GgufCheckpoint
from engine.formats.limits import MAX_SPM_MERGE_WORK

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # llama.cpp's llama_token_type
GGML = "tokenizer.ggml."

_QWEN2 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
          r"|\s+(?!\S)|\s+")
_LLAMA3 = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
           r"|\s+(?!\S)|\s+")


def _byte_level(regex: bool) -> dict:
    return {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": regex}


def _split(regex: str) -> dict:
    return {"type": "Split", "pattern": {"Regex": regex}, "behavior": "Isolated", "invert": False}


def _sequence(*steps: dict) -> dict:
    return {"type": "Sequence", "pretokenizers": list(steps)}


class _Family(NamedTuple):
    normalizer: dict | None
    pre_tokenizer: dict
    ignore_merges: bool  # a word that is itself a token skips BPE (Llama 3's tokenizer.json sets this)
    add_bos: bool  # llama.cpp's default when the file has no add_bos_token


# tokenizer.ggml.pre -> the family's own pre-tokenizer (llama.cpp's regexes, as that family's tokenizer.json
# spells them). A missing pre or "default" gets GPT-2's split, as in transformers; llama.cpp's own "default"
# is a degraded regex chain it warns about. Qwen2's tokenizer.json also NFC-normalizes (llama.cpp skips that).
_GPT2 = _Family(None, _byte_level(True), False, False)  # ByteLevel's built-in regex is GPT-2's
_DIGITS_GPT2 = _Family(None, _sequence({"type": "Digits", "individual_digits": True}, _byte_level(True)), False, False)
_QWEN2_FAMILY = _Family({"type": "NFC"}, _sequence(_split(_QWEN2), _byte_level(False)), False, False)
_LLAMA3_FAMILY = _Family(None, _sequence(_split(_LLAMA3), _byte_level(False)), True, True)
PRE_TOKENIZERS = {
    "default": _GPT2, "gpt-2": _GPT2, "phi-2": _GPT2,
    "smollm": _DIGITS_GPT2, "starcoder": _DIGITS_GPT2, "refact": _DIGITS_GPT2, "codeshell": _DIGITS_GPT2,
    "qwen2": _QWEN2_FAMILY, "deepseek-r1-qwen": _QWEN2_FAMILY,
    "llama3": _LLAMA3_FAMILY, "llama-v3": _LLAMA3_FAMILY, "llama-bpe": _LLAMA3_FAMILY,
}
ADDED = (UNKNOWN, CONTROL, USER_DEFINED)  # token types matched whole in the text, before BPE


class TokenizerParts(NamedTuple):
    """What Tokenizer.from_parts takes: a tokenizer.json text, the chat template, special tokens, stop ids."""

    tokenizer_json: str
    chat_template: str | None
    bos: str | None
    eos: str | None
    eos_ids: list[int]
    source: str


def read_tokenizer(path: str | Path) -> TokenizerParts:
    """The tokenizer described by a GGUF file's tokenizer.ggml.* metadata, with its chat template."""
    path = Path(path)
    return _Builder(path, GgufCheckpoint(path).metadata).build()


class _Builder:
    def __init__(self, path: Path, meta: dict):
        self.path, self.meta = path, meta

    def build(self) -> TokenizerParts:
        model = self._field("model", str)
        if model not in ("gpt2", "llama"):
            raise ModelFormatError(f"{self.path}: tokenizer model '{model}' ({GGML}model) is not supported; "
                                   "supported: gpt2 (byte-level BPE), llama (SentencePiece BPE)")
        self.tokens = self._tokens()
        n = len(self.tokens)
        self.types = types = self._array("token_type", int, n, [NORMAL] * n)
        spm = model == "llama"
        # llama.cpp's defaults when the file does not say: SentencePiece files use ids 1/2/0 for bos/eos/unk.
        self.ids = {name: self._token_id(name, default) for name, default in
                    (("bos", 1 if spm else None), ("eos", 2 if spm else None), ("unknown", 0 if spm else None),
                     ("eot", None), ("eom", None))}
        if spm:
            config, add_bos = self._sentencepiece(), True
        else:
            config, add_bos = self._byte_level_bpe()
        config["post_processor"] = self._post_processor(self._field("add_bos_token", bool, add_bos),
                                                        self._field("add_eos_token", bool, False))
        config["added_tokens"] = [
            {"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False,
             "special": ty != USER_DEFINED}
            for i, (t, ty) in enumerate(zip(self.tokens, types, strict=True)) if ty in ADDED
        ]
        template = self.meta.get("tokenizer.chat_template")
        stops = [self.ids[k] for k in ("eos", "eot", "eom") if self.ids[k] is not None]
        return TokenizerParts(json.dumps({"version": "1.0", **config}, ensure_ascii=False),
                              template if isinstance(template, str) else None, bos=self._text("bos"),
                              eos=self._text("eos"), eos_ids=stops, source=str(self.path))

    # -- the two tokenizer kinds --------------------------------------------------------------------

    def _byte_level_bpe(self) -> tuple[dict, bool]:
        pre = self._field("pre", str, "default")
        if pre not in PRE_TOKENIZERS:
            raise ModelFormatError(f"{self.path}: pre-tokenizer '{pre}' ({GGML}pre) is not supported; "
                                   f"supported: {', '.join(PRE_TOKENIZERS)}")
        family = PRE_TOKENIZERS[pre]
        alphabet = set(_BYTE_TO_CHAR.values())
        vocab = {}
        for i, (token, ty) in enumerate(zip(self.tokens, self.types, strict=True)):
            # Added tokens are stored as plain text; any other token outside the byte alphabet is respelled
            # in it, as transformers does (BPE only ever produces byte-alphabet strings).
            if ty not in ADDED and not set(token) <= alphabet:
                token = "".join(_BYTE_TO_CHAR[b] for b in token.encode("utf-8", "surrogateescape"))
            self._add(vocab, token, i)
        merges = []
        for m in self._field("merges", list):
            at = m.find(" ", 1) if isinstance(m, str) else -1  # llama.cpp splits at the first space after 1 char
            if at < 0:
                raise ModelFormatError(f"{self.path}: {GGML}merges entry {m!r} is not 'left right'")
            merges.append([m[:at], m[at + 1:]])
        model = {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                 "ignore_merges": family.ignore_merges, "vocab": vocab, "merges": merges}
        return {"normalizer": family.normalizer, "pre_tokenizer": family.pre_tokenizer, "model": model,
                "decoder": _byte_level(True)}, family.add_bos

    def _sentencepiece(self) -> dict:
        scores = self._array("scores", (int, float), len(self.tokens))
        work = sum(len(t) ** 2 for t in self.tokens)
        if work > MAX_SPM_MERGE_WORK:
            longest = max(self.tokens, key=len)
            raise ModelFormatError(f"{self.path}: metadata field '{GGML}tokens' holds tokens too long to rebuild "
                                   f"SentencePiece merges from (the longest has {len(longest):,} characters); "
                                   "not a real vocabulary")
        vocab = {}
        for i, token in enumerate(self.tokens):
            self._add(vocab, token, i)
        unk = self._text("unknown")
        model = {"type": "BPE", "dropout": None, "unk_token": unk, "continuing_subword_prefix": None,
                 "end_of_word_suffix": None, "fuse_unk": True, "byte_fallback": True, "ignore_merges": False,
                 "vocab": vocab, "merges": _merges_by_score(self.tokens, scores, vocab)}
        prefix = self._field("add_space_prefix", bool, True)
        # Prepend as a normalizer (not Metaspace): it adds "▁" to every stretch between added tokens, even one
        # that starts with a space, which is what llama.cpp does.
        spaces = {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}
        normalizer = {"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"}, spaces]}
        decoders = [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                    {"type": "Fuse"}]
        if prefix:
            decoders.append({"type": "Strip", "content": " ", "start": 1, "stop": 0})
        return {"normalizer": normalizer if prefix else spaces, "pre_tokenizer": None, "model": model,
                "decoder": {"type": "Sequence", "decoders": decoders}}

    def _post_processor(self, add_bos: bool, add_eos: bool) -> dict:
        """TemplateProcessing that puts bos before and/or eos after each sequence, as llama.cpp does."""
        specials, before, after = {}, [], []
        for name, add, where in (("bos", add_bos, before), ("eos", add_eos, after)):
            text = self._text(name)
            if add and text is None:
                raise ModelFormatError(
                    f"{self.path}: {GGML}add_{name}_token is set but {GGML}{name}_token_id is missing")
            if add:
                specials[text] = {"id": text, "ids": [self.ids[name]], "tokens": [text]}
                where.append(text)

        def sequence(seq: str, type_id: int) -> list[dict]:
            return ([{"SpecialToken": {"id": t, "type_id": type_id}} for t in before]
                    + [{"Sequence": {"id": seq, "type_id": type_id}}]
                    + [{"SpecialToken": {"id": t, "type_id": type_id}} for t in after])

        return {"type": "TemplateProcessing", "single": sequence("A", 0),
                "pair": sequence("A", 0) + sequence("B", 1), "special_tokens": specials}

    # -- metadata -----------------------------------------------------------------------------------

    def _field(self, name: str, kind: type, default=...):
        value = self.meta.get(GGML + name)
        if value is None:
            if default is ...:
                raise ModelFormatError(f"{self.path}: metadata field '{GGML}{name}' is missing")
            return default
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise ModelFormatError(f"{self.path}: metadata field '{GGML}{name}' is {type(value).__name__}, "
                                   f"expected {kind.__name__}")
        return value

    def _array(self, name: str, kind, n: int, default=...) -> list:
        """A per-token array field: `n` entries of type `kind`."""
        value = self._field(name, list, default)
        if len(value) != n or not all(isinstance(v, kind) and not isinstance(v, bool) for v in value):
            raise ModelFormatError(f"{self.path}: metadata field '{GGML}{name}' should hold one number per token "
                                   f"({n}), has {len(value)} entries")
        return value

    def _tokens(self) -> list[str]:
        tokens = self._field("tokens", list)
        if not tokens or not all(isinstance(t, str) for t in tokens):
            raise ModelFormatError(f"{self.path}: metadata field '{GGML}tokens' is not a list of strings")
        # llama.cpp renames empty tokens the same way, so ids stay aligned.
        return [t or f"[EMPTY_{i}]" for i, t in enumerate(tokens)]

    def _token_id(self, name: str, default: int | None) -> int | None:
        value = self.meta.get(f"{GGML}{name}_token_id", default)
        ok = isinstance(value, int) and not isinstance(value, bool) and 0 <= value < len(self.tokens)
        return value if ok else None  # like llama.cpp, an id outside the vocabulary counts as unset

    def _text(self, name: str) -> str | None:
        i = self.ids[name]
        return None if i is None else self.tokens[i]

    def _add(self, vocab: dict, token: str, i: int) -> None:
        if vocab.setdefault(token, i) != i:
            raise ModelFormatError(f"{self.path}: {GGML}tokens lists {token!r} twice (ids {vocab[token]} and {i})")


def _merges_by_score(tokens: list[str], scores: list, vocab: dict) -> list[list[str]]:
    """BPE merges that replay SentencePiece BPE: every way to split a token into two tokens, best-scored
    result first (ties by token id, as transformers' converter orders them)."""
    ranked = []
    for i, token in enumerate(tokens):
        for at in range(1, len(token)):
            left, right = token[:at], token[at:]
            if left in vocab and right in vocab:
                ranked.append((-float(scores[i]), i, at, left, right))
    ranked.sort()
    return [[left, right] for *_, left, right in ranked]


def _bytes_to_unicode() -> dict[int, str]:
    # GPT-2's byte alphabet: printable bytes stand for themselves, the rest map to code points from 256 up.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    out, extra = {b: chr(b) for b in printable}, 0
    for b in range(256):
        if b not in out:
            out[b], extra = chr(256 + extra), extra + 1
    return out


_BYTE_TO_CHAR = _bytes_to_unicode()
