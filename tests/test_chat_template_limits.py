"""A chat template is code from a downloaded file: every runaway (time, size, recursion) stops with a
ChatTemplateError naming the file, Stop and close end a render at once, and a deeply nested tokenizer or
generation config is a clear error. Regression tests for issue 16 (4, and the JSON-nesting attacks)."""

from __future__ import annotations

import json
import threading
import time
from types import SimpleNamespace

import pytest
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models

from engine import chat_guard
from engine.chat import ChatTemplate, ChatTemplateError, TemplateCancelled, render_cancel
from engine.errors import ModelFormatError
from engine.sampling import SamplingParams
from engine.tokenizer import Tokenizer
from tests.helpers import write_tiny_tokenizer

WHERE = "/models/evil-model/tokenizer_config.json"
HELLO = [{"role": "user", "content": "hello"}]
ENDLESS = "{% for a in range(99999) %}{% for b in range(99999) %}{% endfor %}{% endfor %}"

RUNAWAYS = [
    pytest.param(ENDLESS, r"ran longer than 1 s", id="empty-nested-loops"),
    pytest.param("{% for a in range(99999) %}{% for b in range(99999) if b < 0 %}{% endfor %}{% endfor %}",
                 r"ran longer than 1 s", id="filtered-nested-loops"),
    pytest.param("{{ 'x' * 10**10 }}", r"repeating a value 10,000,000,000 times would be longer than", id="str-repeat"),
    pytest.param("{{ ['x'] * 10**9 }}", r"repeating a value", id="list-repeat"),
    pytest.param("{{ 2 ** 100000 }}", r"2 \*\* 100000 is a number of more than 4096 bits", id="power"),
    pytest.param("{% set ns = namespace(x=3) %}{% for i in range(40) %}{% set ns.x = ns.x * ns.x %}{% endfor %}",
                 r"a product of more than 4096 bits", id="squaring"),
    pytest.param("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}",
                 r"joining values with ~ would be longer than", id="doubling-tilde"),
    pytest.param("{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}",
                 r"joining two values with \+ would be longer than", id="doubling-plus"),
    pytest.param("{% set ns = namespace(a=['x' * 1000]) %}{% for i in range(40) %}{% set ns.a = [ns.a, ns.a] %}"
                 "{% endfor %}{{ ns.a }}", r"a printed value would be longer than", id="shared-list-doubling"),
    pytest.param("{{ 'x'|center(10**9) }}", r"the center filter would be longer than", id="center"),
    pytest.param("{{ 'x\\ny'|indent(10**9) }}", r"the indent filter would be longer than", id="indent"),
    pytest.param("{{ 'x'.ljust(10**9) }}", r"str\.ljust\(1000000000\) would be longer than", id="ljust"),
    pytest.param("{{ ('x' * 100000)|replace('', 'y' * 1000) }}", r"str\.replace would be longer than", id="replace"),
    pytest.param("{{ '%*d'|format(10**9, 1) }}", r"a '%' format width or precision over 10,000", id="printf-star"),
    pytest.param("{{ '%099999999d' % 1 }}", r"a '%' format width or precision over 10,000", id="printf-width"),
    pytest.param("{% set f = '{:>' ~ 'x'|length ~ '000000000}' %}{{ f.format(1) }}",
                 r"a format width or precision over 10,000", id="str-format-width"),
    pytest.param("{{ range(100000)|map('string')|map('center', 100000)|list|length }}",
                 r"built more than [\d,]+ characters of text and lists in all", id="map-amplify"),
    pytest.param("{{ messages|tojson(indent=10**8) }}", r"tojson indent over 64", id="tojson-indent"),
    pytest.param("{{ [1]|slice(10**9)|list|length }}", r"the slice filter's count would be longer", id="slice"),
    pytest.param("{{ [1]|batch(10**9, 0)|list|length }}", r"the batch filter's count would be longer", id="batch"),
    pytest.param("{{ range(3000)|map('list')|sum(start=[]) }}", r"the sum filter on values that are not numbers",
                 id="sum-lists"),
    pytest.param("{{ lipsum(10**7) }}", r"lipsum\(\) would be longer than", id="lipsum"),
    pytest.param("{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}", r"its output would be longer than",
                 id="output"),
    pytest.param("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}", r"nests deeper than 64 levels",
                 id="macro-recursion"),
    pytest.param("{% macro f() %}{{ caller() }}{% endmacro %}{% macro g() %}{% call f() %}{{ g() }}{% endcall %}"
                 "{% endmacro %}{{ g() }}", r"nests deeper than 64 levels", id="caller-recursion"),
    pytest.param("{% for x in [1] recursive %}{{ loop([1]) }}{% endfor %}", r"nests deeper than 64 levels",
                 id="recursive-loop"),
    pytest.param("{% set ns = namespace() %}{% set ns.me = ns %}{{ ns }}", r"a printed value would be longer",
                 id="namespace-cycle"),
]


@pytest.mark.parametrize("source, reason", RUNAWAYS)
@pytest.mark.slow
def test_a_runaway_template_stops_with_a_named_error(source, reason):
    t0 = time.monotonic()
    with pytest.raises(ChatTemplateError, match=rf"^{WHERE}: the chat template (was stopped|was refused while "
                                                rf"compiling): .*{reason}"):
        ChatTemplate(source, WHERE).render(HELLO, timeout_s=1.0)
    assert time.monotonic() - t0 < 5  # 1 s of budget, then out; nothing ran to its end


@pytest.mark.parametrize("source, reason", [
    ("{{ 1 // 0 }}", r"failed on these messages \(ZeroDivisionError"),
    ("{{ 10.0 ** 400 }}", r"failed on these messages \(OverflowError"),
    ("{{ messages[0].content + 1 }}", r"failed on these messages \(TypeError"),
    ("{{ raise_exception('Conversation roles must alternate') }}",
     r"refused these messages: Conversation roles must alternate"),
    ("{{ nothing() }}", r"refused these messages: 'nothing' is undefined"),
    ("{{ ''.__class__.__mro__ }}", r"refused these messages|failed on these messages"),
    ("{% for x in messages %}{{ x.__init__.__globals__ }}{% endfor %}", r"refused these messages|failed on"),
])
def test_every_failure_is_a_chat_template_error(source, reason):
    with pytest.raises(ChatTemplateError, match=rf"^{WHERE}: the chat template {reason}"):
        ChatTemplate(source, WHERE).render(HELLO)


@pytest.mark.parametrize("source, reason", [
    ("{{ " + "(" * 5000 + "1" + ")" * 5000 + " }}", r"cannot be compiled \(it nests too deeply\)"),
    ("{% if 1 %}" * 120 + "x" + "{% endif %}" * 120, r"cannot be compiled \("),
    ("{% for m in messages %}", r"does not parse \(line 1"),
    ("x" * (1024**2 + 1), r"is 1,048,577 characters long, more than the 1,048,576"),
])
def test_a_template_that_cannot_compile_names_its_file(source, reason):
    with pytest.raises(ChatTemplateError, match=rf"^{WHERE}: (the )?chat template {reason}"):
        ChatTemplate(source, WHERE)


def test_errors_are_model_format_and_value_errors():
    assert issubclass(ChatTemplateError, ModelFormatError) and issubclass(ChatTemplateError, ValueError)


def test_limits_do_not_change_what_a_real_template_renders():
    """A template that loops, recurses a little, formats and joins gives exactly what plain jinja2 gives."""
    source = ("{% macro show(v, d) %}{% if v is mapping %}{% for k in v|sort %}{{ k }}={{ show(v[k], d + 1) }};"
              "{% endfor %}{% else %}{{ v }}{% endif %}{% endmacro %}"
              "{% for m in messages %}<{{ m.role|upper }}>{{ m.content|trim ~ '|' + '%03d' % loop.index }}"
              "{{ show(m.get('meta', {}), 0) }}{{ '=' * 3 }}{% endfor %}{{ tools|tojson }}")
    messages = [{"role": "user", "content": " hi ", "meta": {"a": {"b": {"c": 1}}, "z": [1, 2]}},
                {"role": "assistant", "content": "yo"}]
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment()
    env.filters["tojson"] = json.dumps
    expected = env.from_string(source).render(messages=messages, tools=[{"name": "f"}])
    assert ChatTemplate(source, WHERE).render(messages, tools=[{"name": "f"}]) == expected


def test_input_sized_limits_let_a_long_chat_through():
    """Sizes scale with what the template is given: a 12 MB conversation renders."""
    long_chat = [{"role": "user" if i % 2 == 0 else "assistant", "content": "word " * 100_000} for i in range(24)]
    out = ChatTemplate("{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}", WHERE).render(long_chat)
    assert len(out) == 24 * 500_000 + sum(len(m["role"]) + 2 for m in long_chat)


# --- Stop -------------------------------------------------------------------------------------------------------

def _render_in_thread(template, **kwargs):
    box = {}

    def run():
        try:
            box["out"] = template.render(HELLO, **kwargs)
        except BaseException as e:  # noqa: B036 - handed to the test thread
            box["error"] = e
        box["t"] = time.monotonic()

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, box


def test_stop_ends_a_runaway_render_at_once():
    stop = threading.Event()
    thread, box = _render_in_thread(ChatTemplate(ENDLESS, WHERE), cancel=stop.is_set, timeout_s=60)
    time.sleep(0.3)
    assert thread.is_alive()  # it is running its loops
    t0 = time.monotonic()
    stop.set()
    thread.join(5)
    assert isinstance(box.get("error"), TemplateCancelled), box
    assert box["t"] - t0 < 0.5 and str(box["error"]) == f"{WHERE}: rendering the chat template was stopped"


def test_render_cancel_reaches_renders_deep_in_the_call_stack():
    """The app's worker does not pass a callback through Tokenizer and ChatSession: it wraps its work."""
    stop = threading.Event()
    template = ChatTemplate(ENDLESS, WHERE)
    box = {}

    def worker():
        with render_cancel(stop.is_set):
            try:
                template.render(HELLO, timeout_s=60)
            except TemplateCancelled as e:
                box["error"] = e

    thread = threading.Thread(target=worker, daemon=True)
    thread.start()
    time.sleep(0.2)
    stop.set()
    thread.join(5)
    assert isinstance(box.get("error"), TemplateCancelled)
    assert chat_guard.active() is None  # nothing left behind in this thread either


def _fake_model(template_source: str):
    vocab = {"[UNK]": 0, "hello": 1}
    tok = Tokenizer(HFTokenizer(models.WordLevel(vocab, unk_token="[UNK]")), [], "fake",
                    chat_templates={"default": ChatTemplate(template_source, WHERE)})
    return SimpleNamespace(tokenizer=tok, runtime=SimpleNamespace(max_context=4096), path="/models/evil-model",
                           default_sampling=SamplingParams())


@pytest.mark.slow
def test_the_app_worker_stops_and_closes_during_a_runaway_template(qtbot):
    """Before, Stop only reset the UI and closing blocked 30 s, then aborted."""
    from PySide6.QtCore import QObject, Signal

    from app.worker import WorkerThread
    from engine.cancel import CancelToken

    class Window(QObject):  # asks for replies the way app/window.py does: a queued signal
        request_reply = Signal(int, list, dict, object)

    worker_thread = WorkerThread()
    worker = worker_thread.worker
    worker.model = _fake_model(ENDLESS)
    window = Window()
    window.request_reply.connect(worker.reply)
    done, failed = [], []
    worker.reply_done.connect(lambda request, stats: done.append((request, stats)))
    worker.failed.connect(lambda *args: failed.append(args))
    try:
        token = CancelToken()
        window.request_reply.emit(7, HELLO, {}, token)
        time.sleep(0.5)  # the worker is inside the template's loops
        t0 = time.monotonic()
        token.cancel()
        qtbot.waitUntil(lambda: bool(done), timeout=3000)
        assert time.monotonic() - t0 < 1.0
        assert done == [(7, {"finish_reason": "stopped", "tokens": 0})] and failed == []

        window.request_reply.emit(8, HELLO, {}, CancelToken())
        time.sleep(0.5)
        t0 = time.monotonic()
        assert worker_thread.close(timeout_ms=5000)
        assert time.monotonic() - t0 < 1.5
    finally:
        worker_thread.close(timeout_ms=5000)


# --- configs nested too deeply ----------------------------------------------------------------------------------

DEEP = "[" * 100_000 + "]" * 100_000


def test_tokenizer_config_nested_100000_deep_is_a_clear_error(tmp_path):
    write_tiny_tokenizer(tmp_path, 259)
    (tmp_path / "tokenizer_config.json").write_text('{"chat_template": ' + DEEP + "}")
    with pytest.raises(ModelFormatError, match=r"tokenizer_config\.json: JSON nested \d+ levels deep"):
        Tokenizer.from_dir(tmp_path)


def test_generation_config_nested_100000_deep_is_a_clear_error(tmp_path):
    (tmp_path / "generation_config.json").write_text('{"temperature": ' + DEEP + "}")
    with pytest.raises(ModelFormatError, match=r"generation_config\.json: JSON nested \d+ levels deep"):
        SamplingParams.from_generation_config(tmp_path)


def test_messages_nested_too_deeply_are_refused():
    from engine.chat import prepare_messages

    deep: list = []
    for _ in range(100_000):
        deep = [deep]
    with pytest.raises(ValueError, match=r"message 0: its contents are nested too deeply"):
        prepare_messages([{"role": "user", "content": "x", "tool_calls": deep}])
