"""The main window: model picker with download/load progress, conversation sidebar, chat, input, status."""

from __future__ import annotations

import logging
import time
from dataclasses import replace
from pathlib import Path

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import (
    QComboBox,
    QFileDialog,
    QHBoxLayout,
    QLabel,
    QMainWindow,
    QMenu,
    QMessageBox,
    QPlainTextEdit,
    QProgressBar,
    QPushButton,
    QSplitter,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.chat_view import ChatView
from app.downloads import DownloadThread
from app.model_list import ModelRow, model_rows
from app.notice import Notice
from app.prefs import AppPrefs, save_prefs
from app.sidebar import ConversationList
from app.store import ConversationStore
from app.worker import WorkerThread
from engine.cancel import CancelToken
from engine.humanize import human_duration
from engine.sampling import SamplingParams
from engine.settings import save_settings, settings_to_dict

log = logging.getLogger("zerotvm.app")
ADD_LOCAL = "__add_local__"
SAVE_EVERY_S = 0.5  # how often a streaming reply is written to the database
RENDER_EVERY_MS = 40  # streamed text is laid out at most this often: re-parsing markdown per token stalls fast replies
PROGRESS_AFTER_MS = 1000  # a prompt still being read after this long shows its progress
CLOSE_WAIT_S = 1.5  # closing waits this long for the workers in all, so the window is gone within 2 s
STOPPED_EMPTY = "Stopped before answering · Regenerate to ask again"
NOT_ANSWERED = "Not answered · Regenerate to ask again"


class InputBox(QPlainTextEdit):
    """Enter sends, Shift+Enter starts a new line."""

    submitted = Signal()

    def keyPressEvent(self, event) -> None:  # noqa: N802 (Qt's name)
        shift = event.modifiers() & Qt.KeyboardModifier.ShiftModifier
        if event.key() in (Qt.Key.Key_Return, Qt.Key.Key_Enter) and not shift:
            self.submitted.emit()
            return
        super().keyPressEvent(event)


def _size(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e9 else f"{n / 1e6:.1f} MB"


def _eta(seconds) -> str:
    return "—" if seconds is None else human_duration(seconds)


class MainWindow(QMainWindow):
    request_load = Signal(str, int, bool, object)  # path, context (0 = the model's), exact decode, CancelToken
    request_reply = Signal(int, list, dict, object)  # request id, messages, settings, CancelToken
    request_unload = Signal()
    request_download = Signal(dict, str)
    request_manage = Signal(dict, str, str)
    fits_ready = Signal()  # the background fit estimates are done: refresh the picker

    def __init__(self, store: ConversationStore, settings, prefs: AppPrefs, prefs_path: Path,
                 adapters: list[str], token_store=None, auto_setup: bool = True, adapter=None):
        """`adapter`: the engine.gpu.AdapterInfo the worker will open (None: not known); a software one gets a
        notice, once per adapter, and the picker's fit gives speeds."""
        super().__init__()
        self.adapter_info = adapter
        self.setWindowTitle("Zero-TVM")
        self.store, self.settings, self.prefs, self.prefs_path = store, settings, prefs, prefs_path
        self.adapters, self.token_store = adapters, token_store
        self.engine = WorkerThread(prefs.adapter or None)
        self.downloads = DownloadThread()
        self.rows: list[ModelRow] = []
        self.facts: dict | None = None  # the loaded model
        self.loading_key: str | None = None
        self.downloading_key: str | None = None
        self.conv_id: int | None = None
        self.request = 0  # id of the reply streaming now (0 = none)
        self._last_request = 0  # ids only grow for the window's life: a late signal never matches a newer request
        self._reply_token: CancelToken | None = None
        self._load_token: CancelToken | None = None
        self._reply_widget = None
        self._reply_conv: int | None = None  # the chat the streaming reply belongs to
        self._reply_msg_id: int | None = None  # stored on its first text: a reply stopped before any has no row
        self._reply_text = ["", ""]  # thinking, answer
        self._reply_progress: tuple[int, int, float] | None = None  # prompt tokens read, of total, seconds
        self._unanswered_slot = None  # the view's reply slot under a question that has no stored answer
        self._reading_bar = False  # the progress row shows the prompt being read
        self._last_save = 0.0
        self._progress_timer = QTimer(self)
        self._progress_timer.setSingleShot(True)
        self._progress_timer.setInterval(PROGRESS_AFTER_MS)
        self._progress_timer.timeout.connect(self._show_reading)
        self._send_when_ready = False  # Enter pressed while the model was still downloading or loading
        self.exit_without_waiting = False  # set by closeEvent (see there)
        self._render_timer = QTimer(self)
        self._render_timer.setSingleShot(True)
        self._render_timer.setInterval(RENDER_EVERY_MS)
        self._render_timer.timeout.connect(self._render_reply)
        self._build()
        self._connect()
        self.engine.worker.reply_done.connect(self._note_speed)
        self._fit_thread = None
        self.fits_ready.connect(self._on_fits_ready)
        self._show_software_notice()
        self.refresh_models()
        self.refresh_conversations()
        if auto_setup:
            self.auto_setup()

    # ---- layout ---------------------------------------------------------------------------------------
    def _build(self) -> None:
        top = QHBoxLayout()
        self.picker = QComboBox()
        self.picker.setAccessibleName("Model")
        self.picker.setMinimumWidth(420)
        self.action = QPushButton("Load")
        self.action.setAccessibleName("Download, load or unload the selected model")
        self.manage = QToolButton()
        self.manage.setText("Manage")
        self.manage.setAccessibleName("Verify or remove the selected model")
        self.manage.setPopupMode(QToolButton.ToolButtonPopupMode.InstantPopup)
        menu = QMenu(self.manage)
        self.verify_action = menu.addAction("Verify files", lambda: self.manage_model("verify"))
        self.remove_action = menu.addAction("Remove from disk…", lambda: self.manage_model("remove"))
        self.manage.setMenu(menu)
        self.settings_button = QPushButton("Settings")
        self.settings_button.setAccessibleName("Settings")
        top.addWidget(QLabel("Model:"))
        top.addWidget(self.picker, 1)
        top.addWidget(self.action)
        top.addWidget(self.manage)
        top.addWidget(self.settings_button)

        progress_row = QHBoxLayout()
        self.progress = QProgressBar()
        self.progress.setAccessibleName("Progress")
        self.progress_label = QLabel()
        self.cancel = QPushButton("Cancel")
        self.cancel.setAccessibleName("Cancel the download or load")
        progress_row.addWidget(self.progress, 2)
        progress_row.addWidget(self.progress_label, 3)
        progress_row.addWidget(self.cancel)
        self.progress_box = QWidget()
        self.progress_box.setLayout(progress_row)
        self.progress_box.hide()

        sidebar = QWidget()
        side = QVBoxLayout(sidebar)
        self.new_chat = QPushButton("New chat")
        self.new_chat.setAccessibleName("New chat")
        self.new_chat.setShortcut(QKeySequence.StandardKey.New)
        self.conversations = ConversationList(self.store)
        side.addWidget(self.new_chat)
        side.addWidget(self.conversations, 1)

        chat = QWidget()
        right = QVBoxLayout(chat)
        self.chat = ChatView()
        self.input = InputBox()
        self.input.setAccessibleName("Message")
        self.input.setPlaceholderText("Message (Enter sends, Shift+Enter for a new line)")
        self.input.setFixedHeight(80)
        self.send = QPushButton("Send")
        self.send.setAccessibleName("Send the message")
        row = QHBoxLayout()
        row.addWidget(self.input, 1)
        row.addWidget(self.send)
        right.addWidget(self.chat, 1)
        right.addLayout(row)

        split = QSplitter()
        split.addWidget(sidebar)
        split.addWidget(chat)
        split.setStretchFactor(1, 1)
        split.setSizes([220, 780])

        self.notice_box = QVBoxLayout()  # the software-adapter notice goes here when there is one
        self.notice: Notice | None = None

        central = QWidget()
        column = QVBoxLayout(central)
        column.addLayout(top)
        column.addLayout(self.notice_box)
        column.addWidget(self.progress_box)
        column.addWidget(split, 1)
        self.setCentralWidget(central)
        self.status = QLabel("No model loaded. Pick one above and choose Load (or Download).")
        self.status.setAccessibleName("Status")
        self.statusBar().addWidget(self.status, 1)
        self.resize(1100, 760)

        prefs = QAction("Settings", self)
        prefs.setShortcuts([QKeySequence.StandardKey.Preferences, QKeySequence("Ctrl+,")])
        prefs.triggered.connect(self.open_settings)
        self.addAction(prefs)
        focus = QAction("Type a message", self)
        focus.setShortcut(QKeySequence("Ctrl+L"))
        focus.triggered.connect(self.input.setFocus)
        self.addAction(focus)
        stop = QAction("Stop the answer", self)
        stop.setShortcut(QKeySequence(Qt.Key.Key_Escape))
        stop.triggered.connect(self.stop)
        self.addAction(stop)
        quit_ = QAction("Quit", self)
        quit_.setShortcuts([QKeySequence.StandardKey.Quit, QKeySequence("Ctrl+Q")])
        quit_.setShortcutContext(Qt.ShortcutContext.ApplicationShortcut)
        quit_.triggered.connect(self.close)  # the same path as the close button: cancel, save, bounded wait
        self.addAction(quit_)

    def _connect(self) -> None:
        w, d = self.engine.worker, self.downloads.worker
        self.request_load.connect(w.load)
        self.request_reply.connect(w.reply)
        self.request_unload.connect(w.unload)
        self.request_download.connect(d.start)
        self.request_manage.connect(d.manage)
        d.managed.connect(self.on_managed)
        w.load_progress.connect(self.on_load_progress)
        w.loaded.connect(self.on_loaded)
        w.unloaded.connect(self.on_unloaded)
        w.reply_progress.connect(self.on_reply_progress)
        w.reply_delta.connect(self.on_delta)
        w.reply_done.connect(self.on_reply_done)
        w.failed.connect(self.on_failed)
        d.progress.connect(self.on_download_progress)
        d.finished.connect(self.on_downloaded)
        d.cancelled.connect(self.on_download_cancelled)
        d.failed.connect(self.on_download_failed)
        self.picker.currentIndexChanged.connect(self.on_pick)
        self.action.clicked.connect(self.on_action)
        self.cancel.clicked.connect(self.on_cancel)
        self.settings_button.clicked.connect(self.open_settings)
        self.new_chat.clicked.connect(self.start_new_chat)
        self.conversations.picked.connect(self.on_conversation_picked)
        self.conversations.deleted.connect(self.on_conversation_deleted)
        self.input.submitted.connect(self.on_send)
        self.send.clicked.connect(self.on_send_button)
        self.chat.edit_requested.connect(self.edit_message)
        self.chat.regenerate_requested.connect(self.regenerate)

    # ---- models ---------------------------------------------------------------------------------------
    def models_dir(self) -> Path | None:
        return Path(self.prefs.models_dir) if self.prefs.models_dir else None

    def refresh_models(self, select: str | None = None) -> None:
        current = select or (self.selected().entry.key if self.selected() else self.prefs.last_model)
        self.rows = model_rows(self.models_dir(), self.prefs.context, quick_only=True, **self._fit_args())
        self._estimate_fits()
        self.picker.blockSignals(True)
        self.picker.clear()
        for row in self.rows:
            self.picker.addItem(self.row_label(row), row.entry.key)
            if row.fit is not None:
                self.picker.setItemData(self.picker.count() - 1, row.fit.message, Qt.ItemDataRole.ToolTipRole)
        self.picker.addItem("Add local model…", ADD_LOCAL)
        found = self.picker.findData(current)
        self.picker.setCurrentIndex(max(found, 0))
        self.picker.blockSignals(False)
        self.update_action()

    def _fit_args(self) -> dict:
        """How this machine's adapter bears on a fit, as `zerotvm models` sees it."""
        from engine.memfit import gpu_memory

        a = self.adapter_info
        software = bool(a is not None and a.software)
        memory = gpu_memory(a) if a is not None else None  # a MoE model too big for a known-size GPU: streams
        return dict(shared_memory=bool(memory and memory.shared), software=software,
                    decode_rate=self._measured_rate(), gpu_bytes=memory.total_bytes if memory else None,
                    gpu_weights=self._weights_budget())

    def _weights_budget(self) -> int | None:
        """The weights budget the next load takes (the worker's rule: Settings, else ZEROTVM_GPU_WEIGHTS), for the
        fit verdicts; one the load would refuse as misspelt counts as auto here (the load names it)."""
        from engine.gpu_budget import setting_budget

        try:
            return setting_budget(self.prefs.gpu_weights)
        except ValueError:
            return None

    def _estimate_fits(self) -> None:
        """Plan the models whose fit is not known yet on a background thread (it takes a moment per model); the
        picker refreshes when it is done."""
        pending = [r for r in self.rows if r.fit_pending]
        if not pending or (self._fit_thread is not None and self._fit_thread.is_alive()):
            return
        import threading

        from app.model_list import fill_fits

        args = self._fit_args()  # read here, on the GUI thread
        context, gpu_bytes, gpu_weights = self.prefs.context, args["gpu_bytes"], args["gpu_weights"]

        def work() -> None:
            fill_fits(pending, context, gpu_bytes, gpu_weights)
            try:
                self.fits_ready.emit()  # queued to the GUI thread
            except RuntimeError:  # the window is gone
                pass

        self._fit_thread = threading.Thread(target=work, name="fit-estimates", daemon=True)
        self._fit_thread.start()

    def _on_fits_ready(self) -> None:
        self._fit_thread = None
        if any(r.fit_pending for r in self.rows):
            self.refresh_models()

    def loaded_key(self) -> str | None:
        return self.facts.get("key") if self.facts is not None else None

    def row_label(self, row: ModelRow) -> str:
        """The picker's text for a row: the model loaded now is marked, whichever one is selected."""
        return f"● {row.label} · loaded" if row.entry.key == self.loaded_key() else row.label

    def relabel_models(self) -> None:
        """Move the "loaded" mark after a load or unload (without re-reading the models folder)."""
        for i, row in enumerate(self.rows):
            if self.picker.itemData(i) == row.entry.key:
                self.picker.setItemText(i, self.row_label(row))

    def idle_status(self) -> str:
        """The status line for the state the app is in now, when nothing is running."""
        if self.facts is None:
            return "No model loaded. Pick one above and choose Load (or Download)."
        text = f"{self.facts.get('title', self.facts['name'])} · context {self.facts['context']} tokens"
        return text + (" · software GPU: slow" if self.adapter_info is not None and self.adapter_info.software
                       else "")

    def _show_software_notice(self) -> None:
        """The plain word that the GPU is a software one, once per adapter (remembered in the app prefs)."""
        a = self.adapter_info
        if a is None or not a.software or a.key in self.prefs.software_notice_shown:
            return
        from engine.speed import SOFTWARE_NOTICE_TITLE, software_notice

        self.notice = Notice(SOFTWARE_NOTICE_TITLE, software_notice(a.name, rate=self._measured_rate()))
        self.notice_box.addWidget(self.notice)
        self.prefs.software_notice_shown = [*self.prefs.software_notice_shown, a.key]
        save_prefs(self.prefs, self.prefs_path)

    def _measured_rate(self) -> float | None:
        """Weight bytes/s a reply reached on this (software) adapter, once one has been measured."""
        if self.adapter_info is None or not self.adapter_info.software:
            return None
        from engine.speed import measured_rate

        return measured_rate(self.adapter_info.key, self.prefs_path.parent)

    def _note_speed(self, _request: int, stats: dict) -> None:
        """On a software GPU a finished reply's decode speed replaces the estimate in the picker (speeds.json)."""
        row = self.row(self.loaded_key() or "")
        if row is None or row.fit is None or self.adapter_info is None or not self.adapter_info.software:
            return
        from engine.speed import record_decode

        if record_decode(self.adapter_info.key, row.fit.estimate.decode_bytes, int(stats.get("tokens") or 0),
                         float(stats.get("tps") or 0), self.prefs_path.parent) is not None:
            self.refresh_models()

    def selected(self) -> ModelRow | None:
        key = self.picker.currentData()
        return next((r for r in self.rows if r.entry.key == key), None)

    def row(self, key: str) -> ModelRow | None:
        return next((r for r in self.rows if r.entry.key == key), None)

    def update_action(self) -> None:
        row = self.selected()
        busy = self.downloading_key is not None or self.loading_key is not None
        self._update_hint()
        if row is None:
            self.action.setText("Load")
            self.action.setEnabled(False)
            self.manage.setEnabled(False)
            return
        loaded = self.facts is not None and self.facts.get("key") == row.entry.key
        text = "Unload" if loaded else "Load" if row.installed else "Download"
        self.action.setText(text)
        self.action.setEnabled(not busy and (row.entry.runs or not row.installed) and self.request == 0)
        self.action.setToolTip("" if row.entry.runs else row.entry.runs_reason or "")
        hub = not row.entry.is_local and not row.entry.is_demo
        self.manage.setEnabled(row.installed and not row.entry.is_local and not busy)
        self.verify_action.setEnabled(hub)
        self.remove_action.setEnabled(not loaded)  # unload before deleting the files it reads

    def _update_hint(self) -> None:
        """The message box's placeholder and the empty chat's line say what happens now."""
        private = "Everything stays on this computer."
        if self.facts is not None:
            title = self.facts.get("title", "the model")
            hint = f"Message {title} (Enter sends, Shift+Enter for a new line)"
            empty = f"Ask {title} anything. {private}"
        elif self.loading_key or self.downloading_key:
            hint = "Type your message: Enter sends it as soon as the model has loaded"
            empty = f"The model is {'loading' if self.loading_key else 'downloading'}; you can type your question now."
        else:
            hint = "No model loaded: pick one above and choose Load, then type your message here"
            empty = f"Pick a model above and load it, then ask anything. {private}"
        self.input.setPlaceholderText(hint)
        self.chat.placeholder.setText(empty)

    def on_pick(self, _index: int) -> None:
        if self.picker.currentData() == ADD_LOCAL:
            self.add_local_model()
        self.update_action()

    def add_local_model(self) -> None:
        from engine.catalog import add_local

        path, _ = QFileDialog.getOpenFileName(self, "Add a GGUF model", "", "GGUF models (*.gguf);;All files (*)")
        if not path:
            path = QFileDialog.getExistingDirectory(self, "…or a model folder (MLC q4f16_1)")
        if not path:
            self.refresh_models()
            return
        try:
            entry = add_local(path)
        except Exception as e:
            self.show_error(*_describe(e, "add the model"))
            self.refresh_models()
            return
        self.refresh_models(select=entry.key)

    def on_action(self) -> None:
        row = self.selected()
        if row is None:
            return
        if self.facts is not None and self.facts.get("key") == row.entry.key:
            self.request_unload.emit()
        elif row.installed:
            self.load(row)
        else:
            self.download(row)

    def manage_model(self, action: str) -> None:
        row = self.selected()
        if row is None or not row.installed:
            return
        if action == "remove":
            answer = QMessageBox.question(self, "Remove model", f"Delete {row.entry.name} from this computer? "
                                          "You can download it again later; your chats stay.")
            if answer != QMessageBox.StandardButton.Yes:
                return
        self.downloading_key = row.entry.key  # the download thread is busy; one model job at a time
        self.show_progress(f"{'Verifying' if action == 'verify' else 'Removing'} {row.entry.name}…", 0, 0)
        self.request_manage.emit(row.entry.to_dict(), str(self.models_dir() or ""), action)
        self.update_action()

    def on_managed(self, key: str, action: str, bad: list) -> None:
        self.downloading_key = None
        self.hide_progress()
        self.refresh_models(select=key)
        name = self.row(key).entry.name if self.row(key) else key
        if action == "remove":
            self.status.setText(f"Removed {name}.")
        elif bad:
            self.show_error("Damaged model files", f"{len(bad)} file(s) of {name} did not match the Hub's checksum "
                            f"and were removed: {', '.join(bad[:5])}.\n\nChoose Download to fetch just those again.")
        else:
            self.status.setText(f"{name}: every file matches the Hub's checksum.")

    def download(self, row: ModelRow) -> None:
        from engine.hub.offline import offline_reason

        if self.prefs.offline or offline_reason():
            self.show_error("Offline mode is on", "Downloads are off in offline mode. Turn it off in Settings "
                            "to download models.")
            return
        self.downloading_key = row.entry.key
        self.show_progress(f"Downloading {row.entry.name}…", 0, 0)
        self.status.setText(f"Downloading {row.entry.name}…")
        self.request_download.emit(row.entry.to_dict(), str(self.models_dir() or ""))
        self.update_action()

    def load(self, row: ModelRow, confirm: bool = True) -> None:
        if row.fit_pending and row.fit is None:  # chosen before the background estimate arrived: work it out now
            from engine.memfit import check_fit

            try:
                args = self._fit_args()
                args["gpu_bytes_available"] = args.pop("gpu_bytes")  # check_fit's name for it
                row.fit = check_fit(row.entry, self.prefs.context or row.entry.default_context, **args)
            except Exception:  # as model_rows: no estimate, no warning
                row.fit = None
        fit = row.fit
        if confirm and fit is not None and fit.load_anyway:
            slow = fit.verdict == "too_slow"
            box = QMessageBox(QMessageBox.Icon.Warning, "Too slow on this computer" if slow else "Memory is tight",
                              f"{row.entry.name} {'would be too slow to use' if slow else 'may not fit'} on this "
                              f"computer.\n\n{fit.message}", parent=self)
            load_anyway = box.addButton("Load anyway", QMessageBox.ButtonRole.AcceptRole)
            box.addButton(QMessageBox.StandardButton.Cancel)
            box.exec()
            if box.clickedButton() is not load_anyway:
                return
        self.loading_key = row.entry.key
        self.facts = None  # the worker lets the loaded model go before it reads the next one
        self.relabel_models()
        self.show_progress(f"Loading {row.entry.name}…", 0, 0)
        self.status.setText(f"Loading {row.entry.name}…")
        self.engine.worker.gpu_weights = self.prefs.gpu_weights  # read by the worker when this load starts
        self._load_token = CancelToken()
        self.request_load.emit(str(row.load_path), self.prefs.context, self.prefs.exact_decode, self._load_token)
        self.update_action()

    def auto_setup(self) -> None:
        """Load the last model; with none installed, set up the demo model by itself (with progress)."""
        installed = [r for r in self.rows if r.installed and r.entry.runs]
        last = self.row(self.prefs.last_model)
        if last is not None and last in installed:
            choice = last
        elif installed:
            choice = next((r for r in installed if not r.entry.is_demo), installed[0])
        else:
            demo = next((r for r in self.rows if r.entry.is_demo), None)
            if demo is not None:
                self.picker.setCurrentIndex(self.picker.findData(demo.entry.key))
                self.download(demo)
            return
        self.picker.setCurrentIndex(self.picker.findData(choice.entry.key))
        self.load(choice, confirm=False)

    # ---- progress --------------------------------------------------------------------------------------
    def show_progress(self, text: str, done: float, total: float) -> None:
        self.progress_box.show()
        self.progress_label.setText(text)
        if total > 0:
            self.progress.setRange(0, 1000)
            self.progress.setValue(int(1000 * done / total))
        else:
            self.progress.setRange(0, 0)  # busy indicator until the size is known

    def hide_progress(self) -> None:
        self.progress_box.hide()

    def on_cancel(self) -> None:
        if self._reading_bar:
            self.stop()
        elif self.downloading_key:
            self.downloads.worker.cancel()
        elif self.loading_key and self._load_token is not None:
            self._load_token.cancel()

    def on_download_progress(self, p: dict) -> None:
        file = p["file"]
        if p.get("file_total"):
            file += f" {100 * p['file_done'] / p['file_total']:.0f}%"
        files = f" · file {min(p['files_done'] + 1, p['files_total'])}/{p['files_total']}" \
            if p.get("files_total", 1) > 1 else ""
        speed = f" · {_size(p['speed'])}/s · ETA {_eta(p.get('eta_s'))}" if p.get("speed") else ""
        self.show_progress(f"{file} · {_size(p['done'])} of {_size(p['total'])}{files}{speed}",
                           p["done"], p["total"])

    def on_downloaded(self, key: str, _path: str) -> None:
        self.downloading_key = None
        self.hide_progress()
        self.refresh_models(select=key)
        row = self.row(key)
        if row is not None and row.installed and row.entry.runs and self.facts is None:
            self.load(row)
        elif row is not None:
            self.status.setText(f"{row.entry.name} is downloaded. " + self.idle_status())

    def on_download_cancelled(self, key: str) -> None:
        self.downloading_key = None
        self._send_when_ready = False
        self.hide_progress()
        self.status.setText("Download cancelled; it resumes where it stopped next time. " + self.idle_status())
        self.refresh_models(select=key)

    def on_download_failed(self, key: str, title: str, message: str) -> None:
        self.downloading_key = None
        self._send_when_ready = False
        self.hide_progress()
        self.refresh_models(select=key)
        name = self.row(key).entry.name if self.row(key) else key
        self.status.setText(f"Downloading {name} failed. " + self.idle_status())
        self.show_error(title, message)

    def on_load_progress(self, part: int, parts: int, done: float, total: float, file: str = "") -> None:
        name = self.row(self.loading_key).entry.name if self.row(self.loading_key or "") else "model"
        shard = f" · reading {file}" if file else ""  # the checkpoint file (shard) being read
        self.show_progress(f"Loading {name}: {_size(done)} of {_size(total)} ({part + 1}/{parts}){shard}", done,
                           total)

    def on_loaded(self, facts: dict) -> None:
        facts["key"] = self.loading_key
        self.facts, self.loading_key = facts, None
        self.hide_progress()
        self.prefs.last_model = facts["key"] or ""
        save_prefs(self.prefs, self.prefs_path)
        row = self.row(facts["key"] or "")
        name = row.entry.name if row else facts["name"]
        self.facts["title"] = name
        experts = f" · {facts['experts']}" if facts.get("experts") else ""  # routed experts streamed from RAM
        self.status.setText(f"{self.idle_status()} · loaded in {human_duration(facts['load_seconds'])} · "
                            f"{facts['adapter']}{experts}")
        self.relabel_models()
        self.update_action()
        self.input.setFocus()
        if self._send_when_ready:
            self._send_when_ready = False
            self.on_send()

    def on_unloaded(self) -> None:
        cancelled = self.loading_key is not None  # a load stopped by Cancel ends here too
        self.facts, self.loading_key = None, None
        self._send_when_ready = False
        self.hide_progress()
        self.status.setText(("Loading cancelled. " if cancelled else "") + self.idle_status())
        self.relabel_models()
        self.update_action()

    # ---- conversations ------------------------------------------------------------------------------------
    def refresh_conversations(self) -> None:
        self.conversations.refresh(self.conv_id)

    def on_conversation_picked(self, conv_id: int) -> None:
        if conv_id == self.conv_id:
            return
        self.stop()  # a reply streaming in the chat being left stops, its text kept under its question
        self.show_conversation(conv_id)
        self.refresh_conversations()

    def on_conversation_deleted(self, conv_id: int) -> None:
        if conv_id == self._reply_conv:
            self._reply_conv = None  # its rows are gone: nothing more is saved for it
            self.stop()
        if conv_id == self.conv_id:
            self.show_conversation(None)

    def show_conversation(self, conv_id: int | None) -> None:
        self.conv_id = conv_id
        self._unanswered_slot = None
        self.chat.clear()
        if conv_id is None:
            return
        rows = self.store.message_rows(conv_id)
        for m in rows:
            widget = self.chat.add(m["role"], self._author(m), m["content"], m["thinking"])
            if m["stats"]:
                widget.set_status(_stats_text(m["stats"]))
        if rows and rows[-1]["role"] == "user":  # stopped before any text, or the app closed first
            self._unanswered(NOT_ANSWERED)
        self.chat.set_idle(True)

    def _unanswered(self, text: str, widget=None) -> None:
        """A reply slot under a question with no stored answer: it says so and offers Regenerate (never stored)."""
        if widget is None:
            widget = self.chat.add("assistant", self.facts.get("title", "Assistant") if self.facts else "Assistant")
        widget.set_status(text)
        self._unanswered_slot = widget

    def _drop_unanswered(self) -> None:
        if self.chat.messages and self.chat.messages[-1] is self._unanswered_slot:
            self.chat.truncate(len(self.chat.messages) - 1)
        self._unanswered_slot = None

    def _author(self, m: dict) -> str:
        return "You" if m["role"] == "user" else (m.get("model") or "Assistant")

    def start_new_chat(self) -> None:
        self.stop()
        self.show_conversation(None)
        self.conversations.clearSelection()
        self.input.setFocus()

    # ---- chatting ----------------------------------------------------------------------------------------
    def on_send_button(self) -> None:
        if self.request:
            self.stop()
        else:
            self.on_send()

    def on_send(self) -> None:
        if self.request:  # Enter while a reply streams: the text waits in the box (Stop or Esc ends the reply)
            return
        text = self.input.toPlainText().strip()
        if not text:
            return
        if self.facts is None:
            if self.loading_key or self.downloading_key:  # first launch: the demo is still arriving
                self._send_when_ready = True
                self.status.setText("Your message will be sent as soon as the model has loaded.")
                return
            self.show_error("No model loaded", "Pick a model and load it, then send your message again. "
                            "Your text stays in the box.")
            return
        if self.conv_id is None:
            self.conv_id = self.store.create_conversation(model=self.facts.get("title"))
        self._drop_unanswered()
        self.store.add_message(self.conv_id, "user", text)  # committed before anything else happens
        self.input.clear()
        self.chat.add("user", "You", text)
        self.refresh_conversations()
        self.start_reply()

    def start_reply(self) -> None:
        messages = self.store.messages(self.conv_id)
        name = self.facts.get("title", "Assistant")
        self._reply_conv, self._reply_msg_id = self.conv_id, None
        self._reply_widget = self.chat.add("assistant", name)
        self._reply_widget.set_status("thinking…")
        self._reply_text = ["", ""]
        self._reply_progress = None
        self._last_request += 1
        self.request = self._last_request
        self._reply_token = CancelToken()
        self.chat.set_idle(False)
        self.set_busy(True)
        self._progress_timer.start()
        self.request_reply.emit(self.request, messages, settings_to_dict(self.settings), self._reply_token)

    def on_reply_progress(self, request: int, done: int, total: int, seconds: float) -> None:
        if request != self.request:
            return
        self._reply_progress = (done, total, seconds)
        if not self._progress_timer.isActive():
            self._show_reading()

    def _show_reading(self) -> None:
        """"Reading your message… 120/480 tokens · 35 tok/s": shown once a prompt takes longer than about a second."""
        if self._reply_widget is None or any(self._reply_text) or self._reply_progress is None:
            return
        done, total, seconds = self._reply_progress
        text = f"Reading your message… {done}/{total} tokens"
        if done and seconds > 0:
            rate = done / seconds
            text += f" · {rate:.0f} tok/s · about {human_duration((total - done) / rate)} left"
        self._reply_widget.set_status(text)
        if not (self.downloading_key or self.loading_key):  # the bar row is free: a bar and Cancel there too
            self._reading_bar = True
            self.show_progress(text, done, total)

    def _hide_reading(self) -> None:
        if self._reading_bar:
            self._reading_bar = False
            self.hide_progress()

    def on_delta(self, request: int, thinking: str, answer: str) -> None:
        if request != self.request:
            return  # a stopped reply's late tokens
        self._progress_timer.stop()
        self._hide_reading()
        self._reply_text[0] += thinking
        self._reply_text[1] += answer
        if not self._render_timer.isActive():
            self._render_timer.start()
        if time.monotonic() - self._last_save > SAVE_EVERY_S:
            self._save_reply()

    def _render_reply(self) -> None:
        if self._reply_widget is not None and any(self._reply_text):
            self._reply_widget.set_content(self._reply_text[1], self._reply_text[0])
            self._reply_widget.set_status("")

    def _save_reply(self, stats: dict | None = None) -> None:
        """Write the reply so far; its row is made with its first text, so nothing empty is ever stored."""
        if not any(self._reply_text) or self._reply_conv is None:
            return
        if self._reply_msg_id is None:
            name = self.facts.get("title", "Assistant") if self.facts else "Assistant"
            self._reply_msg_id = self.store.add_message(self._reply_conv, "assistant", self._reply_text[1],
                                                        self._reply_text[0], model=name)
        self.store.update_message(self._reply_msg_id, self._reply_text[1], self._reply_text[0], stats)
        self._last_save = time.monotonic()

    def on_reply_done(self, request: int, stats: dict) -> None:
        if request != self.request:
            return
        self.finish_reply(stats)

    def finish_reply(self, stats: dict) -> None:
        self._render_timer.stop()
        self._progress_timer.stop()
        self._hide_reading()
        self._render_reply()  # whatever arrived since the last frame
        self._save_reply(stats)
        if self._reply_widget is not None:
            if any(self._reply_text):
                self._reply_widget.set_status(_stats_text(stats))
            else:  # nothing stored: the question stays, with Regenerate
                self._unanswered(STOPPED_EMPTY if stats.get("finish_reason") == "stopped" else NOT_ANSWERED,
                                 self._reply_widget)
        if stats.get("tokens"):
            experts = f" · {stats['experts']}" if stats.get("experts") else ""  # the expert cache's hit rate
            self.status.setText(f"{self.facts.get('title', '') if self.facts else ''} · {_stats_text(stats)}{experts}")
        self._reply_widget, self._reply_msg_id, self._reply_conv = None, None, None
        self._reply_token = None
        self.request = 0
        self.set_busy(False)
        self.chat.set_idle(True)
        self.refresh_conversations()

    def stop(self) -> None:
        """Stop the streaming reply now: its token is cancelled (the worker sees it at its next piece or token,
        even if the request is still queued) and the UI does not wait for the worker."""
        if not self.request:
            return
        if self._reply_token is not None:
            self._reply_token.cancel()
        self.finish_reply({"finish_reason": "stopped", "tokens": None})

    def regenerate(self) -> None:
        if self.request or self.conv_id is None or self.facts is None:
            return
        rows = self.store.message_rows(self.conv_id)
        last_user = max((i for i, m in enumerate(rows) if m["role"] == "user"), default=None)
        if last_user is None:
            return
        self.store.truncate_after(self.conv_id, rows[last_user]["position"])
        self.chat.truncate(last_user + 1)
        self.start_reply()

    def edit_message(self, index: int, text: str) -> None:
        if self.request or self.conv_id is None:
            return
        if self.facts is None:
            self.show_error("No model loaded", "Load a model to answer the edited message.")
            return
        rows = self.store.message_rows(self.conv_id)
        msg = rows[index]
        self.store.update_message(msg["id"], content=text)
        self.store.truncate_after(self.conv_id, msg["position"])
        self.chat.truncate(index + 1)
        self.chat.messages[index].set_content(text)
        self.start_reply()

    def on_failed(self, request: int, title: str, message: str) -> None:
        if request == 0:  # a load: the worker let the previous model go too
            row = self.row(self.loading_key or "")
            self.facts, self.loading_key = None, None
            self._send_when_ready = False
            self.hide_progress()
            self.status.setText(f"Could not load {row.entry.name if row else 'the model'}. " + self.idle_status())
            self.relabel_models()
            self.update_action()
        elif request == self.request:
            if not any(self._reply_text) and self._reply_widget is not None:
                self.chat.truncate(len(self.chat.messages) - 1)  # nothing was stored: drop the empty slot
                self._reply_widget = None
            self.finish_reply({"finish_reason": "error"})
        else:
            return
        self.show_error(title, message)

    def set_busy(self, busy: bool) -> None:
        self.send.setText("Stop" if busy else "Send")
        self.send.setAccessibleName("Stop the answer" if busy else "Send the message")
        # Switching chats or starting a new one stays possible: it stops the reply (see on_conversation_picked).
        self.update_action()

    # ---- settings, errors, closing ---------------------------------------------------------------------------
    def open_settings(self) -> None:
        from app.settings_dialog import SettingsDialog

        defaults = SamplingParams(**self.facts["sampling"]) if self.facts else SamplingParams()
        dialog = SettingsDialog(self.settings, self.prefs, defaults, self.adapters, self.token_store, self)
        if not dialog.exec():
            return
        old = self.prefs
        self.settings, self.prefs = dialog.result_settings(), dialog.result_prefs()
        save_settings(self.settings)
        save_prefs(self.prefs, self.prefs_path)
        action, token = dialog.token_change()
        if self.token_store is not None and action != "keep":
            try:
                self.token_store.set(token) if action == "set" else self.token_store.clear()
            except Exception as e:
                self.show_error(*_describe(e, "save the token"))
        apply_engine_prefs(self.prefs)
        if self.prefs.theme != old.theme:
            from PySide6.QtWidgets import QApplication

            from app.theme import apply_theme

            apply_theme(QApplication.instance(), self.prefs.theme)
        # The fit verdicts take the context and the weights budget: "fits" may now stream, or not load at all.
        if (self.prefs.models_dir, self.prefs.context, self.prefs.gpu_weights) != (
                old.models_dir, old.context, old.gpu_weights):
            self.refresh_models()
        if self.prefs.adapter != old.adapter:
            self.status.setText("The GPU choice applies the next time Zero-TVM starts.")
        elif self.prefs.exact_decode != old.exact_decode and self.facts is not None:
            self.status.setText("Exact decode arithmetic applies when a model next loads.")
        elif self.prefs.gpu_weights != old.gpu_weights and self.facts is not None:
            self.status.setText("The GPU weights budget applies when a model next loads.")

    def show_error(self, title: str, message: str) -> None:
        log.warning("%s: %s", title, message)
        box = QMessageBox(QMessageBox.Icon.Warning, title, message, parent=self)
        box.setAccessibleName(title)
        box.open()  # not exec(): tests and the event loop keep running
        self.last_error = (title, message)

    def closeEvent(self, event) -> None:  # noqa: N802
        """Close (the close button, Ctrl+Q): cancel everything first, save, then wait for the workers at most
        CLOSE_WAIT_S in all; a worker still busy then is left to the process exit (app/main.py)."""
        started = time.monotonic()
        try:
            self.downloads.worker.cancel()
            if self._load_token is not None:
                self._load_token.cancel()
            self.engine.worker.close()
            self.stop()  # saves the reply so far under its question
            self.prefs = replace(self.prefs)
            save_prefs(self.prefs, self.prefs_path)
        finally:
            left = lambda: int(1000 * max(0.0, CLOSE_WAIT_S - (time.monotonic() - started)))  # noqa: E731
            ended = self.engine.close(timeout_ms=left())
            ended = self.downloads.close(timeout_ms=left()) and ended
            # app/main.py then ends the process without Python's clean-up, which would wait for the GPU queue
            # (a parked device) or for a thread still running.
            self.exit_without_waiting = not ended or self.engine.worker.parked
        super().closeEvent(event)


def apply_engine_prefs(prefs: AppPrefs) -> None:
    """Hand the engine the prefs it acts on by itself: the models folder and offline mode (downloads refuse).
    Through the engine's setters: the environment stays the user's."""
    from engine.hub.offline import set_offline
    from engine.paths import choose_models_dir

    choose_models_dir(prefs.models_dir or None, setting="Settings → Models folder")
    set_offline(prefs.offline)


def _stats_text(stats: dict) -> str:
    reason = stats.get("finish_reason")
    if reason == "stopped":
        return "stopped"
    if reason == "error" or not stats.get("tokens"):
        return reason or ""
    dropped = f" · {stats['dropped_turns']} oldest messages left out" if stats.get("dropped_turns") else ""
    return (f"{stats['tokens']} tokens · {stats.get('tps', 0):.1f} tok/s · first token "
            f"{human_duration(stats.get('ttft', 0))} · context {stats.get('context_used')}/{stats.get('context_limit')}"
            f"{dropped}")


def _describe(e: Exception, what: str) -> tuple[str, str]:
    from app.errors import describe_error

    return describe_error(e, what)
