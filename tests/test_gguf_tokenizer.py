"""Tokenizers rebuilt from GGUF metadata (engine/formats/gguf_tokenizer.py), against real tokenizers.

- The demo SmolLM2 GGUF against transformers' own GGUF loader (encode, chat prompts) and SmolLM2's
  pre-tokenizer, where transformers' loader drops the digit split.
- Weightless GGUFs written here the way llama.cpp's convert_hf_to_gguf.py writes the tokenizer, from real
  tokenizer.json files: Qwen3 (pre "qwen2"), Llama 3 ("llama-bpe") and, for the SentencePiece path, a real
  32000-token SentencePiece BPE vocabulary (Llama 2 style) with Phi-3's added tokens and template (arch "phi3",
  tokenizer "llama", as Phi-3 GGUFs are). Each must encode exactly as the tokenizer.json it came from.
No GPU; transformers is the oracle only.
"""

from __future__ import annotations

import json
import re
import unicodedata
from pathlib import Path

import pytest
from gguf import GGUFWriter
from tokenizers import Tokenizer as HFTokenizer

from engine.errors import ModelFormatError
from engine.tokenizer import Tokenizer
from engine.tokenizer_loader import load_tokenizer
from tests.helpers import (
    BYTE,
    CONTROL,
    NORMAL,
    UNKNOWN,
    UNUSED,
    FetchError,
    byte_level_fields,
    demo_gguf,
    llama2_tokenizer_dir,
    llama3_tokenizer_dir,
    qwen3_tokenizer_dir,
)

TEXTS = [
    "Hello, world!",
    "héllo wörld — naïve café, Ångström",
    "Emoji: 🙂👍🏽🇺🇸 and ❤️ 👨‍👩‍👧 done",
    "def add(a, b):\n    return a + b\n\n\nprint(add(2, 40))",
    "Numbers: 3.14159, 1,000,000 and 2024-01-31; x=42 v2.0 123456789",
    "tabs\tand\nnewlines\r\n\n\nend",
    "trailing spaces   ",
    "   leading spaces",
    "multiple    internal     spaces and\u00a0nbsp\u2003em",
    "中文测试：你好，世界！日本語のテキスト 한국어 텍스트",
    "I'm sure they'll say it's fine, don't you think? WE'VE SEEN IT",
    '<html><body class="x">&amp; {"k": [1, 2]}</body></html>',
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 math ∑ x² ≤ ∞ ÷",
    " ",
    "",
]
# Whitespace before a number: SmolLM2's own tokenizer splits numbers (\p{N}) off first, transformers' GGUF
# loader does not, so the space before them is tokenized differently.
DIGIT_SPLITS = ["a  1", "x\n\n2", "  42  ", "a   12", "line\n\n  2. item", "col\t\t3", "a ½ cup"]


def fetch(get):
    try:
        return get()
    except FetchError as e:
        pytest.fail(f"could not fetch a tokenizer for this test: {e}")


def hf_chat_ids(hf, messages, **kwargs) -> list[int]:
    out = hf.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, **kwargs)
    return list(out["input_ids"] if hasattr(out, "keys") else out)  # transformers 5 returns a BatchEncoding


def write_gguf(path: Path, fields: dict, arch: str = "llama") -> Path:
    """A GGUF holding only key/value fields (no tensors)."""
    writer = GGUFWriter(str(path), arch)
    for key, value in fields.items():
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        else:
            writer.add_array(key, value)  # str -> STRING, int -> INT32, float -> FLOAT32 elements
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


# ---- SmolLM2 (the demo GGUF) --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def smollm_path():
    return demo_gguf()


@pytest.fixture(scope="module")
def smollm(smollm_path):
    return load_tokenizer(smollm_path)


@pytest.fixture(scope="module")
def hf_smollm(smollm_path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(smollm_path.parent, gguf_file=smollm_path.name)


@pytest.fixture(scope="module")
def smollm_reference(hf_smollm):
    """transformers' vocabulary and merges with SmolLM2's own pre-tokenizer (its tokenizer.json:
    Digits(individual_digits) then GPT-2's ByteLevel), which llama.cpp's "smollm" regexes reproduce."""
    data = json.loads(hf_smollm.backend_tokenizer.to_str())
    data["pre_tokenizer"] = {"type": "Sequence", "pretokenizers": [
        {"type": "Digits", "individual_digits": True},
        {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}]}
    return HFTokenizer.from_str(json.dumps(data))


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("text", TEXTS)
def test_smollm_encode_matches_transformers(smollm, hf_smollm, text):
    ids = smollm.encode(text)
    assert ids == hf_smollm.encode(text)
    assert smollm.decode(ids) == text


@pytest.mark.slow
@pytest.mark.model
def test_smollm_splits_digits_like_its_own_tokenizer(smollm, hf_smollm, smollm_reference):
    for text in TEXTS + DIGIT_SPLITS:
        assert smollm.encode(text) == smollm_reference.encode(text).ids, text
    # transformers' GGUF loader gives "a  1" as a, Ġ, Ġ, 1; SmolLM2 (and llama.cpp) give a, ĠĠ, 1.
    assert smollm.encode("a  1") == [81, 256, 33] and hf_smollm.encode("a  1") == [81, 216, 216, 33]


SMOLLM_CHATS = [
    pytest.param([{"role": "user", "content": "Hello!"}], id="default-system"),
    pytest.param([{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 12 + 30?"}],
                 id="system"),
    pytest.param([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                  {"role": "user", "content": "Tell me a joke."}], id="multi-turn-default-system"),
    pytest.param([{"role": "system", "content": "Answer in French."}, {"role": "user", "content": "Good morning"},
                  {"role": "assistant", "content": "Bonjour !"}, {"role": "user", "content": "And at night?"},
                  {"role": "assistant", "content": "Bonne nuit."}], id="ends-with-assistant"),
    pytest.param([{"role": "user", "content": "Écris `print('hi')` 🙂\n\n日本語で?"}], id="unicode-code"),
    pytest.param([{"role": "user", "content": "  spaced   out\t\ttabs \n"},
                  {"role": "assistant", "content": "```python\nx = [1, 2]\n```"},
                  {"role": "user", "content": ""}], id="whitespace-empty"),
]


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("messages", SMOLLM_CHATS)
def test_smollm_chat_prompt_matches_transformers(smollm, hf_smollm, messages):
    prompt = smollm.chat_prompt(messages)
    assert prompt.ids == hf_chat_ids(hf_smollm, messages)
    assert prompt.text == hf_smollm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt.generation_prompt == "<|im_start|>assistant\n"
    assert smollm.decode(prompt.ids, skip_special_tokens=False) == prompt.text


@pytest.mark.slow
def test_smollm_stop_ids(smollm, smollm_path):
    added = smollm.tok.get_added_tokens_decoder()
    assert smollm.tok.token_to_id("<|im_end|>") == 2 and 2 in smollm.eos_ids
    assert all(i in added and added[i].special for i in smollm.eos_ids)
    assert smollm.source == str(smollm_path)
    assert smollm.special_tokens == {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>"}


@pytest.mark.slow
def test_smollm_no_bos_added(smollm):
    # The file says add_bos_token = false; llama.cpp and transformers add nothing either.
    assert smollm.encode("Hi") == smollm.encode("Hi", add_special_tokens=False) == [26843]


@pytest.mark.slow
def test_smollm_typed_control_token_is_text(smollm):
    chat = [{"role": "user", "content": "stop <|im_end|> here"}]
    clean = [{"role": "user", "content": "stop x here"}]
    ids = smollm.chat_prompt(chat).ids
    assert ids.count(2) == smollm.chat_prompt(clean).ids.count(2)
    assert smollm.decode(ids, skip_special_tokens=False) == smollm.render_chat(chat)


@pytest.mark.slow
def test_smollm_stream_decoder_never_splits_a_character(smollm):
    text = "héllo 世界 🙂🙂 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 👨‍👩‍👧 日本語のテキスト"
    ids = smollm.encode(text)
    assert any("\ufffd" in smollm.decode([i]) for i in ids), "no token splits a character; the test is too easy"
    dec = smollm.decoder()
    deltas = [dec.step(i) for i in ids] + [dec.flush()]
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text


# ---- Qwen3 and Llama 3: byte-level BPE GGUFs written from their tokenizer.json ----------------------------

@pytest.fixture(scope="module")
def qwen3_dir():
    return fetch(qwen3_tokenizer_dir)


@pytest.fixture(scope="module")
def qwen3_gguf(qwen3_dir, tmp_path_factory):
    config = json.loads((qwen3_dir / "tokenizer_config.json").read_text())
    fields = byte_level_fields(qwen3_dir, "qwen2", vocab_size=151936)  # Qwen3-0.6B's embedding rows
    fields.update({"tokenizer.ggml.bos_token_id": 151643, "tokenizer.ggml.eos_token_id": 151645,
                   "tokenizer.ggml.padding_token_id": 151643, "tokenizer.ggml.add_bos_token": False,
                   "tokenizer.chat_template": config["chat_template"]})
    return load_tokenizer(write_gguf(tmp_path_factory.mktemp("qwen3") / "qwen3.gguf", fields, "qwen3"))


@pytest.fixture(scope="module")
def qwen3_folder(qwen3_dir):
    return Tokenizer.from_dir(qwen3_dir)


@pytest.mark.slow
@pytest.mark.parametrize("text", [*TEXTS, *DIGIT_SPLITS, "cafe\u0301 n\u0303 (decomposed)", "<think>\nhm</think>"])
def test_qwen3_gguf_encodes_like_tokenizer_json(qwen3_gguf, qwen3_folder, text):
    assert qwen3_gguf.encode(text) == qwen3_folder.encode(text)
    assert qwen3_gguf.decode(qwen3_gguf.encode(text)) == unicodedata.normalize("NFC", text)


QWEN3_CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "2+2? 🙂"}],
    [{"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "<think>\nThe user greets me.\n</think>\n\nHello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 中文."}],
]


@pytest.mark.slow
@pytest.mark.parametrize("thinking", [None, True, False])
@pytest.mark.parametrize("messages", QWEN3_CHATS)
def test_qwen3_gguf_chat_prompt_matches_folder(qwen3_gguf, qwen3_folder, messages, thinking):
    expected = qwen3_folder.chat_prompt(messages, thinking=thinking)
    prompt = qwen3_gguf.chat_prompt(messages, thinking=thinking)
    assert (prompt.ids, prompt.text, prompt.thinking) == (expected.ids, expected.text, expected.thinking)


@pytest.mark.slow
def test_qwen3_gguf_tokens(qwen3_gguf):
    added = qwen3_gguf.tok.get_added_tokens_decoder()
    assert qwen3_gguf.eos_ids == [151645] and qwen3_gguf.vocab_size == 151936
    assert added[151667].content == "<think>" and not added[151667].special  # USER_DEFINED
    assert added[151644].content == "<|im_start|>" and added[151644].special  # CONTROL
    assert qwen3_gguf.tok.id_to_token(151700) == "[PAD151700]"


@pytest.mark.slow
def test_llama3_gguf_encodes_like_tokenizer_json(tmp_path):
    folder = fetch(llama3_tokenizer_dir)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    fields = byte_level_fields(folder, "llama-bpe")
    fields.update({"tokenizer.ggml.bos_token_id": 128000, "tokenizer.ggml.eos_token_id": 128001,
                   "tokenizer.ggml.eot_token_id": 128009, "tokenizer.chat_template": config["chat_template"]})
    ours = load_tokenizer(write_gguf(tmp_path / "llama3.gguf", fields))
    original = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS + DIGIT_SPLITS:
        ids = original.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special_tokens=False) == ids, text
        assert ours.encode(text) == [128000, *ids]  # no add_bos_token field: llama.cpp's llama3 default adds it
        assert ours.decode(ids) == text
    assert ours.eos_ids == [128001, 128009]
    chat = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi 🙂"}]
    expected = Tokenizer.from_parts(original.to_str(), config["chat_template"], bos="<|begin_of_text|>",
                                    eos="<|end_of_text|>").chat_prompt(chat).ids
    assert ours.chat_prompt(chat).ids == expected and expected[:2] == [128000, 128006]


# ---- SentencePiece ("llama"): a Llama 2 style vocabulary as Phi-3 ships one ------------------------------

# Phi-3-mini's added tokens (ids 32000-32010) and chat template; Phi-3 pads its 32000-token SentencePiece
# vocabulary (Llama 2's) with these to 32064.
PHI3_ADDED = ["<|endoftext|>", "<|assistant|>", "<|placeholder1|>", "<|placeholder2|>", "<|placeholder3|>",
              "<|placeholder4|>", "<|system|>", "<|end|>", "<|placeholder5|>", "<|placeholder6|>", "<|user|>"]
PHI3_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'system' %}{{'<|system|>\n' + message['content'] + "
    "'<|end|>\n'}}{% elif message['role'] == 'user' %}{{'<|user|>\n' + message['content'] + '<|end|>\n'}}"
    "{% elif message['role'] == 'assistant' %}{{'<|assistant|>\n' + message['content'] + '<|end|>\n'}}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\n' }}{% else %}{{ eos_token }}{% endif %}"
)


def sentencepiece_fields(folder: Path) -> dict:
    """The tokenizer.json's tokens with SentencePiece-style scores and types. Its merges were made from the
    scores (best first), so a token's score is minus the rank of the first merge that makes it."""
    data = json.loads((folder / "tokenizer.json").read_text())
    vocab = data["model"]["vocab"]
    first_rank = {}
    for rank, merge in enumerate(data["model"]["merges"]):
        first_rank.setdefault(merge.replace(" ", "", 1), rank)
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    scores = [-float(first_rank[t]) if t in first_rank else -1e6 - i for i, t in enumerate(tokens)]
    special = {a["content"]: a for a in data["added_tokens"]}
    types = [UNKNOWN if t == "<unk>" else CONTROL if t in special else BYTE if t.startswith("<0x") and len(t) == 6
             else NORMAL for t in tokens]
    n = len(tokens)
    tokens += PHI3_ADDED + [f"[PAD{i}]" for i in range(n + len(PHI3_ADDED), 32064)]
    scores += [0.0] * (32064 - n)
    types += [CONTROL] * len(PHI3_ADDED) + [UNUSED] * (32064 - n - len(PHI3_ADDED))
    return {"tokenizer.ggml.model": "llama", "tokenizer.ggml.pre": "default", "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.scores": scores, "tokenizer.ggml.token_type": types,
            "tokenizer.ggml.bos_token_id": 1, "tokenizer.ggml.eos_token_id": 32000,
            "tokenizer.ggml.unknown_token_id": 0, "tokenizer.ggml.padding_token_id": 32000,
            "tokenizer.ggml.eot_token_id": 32007, "tokenizer.ggml.add_bos_token": True,
            "tokenizer.ggml.add_eos_token": False, "tokenizer.ggml.add_space_prefix": True,
            "tokenizer.chat_template": PHI3_TEMPLATE}


PHI3_META = {"phi3.context_length": 4096, "phi3.embedding_length": 64, "phi3.feed_forward_length": 96,
             "phi3.block_count": 1, "phi3.attention.head_count": 4, "phi3.attention.head_count_kv": 4,
             "phi3.rope.dimension_count": 16}


@pytest.fixture(scope="module")
def llama2_dir():
    return fetch(llama2_tokenizer_dir)


@pytest.fixture(scope="module")
def phi3_path(llama2_dir, tmp_path_factory):
    path = tmp_path_factory.mktemp("phi3") / "phi3.gguf"
    return write_gguf(path, {**PHI3_META, **sentencepiece_fields(llama2_dir)}, "phi3")


@pytest.fixture(scope="module")
def phi3(phi3_path):
    return load_tokenizer(phi3_path)


SPM_TEXTS = [*TEXTS, *DIGIT_SPLITS, "  two leading", "\n\nnewlines first", "<s>hi</s> again", "x" * 300,
             "Ünïcödé ☃ 🦙 \u200b zero width"]


@pytest.fixture(scope="module")
def spm_original(llama2_dir):
    return HFTokenizer.from_file(str(llama2_dir / "tokenizer.json"))


@pytest.mark.slow
@pytest.mark.parametrize("text", SPM_TEXTS)
def test_sentencepiece_gguf_encodes_like_tokenizer_json(phi3, spm_original, text):
    original = spm_original
    ids = phi3.encode(text)
    assert ids == original.encode(text).ids and ids[0] == 1  # add_bos_token
    assert phi3.decode(ids) == original.decode(ids)
    if "<s>" not in text:
        assert phi3.decode(ids) == text


@pytest.mark.slow
def test_sentencepiece_gguf_tokens(phi3):
    assert phi3.eos_ids == [32000, 32007] and phi3.vocab_size == 32064
    assert phi3.tok.model.unk_token == "<unk>"
    # Characters missing from the vocabulary fall back to <0xNN> byte tokens.
    assert [phi3.tok.id_to_token(i) for i in phi3.encode("🦙", add_special_tokens=False)][1:] == \
        ["<0xF0>", "<0x9F>", "<0xA6>", "<0x99>"]


PHI3_CHATS = [
    [{"role": "user", "content": "Hello!"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "  2+2? 🙂"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
     {"role": "user", "content": "Tell me a joke about 中文.\n"}],
]


@pytest.fixture(scope="module")
def hf_phi3(phi3_path):
    # transformers builds Phi-3's GGUF tokenizer the same way (Prepend normalizer), so its ids are the oracle.
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(phi3_path.parent, gguf_file=phi3_path.name)


@pytest.mark.slow
@pytest.mark.model
@pytest.mark.parametrize("messages", PHI3_CHATS)
def test_sentencepiece_gguf_chat_prompt_matches_transformers(phi3, hf_phi3, messages):
    hf = hf_phi3
    prompt = phi3.chat_prompt(messages)
    assert prompt.ids == hf_chat_ids(hf, messages)
    assert prompt.text == hf.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


# ---- errors --------------------------------------------------------------------------------------------

def small_fields(**changes) -> dict:
    fields = {"tokenizer.ggml.model": "gpt2", "tokenizer.ggml.pre": "gpt-2", "tokenizer.ggml.tokens": ["a", "b", "ab"],
              "tokenizer.ggml.merges": ["a b"]}
    fields.update(changes)
    return {k: v for k, v in fields.items() if v is not None}


@pytest.mark.parametrize("changes,field", [
    ({"tokenizer.ggml.model": "bert"}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.pre": "klingon"}, "tokenizer.ggml.pre"),
    ({"tokenizer.ggml.tokens": None}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.model": None}, "tokenizer.ggml.model"),
    ({"tokenizer.ggml.merges": None}, "tokenizer.ggml.merges"),
    ({"tokenizer.ggml.model": "llama"}, "tokenizer.ggml.scores"),
    ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, "tokenizer.ggml.tokens"),
    ({"tokenizer.ggml.add_bos_token": True}, "tokenizer.ggml.bos_token_id"),
])
def test_errors_name_file_and_field(tmp_path, changes, field):
    path = write_gguf(tmp_path / "bad.gguf", small_fields(**changes))
    with pytest.raises(ModelFormatError, match=r"bad\.gguf.*" + re.escape(field)):
        load_tokenizer(path)


def test_small_gguf_tokenizer(tmp_path):
    # The minimal file the error cases start from is itself valid.
    tok = load_tokenizer(write_gguf(tmp_path / "ok.gguf", small_fields()))
    assert tok.encode("abba") == [2, 1, 0] and tok.eos_ids == [] and tok.chat_templates == {}
    with pytest.raises(ModelFormatError, match="missing.gguf"):
        load_tokenizer(tmp_path / "missing.gguf")
