"""Settings: system prompt, sampling, context, thinking, models folder, Hugging Face token, GPU, theme, offline."""

from __future__ import annotations

from dataclasses import replace

from PySide6.QtWidgets import (
    QCheckBox,
    QComboBox,
    QDialog,
    QDialogButtonBox,
    QDoubleSpinBox,
    QFileDialog,
    QFormLayout,
    QGroupBox,
    QHBoxLayout,
    QLabel,
    QLineEdit,
    QPlainTextEdit,
    QPushButton,
    QSpinBox,
    QVBoxLayout,
    QWidget,
)

from app.prefs import THEMES, AppPrefs
from engine.sampling import SamplingParams
from engine.session import ChatSettings

POLICY_LABELS = {"refuse": "Refuse and tell me", "drop_oldest": "Leave the oldest turns out"}
THINKING_LABELS = {None: "Model default", True: "On", False: "Off"}


def _spin(lo: float, hi: float, step: float, decimals: int, name: str) -> QDoubleSpinBox:
    box = QDoubleSpinBox()
    box.setRange(lo, hi)
    box.setSingleStep(step)
    box.setDecimals(decimals)
    box.setAccessibleName(name)
    return box


def _int_spin(lo: int, hi: int, name: str, special: str | None = None) -> QSpinBox:
    box = QSpinBox()
    box.setRange(lo, hi)
    box.setAccessibleName(name)
    if special:
        box.setSpecialValueText(special)  # shown at the minimum
    return box


class SettingsDialog(QDialog):
    """Edits copies of the chat settings and app prefs; `result_settings()`/`result_prefs()` after accept."""

    def __init__(self, settings: ChatSettings, prefs: AppPrefs, default_sampling: SamplingParams,
                 adapters: list[str], token_store=None, parent=None):
        super().__init__(parent)
        self.setWindowTitle("Settings")
        self.setAccessibleName("Settings")
        self._settings, self._prefs, self._defaults = settings, prefs, default_sampling
        self._token_store = token_store
        layout = QVBoxLayout(self)
        layout.addWidget(self._chat_group())
        layout.addWidget(self._sampling_group())
        layout.addWidget(self._app_group(adapters))
        self._buttons = buttons = QDialogButtonBox(QDialogButtonBox.StandardButton.Ok |
                                                   QDialogButtonBox.StandardButton.Cancel)
        buttons.accepted.connect(self.accept)
        buttons.rejected.connect(self.reject)
        layout.addWidget(buttons)

    # ---- groups -------------------------------------------------------------------------------------
    def _chat_group(self) -> QGroupBox:
        s = self._settings
        group = QGroupBox("Chat")
        form = QFormLayout(group)
        self.system = QPlainTextEdit(s.system or "")
        self.system.setPlaceholderText("The model's default system prompt")
        self.system.setAccessibleName("System prompt")
        self.system.setFixedHeight(70)
        form.addRow("System prompt", self.system)
        self.thinking = QComboBox()
        self.thinking.setAccessibleName("Thinking")
        for value, label in THINKING_LABELS.items():
            self.thinking.addItem(label, value)
        self.thinking.setCurrentIndex(list(THINKING_LABELS).index(s.thinking))
        form.addRow("Thinking (Qwen3)", self.thinking)
        self.max_tokens = _int_spin(1, 32768, "Longest reply in tokens")
        self.max_tokens.setValue(s.max_tokens)
        form.addRow("Longest reply (tokens)", self.max_tokens)
        self.context = _int_spin(0, 262144, "Context length in tokens", special="Model default")
        self.context.setSingleStep(1024)
        self.context.setValue(self._prefs.context)
        form.addRow("Context length", self.context)
        self.policy = QComboBox()
        self.policy.setAccessibleName("When the conversation outgrows the context")
        for value, label in POLICY_LABELS.items():
            self.policy.addItem(label, value)
        self.policy.setCurrentIndex(list(POLICY_LABELS).index(s.context_policy))
        form.addRow("When the context is full", self.policy)
        self.exact_decode = QCheckBox("Exact decode arithmetic (slower)")
        self.exact_decode.setAccessibleName("Exact decode arithmetic")
        self.exact_decode.setToolTip("Replies are generated with each layer's input rounded to 8 bits, as llama.cpp "
                                     "does on GPUs (prompts too, on models of 2,048 dims and up): about 1.5× faster "
                                     "on 4-bit models. Tick this to keep full precision. Applies when a model next "
                                     "loads.")
        self.exact_decode.setChecked(self._prefs.exact_decode)
        form.addRow(self.exact_decode)
        self.gpu_weights = QLineEdit(self._prefs.gpu_weights)
        self.gpu_weights.setAccessibleName("GPU weights budget")
        self.gpu_weights.setPlaceholderText("auto")
        self.gpu_weights.setToolTip("How much of the model's weights may live on the GPU: auto (the GPU's memory less "
                                    "the context cache and a margin), or a size such as 12G or 8192M. A mixture-of-"
                                    "experts model over it keeps its experts in RAM and streams them (slower); other "
                                    "models must fit. Applies when a model next loads.")
        self.gpu_weights.textChanged.connect(self._check_gpu_weights)
        self.gpu_weights_error = QLabel("")
        self.gpu_weights_error.setWordWrap(True)
        self.gpu_weights_error.setVisible(False)
        form.addRow("GPU weights budget", self.gpu_weights)
        form.addRow(self.gpu_weights_error)
        return group

    def _check_gpu_weights(self) -> bool:
        """Whether the budget as typed is valid; the reason is shown under the field, and OK is held back."""
        from engine.gpu_budget import parse_size

        try:
            parse_size(self.gpu_weights.text(), "GPU weights budget")
            problem = ""
        except ValueError as e:
            problem = str(e)
        self.gpu_weights_error.setText(problem)
        self.gpu_weights_error.setVisible(bool(problem))
        buttons = getattr(self, "_buttons", None)
        if buttons is not None:
            buttons.button(QDialogButtonBox.StandardButton.Ok).setEnabled(not problem)
        return not problem

    def _sampling_group(self) -> QGroupBox:
        group = QGroupBox("Sampling")
        form = QFormLayout(group)
        self.use_defaults = QCheckBox("Use the model's recommended settings")
        self.use_defaults.setAccessibleName("Use the model's recommended sampling settings")
        self.use_defaults.setChecked(self._settings.sampling is None)
        form.addRow(self.use_defaults)
        self.temperature = _spin(0.0, 2.0, 0.05, 2, "Temperature (0 = always the most likely word)")
        self.top_k = _int_spin(0, 1000, "Top-k (0 = off)", special="off")
        self.top_p = _spin(0.01, 1.0, 0.01, 2, "Top-p (1 = off)")
        self.min_p = _spin(0.0, 1.0, 0.01, 2, "Min-p (0 = off)")
        self.penalty = _spin(0.5, 2.0, 0.05, 2, "Repetition penalty (1 = off)")
        self.seed = _int_spin(-1, 2**31 - 1, "Seed (random when off)", special="random")
        for label, box in (("Temperature", self.temperature), ("Top-k", self.top_k), ("Top-p", self.top_p),
                           ("Min-p", self.min_p), ("Repetition penalty", self.penalty), ("Seed", self.seed)):
            form.addRow(label, box)
        self._show_sampling(self._settings.sampling or self._defaults)
        self.seed.setValue(self._settings.seed if self._settings.seed is not None else -1)
        self.use_defaults.toggled.connect(self._defaults_toggled)
        self._defaults_toggled(self.use_defaults.isChecked())
        return group

    def _app_group(self, adapters: list[str]) -> QGroupBox:
        p = self._prefs
        group = QGroupBox("App")
        form = QFormLayout(group)
        row = QHBoxLayout()
        self.models_dir = QLineEdit(p.models_dir)
        self.models_dir.setPlaceholderText("Default folder")
        self.models_dir.setAccessibleName("Models folder")
        browse = QPushButton("Browse…")
        browse.setAccessibleName("Choose the models folder")
        browse.clicked.connect(self._browse)
        row.addWidget(self.models_dir, 1)
        row.addWidget(browse)
        form.addRow("Models folder", _wrap(row))

        row = QHBoxLayout()
        self.token = QLineEdit()
        self.token.setEchoMode(QLineEdit.EchoMode.Password)
        self.token.setAccessibleName("Hugging Face token")
        saved = self._token_store.has_token() if self._token_store else False
        self.token.setPlaceholderText("•••••••• saved in the system keyring" if saved else "hf_… (optional)")
        self.clear_token = QCheckBox("Forget the saved token")
        self.clear_token.setAccessibleName("Forget the saved Hugging Face token")
        self.clear_token.setEnabled(saved)
        row.addWidget(self.token, 1)
        row.addWidget(self.clear_token)
        form.addRow("Hugging Face token", _wrap(row))

        self.adapter = QComboBox()
        self.adapter.setAccessibleName("GPU")
        self.adapter.addItem("Automatic (fastest)", "")
        for i, name in enumerate(adapters):
            self.adapter.addItem(name, str(i))
        found = self.adapter.findData(p.adapter)
        self.adapter.setCurrentIndex(max(found, 0))
        form.addRow("GPU", self.adapter)
        self.theme = QComboBox()
        self.theme.setAccessibleName("Theme")
        for t in THEMES:
            self.theme.addItem(t.capitalize(), t)
        self.theme.setCurrentIndex(THEMES.index(p.theme))
        form.addRow("Theme", self.theme)
        self.offline = QCheckBox("Offline mode: never use the network")
        self.offline.setAccessibleName("Offline mode")
        self.offline.setChecked(p.offline)
        form.addRow(self.offline)
        form.addRow(QLabel("Loaded models never use the network; offline mode also blocks downloads."))
        return group

    # ---- behaviour ------------------------------------------------------------------------------------
    def _show_sampling(self, s: SamplingParams) -> None:
        self.temperature.setValue(s.temperature)
        self.top_k.setValue(s.top_k)
        self.top_p.setValue(s.top_p)
        self.min_p.setValue(s.min_p)
        self.penalty.setValue(s.repetition_penalty)

    def _defaults_toggled(self, on: bool) -> None:
        if on:
            self._show_sampling(self._defaults)
        for box in (self.temperature, self.top_k, self.top_p, self.min_p, self.penalty):
            box.setEnabled(not on)

    def _browse(self) -> None:
        folder = QFileDialog.getExistingDirectory(self, "Models folder", self.models_dir.text())
        if folder:
            self.models_dir.setText(folder)

    # ---- results ---------------------------------------------------------------------------------------
    def result_settings(self) -> ChatSettings:
        sampling = None if self.use_defaults.isChecked() else SamplingParams(
            temperature=round(self.temperature.value(), 4), top_k=self.top_k.value(),
            top_p=round(self.top_p.value(), 4), min_p=round(self.min_p.value(), 4),
            repetition_penalty=round(self.penalty.value(), 4))
        return replace(
            self._settings, system=self.system.toPlainText().strip() or None, thinking=self.thinking.currentData(),
            max_tokens=self.max_tokens.value(), context_policy=self.policy.currentData(), sampling=sampling,
            seed=None if self.seed.value() < 0 else self.seed.value())

    def result_prefs(self) -> AppPrefs:
        return replace(self._prefs, models_dir=self.models_dir.text().strip(), adapter=self.adapter.currentData(),
                       theme=self.theme.currentData(), offline=self.offline.isChecked(),
                       context=self.context.value(), exact_decode=self.exact_decode.isChecked(),
                       gpu_weights=self.gpu_weights.text().strip() or "auto")

    def token_change(self) -> tuple[str, str | None]:
        """("set", token), ("clear", None) or ("keep", None) — applied by the caller through the keyring."""
        if self.token.text().strip():
            return "set", self.token.text().strip()
        if self.clear_token.isChecked():
            return "clear", None
        return "keep", None


def _wrap(layout) -> QWidget:
    w = QWidget()
    layout.setContentsMargins(0, 0, 0, 0)
    w.setLayout(layout)
    return w
