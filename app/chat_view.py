"""The conversation view: one widget per message, markdown prose, code blocks with Copy, collapsible thinking."""

from __future__ import annotations

from PySide6.QtCore import Qt, QTimer, Signal
from PySide6.QtGui import QFontDatabase, QGuiApplication
from PySide6.QtWidgets import (
    QFrame,
    QHBoxLayout,
    QLabel,
    QPlainTextEdit,
    QPushButton,
    QScrollArea,
    QSizePolicy,
    QToolButton,
    QVBoxLayout,
    QWidget,
)

from app.markdown import split_blocks

MAX_CODE_LINES = 30


class CodeBlock(QFrame):
    """A read-only monospace view of one fenced block with its language and a Copy button."""

    def __init__(self, code: str, language: str, parent=None):
        super().__init__(parent)
        self.setObjectName("codeBlock")
        self.setFrameShape(QFrame.Shape.StyledPanel)
        layout = QVBoxLayout(self)
        layout.setContentsMargins(6, 4, 6, 6)
        bar = QHBoxLayout()
        self.language = QLabel(language or "code")
        self.language.setObjectName("codeLanguage")
        self.copy = QPushButton("Copy")
        self.copy.setAccessibleName(f"Copy {language or 'code'} block")
        self.copy.clicked.connect(self._copy)
        bar.addWidget(self.language)
        bar.addStretch(1)
        bar.addWidget(self.copy)
        layout.addLayout(bar)
        self.view = QPlainTextEdit()
        self.view.setReadOnly(True)
        self.view.setLineWrapMode(QPlainTextEdit.LineWrapMode.NoWrap)
        self.view.setFont(QFontDatabase.systemFont(QFontDatabase.SystemFont.FixedFont))
        self.view.setAccessibleName(f"{language or 'Code'} block")
        layout.addWidget(self.view)
        self.set_code(code)

    def set_code(self, code: str) -> None:
        if self.view.toPlainText() != code:
            self.view.setPlainText(code)
        lines = min(max(code.count("\n") + 1, 1), MAX_CODE_LINES)
        height = self.view.fontMetrics().lineSpacing() * lines + 16
        self.view.setFixedHeight(height + self.view.horizontalScrollBar().sizeHint().height())

    def _copy(self) -> None:
        QGuiApplication.clipboard().setText(self.view.toPlainText())
        self.copy.setText("Copied")
        QTimer.singleShot(1500, self.copy, lambda: self.copy.setText("Copy"))  # dropped if the button goes


def _prose(text: str) -> QLabel:
    label = QLabel()
    label.setTextFormat(Qt.TextFormat.MarkdownText)
    label.setWordWrap(True)
    label.setOpenExternalLinks(True)
    label.setTextInteractionFlags(Qt.TextInteractionFlag.TextBrowserInteraction)
    label.setSizePolicy(QSizePolicy.Policy.Preferred, QSizePolicy.Policy.Minimum)
    label.setText(text)
    return label


class MessageWidget(QFrame):
    """One message. Assistant messages stream: set_content() is called as text arrives."""

    edit_requested = Signal(int, str)  # message index, new text
    regenerate_requested = Signal()

    def __init__(self, index: int, role: str, author: str, parent=None):
        super().__init__(parent)
        self.index, self.role = index, role
        self.setObjectName("userMessage" if role == "user" else "assistantMessage")
        self._answer, self._thinking = "", ""
        layout = QVBoxLayout(self)
        layout.setContentsMargins(12, 8, 12, 8)
        header = QHBoxLayout()
        self.author = QLabel(f"<b>{author}</b>")
        header.addWidget(self.author)
        header.addStretch(1)
        self.status = QLabel()
        self.status.setObjectName("messageStatus")
        header.addWidget(self.status)
        self.action = QToolButton()
        if role == "user":
            self.action.setText("Edit")
            self.action.setAccessibleName("Edit this message and answer it again")
            self.action.clicked.connect(self._start_edit)
        else:
            self.action.setText("Regenerate")
            self.action.setAccessibleName("Answer the last message again")
            self.action.clicked.connect(self.regenerate_requested)
            self.action.hide()  # shown on the last reply once it is finished
            self.copy = QToolButton()
            self.copy.setText("Copy")
            self.copy.setAccessibleName("Copy this answer")
            self.copy.clicked.connect(self._copy_answer)
            header.addWidget(self.copy)
        header.addWidget(self.action)
        layout.addLayout(header)

        self.thinking_toggle = QToolButton()
        self.thinking_toggle.setCheckable(True)
        self.thinking_toggle.setToolButtonStyle(Qt.ToolButtonStyle.ToolButtonTextBesideIcon)
        self.thinking_toggle.setArrowType(Qt.ArrowType.RightArrow)
        self.thinking_toggle.setText("Thinking")
        self.thinking_toggle.setAccessibleName("Show or hide the model's thinking")
        self.thinking_toggle.toggled.connect(self._toggle_thinking)
        self.thinking_view = QLabel()
        self.thinking_view.setObjectName("thinking")
        self.thinking_view.setWordWrap(True)
        self.thinking_view.setTextFormat(Qt.TextFormat.PlainText)
        self.thinking_view.setTextInteractionFlags(Qt.TextInteractionFlag.TextSelectableByMouse
                                                   | Qt.TextInteractionFlag.TextSelectableByKeyboard)
        self.thinking_toggle.hide()
        self.thinking_view.hide()
        layout.addWidget(self.thinking_toggle)
        layout.addWidget(self.thinking_view)

        self.body = QVBoxLayout()
        layout.addLayout(self.body)
        self._blocks: list[tuple[str, QWidget]] = []
        self._editor: QPlainTextEdit | None = None

    # ---- content -----------------------------------------------------------------------------
    @property
    def answer(self) -> str:
        return self._answer

    @property
    def thinking(self) -> str:
        return self._thinking

    def set_content(self, answer: str, thinking: str = "") -> None:
        if thinking != self._thinking:
            self._thinking = thinking
            self.thinking_view.setText(thinking)
            self.thinking_toggle.setVisible(bool(thinking))
        if answer != self._answer or not self._blocks:
            self._answer = answer
            self._render(answer)

    def append(self, thinking: str, answer: str) -> None:
        self.set_content(self._answer + answer, self._thinking + thinking)

    def _render(self, text: str) -> None:
        blocks = split_blocks(text) if self.role != "user" else ([] if not text else [_user_block(text)])
        for i, block in enumerate(blocks):
            if i < len(self._blocks) and self._blocks[i][0] == block.kind:
                widget = self._blocks[i][1]
                if block.kind == "code":
                    widget.set_code(block.text)
                elif widget.text() != block.text:
                    widget.setText(block.text)
                continue
            for _, old in self._blocks[i:]:  # structure changed from here on: rebuild the tail
                old.deleteLater()
            del self._blocks[i:]
            widget = CodeBlock(block.text, block.language) if block.kind == "code" else _prose(block.text)
            if block.kind == "text" and self.role == "user":
                widget.setTextFormat(Qt.TextFormat.PlainText)  # what the user typed, exactly
            self.body.addWidget(widget)
            self._blocks.append((block.kind, widget))
        for _, old in self._blocks[len(blocks):]:
            old.deleteLater()
        del self._blocks[len(blocks):]

    def _copy_answer(self) -> None:
        """The answer's markdown as written (code fences included), without the thinking."""
        QGuiApplication.clipboard().setText(self._answer)
        self.copy.setText("Copied")
        QTimer.singleShot(1500, self.copy, lambda: self.copy.setText("Copy"))  # dropped if the button goes

    def _toggle_thinking(self, shown: bool) -> None:
        self.thinking_view.setVisible(shown)
        self.thinking_toggle.setArrowType(Qt.ArrowType.DownArrow if shown else Qt.ArrowType.RightArrow)

    def set_status(self, text: str) -> None:
        self.status.setText(text)

    # ---- editing (user messages) -----------------------------------------------------------------
    def _start_edit(self) -> None:
        if self._editor is not None:
            return
        self._editor = QPlainTextEdit(self._answer)
        self._editor.setAccessibleName("Edited message")
        row = QHBoxLayout()
        save, cancel = QPushButton("Save and answer"), QPushButton("Cancel")
        save.setAccessibleName("Save the edit and answer again")
        cancel.setAccessibleName("Cancel editing")
        row.addStretch(1)
        row.addWidget(cancel)
        row.addWidget(save)
        holder = QWidget()
        holder.setLayout(row)
        self.body.addWidget(self._editor)
        self.body.addWidget(holder)
        self._edit_holder = holder
        save.clicked.connect(self._save_edit)
        cancel.clicked.connect(self._end_edit)
        self._editor.setFocus()

    def _save_edit(self) -> None:
        text = self._editor.toPlainText().strip() if self._editor else ""
        self._end_edit()
        if text:
            self.edit_requested.emit(self.index, text)

    def _end_edit(self) -> None:
        if self._editor is not None:
            self._editor.deleteLater()
            self._edit_holder.deleteLater()
            self._editor = None


def _user_block(text: str):
    from app.markdown import Block

    return Block("text", text)


class ChatView(QScrollArea):
    """A scrolling column of MessageWidgets; follows the newest text unless the user scrolled up."""

    edit_requested = Signal(int, str)
    regenerate_requested = Signal()

    def __init__(self, parent=None):
        super().__init__(parent)
        self.setWidgetResizable(True)
        self.setAccessibleName("Conversation")
        self.container = QWidget()
        self.column = QVBoxLayout(self.container)
        self.column.setSpacing(10)
        self.placeholder = QLabel("Pick a model, then ask anything. Everything stays on this computer.")
        self.placeholder.setObjectName("placeholder")
        self.placeholder.setAlignment(Qt.AlignmentFlag.AlignCenter)
        self.placeholder.setWordWrap(True)
        self.column.addWidget(self.placeholder)
        self.column.addStretch(1)
        self.setWidget(self.container)
        self.messages: list[MessageWidget] = []
        self._follow = True
        bar = self.verticalScrollBar()
        bar.valueChanged.connect(lambda v: setattr(self, "_follow", v >= bar.maximum() - 24))
        bar.rangeChanged.connect(lambda _lo, hi: self._follow and bar.setValue(hi))

    def clear(self) -> None:
        for m in self.messages:
            m.deleteLater()
        self.messages = []
        self.placeholder.show()

    def add(self, role: str, author: str, answer: str = "", thinking: str = "") -> MessageWidget:
        self.placeholder.hide()
        widget = MessageWidget(len(self.messages), role, author)
        widget.set_content(answer, thinking)
        widget.edit_requested.connect(self.edit_requested)
        widget.regenerate_requested.connect(self.regenerate_requested)
        self.column.insertWidget(self.column.count() - 1, widget)
        self.messages.append(widget)
        self._follow = True
        return widget

    def truncate(self, count: int) -> None:
        """Drop message widgets from index `count` on."""
        for m in self.messages[count:]:
            m.deleteLater()
        del self.messages[count:]
        if not self.messages:
            self.placeholder.show()

    def set_idle(self, idle: bool) -> None:
        """While a reply streams, editing and regenerating are off; after, the last reply offers Regenerate."""
        for m in self.messages:
            m.action.setEnabled(idle)
            if m.role == "assistant":
                m.action.setVisible(idle and m is self.messages[-1])
