"""A dismissible notice across the top of the window (the software-adapter warning)."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtWidgets import QFrame, QHBoxLayout, QLabel, QPushButton


class Notice(QFrame):
    dismissed = Signal()

    def __init__(self, title: str, text: str, parent=None):
        super().__init__(parent)
        self.setObjectName("notice")
        self.setAccessibleName(title)
        row = QHBoxLayout(self)
        self.label = QLabel(f"<b>{title}</b><br>{text}")
        self.label.setTextFormat(Qt.TextFormat.RichText)
        self.label.setWordWrap(True)
        self.label.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse)
        self.button = QPushButton("Got it")
        self.button.setAccessibleName("Dismiss this notice")
        self.button.clicked.connect(self._dismiss)
        row.addWidget(self.label, 1)
        row.addWidget(self.button, 0, Qt.AlignmentFlag.AlignTop)

    def text(self) -> str:
        return self.label.text()

    def _dismiss(self) -> None:
        self.hide()
        self.dismissed.emit()
