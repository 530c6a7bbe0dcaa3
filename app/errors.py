"""Errors in plain words for dialogs, and the log file that keeps the details (tracebacks never reach a dialog)."""

from __future__ import annotations

import logging
from logging.handlers import RotatingFileHandler
from pathlib import Path

from engine.errors import ContextLimitError, GpuError, ModelFormatError, ZeroTVMError

LOG_NAME = "zerotvm.log"
_log_path: Path | None = None


def setup_logging(folder: Path) -> Path:
    """Log to `folder`/zerotvm.log (rotated at 2 MB, 3 kept); returns the path for error messages."""
    global _log_path
    folder.mkdir(parents=True, exist_ok=True)
    _log_path = folder / LOG_NAME
    handler = RotatingFileHandler(_log_path, maxBytes=2_000_000, backupCount=3, encoding="utf-8")
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"))
    root = logging.getLogger("zerotvm")
    root.setLevel(logging.INFO)
    if not any(isinstance(h, RotatingFileHandler) for h in root.handlers):
        root.addHandler(handler)
    return _log_path


def log_path() -> Path | None:
    return _log_path


def _is_out_of_memory(e: BaseException) -> bool:
    text = str(e).lower()
    return isinstance(e, MemoryError) or "out of memory" in text or "outofmemory" in text


def describe_error(e: BaseException, what: str = "continue") -> tuple[str, str]:
    """(dialog title, message) for an exception: what happened and what to do about it."""
    from engine.chat import ChatTemplateError
    from engine.hub.errors import DownloadError

    details = f"\n\nDetails are in the log file: {_log_path}" if _log_path else ""
    if _is_out_of_memory(e):
        return ("Not enough memory",
                f"The model does not fit in this computer's memory ({e}).\n\nPick a smaller model or a shorter "
                "context length in Settings, and close other programs that use a lot of memory." + details)
    if isinstance(e, GpuError):
        return ("No compatible GPU",
                f"{e}\n\nZero-TVM needs a GPU with Vulkan (Windows, Linux), Metal (macOS) or DirectX 12 and f16 "
                "shader support. Update the graphics driver, or choose another GPU in Settings.")
    if isinstance(e, ContextLimitError):
        return ("Conversation too long",
                f"{e}.\n\nStart a new chat, or in Settings let the app leave the oldest turns out.")
    if isinstance(e, DownloadError):
        return "Download failed", f"{e}\n\nCheck the connection and try again; finished parts are kept." + details
    if isinstance(e, ChatTemplateError):  # before ModelFormatError: the files may be fine, the messages not
        return ("The model's chat template failed",
                f"{e}\n\nChange or shorten the conversation and try again, or choose another model." + details)
    if isinstance(e, ModelFormatError):
        return ("Model files are damaged or unsupported",
                f"{e}\n\nRemove the model and download it again, or choose a different file." + details)
    if isinstance(e, ZeroTVMError):
        return "Could not " + what, str(e) + details
    return ("Unexpected error",
            f"Zero-TVM could not {what}: {type(e).__name__}: {e}\n\nYour chats are saved." + details)
