"""Fuzzing chat templates and tokenizer configs (hypothesis, derandomized so CI runs the same cases each time).

Property: whatever the template or tokenizer_config.json holds, rendering ends within its time limit with either
text no longer than the output limit or a ChatTemplateError / ModelFormatError naming the file: never another
exception, a hang or unbounded memory. The `slow` variants run ten times the examples with fresh randomness.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import chat_guard
from engine.chat import ChatTemplate, ChatTemplateError
from engine.errors import ModelFormatError
from engine.tokenizer import Tokenizer
from tests.helpers import llama2_tokenizer_dir, llama3_tokenizer_dir, qwen3_tokenizer_dir, write_tiny_tokenizer

WHERE = "/models/fuzzed/tokenizer_config.json"
TIMEOUT_S = 0.3
TOKENIZERS = Path(__file__).resolve().parents[1] / ".cache" / "tokenizers"
MESSAGES = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi <|im_end|> there"},
            {"role": "assistant", "content": "<think>x</think>Hello", "reasoning_content": "x"},
            {"role": "user", "content": "again", "tool_calls": [{"function": {"name": "f", "arguments": {"a": 1}}}]}]
QUICK = settings(max_examples=100, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.too_slow])
LONG = settings(max_examples=1500, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])

# --- a grammar of template pieces, hostile and ordinary --------------------------------------------------------

numbers = st.sampled_from(["0", "1", "3", "-1", "99999", "100000", "10**9", "2**62", "10**10", "0.5", "1e308"])
strings = st.sampled_from(["''", "'x'", "'ab' * 3", "'%*d'", "'{:>99999999}'", "'\\n'", "'<|im_end|>'",
                           "'%(a)s'", "'{0}{1}'"])
atoms = st.one_of(numbers, strings, st.sampled_from([
    "messages", "messages[0]", "messages[-1].content", "m", "ns.s", "ns", "loop.index", "range(99999)",
    "[1, 2, 3]", "{'a': 1}", "none", "true", "undefined_name", "''.__class__", "m.__init__", "lipsum(3)",
    "dict(a=1)", "namespace(a=1)", "messages|length", "tools", "add_generation_prompt"]))
operators = st.sampled_from(["+", "*", "**", "~", "%", "//", "-", " in ", " == ", " and ", " or "])
filters = st.sampled_from([
    "upper", "trim", "length", "list", "string", "tojson", "tojson(indent=99999)", "center(99999999)",
    "indent(99999999)", "format(99999999, 1)", "replace('', 'yyyy')", "join(', ')", "batch(99999999)",
    "slice(99999999)", "sum", "sum(start=[])", "map('string')", "map('center', 100000)", "first", "last",
    "reverse", "sort", "unique", "default('d')", "int", "float", "wordwrap(1)", "truncate(3)", "items",
    "dictsort", "selectattr('role')", "groupby('role')", "attr('__class__')", "pprint", "urlize", "striptags"])


@st.composite
def expressions(draw, depth=0):
    left = draw(atoms)
    if depth < 3 and draw(st.booleans()):
        left = f"({left} {draw(operators)} {draw(expressions(depth + 1))})"
    for _ in range(draw(st.integers(0, 2))):
        left = f"{left}|{draw(filters)}"
    return left


@st.composite
def statements(draw, depth=0):
    kind = draw(st.sampled_from(["out", "out", "for", "if", "set", "nsset", "macro", "call", "raise", "text"]))
    body = "".join(draw(st.lists(statements(depth + 1), max_size=2))) if depth < 3 else ""
    expr = draw(expressions())
    if kind == "out":
        return f"{{{{ {expr} }}}}"
    if kind == "for":
        recursive = draw(st.booleans())
        inner = "{{ loop(m) }}" if recursive else ""
        return (f"{{% for m in {draw(atoms)} {'recursive' if recursive else ''} %}}{body}{inner}{{% endfor %}}")
    if kind == "if":
        return f"{{% if {expr} %}}{body}{{% else %}}{{{{ {draw(atoms)} }}}}{{% endif %}}"
    if kind == "set":
        return f"{{% set x = {expr} %}}{body}"
    if kind == "nsset":
        return f"{{% set ns.s = ns.s ~ ns.s ~ {draw(atoms)} %}}{body}"
    if kind == "macro":
        return f"{{% macro f(n) %}}{body}{{{{ f(n + 1) }}}}{{% endmacro %}}{{{{ f(0) }}}}"
    if kind == "call":
        return "{% macro g() %}{{ caller() }}{% endmacro %}{% call g() %}" + body + "{% endcall %}"
    if kind == "raise":
        return f"{{{{ raise_exception({draw(strings)}) }}}}"
    return draw(st.text(max_size=20))


@st.composite
def templates(draw):
    return "{% set ns = namespace(s='x') %}" + "".join(draw(st.lists(statements(), min_size=1, max_size=4)))


def check_render(source: str) -> None:
    t0 = time.monotonic()
    try:
        template = ChatTemplate(source, WHERE)
    except ChatTemplateError as e:
        assert str(e).startswith(f"{WHERE}: "), e
        return
    try:
        out = template.render(MESSAGES, tools=[{"name": "f"}], timeout_s=TIMEOUT_S, bos_token="<s>")
    except ChatTemplateError as e:
        assert str(e).startswith(f"{WHERE}: the chat template "), e
    else:
        assert isinstance(out, str) and len(out) <= chat_guard.BASE_VALUE_CHARS + chat_guard.INPUT_FACTOR * 10_000
    assert time.monotonic() - t0 < TIMEOUT_S + 2.0  # the limit, plus one bounded check that was under way
    assert chat_guard.active() is None


@QUICK
@given(templates())
def test_fuzzed_templates_end_in_text_or_a_named_error(source):
    check_render(source)


@pytest.mark.slow
@LONG
@given(templates())
def test_fuzzed_templates_long(source):
    check_render(source)


# --- mutations of real templates -------------------------------------------------------------------------------

# Whole constructs, inserted where a tag ends, so most mutants still parse and run into the limits.
RUNAWAYS = ["{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}",
            "{{ 'x' * 10**9 }}", "{% macro r() %}{{ r() }}{% endmacro %}{{ r() }}", "{{ messages * 10**8 }}",
            "{{ 2 ** 99999 }}", "{{ '%099999999d' % 1 }}", "{{ messages|tojson(indent=10**6) }}",
            "{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}", "{{ raise_exception('no') }}",
            "{% set ns.x = ns %}{{ ns }}", "{{ lipsum(10**6) }}", "{{ range(99999)|map('center', 99999)|list }}",
            "{% for m in messages recursive %}{{ loop(messages) }}{% endfor %}", "{{ messages[0].content * 9**9 }}"]
BROKEN = ["{%", "}}", "{{ ", "{% endif %}", "{% if true %}", "(" * 50, "|tojson", "{% endfor %}"]


def real_templates() -> list[str]:
    found = []
    for fetch in (qwen3_tokenizer_dir, llama2_tokenizer_dir, llama3_tokenizer_dir):  # fetched once (skips offline)
        fetch()
    for config in sorted(TOKENIZERS.glob("*/tokenizer_config.json")):
        value = json.loads(config.read_text()).get("chat_template")
        if isinstance(value, str):
            found.append(value)
    assert found, f"no real chat templates under {TOKENIZERS}"
    return found


def mutate(source: str, rng: random.Random) -> str:
    """Three kinds: a runaway construct where a tag ends (most), a fragment that breaks the syntax, or a span
    cut or repeated anywhere."""
    source = "{% set ns = namespace(s='x') %}" + source
    for _ in range(rng.randint(1, 3)):
        op = rng.random()
        if op < 0.6:
            ends = [i + 2 for i in range(len(source) - 1) if source[i:i + 2] in ("%}", "}}")]
            at = rng.choice(ends)
            source = source[:at] + rng.choice(RUNAWAYS) + source[at:]
        elif op < 0.75:
            at = rng.randrange(len(source) + 1)
            source = source[:at] + rng.choice(BROKEN) + source[at:]
        else:
            at = rng.randrange(len(source) + 1)
            span = source[at:at + rng.randint(1, 200)]
            source = source[:at] + span * rng.randint(0, 6) + source[at + len(span):]
    return source


@pytest.mark.parametrize("seed", range(60))
def test_mutated_real_templates_end_in_text_or_a_named_error(seed):
    rng = random.Random(seed)
    for source in real_templates():
        check_render(mutate(source, rng))


# --- tokenizer_config.json -------------------------------------------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats(allow_nan=False) | st.text(max_size=30),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20)
config_keys = st.sampled_from(["chat_template", "bos_token", "eos_token", "pad_token", "additional_special_tokens",
                               "extra_special_tokens", "chat_control_tokens", "added_tokens_decoder",
                               "model_max_length", "eos_token_id"])
template_values = st.one_of(
    templates(), json_values,
    st.lists(st.fixed_dictionaries({"name": json_values, "template": st.one_of(templates(), json_values)}),
             max_size=3))


@st.composite
def tokenizer_configs(draw):
    config = draw(st.dictionaries(config_keys, json_values, max_size=6))
    config["chat_template"] = draw(template_values)
    return config


_TINY: dict[str, bytes] = {}


def tiny_tokenizer_files(tmp: Path) -> None:
    if not _TINY:
        write_tiny_tokenizer(tmp, 259)
        _TINY.update({p.name: p.read_bytes() for p in tmp.iterdir()})
    for name, data in _TINY.items():
        (tmp / name).write_bytes(data)


def check_config(folder: Path, config) -> None:
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    try:
        tok = Tokenizer.from_dir(folder)
    except ModelFormatError as e:
        assert str(folder) in str(e), e
        return
    for name in list(tok.chat_templates) or [None]:
        try:
            tok.chat_prompt(MESSAGES[:2], template=name)
        except (ModelFormatError, ValueError) as e:  # ChatTemplateError is both; no template is a ModelFormatError
            assert str(folder) in str(e) or "chat template named" in str(e), e


@pytest.mark.parametrize("entries", [
    [{"name": True, "template": "a"}, {"name": None, "template": "b"}],  # the long fuzz pass found these names
    [{"name": "", "template": "a"}],
    [{"name": "tool_use", "template": 3}],
    ["{{ messages }}"],
])
def test_named_templates_need_text_names_and_bodies(tmp_path, entries):
    tiny_tokenizer_files(tmp_path)
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": entries}))
    with pytest.raises(ModelFormatError, match="chat_template list entries need a 'name' and a 'template'") as e:
        Tokenizer.from_dir(tmp_path)
    assert str(tmp_path / "tokenizer_config.json") in str(e.value)


@QUICK
@given(config=tokenizer_configs())
def test_fuzzed_tokenizer_configs_load_or_fail_clearly(tmp_path_factory, config):
    folder = tmp_path_factory.mktemp("tok")
    tiny_tokenizer_files(folder)
    check_config(folder, config)


@pytest.mark.slow
@LONG
@given(config=tokenizer_configs())
def test_fuzzed_tokenizer_configs_long(tmp_path_factory, config):
    folder = tmp_path_factory.mktemp("tok")
    tiny_tokenizer_files(folder)
    check_config(folder, config)
