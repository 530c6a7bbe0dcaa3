"""`zerotvm-chat` / `python -m app`: start the desktop app, or `--self-test` without a window."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

PREFS_FILE = "app.json"
STORE_FILE = "chats.sqlite3"


def parse_args(argv: list[str] | None):
    from engine import get_version

    p = argparse.ArgumentParser(prog="zerotvm-chat", description="Zero-TVM Desktop: private LLM chat on your GPU")
    p.add_argument("--version", action="version", version=f"%(prog)s {get_version()}")
    p.add_argument("--self-test", action="store_true",
                   help="load the demo model without a window, answer one question, print it and exit")
    p.add_argument("--data-dir", help="keep chats, settings and models here instead of the per-user folder")
    p.add_argument("--no-auto-setup", action="store_true", help="do not load or install a model at start")
    args, qt_args = p.parse_known_args(argv)
    return args, qt_args


def main(argv: list[str] | None = None) -> int:
    args, qt_args = parse_args(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("XDG_RUNTIME_DIR", "/tmp")  # Mesa's Vulkan warns loudly without it
    from app.errors import setup_logging
    from engine.paths import choose_data_dir, data_dir, data_dir_problem, use_temporary_data_dir

    if args.data_dir:
        choose_data_dir(Path(args.data_dir).resolve(), setting="--data-dir")

    problem = data_dir_problem()  # a file, read-only, full: one sentence, and the window still starts
    if problem:
        print(f"zerotvm-chat: {problem}", file=sys.stderr)
    source = use_temporary_data_dir() if problem else None
    setup_logging(data_dir() / "logs")
    from engine import get_version

    logging.getLogger("zerotvm.app").info("zerotvm-chat %s started (pid %d)", get_version(), os.getpid())
    if args.self_test:
        from app.self_test import run_self_test

        return run_self_test()
    return run_app(qt_args, auto_setup=not args.no_auto_setup and not problem, data_problem=problem,
                   source=source)


def run_app(qt_args: list[str], auto_setup: bool = True, data_problem: str | None = None,
            source: Path | None = None) -> int:
    """`source`: where the user's chats, settings and prefs are read from when the data folder cannot be written
    (this session then writes to a temporary one)."""
    from PySide6.QtWidgets import QApplication

    from app.errors import startup_notice
    from app.prefs import load_prefs
    from app.store import open_store
    from app.theme import apply_theme
    from app.window import MainWindow, apply_engine_prefs
    from engine.paths import data_dir
    from engine.settings import read_settings

    app = QApplication.instance() or QApplication(["zerotvm-chat", *qt_args])
    app.setApplicationName("ZeroTVM")
    app.setApplicationDisplayName("Zero-TVM")
    from PySide6.QtGui import QIcon

    from engine.resources import resource_path

    app.setWindowIcon(QIcon(str(resource_path("icons/zerotvm-256.png"))))  # PNG: no SVG plugin needed
    data = data_dir()
    prefs_path = data / PREFS_FILE
    prefs = load_prefs((source or data) / PREFS_FILE)
    apply_engine_prefs(prefs)
    apply_theme(app, prefs.theme)
    store = open_store((source or data) / STORE_FILE)  # never fails: repaired, recovered or kept in memory
    settings, settings_problems = read_settings((source or data) / "settings.json")
    window = MainWindow(store, settings, prefs, prefs_path, _adapters(), TokenStore(), auto_setup,
                        adapter=_chosen_adapter(prefs.adapter))
    window.show()
    notice = startup_notice(data_problem, store.notice, settings_problems)
    if notice:
        window.show_error(*notice)
    closer = _close_on_signals(app, window)
    try:
        code = app.exec()
    finally:
        if closer is not None:
            closer.restore()
        store.close()
    if window.exit_without_waiting:  # every message is saved and the store closed: do not wait on the GPU queue
        import logging

        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


def _close_on_signals(app, window):
    """SIGTERM / SIGINT close the window like its close button (app/signals.py); only the main thread can."""
    import threading

    if threading.current_thread() is not threading.main_thread():
        return None
    from app.signals import SignalCloser

    return SignalCloser(app, window)


def _adapters() -> list[str]:
    try:
        from engine.gpu import list_adapters

        return [a.summary() for a in list_adapters()]
    except Exception:  # the worker reports GPU problems when it loads a model
        return []


def _chosen_adapter(choice: str):
    """The adapter the engine worker will open (for the software-GPU notice), or None if none is usable."""
    try:
        from engine.gpu import pick_adapter

        return pick_adapter(choice or None)
    except Exception:  # the worker reports GPU problems when it loads a model
        return None


class TokenStore:
    """The settings dialog's view of the Hugging Face token in the system keyring."""

    def has_token(self) -> bool:
        try:
            from engine.hub.token import get_token

            return bool(get_token())
        except Exception:
            return False

    def set(self, token: str) -> None:
        from engine.hub.token import set_token

        set_token(token)

    def clear(self) -> None:
        from engine.hub.token import clear_token

        clear_token()


if __name__ == "__main__":
    sys.exit(main())
