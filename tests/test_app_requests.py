"""Requests, Stop and close in the real window and its real worker thread, the engine replaced by a scripted chat
session (tests/test_app.py drives the demo model): each reply must land, in the view and in the store, under the
question it answers, whatever the user presses while it streams."""

import time

import pytest

from engine.cancel import Cancelled
from engine.generate import GenerationResponse, PrefillProgress
from engine.session import ChatEvent
from tests.helpers import open_window, send

pytestmark = pytest.mark.app
WORDS = 12
TOTAL = 480  # prompt tokens the scripted prefill reads


def answer_to(question: str) -> str:
    return " ".join(f"{question}#{i}" for i in range(WORDS))


class Script:
    """What the scripted engine does per request, and what it was asked."""

    def __init__(self):
        self.asked: list[str] = []  # the last user message of each request that started
        self.prefill_s = 0.0  # spread over 8 progress steps, cancel checked between them
        self.blocking_s = 0.0  # a first step that ignores cancel (GPU work already queued)
        self.word_s = 0.03


def scripted_session(script: Script):
    class ScriptedSession:
        def __init__(self, model, settings, messages, cancel=None, progress=False):
            self.messages, self.cancel, self.progress = messages, cancel, progress

        def regenerate(self):
            question = self.messages[-1]["content"]
            script.asked.append(question)
            return self._stream(question)

        def _stream(self, question):
            time.sleep(script.blocking_s)
            started = time.perf_counter()
            for step in range(8):
                if self.cancel.wait(script.prefill_s / 8):
                    raise Cancelled
                done = (step + 1) * TOTAL // 8
                yield ChatEvent("", "", None, progress=PrefillProgress(done, TOTAL, time.perf_counter() - started, 0))
            words = answer_to(question).split(" ")
            for i, word in enumerate(words):
                if self.cancel.wait(script.word_s):
                    raise Cancelled
                last = i == len(words) - 1
                r = GenerationResponse(("" if i == 0 else " ") + word, i, TOTAL, i + 1, 0.5, 100.0, 20.0,
                                       TOTAL + i + 1, 2048, 0, "stop" if last else None)
                yield ChatEvent("", r.text, r)

    return ScriptedSession


@pytest.fixture
def script(monkeypatch):
    s = Script()
    monkeypatch.setattr("engine.session.ChatSession", scripted_session(s))
    return s


@pytest.fixture
def window(qtbot, tmp_path, monkeypatch, script):
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTVM_MODELS", str(tmp_path / "models"))
    w = open_window(qtbot, tmp_path, auto_setup=False)
    w.engine.worker.model = scripted_model()  # the scripted session never looks at it; the worker asks its stream
    w.facts = {"key": None, "title": "Scripted", "name": "scripted", "sampling": {}}
    yield w
    w.close()
    assert getattr(w, "last_error", None) is None  # a reply that lands is never also an error dialog


class ScriptedStream:
    """The expert stream's counters the worker reports after a reply (engine/blocks/expert_cache.py ExpertStream)."""

    hits, misses, uploaded_bytes, upload_seconds = 30, 10, 2.5e9, 0.5

    def hit_rate(self):
        return self.hits / (self.hits + self.misses)


def scripted_model(streaming=None):
    from types import SimpleNamespace

    return SimpleNamespace(runtime=SimpleNamespace(plan=SimpleNamespace(streaming=streaming)))


def idle(qtbot, w, timeout=10_000):
    qtbot.waitUntil(lambda: w.request == 0, timeout=timeout)


def stored(w, conv=None):
    return [(m["role"], m["content"]) for m in w.store.messages(conv or w.conv_id)]


def shown(w):
    return [(m.role, m.answer) for m in w.chat.messages]


def first_text(qtbot, w):
    qtbot.waitUntil(lambda: bool(w._reply_text[1]), timeout=10_000)


def settle(qtbot, w, ms=400):
    """Long enough for a stopped request's late tokens to arrive, if anything let them through."""
    qtbot.wait(ms)


def test_stop_then_ask_puts_each_reply_under_its_question(qtbot, window, script):
    send(qtbot, window, "A")
    first_text(qtbot, window)
    window.send.click()  # Stop
    partial = window.chat.messages[-1].answer
    assert partial and answer_to("A").startswith(partial) and partial != answer_to("A")
    send(qtbot, window, "B")
    idle(qtbot, window)
    settle(qtbot, window)
    expected = [("user", "A"), ("assistant", partial), ("user", "B"), ("assistant", answer_to("B"))]
    assert stored(window) == expected and shown(window) == expected
    assert window.chat.messages[1].status.text() == "stopped"


def test_stop_then_regenerate(qtbot, window, script):
    send(qtbot, window, "A")
    first_text(qtbot, window)
    window.stop()
    window.chat.messages[-1].action.click()  # Regenerate
    idle(qtbot, window)
    settle(qtbot, window)
    assert stored(window) == shown(window) == [("user", "A"), ("assistant", answer_to("A"))]
    assert script.asked == ["A", "A"]


def test_stop_then_edit(qtbot, window, script):
    send(qtbot, window, "A")
    first_text(qtbot, window)
    window.stop()
    user = window.chat.messages[0]
    user.action.click()  # Edit
    user._editor.setPlainText("C")
    user._save_edit()
    idle(qtbot, window)
    settle(qtbot, window)
    assert stored(window) == shown(window) == [("user", "C"), ("assistant", answer_to("C"))]


def test_rapid_double_send_keeps_the_second_message_in_the_box(qtbot, window, script):
    from PySide6.QtCore import Qt

    send(qtbot, window, "A")
    window.input.setPlainText("B")
    qtbot.keyClick(window.input, Qt.Key.Key_Return)  # at once, while A's reply streams: Enter does not stop it
    assert window.request != 0 and window.input.toPlainText() == "B"
    idle(qtbot, window)
    assert stored(window) == [("user", "A"), ("assistant", answer_to("A"))]
    qtbot.keyClick(window.input, Qt.Key.Key_Return)
    idle(qtbot, window)
    expected = [("user", "A"), ("assistant", answer_to("A")), ("user", "B"), ("assistant", answer_to("B"))]
    assert stored(window) == shown(window) == expected


@pytest.mark.slow
def test_switching_chat_while_a_reply_streams_stops_it_under_its_own_question(qtbot, window, script):
    send(qtbot, window, "first chat")
    idle(qtbot, window)
    first = window.conv_id
    window.new_chat.click()
    send(qtbot, window, "second chat")
    first_text(qtbot, window)
    second = window.conv_id
    row = next(i for i in range(window.conversations.count())
               if window.conversations.item(i).text().startswith("first"))
    window.conversations.setCurrentRow(row)  # switch while the reply streams
    assert window.conv_id == first and window.request == 0
    settle(qtbot, window)
    assert shown(window) == stored(window, first) == [("user", "first chat"), ("assistant", answer_to("first chat"))]
    partial = stored(window, second)
    assert partial[0] == ("user", "second chat") and partial[1][0] == "assistant"
    assert answer_to("second chat").startswith(partial[1][1]) and partial[1][1] != answer_to("second chat")


@pytest.mark.slow
def test_stop_reaches_a_request_still_queued_and_never_a_later_one(qtbot, window, script):
    """Before, every request id was 1 and the worker cleared the stop flag when the next request began."""
    script.blocking_s = 0.8  # A sits in work that cannot be interrupted; B queues behind it
    send(qtbot, window, "A")
    qtbot.waitUntil(lambda: script.asked == ["A"], timeout=5000)  # A runs
    window.stop()
    send(qtbot, window, "B")
    window.stop()  # B is still queued
    script.blocking_s = 0.0
    send(qtbot, window, "C")
    idle(qtbot, window)
    settle(qtbot, window)
    assert script.asked == ["A", "C"]  # B never started
    expected = [("user", "A"), ("user", "B"), ("user", "C"), ("assistant", answer_to("C"))]
    assert stored(window) == shown(window) == expected
    ids = []
    window.request_reply.connect(lambda request, *_: ids.append(request))
    send(qtbot, window, "D")
    idle(qtbot, window)
    assert ids == [4]  # ids only grow: A=1, B=2, C=3


@pytest.mark.slow
def test_a_reply_stopped_before_any_text_stores_nothing_and_offers_regenerate(qtbot, window, script):
    from PySide6.QtCore import Qt

    script.prefill_s = 3.0
    send(qtbot, window, "A")
    qtbot.waitUntil(lambda: "Reading your message" in window.chat.messages[-1].status.text(), timeout=5000)
    status = window.chat.messages[-1].status.text()
    assert f"/{TOTAL} tokens" in status and "tok/s" in status
    assert window.progress_box.isVisible() and window.progress_label.text() == status  # with a bar and Cancel
    qtbot.keyClick(window, Qt.Key.Key_Escape)  # Esc stops the prefill
    assert window.request == 0 and not window.progress_box.isVisible()
    settle(qtbot, window)
    assert stored(window) == [("user", "A")]  # no empty assistant row, no null stats
    slot = window.chat.messages[-1]
    assert slot.role == "assistant" and slot.answer == "" and "Stopped before answering" in slot.status.text()
    assert slot.action.isVisible() and slot.action.text() == "Regenerate"
    window.show_conversation(window.conv_id)  # reopened later: the question is shown unanswered
    assert "Not answered" in window.chat.messages[-1].status.text()
    script.prefill_s = 0.0
    window.chat.messages[-1].action.click()
    idle(qtbot, window)
    assert stored(window) == shown(window) == [("user", "A"), ("assistant", answer_to("A"))]


def test_close_while_a_reply_streams_saves_it_and_returns_at_once(qtbot, window, script):
    script.word_s = 0.2
    send(qtbot, window, "A")
    first_text(qtbot, window)
    store = window.store
    conv = window.conv_id
    t0 = time.monotonic()
    window.close()
    assert time.monotonic() - t0 < 2.0
    assert not window.engine.thread.isRunning()  # the worker saw the cancel: nothing left behind
    rows = [(m["role"], m["content"]) for m in store.messages(conv)]
    assert rows[0] == ("user", "A") and rows[1][0] == "assistant" and answer_to("A").startswith(rows[1][1])


def test_ctrl_q_closes_the_window(qtbot, window):
    from PySide6.QtCore import Qt

    assert window.isVisible()
    qtbot.keyClick(window, Qt.Key.Key_Q, Qt.KeyboardModifier.ControlModifier)
    qtbot.waitUntil(lambda: not window.isVisible(), timeout=3000)



def test_status_line_shows_the_experts_streamed_then_the_hit_rate(qtbot, window, script):
    """After a load, the share of experts on the GPU (the worker's facts, as the CLI's stderr line); after each
    reply, the expert cache's hit rate (the worker's stats of the real stream's counters)."""
    line = "experts streamed from RAM: 4 of 8 routed experts a layer on the GPU (50% resident)"
    window.on_loaded({"path": "/x", "name": "scripted", "model_type": "qwen3_5_moe", "context": 512,
                      "load_seconds": 2.0, "thinking": False, "chat": True, "sampling": {}, "adapter": "[0] test",
                      "int8_decode": True, "experts": line})
    assert window.status.text().endswith(f"[0] test · {line}")
    window.engine.worker.model = scripted_model(ScriptedStream())
    send(qtbot, window, "A")
    idle(qtbot, window)
    assert window.status.text().endswith("· expert cache hit rate 75.0% (30 hits, 10 misses; 2.50 GB uploaded, "
                                         "5.0 GB/s)")
    window.engine.worker.model = scripted_model()  # every expert resident: nothing about experts
    send(qtbot, window, "B")
    idle(qtbot, window)
    assert "expert" not in window.status.text() and f"{WORDS} tokens" in window.status.text()
