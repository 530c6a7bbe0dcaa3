"""The conversation list: every chat in the store, newest first, with rename, export and delete (F2, Delete,
context menu). It owns no chat state: the window says which chat is open and is told which one was picked."""

from __future__ import annotations

from PySide6.QtCore import Qt, Signal
from PySide6.QtGui import QAction, QKeySequence
from PySide6.QtWidgets import QFileDialog, QInputDialog, QListWidget, QListWidgetItem, QMenu, QMessageBox

from app.store import ConversationStore


class ConversationList(QListWidget):
    picked = Signal(int)  # the user selected a chat
    deleted = Signal(int)  # a chat was deleted (the window closes it if it was open)

    def __init__(self, store: ConversationStore, parent=None):
        super().__init__(parent)
        self.store = store
        self.locked = False  # while a reply streams, switching or deleting chats waits
        self.setAccessibleName("Conversations")
        self.setContextMenuPolicy(Qt.ContextMenuPolicy.CustomContextMenu)
        self.customContextMenuRequested.connect(self._menu)
        self.currentItemChanged.connect(self._changed)
        for name, keys, slot in (("Rename chat", "F2", self.rename_current),
                                 ("Delete chat", QKeySequence.StandardKey.Delete, self.delete_current)):
            action = QAction(name, self)
            action.setShortcut(keys)
            action.setShortcutContext(Qt.ShortcutContext.WidgetShortcut)
            action.triggered.connect(slot)
            self.addAction(action)

    def refresh(self, current: int | None) -> None:
        """Reload the list from the store, keeping `current` selected, without emitting `picked`."""
        self.blockSignals(True)
        self.clear()
        for c in self.store.list_conversations():
            item = QListWidgetItem(c["title"])
            item.setData(Qt.ItemDataRole.UserRole, c["id"])
            item.setToolTip(f"{c['message_count']} messages")
            self.addItem(item)
            if c["id"] == current:
                self.setCurrentItem(item)
        self.blockSignals(False)

    def current_id(self) -> int | None:
        item = self.currentItem()
        return None if item is None else item.data(Qt.ItemDataRole.UserRole)

    def _changed(self, item, _previous=None) -> None:
        if item is not None and not self.locked:
            self.picked.emit(item.data(Qt.ItemDataRole.UserRole))

    def rename_current(self) -> None:
        item = self.currentItem()
        if item is None:
            return
        title, ok = QInputDialog.getText(self, "Rename chat", "Title:", text=item.text())
        if ok and title.strip():
            self.store.rename(self.current_id(), title)
            self.refresh(self.current_id())

    def delete_current(self) -> None:
        item = self.currentItem()
        if item is None or self.locked:
            return
        answer = QMessageBox.question(self, "Delete chat", f"Delete “{item.text()}”? This cannot be undone.")
        if answer == QMessageBox.StandardButton.Yes:
            conv = self.current_id()
            self.store.delete(conv)
            self.deleted.emit(conv)
            self.refresh(None)

    def export_current(self, kind: str) -> None:
        item = self.currentItem()
        if item is None:
            return
        suffix = ".md" if kind == "markdown" else ".json"
        path, _ = QFileDialog.getSaveFileName(self, "Export chat", item.text() + suffix,
                                              "Markdown (*.md)" if suffix == ".md" else "JSON (*.json)")
        if path:
            self.store.export(self.current_id(), path if path.endswith(suffix) else path + suffix)

    def _menu(self, pos) -> None:
        if self.currentItem() is None:
            return
        menu = QMenu(self)
        menu.addAction("Rename…", self.rename_current)
        menu.addAction("Export as Markdown…", lambda: self.export_current("markdown"))
        menu.addAction("Export as JSON…", lambda: self.export_current("json"))
        menu.addSeparator()
        menu.addAction("Delete", self.delete_current)
        menu.exec(self.mapToGlobal(pos))
