"""What the window says about models and the GPU: the loaded model marked apart from the selection, each row's fit,
status and hint texts that follow the state, and the software-GPU notice shown once per adapter."""

import pytest

from app.prefs import AppPrefs, load_prefs
from engine import demo
from engine.gpu import AdapterInfo
from engine.sampling import SamplingParams
from engine.session import ChatSettings
from tests.helpers import demo_gguf

pytestmark = pytest.mark.app

DEMO = "smollm2-135m-demo"
LLVMPIPE = AdapterInfo(0, "llvmpipe (LLVM 15.0.6, 256 bits)", "Vulkan", "CPU", "Mesa 22.3.6", ["shader-f16"], {})
WARP = AdapterInfo(1, "Microsoft Basic Render Driver", "D3D12", "Unknown", "", ["shader-f16"], {})
RTX = AdapterInfo(0, "NVIDIA GeForce RTX 4090", "Vulkan", "DiscreteGPU", "565.57", ["shader-f16"], {})


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    models = tmp_path / "models"
    models.mkdir()
    (models / demo.FILE_NAME).symlink_to(demo_gguf())
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path))
    monkeypatch.setenv("ZEROTVM_MODELS", str(models))
    return tmp_path


def window(qtbot, data_dir, adapter=None, prefs=None):
    """The real window, no model loading by itself; loads are recorded instead of reaching the worker."""
    from app.store import ConversationStore
    from app.window import MainWindow

    store = ConversationStore(data_dir / "chats.sqlite3")
    settings = ChatSettings(max_tokens=12, sampling=SamplingParams(), seed=0)
    w = MainWindow(store, settings, prefs or load_prefs(data_dir / "app.json"), data_dir / "app.json", [], None,
                   auto_setup=False, adapter=adapter)
    qtbot.addWidget(w)
    w.loads = []
    w.request_load = type("S", (), {"emit": lambda self, *a: w.loads.append(a)})()
    w.show()
    qtbot.waitUntil(lambda: not any(r.fit_pending for r in w.rows), timeout=60_000)  # worked out off the GUI thread
    return w


def texts(w) -> dict[str, str]:
    return {w.picker.itemData(i): w.picker.itemText(i) for i in range(w.picker.count())}


def facts(name="SmolLM2-135M-Instruct.Q4_1.gguf"):
    return {"path": "/x", "name": name, "model_type": "llama", "context": 512, "load_seconds": 94.149,
            "thinking": False, "chat": True, "sampling": {}, "adapter": "[0] test", "int8_decode": True}


def test_fits_are_worked_out_off_the_gui_thread(qtbot, data_dir, monkeypatch):
    import threading

    from app.store import ConversationStore
    from app.window import MainWindow
    from engine import memfit

    monkeypatch.setattr(memfit, "_ESTIMATES", {})  # nothing remembered: every model must be planned
    planned_on = set()
    real = memfit.estimate
    monkeypatch.setattr(memfit, "estimate", lambda *a, **k: planned_on.add(threading.current_thread().name)
                        or real(*a, **k))
    w = MainWindow(ConversationStore(data_dir / "chats.sqlite3"), ChatSettings(), AppPrefs(), data_dir / "app.json",
                   [], None, auto_setup=False, adapter=LLVMPIPE)
    qtbot.addWidget(w)
    pending = [r.entry.key for r in w.rows if r.fit_pending]
    assert pending and all(texts(w)[k].endswith(" · checking fit…") for k in pending)
    qtbot.waitUntil(lambda: not any(r.fit_pending for r in w.rows), timeout=60_000)
    assert planned_on == {"fit-estimates"}
    assert "too slow (one token every" in texts(w)["qwen3.6-35b-a3b-mlx-4bit"]


def test_the_loaded_model_is_marked_apart_from_the_selection(qtbot, data_dir):
    w = window(qtbot, data_dir)
    assert not any(t.startswith("● ") or t.endswith("· loaded") for t in texts(w).values())
    assert w.status.text() == "No model loaded. Pick one above and choose Load (or Download)."
    assert w.input.placeholderText().startswith("No model loaded")

    w.picker.setCurrentIndex(w.picker.findData(DEMO))
    w.on_action()  # Load
    assert w.status.text() == "Loading SmolLM2 135M Instruct (demo)…" and len(w.loads) == 1
    assert "as soon as the model has loaded" in w.input.placeholderText()
    assert w.chat.placeholder.text() == "The model is loading; you can type your question now."
    w.on_loaded(facts())
    demo_row = w.row(DEMO)
    assert texts(w)[DEMO] == f"● {demo_row.label} · loaded"
    assert w.status.text().startswith("SmolLM2 135M Instruct (demo) · context 512 tokens · loaded in 1 min 34 s")
    assert w.input.placeholderText().startswith("Message SmolLM2 135M Instruct (demo)")
    assert w.chat.placeholder.text().startswith("Ask SmolLM2 135M Instruct (demo) anything.")

    w.picker.setCurrentIndex(w.picker.findData("qwen3-4b-q4f16_1"))  # selecting another model moves no mark
    assert texts(w)[DEMO].endswith("· loaded") and not texts(w)["qwen3-4b-q4f16_1"].endswith("loaded")
    assert w.action.text() == "Download"
    w.on_unloaded()
    assert not any(t.startswith("● ") or t.endswith("· loaded") for t in texts(w).values())
    assert w.status.text().startswith("No model loaded")


def test_a_failed_or_cancelled_load_leaves_no_stale_text(qtbot, data_dir):
    w = window(qtbot, data_dir)
    w.picker.setCurrentIndex(w.picker.findData(DEMO))
    w.on_action()
    w.on_loaded(facts())
    w.on_action()  # Unload is what the button says now; load it again instead
    w.load(w.row(DEMO), confirm=False)
    assert w.facts is None and not texts(w)[DEMO].endswith("loaded")  # the worker lets the old copy go first
    w.on_failed(0, "Could not load the model", "The file is damaged.")
    assert w.status.text() == ("Could not load SmolLM2 135M Instruct (demo). No model loaded. Pick one above and "
                               "choose Load (or Download).")
    assert not w.progress_box.isVisible() and w.loading_key is None and w.action.text() == "Load"
    assert w.input.placeholderText().startswith("No model loaded")
    assert w.chat.placeholder.text().startswith("Pick a model above and load it")
    w.load(w.row(DEMO), confirm=False)
    w.on_unloaded()  # Cancel during the load ends here
    assert w.status.text().startswith("Loading cancelled. No model loaded.")


def test_every_row_shows_its_fit(qtbot, data_dir, monkeypatch):
    import re

    from engine import memfit
    from engine.memfit import SystemMemory

    w = window(qtbot, data_dir, adapter=RTX)  # a discrete GPU does not report its memory: the need, said so
    for row in w.rows:
        label = texts(w)[row.entry.key]
        assert label.endswith(" · " + row.fit.summary) and "slow" not in label  # a real GPU: no speed verdict
        assert re.fullmatch(r"needs [\d.]+ GB of GPU memory \(free amount unknown\)", row.fit.summary)
    # An integrated GPU takes system RAM, so with 5 GB free each row can say fits / tight / does not fit.
    monkeypatch.setattr(memfit, "system_memory", lambda: SystemMemory(32 * 10**9, 5 * 10**9))
    igpu = AdapterInfo(0, "Intel(R) UHD Graphics 630", "Vulkan", "IntegratedGPU", "Mesa", ["shader-f16"], {})
    w = window(qtbot, data_dir, adapter=igpu)
    shown = texts(w)
    need = {k: w.row(k).fit.ram_needed / 1e9 for k in (DEMO, "qwen3-4b-q4f16_1", "qwen3.6-35b-a3b-mlx-4bit")}
    assert shown[DEMO].endswith(f" · fits ({need[DEMO]:.1f} GB of RAM)")
    assert shown["qwen3-4b-q4f16_1"].endswith(f" · tight (needs {need['qwen3-4b-q4f16_1']:.1f} GB of RAM, 5.0 GB free)")
    assert shown["qwen3.6-35b-a3b-mlx-4bit"].endswith(
        f" · does not fit (needs {need['qwen3.6-35b-a3b-mlx-4bit']:.1f} GB of RAM, 5.0 GB free)")


def test_software_gpu_notice_once_per_adapter_and_slow_rows(qtbot, data_dir):
    from engine.speed import DEMO_DECODE_BYTES, SOFTWARE_NOTICE_TITLE, software_tps

    w = window(qtbot, data_dir, adapter=LLVMPIPE)
    assert w.notice is not None and w.notice.isVisible()
    text = w.notice.text()
    assert SOFTWARE_NOTICE_TITLE in text and "llvmpipe (LLVM 15.0.6, 256 bits)" in text
    from engine.humanize import human_rate

    assert f"roughly {human_rate(software_tps(DEMO_DECODE_BYTES))} from the demo model" in text
    assert load_prefs(data_dir / "app.json").software_notice_shown == [LLVMPIPE.key]
    big = texts(w)["qwen3.6-35b-a3b-mlx-4bit"]
    assert "too slow (one token every" in big and not big.endswith("fits")
    assert "slow (about" in texts(w)[DEMO]
    qtbot.mouseClick(w.notice.button, __import__("PySide6.QtCore").QtCore.Qt.MouseButton.LeftButton)
    assert not w.notice.isVisible()
    w.picker.setCurrentIndex(w.picker.findData(DEMO))
    w.on_action()
    w.on_loaded(facts())
    assert "software GPU: slow" in w.status.text()
    # A finished reply's speed replaces the estimate (kept in the data folder for the next start and the CLI).
    w.engine.worker.reply_done.emit(7, {"finish_reason": "stop", "tokens": 40, "tps": 9.0})
    assert texts(w)[DEMO].endswith("slow (about 9.0 tokens/s) · loaded")
    big_row = w.row("qwen3.6-35b-a3b-mlx-4bit")
    assert big_row.fit.speed.measured and big_row.fit.speed.tokens_per_s == pytest.approx(
        9.0 * w.row(DEMO).fit.estimate.decode_bytes / big_row.fit.estimate.decode_bytes)
    w.close()

    again = window(qtbot, data_dir, adapter=LLVMPIPE)  # the same adapter next time: no notice
    assert again.notice is None
    other = window(qtbot, data_dir, adapter=WARP)  # another software adapter is told once too
    assert other.notice is not None and "Microsoft Basic Render Driver" in other.notice.text()
    assert set(load_prefs(data_dir / "app.json").software_notice_shown) == {LLVMPIPE.key, WARP.key}
    assert window(qtbot, data_dir, adapter=RTX, prefs=AppPrefs()).notice is None


def test_a_too_slow_model_asks_before_loading(qtbot, data_dir, monkeypatch):
    from PySide6.QtWidgets import QMessageBox

    w = window(qtbot, data_dir, adapter=LLVMPIPE)
    row = w.row("qwen3-4b-q4f16_1")
    row.installed = True
    assert row.fit.verdict == "too_slow" and row.fit.load_anyway
    asked = []
    monkeypatch.setattr(QMessageBox, "exec", lambda box: asked.append((box.windowTitle(), box.text())) or 0)
    monkeypatch.setattr(QMessageBox, "clickedButton", lambda box: None)  # Cancel
    w.load(row)
    assert w.loads == [] and asked[0][0] == "Too slow on this computer"
    assert "would be too slow to use" in asked[0][1] and "one token every" in asked[0][1]


def test_load_progress_names_the_shard_and_cancel_reaches_the_load(qtbot, data_dir):
    """The progress line while a load runs: bytes, the part and the checkpoint file being read; Cancel (the button
    beside it) sets that load's token, which the worker checks between tensors."""
    w = window(qtbot, data_dir)
    w.load(w.row(DEMO), confirm=False)
    (_path, _context, _exact, token), = w.loads
    w.on_load_progress(0, 2, 3 * 2**20, 8 * 2**20, "model-00001-of-00002.safetensors")
    assert w.progress_box.isVisible() and w.cancel.isVisible()
    assert w.progress_label.text().startswith("Loading SmolLM2 135M Instruct (demo): ")
    assert w.progress_label.text().endswith("(1/2) · reading model-00001-of-00002.safetensors")
    assert w.progress.value() == 375
    assert not token.cancelled
    w.cancel.click()
    assert token.cancelled
    w.on_unloaded()  # the worker's answer to a cancelled load
    assert w.status.text().startswith("Loading cancelled.") and not w.progress_box.isVisible()


def test_the_settings_budget_changes_what_the_picker_says(qtbot, data_dir, monkeypatch):
    """Settings → GPU weights budget 2G on a 24 GiB GPU: the Qwen3.6 row that fitted whole now says it streams, the
    dense Qwen3-4B (2.13 GiB of weights) says it cannot load, in the rows shown and in their tooltips; back to auto,
    as before. A row chosen before its fit was worked out gets it at load time, budget included."""
    from PySide6.QtCore import Qt
    from PySide6.QtWidgets import QMessageBox

    from app.settings_dialog import SettingsDialog
    from engine import memfit
    from engine.memfit import GpuMemory

    monkeypatch.setattr(memfit, "gpu_memory", lambda *_: GpuMemory(24 * 2**30, False, "test"))
    monkeypatch.setattr(memfit, "system_memory", lambda: memfit.SystemMemory(256 * 10**9, 200 * 10**9))  # not ours
    monkeypatch.delenv("ZEROTVM_GPU_WEIGHTS", raising=False)
    w = window(qtbot, data_dir, adapter=RTX)
    moe, dense = "qwen3.6-35b-a3b-mlx-4bit", "qwen3-4b-q4f16_1"
    assert "fits (" in texts(w)[moe] and "fits (" in texts(w)[dense]

    def set_budget(text):
        def exec_(dialog):
            dialog.gpu_weights.setText(text)
            return True
        monkeypatch.setattr(SettingsDialog, "exec", exec_)
        w.open_settings()
        qtbot.waitUntil(lambda: not any(r.fit_pending for r in w.rows), timeout=60_000)

    def tooltip(key):
        return w.picker.itemData(w.picker.findData(key), Qt.ItemDataRole.ToolTipRole)

    set_budget("2G")
    assert " · runs with experts streamed from RAM, about " in texts(w)[moe]
    assert "The GPU weights budget of 2.00 GiB does not hold it whole." in tooltip(moe)
    assert texts(w)[dense].endswith(" · does not fit the weights budget (2.00 GiB)")
    assert "cannot load with the GPU weights budget you set: this model's weights need 2.11 GiB" in tooltip(dense)
    # Chosen before the background estimate: load() works it out with the budget and asks first.
    row = w.row(dense)
    row.installed, row.fit, row.fit_pending = True, None, True
    asked = []
    monkeypatch.setattr(QMessageBox, "exec", lambda box: asked.append(box.text()) or 0)
    monkeypatch.setattr(QMessageBox, "clickedButton", lambda box: None)  # Cancel
    w.load(row)
    assert row.fit is not None and row.fit.summary == "does not fit the weights budget (2.00 GiB)"
    assert w.loads == [] and asked and "weights need 2.11 GiB" in asked[0]
    set_budget("auto")
    assert "fits (" in texts(w)[moe] and "fits (" in texts(w)[dense]
    w.close()
