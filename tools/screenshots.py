"""Screenshots of the app's main states for the README, taken from the real window (run under Xvfb):

    xvfb-run -a -s "-screen 0 1280x900x24" python3 tools/screenshots.py docs/ [NAME ...]

NAME picks some of the shots (empty, chat, downloading, settings, software-adapter, prefill); none: all. Uses a
throwaway data folder with the demo model (installed if missing) and real replies from it.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")


# A long message, so the prompt takes several prefill pieces to read.
LONG_MESSAGE = ("Here are my meeting notes from this week. Please summarise them in five bullet points and list the "
                "open questions at the end.\n\n" + "\n".join(
                    f"- Day {d}: the team reviewed the release plan, agreed to move the beta by one week, asked design "
                    f"for new onboarding screens, and found that the installer fails on machines without a GPU "
                    f"driver; support tickets rose by {d * 7} percent." for d in range(1, 11)))


def main(out: Path, only: set[str] | None = None) -> None:
    from PySide6.QtCore import QEventLoop, QTimer
    from PySide6.QtWidgets import QApplication

    from app.prefs import AppPrefs
    from app.settings_dialog import SettingsDialog
    from app.store import ConversationStore
    from app.theme import apply_theme
    from app.window import MainWindow
    from engine import demo
    from engine.sampling import SamplingParams
    from engine.session import ChatSettings

    home = Path(tempfile.mkdtemp(prefix="zerotvm-shots-"))
    models = home / "models"
    models.mkdir()
    (models / demo.FILE_NAME).symlink_to(demo.install_demo())
    os.environ["ZEROTVM_HOME"], os.environ["ZEROTVM_MODELS"] = str(home), str(models)
    app = QApplication(["zerotvm-chat"])
    app.setApplicationName("ZeroTVM")
    apply_theme(app, "light")
    out.mkdir(parents=True, exist_ok=True)

    def wait(condition, ms=300_000):
        loop = QEventLoop()
        timer = QTimer()
        timer.timeout.connect(lambda: condition() and loop.quit())
        timer.start(50)
        QTimer.singleShot(ms, loop.quit)
        loop.exec()
        timer.stop()

    def shot(widget, name):
        wait(lambda: False, 300)  # let layouts settle
        widget.grab().save(str(out / name))
        print("wrote", out / name)

    store = ConversationStore(home / "chats.sqlite3")
    settings = ChatSettings(max_tokens=160, sampling=SamplingParams(temperature=0.3, top_p=0.9), seed=7)
    if only is None or "software-adapter" in only:
        software_adapter(home, store, settings, wait, shot)
    if only is not None and not only - {"software-adapter", "prefill"}:
        if "prefill" in only:
            w = MainWindow(store, settings, AppPrefs(context=2048), home / "app.json", [], None)
            w.resize(1200, 800)
            w.show()
            wait(lambda: w.facts is not None)
            prefill_shot(w, wait, shot)
            w.close()
        store.close()
        return
    w = MainWindow(store, settings, AppPrefs(context=2048), home / "app.json", ["[0] this machine's GPU"], None)
    w.resize(1200, 800)
    w.show()
    wait(lambda: w.facts is not None)
    shot(w, "screenshot-empty.png")
    for question in ("What is the capital of France?", "Write a Python function that reverses a string."):
        w.input.setPlainText(question)
        w.on_send()
        wait(lambda: w.request == 0)
    shot(w, "screenshot-chat.png")
    if only is None or "prefill" in only:
        prefill_shot(w, wait, shot)
    w.on_download_progress({"key": "qwen3-4b-q4f16_1", "file": "params_shard_12.bin", "file_done": 21_000_000,
                            "file_total": 33_000_000, "done": 914_000_000,
                            "total": 2_285_014_203, "speed": 48_300_000, "eta_s": 28, "files_done": 12,
                            "files_total": 71})
    w.picker.setCurrentIndex(w.picker.findData("qwen3-4b-q4f16_1"))
    shot(w, "screenshot-downloading.png")
    w.hide_progress()
    dialog = SettingsDialog(w.settings, w.prefs, SamplingParams(), ["[0] this machine's GPU"], None, w)
    dialog.show()
    shot(dialog, "screenshot-settings.png")
    dialog.close()
    w.close()
    store.close()


def software_adapter(home, store, settings, wait, shot) -> None:
    """The first launch on a software GPU: the notice, the loaded demo marked in the picker, the status line. The
    adapter is this machine's when it is a software one, else a stand-in named like Mesa's lavapipe."""
    from app.prefs import AppPrefs
    from app.window import MainWindow
    from engine.gpu import AdapterInfo, pick_adapter

    real = pick_adapter()
    adapter = real if real.software else AdapterInfo(0, "llvmpipe (LLVM 15.0.6, 256 bits)", "Vulkan", "CPU",
                                                      "Mesa 22.3.6", [], {})
    w = MainWindow(store, settings, AppPrefs(context=2048), home / "app-software.json", [adapter.summary()], None,
                   adapter=adapter)
    w.resize(1200, 800)
    w.show()
    wait(lambda: w.facts is not None)
    shot(w, "screenshot-software-adapter.png")
    w.close()


def prefill_shot(w, wait, shot) -> None:
    """A long message being read: the reply shows "Reading your message… done/total tokens · rate" (then Stop)."""
    w.start_new_chat()
    w.input.setPlainText(LONG_MESSAGE)
    w.on_send()
    wait(lambda: "Reading your message" in w.chat.messages[-1].status.text()
         and not w.chat.messages[-1].status.text().split("… ")[1].startswith("0/"))
    shot(w, "screenshot-prefill.png")
    w.stop()


if __name__ == "__main__":
    main(Path(sys.argv[1] if len(sys.argv) > 1 else "docs"), set(sys.argv[2:]) or None)
