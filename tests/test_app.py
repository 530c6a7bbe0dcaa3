"""The desktop app driven like a person would (pytest-qt, offscreen Qt, lavapipe, the real demo model)."""

import os
import subprocess
import sys
import time

import pytest
from PySide6.QtWidgets import QAbstractButton, QAbstractSpinBox, QComboBox, QLineEdit, QListWidget, QPlainTextEdit

from app.prefs import AppPrefs
from engine import demo
from engine.sampling import SamplingParams
from engine.session import ChatSettings
from tests.helpers import (
    LOAD_MS,
    REPLY_MS,
    cached_mlx,
    demo_gguf,
    open_window,
    send,
    wait_idle,
    wait_loaded,
)
from tests.helpers import TINY_QWEN3_KEY as KEY

pytestmark = pytest.mark.app


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """A fresh data folder whose models folder holds the demo model (a link to the test cache)."""
    models = tmp_path / "models"
    models.mkdir()
    (models / demo.FILE_NAME).symlink_to(demo_gguf())
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTVM_MODELS", str(models))
    return tmp_path


@pytest.fixture
def window(qtbot, data_dir):
    w = open_window(qtbot, data_dir)
    wait_loaded(qtbot, w)
    yield w
    w.close()


@pytest.mark.slow
@pytest.mark.gpu
def test_first_launch_loads_the_demo_and_answers(qtbot, window):
    assert window.facts["key"] == "smollm2-135m-demo" or "SmolLM2" in window.facts["title"]
    send(qtbot, window, "What is the capital of France?")
    assert window.send.text() == "Stop"  # streaming: the button turns into Stop
    wait_idle(qtbot, window)
    reply = window.chat.messages[-1]
    assert "tok/s" in reply.status.text() and "context" in window.status.text()
    stored = window.store.messages(window.conv_id)
    assert [m["role"] for m in stored] == ["user", "assistant"] and stored[1]["content"] == reply.answer
    assert window.conversations.count() == 1 and "capital of France" in window.conversations.item(0).text()
    assert "Paris" in reply.answer, reply.answer


@pytest.mark.slow
@pytest.mark.gpu
def test_stop_regenerate_edit_and_new_chat(qtbot, window):
    window.settings = ChatSettings(max_tokens=200, sampling=SamplingParams(temperature=0.8), seed=1)
    send(qtbot, window, "Tell me a long story about a dragon.")
    qtbot.waitUntil(lambda: bool(window.chat.messages[-1].answer), timeout=REPLY_MS)
    window.send.click()  # Stop
    assert window.request == 0 and window.send.text() == "Send"  # the UI stops at once, not at the worker's pace
    partial = window.chat.messages[-1].answer
    assert window.store.messages(window.conv_id)[-1]["content"] == partial
    assert window.chat.messages[-1].status.text() == "stopped"

    window.settings = ChatSettings(max_tokens=8, sampling=SamplingParams(temperature=0.8), seed=None)
    window.chat.messages[-1].action.click()  # Regenerate
    wait_idle(qtbot, window)
    assert len(window.store.messages(window.conv_id)) == 2

    user = window.chat.messages[0]
    user.action.click()  # Edit
    user._editor.setPlainText("What is the capital of Italy?")
    user._save_edit()
    wait_idle(qtbot, window)
    stored = window.store.messages(window.conv_id)
    assert stored[0]["content"] == "What is the capital of Italy?" and len(stored) == 2

    first = window.conv_id
    window.new_chat.click()
    assert window.chat.messages == [] and window.conv_id is None
    send(qtbot, window, "Hello!")
    wait_idle(qtbot, window)
    assert window.conv_id != first and window.conversations.count() == 2


@pytest.mark.slow
@pytest.mark.gpu
def test_stop_while_the_prompt_is_read_then_ask_again(qtbot, window):
    """Esc during the prefill of a long message stops it between pieces; nothing empty is stored, and the next
    question is answered under itself."""
    window.settings = ChatSettings(max_tokens=12, sampling=SamplingParams(), seed=0)
    send(qtbot, window, "Please summarise these notes. " + "The team met and agreed on the plan. " * 12)
    reply = window.chat.messages[-1]
    qtbot.waitUntil(lambda: "Reading your message" in reply.status.text() and "tok/s" in reply.status.text(),
                    timeout=REPLY_MS)
    window.stop()
    assert window.request == 0 and "Stopped before answering" in reply.status.text()
    assert [m["role"] for m in window.store.messages(window.conv_id)] == ["user"]
    send(qtbot, window, "What is the capital of France?")
    wait_idle(qtbot, window)
    stored = window.store.messages(window.conv_id)
    assert [m["role"] for m in stored] == ["user", "user", "assistant"]
    assert stored[1]["content"] == "What is the capital of France?" and "Paris" in stored[2]["content"]
    assert [m.answer for m in window.chat.messages] == [m["content"] for m in stored]


@pytest.mark.slow
@pytest.mark.gpu
def test_closing_while_a_reply_streams_takes_under_2_s_and_keeps_it(qtbot, data_dir):
    w = open_window(qtbot, data_dir, settings=ChatSettings(max_tokens=300, sampling=SamplingParams(), seed=0))
    wait_loaded(qtbot, w)
    send(qtbot, w, "Tell me a long story about a dragon.")
    qtbot.waitUntil(lambda: bool(w.chat.messages[-1].answer), timeout=REPLY_MS)
    store, conv = w.store, w.conv_id
    started = time.monotonic()
    w.close()
    assert time.monotonic() - started < 2.0  # the issue measured ~28 s
    stored = store.messages(conv)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert stored[1]["content"] and stored[1]["content"] == w.chat.messages[-1].answer


@pytest.mark.slow
@pytest.mark.gpu
def test_closing_while_the_prompt_is_read_or_the_model_loads_takes_under_2_s(qtbot, data_dir):
    w = open_window(qtbot, data_dir)  # loads the demo model
    qtbot.waitUntil(lambda: "Loading" in w.progress_label.text() and " of " in w.progress_label.text(),
                    timeout=LOAD_MS)
    started = time.monotonic()
    w.close()
    assert time.monotonic() - started < 2.0 and not w.engine.thread.isRunning()

    w = open_window(qtbot, data_dir)
    wait_loaded(qtbot, w)
    send(qtbot, w, "Please summarise these notes. " + "The team met and agreed on the plan. " * 12)
    qtbot.waitUntil(lambda: "tok/s" in w.chat.messages[-1].status.text(), timeout=REPLY_MS)  # between pieces
    store, conv = w.store, w.conv_id
    started = time.monotonic()
    w.close()
    # The worker leaves the wait for the piece on the GPU at once (the piece finishes there later).
    assert time.monotonic() - started < 2.0 and not w.engine.thread.isRunning()
    assert [m["role"] for m in store.messages(conv)] == ["user"]


CLOSE_DURING_DECODE = """
import sys, time
from PySide6.QtCore import QTimer
from app import main
from app.window import MainWindow

loaded, delta = MainWindow.on_loaded, MainWindow.on_delta

def on_loaded(self, facts):
    loaded(self, facts)
    self.input.setPlainText("Tell me a long story about a dragon.")
    self.on_send()

def on_delta(self, *args):
    delta(self, *args)
    if not getattr(self, "closing", False) and self.chat.messages[-1].answer:
        self.closing = True
        print("closing", time.time(), flush=True)
        QTimer.singleShot(0, self.close)  # as the close button would

MainWindow.on_loaded, MainWindow.on_delta = on_loaded, on_delta
sys.exit(main.main([]))
"""


@pytest.mark.slow
@pytest.mark.gpu
def test_the_app_process_exits_within_2_s_of_a_close_during_decode_and_keeps_the_reply(data_dir):
    from app.store import ConversationStore

    proc = subprocess.Popen([sys.executable, "-c", CLOSE_DURING_DECODE], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = proc.stdout.readline()  # written just before the close
        assert line.startswith("closing"), proc.stderr.read()[-2000:]
        proc.wait(timeout=60)
        exited = time.time()
    finally:
        proc.kill()
    assert proc.returncode == 0
    assert exited - float(line.split()[1]) < 2.0  # the issue measured ~28 s
    store = ConversationStore(data_dir / "chats.sqlite3")
    conv = store.list_conversations()[0]["id"]
    stored = store.messages(conv)
    store.close()
    assert [m["role"] for m in stored] == ["user", "assistant"] and stored[1]["content"]


@pytest.mark.slow
@pytest.mark.gpu
def test_chats_survive_a_restart(qtbot, data_dir):
    w = open_window(qtbot, data_dir)
    wait_loaded(qtbot, w)
    send(qtbot, w, "First chat")
    wait_idle(qtbot, w)
    w.new_chat.click()
    send(qtbot, w, "Second chat")
    wait_idle(qtbot, w)
    w.close()
    again = open_window(qtbot, data_dir, auto_setup=False)
    titles = [again.conversations.item(i).text() for i in range(again.conversations.count())]
    assert titles == ["Second chat", "First chat"]
    again.conversations.setCurrentRow(1)
    assert [m.answer for m in again.chat.messages][0] == "First chat" and len(again.chat.messages) == 2
    again.close()


@pytest.mark.slow
@pytest.mark.gpu
def test_corrupt_model_shows_a_plain_error(qtbot, data_dir, monkeypatch):
    import shutil

    from engine.catalog import add_local

    bad = data_dir / "broken.gguf"
    shutil.copyfile(demo_gguf(), bad)
    add_local(bad)
    with open(bad, "r+b") as f:  # damaged on disk after it was added
        f.truncate(3_000_000)
    w = open_window(qtbot, data_dir, auto_setup=False)
    shown = []
    monkeypatch.setattr(w, "show_error", lambda title, message: shown.append((title, message)))
    w.picker.setCurrentIndex(w.picker.findData(next(r.entry.key for r in w.rows if r.entry.is_local)))
    w.action.click()
    qtbot.waitUntil(lambda: bool(shown), timeout=LOAD_MS)
    title, message = shown[0]
    assert title == "Model files are damaged or unsupported" and "broken.gguf" in message
    assert "Traceback" not in message and w.facts is None
    w.close()


def unnamed_controls(root) -> list:
    """Visible interactive controls a screen reader could not name (a spin box's inner line edit is the box)."""
    kinds = (QAbstractButton, QComboBox, QLineEdit, QPlainTextEdit, QAbstractSpinBox, QListWidget)
    return [c for kind in kinds for c in root.findChildren(kind)
            if c.isVisible() and not isinstance(c.parent(), QAbstractSpinBox)
            and not (c.accessibleName() or (isinstance(c, QAbstractButton) and c.text()))]


def test_every_control_has_an_accessible_name(qtbot, data_dir):
    w = open_window(qtbot, data_dir, auto_setup=False)
    w.chat.add("user", "You", "hi")
    w.chat.add("assistant", "Model", "```python\nprint(1)\n```", thinking="hmm")
    assert unnamed_controls(w) == []
    from app.settings_dialog import SettingsDialog

    dialog = SettingsDialog(w.settings, w.prefs, SamplingParams(), ["[0] test gpu"], None, w)
    dialog.show()
    assert unnamed_controls(dialog) == []
    dialog.close()
    w.close()


def test_settings_dialog_round_trips(qtbot, data_dir):
    from app.settings_dialog import SettingsDialog

    settings = ChatSettings(system="Be brief.", thinking=False, max_tokens=300, context_policy="drop_oldest",
                            sampling=SamplingParams(temperature=0.7, top_k=20, top_p=0.9, min_p=0.05), seed=42)
    prefs = AppPrefs(theme="dark", context=4096, offline=True, exact_decode=True)
    dialog = SettingsDialog(settings, prefs, SamplingParams(), [], None)
    qtbot.addWidget(dialog)
    assert dialog.result_settings() == settings and dialog.result_prefs() == prefs
    dialog.use_defaults.setChecked(True)
    dialog.seed.setValue(-1)
    assert dialog.result_settings().sampling is None and dialog.result_settings().seed is None


def test_gpu_weights_setting_is_validated_and_kept(qtbot, tmp_path):
    from PySide6.QtWidgets import QDialogButtonBox

    from app.prefs import load_prefs, save_prefs
    from app.settings_dialog import SettingsDialog

    dialog = SettingsDialog(ChatSettings(), AppPrefs(gpu_weights="12G"), SamplingParams(), [], None)
    qtbot.addWidget(dialog)
    ok = dialog._buttons.button(QDialogButtonBox.StandardButton.Ok)
    assert dialog.result_prefs().gpu_weights == "12G" and ok.isEnabled()
    dialog.gpu_weights.setText("lots")
    assert not ok.isEnabled() and "GPU weights budget" in dialog.gpu_weights_error.text()
    dialog.gpu_weights.setText("8192M")
    assert ok.isEnabled() and not dialog.gpu_weights_error.isVisibleTo(dialog)
    save_prefs(dialog.result_prefs(), tmp_path / "prefs.json")
    assert load_prefs(tmp_path / "prefs.json").gpu_weights == "8192M"
    (tmp_path / "prefs.json").write_text('{"gpu_weights": "12X", "context": 512}')
    assert load_prefs(tmp_path / "prefs.json") == AppPrefs(context=512)  # a bad budget falls back to auto


@pytest.mark.parametrize("value", ["9" * 400, "-5G", "2000T", 12884901888, ["12G"], {"G": 12}, None, True])
def test_a_hostile_gpu_weights_setting_falls_back_to_auto(qtbot, tmp_path, value):
    """settings.json's budget huge (float() made 400 digits inf: an OverflowError at start), negative, past the limit
    or not a string: auto, and the rest of the file kept; typed into Settings, one sentence under the field and OK
    held back, never an exception in the slot."""
    import json

    from PySide6.QtWidgets import QDialogButtonBox

    from app.prefs import load_prefs
    from app.settings_dialog import SettingsDialog

    (tmp_path / "prefs.json").write_text(json.dumps({"gpu_weights": value, "context": 512}))
    assert load_prefs(tmp_path / "prefs.json") == AppPrefs(context=512)
    if isinstance(value, str):
        dialog = SettingsDialog(ChatSettings(), AppPrefs(), SamplingParams(), [], None)
        qtbot.addWidget(dialog)
        dialog.gpu_weights.setText(value)
        error = dialog.gpu_weights_error.text()
        assert error.startswith("GPU weights budget: ") and "\n" not in error and len(error) < 200
        assert not dialog._buttons.button(QDialogButtonBox.StandardButton.Ok).isEnabled()


def test_gpu_weights_setting_is_shown_after_reopening(qtbot, data_dir, monkeypatch):
    """Settings → GPU weights budget through the window: saved with the app prefs, in the field when Settings opens
    again, and in a window started afresh from the same file."""
    from app.prefs import load_prefs
    from app.settings_dialog import SettingsDialog

    seen = []

    def exec_with(text):
        def exec_(dialog):
            seen.append(dialog.gpu_weights.text())
            if text is not None:
                dialog.gpu_weights.setText(text)
            return text is not None
        return exec_

    w = open_window(qtbot, data_dir, auto_setup=False)
    monkeypatch.setattr(SettingsDialog, "exec", exec_with("10G"))
    w.open_settings()
    assert w.prefs.gpu_weights == "10G" and load_prefs(w.prefs_path).gpu_weights == "10G"
    monkeypatch.setattr(SettingsDialog, "exec", exec_with(None))
    w.open_settings()
    again = open_window(qtbot, data_dir, auto_setup=False, prefs=load_prefs(w.prefs_path))
    again.open_settings()
    assert seen == ["auto", "10G", "10G"]
    w.close()
    again.close()


def test_a_bad_environment_budget_is_one_sentence_in_the_load_dialog(qtbot, data_dir, monkeypatch):
    """Settings on auto, ZEROTVM_GPU_WEIGHTS hostile: the load fails before any file or GPU is touched, with the
    budget's own dialog naming the variable (not "Unexpected error")."""
    from app.worker import EngineWorker
    from engine.cancel import CancelToken

    monkeypatch.setenv("ZEROTVM_GPU_WEIGHTS", "9" * 400)
    worker = EngineWorker()
    got = []
    worker.failed.connect(lambda *e: got.append(e))
    worker.load(str(data_dir / "nowhere"), 0, False, CancelToken())
    (request, title, message), = got
    assert (request, title) == (0, "GPU weights budget") and message.startswith("ZEROTVM_GPU_WEIGHTS: ")


def test_engine_imports_without_qt():
    code = ("import sys; sys.modules['PySide6'] = None\n"
            "import engine, engine.model, engine.session, engine.cli, engine.catalog, engine.memfit, engine.settings\n"
            "assert 'PySide6' not in [m for m in sys.modules if sys.modules[m] is not None]\nprint('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=os.environ)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


def test_signals_do_not_leak_references():
    """PySide6 6.12.0 released True once per signal emit, crashing Python < 3.12 at exit (pinned out)."""
    from PySide6.QtCore import QObject, Signal

    class Emitter(QObject):
        sig = Signal(dict)

    e = Emitter()
    got = []
    e.sig.connect(got.append)
    n = 1000
    before = sys.getrefcount(True)
    for _ in range(n):
        e.sig.emit({"n": 1})
    # The defect drops one reference per emit (n in all); other threads (an earlier test's worker winding down)
    # may move the count by a few, far from n.
    assert len(got) == n and sys.getrefcount(True) > before - n // 10


@pytest.mark.slow
@pytest.mark.gpu
def test_self_test_command(data_dir):
    env = dict(os.environ)
    out = subprocess.run([sys.executable, "-m", "app", "--self-test"], capture_output=True, text=True, env=env,
                         timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "Paris" in out.stdout.split("A:", 1)[-1], out.stdout


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.model
def test_download_flow_progress_cancel_resume_then_selectable(qtbot, tiny_repo, hub, monkeypatch):
    home = tiny_repo.parent.parent / "home"
    w = open_window(qtbot, home, auto_setup=False)
    seen = []
    w.downloads.worker.progress.connect(lambda p: seen.append(p))  # noqa: PLW0108 (runs in the GUI thread)
    w.picker.setCurrentIndex(w.picker.findData(KEY))
    assert w.action.text() == "Download"
    hub.faults.chunk_delay_s = 0.3  # slow enough to press Cancel mid-file
    w.action.click()
    qtbot.waitUntil(lambda: w.progress_box.isVisible() and "of" in w.progress_label.text(), timeout=20_000)
    w.cancel.click()
    qtbot.waitUntil(lambda: w.downloading_key is None, timeout=20_000)
    assert not w.selected().installed and w.action.text() == "Download"
    assert "resumes" in w.status.text()

    hub.faults.chunk_delay_s = 0
    w.action.click()
    qtbot.waitUntil(lambda: w.downloading_key is None, timeout=60_000)
    row = w.row(KEY)
    assert row.installed  # verified, so it is selectable and loads
    assert any(p["total"] > 0 and p["done"] > 0 for p in seen)
    qtbot.waitUntil(lambda: w.facts is not None, timeout=LOAD_MS)  # a finished download loads by itself
    assert w.action.text() == "Unload"
    w.close()


def test_tight_memory_asks_before_loading(qtbot, data_dir, monkeypatch):
    """A model whose fit check warns (Qwen3.6 on a machine short of RAM) is loaded only after "Load anyway"."""
    from PySide6.QtWidgets import QMessageBox

    from engine.memfit import SystemMemory, check_fit

    w = open_window(qtbot, data_dir, auto_setup=False)
    row = next(r for r in w.rows if r.entry.key.startswith("qwen3.6"))
    row.fit = check_fit(row.entry, system=SystemMemory(total_bytes=16 * 2**30, available_bytes=8 * 2**30))
    row.installed = True
    assert row.fit.ram_warning  # GPU memory unknown, but the 24 GB RAM warning fires
    asked, loads = [], []
    monkeypatch.setattr(w, "request_load", type("S", (), {"emit": lambda self, *a: loads.append(a)})())

    def answer(choice):
        def exec_(box):
            asked.append(box.text())
            box._clicked = next(b for b in box.buttons() if b.text() == choice)
            return 0
        return exec_

    monkeypatch.setattr(QMessageBox, "exec", answer("Cancel"))
    monkeypatch.setattr(QMessageBox, "clickedButton", lambda box: box._clicked)
    w.load(row)
    assert loads == [] and "GB" in asked[0] and row.entry.name in asked[0]
    monkeypatch.setattr(QMessageBox, "exec", answer("Load anyway"))
    w.load(row)
    assert len(loads) == 1
    w.close()


def test_sidebar_rename_export_delete(qtbot, data_dir, monkeypatch, tmp_path):
    from PySide6.QtWidgets import QFileDialog, QInputDialog, QMessageBox

    w = open_window(qtbot, data_dir, auto_setup=False)
    first = w.store.create_conversation()
    w.store.add_message(first, "user", "Tell me about ```code```")
    w.store.add_message(first, "assistant", "Sure.", thinking="Let me think.")
    second = w.store.create_conversation("Second")
    w.refresh_conversations()
    w.conversations.setCurrentRow(1)  # the older chat opens
    assert w.conv_id == first and [m.answer for m in w.chat.messages] == ["Tell me about ```code```", "Sure."]

    monkeypatch.setattr(QInputDialog, "getText", lambda *a, **k: ("Renamed", True))
    w.conversations.rename_current()
    assert w.store.conversation(first)["title"] == "Renamed"
    for kind, suffix in (("markdown", ".md"), ("json", ".json")):
        target = tmp_path / f"chat{suffix}"
        monkeypatch.setattr(QFileDialog, "getSaveFileName", lambda *a, t=target, **k: (str(t), ""))
        w.conversations.export_current(kind)
        assert "Let me think." in target.read_text()
    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    w.conversations.setCurrentRow([w.conversations.item(i).text() for i in range(2)].index("Renamed"))
    w.conversations.delete_current()
    assert [c["id"] for c in w.store.list_conversations()] == [second] and w.conv_id is None
    assert w.chat.messages == [] and w.conversations.count() == 1
    w.close()


@pytest.mark.gpu
@pytest.mark.model
@pytest.mark.slow
def test_app_loads_and_chats_with_an_mlx_moe_model(qtbot, data_dir):
    """A Qwen3.5-MoE-architecture MLX folder (tiny, made by mlx-lm) added by path loads and answers in the app."""
    from engine.catalog import add_local
    entry = add_local(cached_mlx("q4"))
    assert entry.runs
    w = open_window(qtbot, data_dir, settings=ChatSettings(max_tokens=6, sampling=SamplingParams()),
                    auto_setup=False)
    w.picker.setCurrentIndex(w.picker.findData(entry.key))
    assert w.action.text() == "Load"
    w.action.click()
    wait_loaded(qtbot, w)
    assert w.facts["model_type"].startswith("qwen3_5_moe")
    send(qtbot, w, "Hello")
    wait_idle(qtbot, w)
    stored = w.store.messages(w.conv_id)
    assert [m["role"] for m in stored] == ["user", "assistant"]
    assert "tok/s" in w.chat.messages[-1].status.text() or w.chat.messages[-1].status.text() in ("stop", "length")
    w.close()


@pytest.mark.slow
@pytest.mark.gpu
@pytest.mark.model
def test_verify_and_remove_a_downloaded_model(qtbot, tiny_repo, hub, monkeypatch):
    from PySide6.QtWidgets import QMessageBox


    w = open_window(qtbot, tiny_repo.parent.parent / "home", auto_setup=False)
    errors = []
    monkeypatch.setattr(w, "show_error", lambda title, message: errors.append(title))
    w.picker.setCurrentIndex(w.picker.findData(KEY))
    w.action.click()  # Download; it loads by itself when done
    qtbot.waitUntil(lambda: w.facts is not None, timeout=LOAD_MS)
    assert w.manage.isEnabled() and not w.remove_action.isEnabled()  # no deleting the files of a loaded model
    w.action.click()  # Unload
    qtbot.waitUntil(lambda: w.facts is None, timeout=20_000)

    w.verify_action.trigger()
    qtbot.waitUntil(lambda: w.downloading_key is None, timeout=20_000)
    assert "every file matches" in w.status.text() and errors == []
    shard = next(tiny_repo.glob("params_shard_*.bin"))
    data = bytearray(shard.read_bytes())
    data[5] ^= 0xFF
    shard.write_bytes(bytes(data))
    w.verify_action.trigger()
    qtbot.waitUntil(lambda: w.downloading_key is None, timeout=20_000)
    assert errors == ["Damaged model files"] and not w.row(KEY).installed and w.action.text() == "Download"

    monkeypatch.setattr(QMessageBox, "question", lambda *a, **k: QMessageBox.StandardButton.Yes)
    w.action.click()  # fetches just the damaged file again
    qtbot.waitUntil(lambda: w.row(KEY) is not None and w.row(KEY).installed and w.downloading_key is None,
                    timeout=60_000)
    qtbot.waitUntil(lambda: w.facts is not None, timeout=LOAD_MS)
    w.action.click()
    qtbot.waitUntil(lambda: w.facts is None, timeout=20_000)
    w.remove_action.trigger()
    qtbot.waitUntil(lambda: w.downloading_key is None, timeout=20_000)
    assert not tiny_repo.exists() and "Removed" in w.status.text()
    w.close()


@pytest.mark.slow
@pytest.mark.gpu
def test_a_message_sent_while_the_model_loads_goes_out_when_it_is_ready(qtbot, data_dir):
    w = open_window(qtbot, data_dir)  # starts loading the demo model
    assert w.facts is None and w.loading_key is not None
    send(qtbot, w, "What is the capital of France?")
    assert "as soon as the model has loaded" in w.status.text() and w.store.list_conversations() == []
    qtbot.waitUntil(lambda: w.conv_id is not None and len(w.store.messages(w.conv_id)) == 2 and w.request == 0,
                    timeout=LOAD_MS + REPLY_MS)
    answer = w.store.messages(w.conv_id)[1]["content"]
    w.close()
    assert "Paris" in answer, answer


@pytest.mark.slow
def test_copy_buttons_put_the_answer_and_code_on_the_clipboard(qtbot, data_dir):
    from PySide6.QtGui import QGuiApplication

    w = open_window(qtbot, data_dir, auto_setup=False)
    answer = "Here:\n\n```python\nprint('hi')\n```\nDone."
    reply = w.chat.add("assistant", "Model", answer, thinking="private reasoning")
    reply.copy.click()
    assert QGuiApplication.clipboard().text() == answer  # markdown as written, no thinking
    code = next(b for kind, b in reply._blocks if kind == "code")
    code.copy.click()
    assert QGuiApplication.clipboard().text() == "print('hi')"
    assert code.copy.text() == "Copied"
    # "Copied" turns back into "Copy" after 1.5 s, unless the message is gone by then (a new chat, a closed window):
    # the timer must die with its button instead of reaching a deleted one.
    w.new_chat.click()
    w.close()
    w.deleteLater()
    qtbot.wait(1700)


@pytest.mark.slow
@pytest.mark.gpu
def test_exact_decode_preference_reaches_the_runtime(qtbot, data_dir):
    """The default decode takes int8 activations (faster); the preference loads the model with f32 ones."""
    for exact in (False, True):
        w = open_window(qtbot, data_dir, prefs=AppPrefs(context=512, exact_decode=exact))
        wait_loaded(qtbot, w)
        assert w.facts["int8_decode"] is (not exact)
        send(qtbot, w, "Hi")
        wait_idle(qtbot, w)
        assert [m["role"] for m in w.store.messages(w.conv_id)][-1] == "assistant"
        w.close()


@pytest.mark.slow
@pytest.mark.gpu
def test_worker_streams_experts_under_the_settings_budget_and_reports_it(qtbot, data_dir):
    """The Settings budget reaches the load; the loaded facts and each reply's stats carry the status line's
    streaming share and hit rate; load progress names the file being read."""
    from app.worker import EngineWorker
    from engine.cancel import CancelToken
    from tests.helpers import cached_mlx

    path = cached_mlx("q4")
    worker = EngineWorker()
    got: dict = {}
    worker.loaded.connect(lambda facts: got.setdefault("facts", facts))
    worker.reply_done.connect(lambda request, stats: got.setdefault("stats", stats))
    worker.failed.connect(lambda *e: got.setdefault("failed", e))
    worker.load_progress.connect(lambda *p: got.setdefault("files", set()).add(p[-1]))
    worker.gpu_weights = "600000"  # the tiny model's weights are 694,656 bytes: 6 of its 8 experts a layer fit
    worker.load(str(path), 64, False, CancelToken())
    assert "failed" not in got, got.get("failed")
    assert got["facts"]["experts"].startswith("experts streamed from RAM:") and got["files"] == {"model.safetensors"}
    worker.reply(1, [{"role": "user", "content": "hi"}], {"max_tokens": 4}, CancelToken())
    assert "failed" not in got, got.get("failed")
    assert got["stats"]["experts"].startswith("expert cache hit rate")
    worker.gpu_weights = "1K"
    got.clear()
    worker.load(str(path), 64, False, CancelToken())
    request, title, message = got["failed"]  # the budget's own dialog, not "No compatible GPU"
    assert (request, title) == (0, "GPU weights budget") and "below this model's minimum of" in message
