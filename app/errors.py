"""Errors in plain words for dialogs, and the log file that keeps the details (tracebacks never reach a dialog)."""

from __future__ import annotations

import logging
import tempfile
from logging.handlers import RotatingFileHandler
from pathlib import Path

from engine.errors import (
    BudgetSpellingError,
    ContextLimitError,
    GpuError,
    ModelFormatError,
    WeightsBudgetError,
    ZeroTVMError,
)

LOG_NAME = "zerotvm.log"
_log_path: Path | None = None


def setup_logging(folder: Path) -> Path | None:
    """Log to `folder`/zerotvm.log (rotated at 2 MB, 3 kept); returns the path for error messages. A folder that
    cannot be written means logging to a temporary folder, and failing that, no log file (never an error)."""
    global _log_path
    for candidate in (Path(folder), Path(tempfile.gettempdir()) / "zerotvm-logs"):
        try:
            candidate.mkdir(parents=True, exist_ok=True)
            handler = RotatingFileHandler(candidate / LOG_NAME, maxBytes=2_000_000, backupCount=3,
                                          encoding="utf-8")
        except OSError:
            continue
        _log_path = candidate / LOG_NAME
        break
    else:
        return None
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(threadName)s %(name)s: %(message)s"))
    root = logging.getLogger("zerotvm")
    root.setLevel(logging.INFO)
    if not any(isinstance(h, RotatingFileHandler) for h in root.handlers):
        root.addHandler(handler)
    else:
        handler.close()
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
    if isinstance(e, (WeightsBudgetError, BudgetSpellingError)):  # the user's setting, not the GPU or its driver
        text = str(e)
        return ("GPU weights budget",
                f"{text[:1].upper()}{text[1:]}.\n\nChange it in Settings → GPU weights budget (a size there wins over "
                "ZEROTVM_GPU_WEIGHTS), or set it to auto to let Zero-TVM choose.")
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


def startup_notice(data_problem: str | None, store_notice: str | None,
                   settings_problems: list[str]) -> tuple[str, str] | None:
    """One dialog (title, message) for everything found wrong with the user's data at start, or None."""
    parts: list[tuple[str, str]] = []
    if data_problem:
        parts.append(("The data folder cannot be used",
                      f"{data_problem[0].upper()}{data_problem[1:]}.\n\nZero-TVM runs, but chats, settings and "
                      "downloads of this session are not saved. Set ZEROTVM_HOME (or start with --data-dir) to a "
                      "folder you can write to, or fix this one, then restart."))
    if store_notice:
        parts.append(("Your chat history needed attention", store_notice))
    if settings_problems:
        parts.append(("Some settings were reset", "Some chat settings could not be used and fell back to their "
                      "defaults (Settings shows what is in use now):\n\n• " + "\n• ".join(settings_problems)))
    if not parts:
        return None
    if len(parts) == 1:
        return parts[0]
    return "Some of your data needs attention", "\n\n".join(f"{title}: {text}" for title, text in parts)
