"""Light and dark themes: the Fusion style with a palette, plus a small stylesheet for chat bubbles."""

from __future__ import annotations

from PySide6.QtGui import QColor, QPalette
from PySide6.QtWidgets import QApplication

_DARK = {
    QPalette.ColorRole.Window: "#202124", QPalette.ColorRole.WindowText: "#e8eaed",
    QPalette.ColorRole.Base: "#17181a", QPalette.ColorRole.AlternateBase: "#2a2b2e",
    QPalette.ColorRole.Text: "#e8eaed", QPalette.ColorRole.Button: "#2d2e31",
    QPalette.ColorRole.ButtonText: "#e8eaed", QPalette.ColorRole.Highlight: "#4c8bf5",
    QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: "#2d2e31",
    QPalette.ColorRole.ToolTipText: "#e8eaed", QPalette.ColorRole.PlaceholderText: "#9aa0a6",
    QPalette.ColorRole.Link: "#8ab4f8",
}
_LIGHT = {
    QPalette.ColorRole.Window: "#f6f7f9", QPalette.ColorRole.WindowText: "#1f2328",
    QPalette.ColorRole.Base: "#ffffff", QPalette.ColorRole.AlternateBase: "#eef0f3",
    QPalette.ColorRole.Text: "#1f2328", QPalette.ColorRole.Button: "#eceef1",
    QPalette.ColorRole.ButtonText: "#1f2328", QPalette.ColorRole.Highlight: "#2f6feb",
    QPalette.ColorRole.HighlightedText: "#ffffff", QPalette.ColorRole.ToolTipBase: "#ffffff",
    QPalette.ColorRole.ToolTipText: "#1f2328", QPalette.ColorRole.PlaceholderText: "#6e7781",
    QPalette.ColorRole.Link: "#0969da",
}

_STYLE = """
#userMessage {{ background: {user}; border-radius: 10px; }}
#assistantMessage {{ background: {assistant}; border-radius: 10px; }}
#codeBlock {{ background: {code}; border-radius: 6px; }}
#thinking {{ color: {muted}; font-style: italic; }}
#messageStatus, #codeLanguage, #placeholder {{ color: {muted}; }}
#notice {{ background: {notice}; border: 1px solid {notice_border}; border-radius: 6px; }}
"""


def _is_dark(app: QApplication, theme: str) -> bool:
    if theme != "system":
        return theme == "dark"
    return app.styleHints().colorScheme().name == "Dark"


def apply_theme(app: QApplication, theme: str) -> None:
    app.setStyle("Fusion")
    dark = _is_dark(app, theme)
    palette = QPalette()
    for role, color in (_DARK if dark else _LIGHT).items():
        palette.setColor(role, QColor(color))
    app.setPalette(palette)
    colors = (dict(user="#2b3a55", assistant="#2a2b2e", code="#111214", muted="#9aa0a6", notice="#3b3317",
                   notice_border="#8a6d1f") if dark
              else dict(user="#dde8fb", assistant="#ffffff", code="#f2f3f5", muted="#6e7781", notice="#fff5d6",
                        notice_border="#d4a72c"))
    app.setStyleSheet(_STYLE.format(**colors))
