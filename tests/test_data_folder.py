"""A data folder that cannot be used (a file, read-only, full) or holds damaged chats and settings: the app
starts, one dialog says what happened, nothing of the user's is lost or written over. Regression tests for
issue 16 (6): before, ZEROTVM_HOME as a file or read-only gave a traceback before any window."""

from __future__ import annotations

import errno
import json
import os
import sqlite3

import pytest

from engine import paths

pytestmark = pytest.mark.app  # drives the Qt app (through app.main.main)


@pytest.fixture
def home(tmp_path, monkeypatch):
    """ZEROTVM_HOME set through monkeypatch, so whatever the app changes in the environment is undone."""
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ZEROTVM_MODELS", raising=False)
    return tmp_path / "home"


def start_app(monkeypatch, argv=("--no-auto-setup",)):
    """Run app.main.main() until its window is up, then read what it showed and close it."""
    from PySide6.QtCore import QTimer
    from PySide6.QtWidgets import QApplication

    from app import main as app_main
    from app.window import MainWindow

    monkeypatch.setattr(app_main, "_adapters", lambda: [])  # no GPU enumeration needed here
    seen = {}

    def look(tries=[0]):  # noqa: B006 - a counter shared by the retries
        windows = [w for w in QApplication.topLevelWidgets() if isinstance(w, MainWindow) and w.isVisible()]
        if not windows:
            tries[0] += 1
            if tries[0] < 200:  # 20 s, then the bound below ends the loop
                QTimer.singleShot(100, look)
            return
        window = windows[0]
        try:
            seen.update(error=getattr(window, "last_error", None), store=window.store,
                        chats=window.store.list_conversations(), settings=window.settings)
        finally:  # whatever happened, the event loop ends: a failing test must not hang
            window.close()
            window.deleteLater()
            QApplication.instance().quit()

    QApplication.instance() or QApplication([])
    QTimer.singleShot(200, look)
    bound = QTimer(singleShot=True, interval=30_000)  # should the window never come up
    bound.timeout.connect(QApplication.instance().quit)
    bound.start()
    try:
        seen["rc"] = app_main.main(list(argv))
    finally:
        bound.stop()
    return seen


def files_under(root) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_data_dir_problem_sentences(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "ok"))
    assert paths.data_dir_problem() is None and (tmp_path / "ok").is_dir()
    (tmp_path / "file").write_text("x")
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "file"))
    assert paths.data_dir_problem() == (f"cannot keep chats and settings: a file is in the way of the data folder "
                                        f"{tmp_path / 'file'} (ZEROTVM_HOME) ({tmp_path / 'file'}); move it or "
                                        "choose another folder")
    for code, words in [(errno.EROFS, "is on a read-only disk"), (errno.EACCES, "no permission to write in"),
                        (errno.ENOSPC, "the disk holding the data folder")]:
        def refuse(*args, code=code, **kwargs):
            raise OSError(code, os.strerror(code))

        monkeypatch.setattr(paths.tempfile, "mkstemp", refuse)
        monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "ok"))
        assert words in paths.data_dir_problem()


def test_home_that_is_a_file_still_opens_the_window_and_says_so(home, monkeypatch, capfd, qapp):
    home.write_text("I am a file")
    seen = start_app(monkeypatch)
    assert seen["rc"] == 0
    title, message = seen["error"]
    assert title == "Some of your data needs attention"  # the folder, and the chats that cannot be kept
    assert "a file is in the way of the data folder" in message and "not saved" in message
    err = capfd.readouterr().err
    assert "zerotvm-chat: cannot keep chats and settings: a file is in the way" in err
    assert "Traceback" not in err
    assert home.read_text() == "I am a file"
    seen["store"].close()


def test_read_only_home_shows_the_chats_and_writes_nothing(home, monkeypatch, capfd, qapp):
    from app.store import ConversationStore

    home.mkdir()
    with ConversationStore(home / "chats.sqlite3") as store:
        store.add_message(store.create_conversation("Old chat"), "user", "still here")
    (home / "settings.json").write_text(json.dumps({"max_tokens": 99}))
    before = files_under(home)

    def read_only(*args, **kwargs):  # the OSError a read-only disk gives (the tests may run as root: no chmod)
        raise OSError(errno.EROFS, "Read-only file system")

    real_connect = sqlite3.connect

    def connect(target, *args, **kwargs):  # SQLite on a read-only disk: reading works, writing does not
        if str(target) == str(home / "chats.sqlite3"):
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return real_connect(target, *args, **kwargs)

    monkeypatch.setattr(paths.tempfile, "mkstemp", read_only)
    monkeypatch.setattr("app.store.sqlite3.connect", connect)
    seen = start_app(monkeypatch)
    assert seen["rc"] == 0
    title, message = seen["error"]
    assert "is on a read-only disk" in message and "cannot be opened for writing" in message
    assert [c["title"] for c in seen["chats"]] == ["Old chat"]  # shown from a copy in memory
    assert seen["settings"].max_tokens == 99
    assert files_under(home) == before  # nothing written, moved or repaired in the read-only folder
    assert "Traceback" not in capfd.readouterr().err
    seen["store"].close()


def test_damaged_chats_and_settings_start_with_one_dialog_and_backups(home, monkeypatch, qapp):
    from app.store import ConversationStore

    home.mkdir()
    with ConversationStore(home / "chats.sqlite3") as store:
        store.add_message(store.create_conversation("Precious"), "user", "keep")
    db = sqlite3.connect(home / "chats.sqlite3")
    db.execute("UPDATE schema_version SET version = 'abc'")
    db.execute("UPDATE conversations SET settings = '{broken'")
    db.commit()
    db.close()
    (home / "settings.json").write_text(json.dumps({"max_tokens": "lots", "thinking": "maybe"}))
    seen = start_app(monkeypatch)
    title, message = seen["error"]
    assert title == "Some of your data needs attention"
    assert "its schema version was 'abc'" in message and "max_tokens must be an integer" in message
    assert [c["title"] for c in seen["chats"]] == ["Precious"]
    assert len(list(home.glob("chats.sqlite3.backup-*"))) == 1 and len(list(home.glob("settings.json.bad-*"))) == 1
    seen["store"].close()


def test_the_apps_choices_reach_the_engine_and_leave_the_environment_alone(tmp_path, monkeypatch, qapp):
    """--data-dir and the prefs' models folder and offline mode go to the engine through its setters: the process
    environment (here a plain dict standing in for it) is the same after the app started as before."""
    from engine.hub.download import DownloadError, download_model
    from engine.hub.offline import offline_reason

    env = {k: v for k, v in os.environ.items() if not k.startswith("ZEROTVM_")}
    monkeypatch.setattr(os, "environ", env)
    before = dict(env)
    home, models = tmp_path / "chosen home", tmp_path / "chosen models"
    home.mkdir()
    (home / "app.json").write_text(json.dumps({"models_dir": str(models), "offline": True}))
    seen = start_app(monkeypatch, ("--no-auto-setup", "--data-dir", str(home)))
    seen["store"].close()
    assert seen["rc"] == 0 and seen["error"] is None
    assert os.environ is env and env == before
    assert paths.data_dir() == home and paths.models_dir() == models
    assert offline_reason() == "set in Settings"
    with pytest.raises(DownloadError, match=r"^offline mode is on \(set in Settings\): cannot download acme/x"):
        download_model("acme/x", dest=tmp_path / "x")
    assert "(Settings → Models folder)" in paths.describe_os_error(PermissionError(errno.EACCES, "no"), models, "x")


def test_folder_choices_win_over_the_environment_and_reset(tmp_path, monkeypatch):
    monkeypatch.setenv("ZEROTVM_HOME", str(tmp_path / "env home"))
    monkeypatch.setenv("ZEROTVM_MODELS", str(tmp_path / "env models"))
    paths.choose_data_dir(tmp_path / "home", setting="--data-dir")
    paths.choose_models_dir(tmp_path / "models")
    assert (paths.data_dir(), paths.models_dir()) == (tmp_path / "home", tmp_path / "models")
    refused = paths.describe_os_error(OSError(errno.EROFS, "ro"), tmp_path / "home", "keep chats")
    assert refused == f"cannot keep chats: the data folder {tmp_path / 'home'} (--data-dir) is on a read-only disk; " \
                      "choose a folder on a writable disk"
    paths.choose_models_dir(None)  # the prefs' "default folder" again: the environment's
    assert paths.models_dir() == tmp_path / "env models"
    paths.reset_choices()
    assert (paths.data_dir(), paths.models_dir()) == (tmp_path / "env home", tmp_path / "env models")
    monkeypatch.delenv("ZEROTVM_MODELS")
    assert paths.models_dir() == tmp_path / "env home" / "models"
