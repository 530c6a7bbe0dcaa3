"""The app's conversation store (app/store.py): plain sqlite3, so these tests need neither a GPU nor a display."""

import json
import os
import sqlite3
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest

from app.store import (
    MIGRATIONS,
    SCHEMA_VERSION,
    ConversationStore,
    SchemaTooNewError,
    StoreRecoveredWarning,
    auto_title,
)

ROOT = Path(__file__).resolve().parents[1]


class Clock:
    """A clock that ticks one second per reading, so ordering by updated_at needs no sleeping."""

    def __init__(self, start=1_700_000_000.0):
        self.now = start

    def __call__(self):
        self.now += 1
        return self.now


@pytest.fixture
def store(tmp_path):
    with ConversationStore(tmp_path / "chats.db", clock=Clock()) as s:
        yield s


def test_create_list_rename_delete(store):
    a = store.create_conversation(model="qwen3-4b")
    b = store.create_conversation("Named", model="phi3")
    assert [c["id"] for c in store.list_conversations()] == [b, a]
    row = store.list_conversations()[1]
    assert row["title"] == "New chat" and row["model"] == "qwen3-4b" and row["message_count"] == 0
    store.rename(a, "  Trip plans ")
    assert store.conversation(a)["title"] == "Trip plans" and not store.conversation(a)["auto_title"]
    with pytest.raises(ValueError):
        store.rename(a, "   ")
    store.update_conversation(a, system_prompt="Be brief.", settings={"thinking": False, "max_tokens": 64})
    conv = store.conversation(a)
    assert conv["system_prompt"] == "Be brief." and conv["settings"] == {"thinking": False, "max_tokens": 64}
    with pytest.raises(TypeError):
        store.update_conversation(a, title="not this way")
    store.add_message(a, "user", "hi")
    store.delete(a)
    assert [c["id"] for c in store.list_conversations()] == [b]
    assert store._db.execute("SELECT COUNT(*) FROM messages").fetchone()[0] == 0  # cascaded
    for call in (lambda: store.delete(a), lambda: store.rename(a, "x"), lambda: store.messages(a),
                 lambda: store.add_message(a, "user", "x")):
        with pytest.raises(KeyError):
            call()
    with pytest.raises(ValueError):
        store.add_message(b, "tool", "x")


def test_list_orders_by_last_activity_with_pinned_first(store):
    a, b, c = (store.create_conversation(t) for t in "abc")
    assert [r["title"] for r in store.list_conversations()] == ["c", "b", "a"]
    store.add_message(a, "user", "one")
    store.add_message(a, "assistant", "two")
    store.rename(b, "renamed")  # naming a chat is not activity: it does not move
    assert [r["id"] for r in store.list_conversations()] == [a, c, b]
    assert store.list_conversations()[0]["message_count"] == 2
    store.update_conversation(b, pinned=True)
    assert [(r["id"], r["pinned"]) for r in store.list_conversations()] == [(b, True), (a, False), (c, False)]


def test_wal_mode_foreign_keys_and_durable_sync(store):
    db = store._db
    assert db.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    assert db.execute("PRAGMA foreign_keys").fetchone()[0] == 1
    assert db.execute("PRAGMA synchronous").fetchone()[0] == 2  # FULL
    assert store.schema_version() == SCHEMA_VERSION == len(MIGRATIONS)
    assert [tuple(r) for r in db.execute("SELECT id, version FROM schema_version")] == [(1, SCHEMA_VERSION)]


def test_connection_refuses_other_threads(store):
    errors = []
    t = threading.Thread(target=lambda: errors.append(_raises(store.list_conversations)))
    t.start()
    t.join()
    assert errors == [sqlite3.ProgrammingError]


def _raises(fn):
    try:
        fn()
    except Exception as e:
        return type(e)


def test_messages_round_trip_for_chat_session_and_ui(store):
    cid = store.create_conversation(model="qwen3-4b")
    u = store.add_message(cid, "user", "What is 2+2?")
    r = store.add_message(cid, "assistant", "4", thinking="2+2 is 4.", stats={"tok_s": 31.5, "tokens": 9})
    assert store.messages(cid) == [
        {"role": "user", "content": "What is 2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "2+2 is 4."},
    ]
    rows = store.message_rows(cid)
    assert [(m["id"], m["position"], m["role"]) for m in rows] == [(u, 0, "user"), (r, 1, "assistant")]
    assert rows[1]["stats"] == {"tok_s": 31.5, "tokens": 9} and rows[1]["model"] == "qwen3-4b"
    assert rows[0]["stats"] is None and rows[0]["model"] is None and rows[0]["thinking"] == ""


def test_streaming_updates(store):
    cid = store.create_conversation()
    store.add_message(cid, "user", "Count to three")
    before = store.conversation(cid)["updated_at"]
    mid = store.add_message(cid, "assistant", "")
    text = ""
    for word in ["one", " two", " three"]:
        text += word
        store.update_message(mid, content=text, thinking="counting")
        assert store.message_rows(cid)[-1]["content"] == text
    store.update_message(mid, stats={"tok_s": 12.0, "ttft_s": 0.2, "tokens": 3, "finish_reason": "stop"})
    last = store.message_rows(cid)[-1]
    assert (last["content"], last["thinking"]) == ("one two three", "counting")  # None kept both as they were
    assert last["stats"]["finish_reason"] == "stop"
    assert store.conversation(cid)["updated_at"] > before
    with pytest.raises(KeyError):
        store.update_message(10_000, content="x")


def test_truncate_after_for_edit_and_regenerate(store):
    cid = store.create_conversation()
    for i, role in enumerate(["user", "assistant"] * 3):
        store.add_message(cid, role, f"m{i}")
    assert store.truncate_after(cid, 3) == 2  # regenerate the second reply: keep up to its question
    assert [m["content"] for m in store.messages(cid)] == ["m0", "m1", "m2", "m3"]
    question = store.message_rows(cid)[2]["id"]  # edit the second question: change it, drop its answer
    store.update_message(question, content="m2 edited")
    assert store.truncate_after(cid, 2) == 1
    new = store.add_message(cid, "assistant", "fresh")
    assert [(m["position"], m["content"]) for m in store.message_rows(cid)] == \
        [(0, "m0"), (1, "m1"), (2, "m2 edited"), (3, "fresh")]
    assert store.message_rows(cid)[-1]["id"] == new
    assert store.truncate_after(cid, -1) == 4 and store.messages(cid) == []
    with pytest.raises(KeyError):
        store.truncate_after(9999, 0)


def test_auto_title_from_first_user_message(store):
    cid = store.create_conversation()
    store.add_message(cid, "system", "You are helpful.")
    store.add_message(cid, "user", "  How do   I bake bread?\nI have flour and yeast.")
    store.add_message(cid, "user", "Another question")
    assert store.conversation(cid)["title"] == "How do I bake bread?"
    store.update_message(store.message_rows(cid)[1]["id"], content="Sourdough starter tips")  # edited first question
    assert store.conversation(cid)["title"] == "Sourdough starter tips"
    store.rename(cid, "Baking")
    store.update_message(store.message_rows(cid)[1]["id"], content="Something else")
    assert store.conversation(cid)["title"] == "Baking"  # renamed: never overwritten
    named = store.create_conversation("Mine")
    store.add_message(named, "user", "hello there")
    assert store.conversation(named)["title"] == "Mine"


@pytest.mark.parametrize("text, title", [
    ("Qu'est-ce que l'été à Zürich? 日本語も", "Qu'est-ce que l'été à Zürich? 日本語も"),
    ("word " * 30, "word word word word word word word word word word word word…"),
    ("```python\ndef f():\n    return 1\n```\nWhy is this slow?", "Why is this slow?"),
    ("```\nprint('only code')\n```", "print('only code')"),
    ("~~~~\n```\nstill code\n~~~~\nthe question", "the question"),
    ("# A heading\nbody", "A heading"),
    ("\n\n   \n", "New chat"),
    ("日本" * 40, "日本" * 29 + "日…"),
    ("e\u0301" * 40, "e\u0301" * 29 + "…"),
])
def test_auto_title_rules(text, title):
    got = auto_title(text)
    assert got == title and len(got) <= 60


def test_auto_title_cuts_on_a_word_boundary():
    text = "Please explain the difference between asyncio tasks and threads in detail with examples"
    got = auto_title(text)
    assert len(got) <= 60 and got.endswith("…") and text.startswith(got[:-1]) and text[len(got) - 1] == " "


def test_export_markdown_and_json(store, tmp_path):
    cid = store.create_conversation(model="qwen3-4b", system_prompt="Answer with code.")
    store.add_message(cid, "user", "Show a loop")
    code = "Here:\n\n```python\nfor i in range(3):\n    print(i)\n```\n\nDone."
    store.add_message(cid, "assistant", code, thinking="User wants a *loop*.", stats={"tok_s": 20.0})
    store.add_message(cid, "user", "And unclosed?\n```js\nlet x = 1")
    md = store.export_markdown(cid)
    assert md.startswith("# Show a loop\n\nStarted 2023-11-14T22:13:21+00:00 · model qwen3-4b\n\n")
    assert "## System prompt\n\nAnswer with code.\n\n## User\n\nShow a loop\n\n## Assistant\n\n" in md
    assert "<details>\n<summary>Thinking</summary>\n\nUser wants a *loop*.\n\n</details>\n\n" + code in md
    assert md.endswith("## User\n\nAnd unclosed?\n```js\nlet x = 1\n```\n")  # the open fence is closed
    assert md.count("## ") == 4 and "reasoning" not in md

    data = store.export_json(cid)
    assert (data["format"], data["version"], data["title"], data["model"]) == \
        ("zerotvm-chat", 1, "Show a loop", "qwen3-4b")
    reply = data["messages"][1]
    assert reply["content"] == code and reply["thinking"] == "User wants a *loop*."
    assert reply["stats"] == {"tok_s": 20.0} and reply["model"] == "qwen3-4b"
    assert data["messages"][0]["thinking"] == "" and data["system_prompt"] == "Answer with code."

    assert store.export(cid, tmp_path / "out" / "chat.md").read_text(encoding="utf-8") == md
    assert json.loads(store.export(cid, tmp_path / "chat.JSON").read_text(encoding="utf-8")) == data
    with pytest.raises(ValueError):
        store.export(cid, tmp_path / "chat.txt")
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["chat.md"]  # no temporary file left


def test_messages_survive_a_killed_process(tmp_path):
    path = tmp_path / "chats.db"
    script = textwrap.dedent(f"""
        import os, signal
        from app.store import ConversationStore
        store = ConversationStore({str(path)!r})
        cid = store.create_conversation()
        store.add_message(cid, "user", "sent just before the crash")
        reply = store.add_message(cid, "assistant", "")
        store.update_message(reply, content="half an ans", thinking="hmm")
        if hasattr(signal, "SIGKILL"):
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(1)
    """)
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr, proc.stderr
    assert path.with_name("chats.db-wal").stat().st_size > 0  # never checkpointed: the data lives in the WAL
    with ConversationStore(path) as store:
        (conv,) = store.list_conversations()
        assert conv["title"] == "sent just before the crash"
        assert store.messages(conv["id"]) == [
            {"role": "user", "content": "sent just before the crash"},
            {"role": "assistant", "content": "half an ans", "reasoning_content": "hmm"},
        ]


def _v1_database(path):
    db = sqlite3.connect(path)
    db.executescript(MIGRATIONS[0])
    db.execute("INSERT INTO schema_version (id, version) VALUES (1, 1)")
    db.execute("INSERT INTO conversations (id, title, auto_title, created_at, updated_at, model, settings)"
               " VALUES (7, 'Old chat', 0, 1.0, 2.0, 'phi3-mini', '{\"seed\": 3}')")
    db.executemany("INSERT INTO messages (conversation_id, position, role, content, thinking, created_at, stats)"
                   " VALUES (7, ?, ?, ?, ?, 1.5, ?)",
                   [(0, "user", "hello", "", None), (1, "assistant", "hi!", "greet", '{"tokens": 2}')])
    db.commit()
    db.close()


def test_migrates_a_version_1_file_keeping_its_data(tmp_path):
    path = tmp_path / "chats.db"
    _v1_database(path)
    with ConversationStore(path) as store:
        assert store.schema_version() == SCHEMA_VERSION == 2
        (conv,) = store.list_conversations()
        assert (conv["id"], conv["title"], conv["message_count"], conv["pinned"]) == (7, "Old chat", 2, False)
        assert store.conversation(7)["settings"] == {"seed": 3}
        rows = store.message_rows(7)
        assert [(m["role"], m["content"], m["thinking"], m["model"]) for m in rows] == \
            [("user", "hello", "", None), ("assistant", "hi!", "greet", "phi3-mini")]  # replies got the chat's model
        assert rows[1]["stats"] == {"tokens": 2}
        store.update_conversation(7, pinned=True)
    with ConversationStore(path) as store:  # reopening an up-to-date file changes nothing
        assert store.schema_version() == 2 and store.list_conversations()[0]["pinned"]


def test_a_failed_migration_changes_nothing(tmp_path, monkeypatch):
    path = tmp_path / "chats.db"
    _v1_database(path)
    monkeypatch.setattr("app.store.MIGRATIONS", [MIGRATIONS[0], MIGRATIONS[1] + "\nSELECT * FROM no_such_table;"])
    with pytest.raises(sqlite3.OperationalError):
        ConversationStore(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchone()[0] == 1
    assert "pinned" not in [r[1] for r in db.execute("PRAGMA table_info(conversations)")]
    db.close()


def test_a_newer_file_is_refused_and_left_alone(tmp_path):
    path = tmp_path / "chats.db"
    ConversationStore(path).close()
    db = sqlite3.connect(path)
    db.execute("UPDATE schema_version SET version = 99")
    db.commit()
    db.close()
    with pytest.raises(SchemaTooNewError, match="version 99.*only knows up to 2.*update the app"):
        ConversationStore(path)
    db = sqlite3.connect(path)
    assert db.execute("SELECT version FROM schema_version").fetchone()[0] == 99
    db.close()
    assert sorted(p.name for p in tmp_path.iterdir() if "corrupt" in p.name) == []


def test_a_foreign_sqlite_file_is_kept_aside_and_a_fresh_store_started(tmp_path):
    path = tmp_path / "chats.db"
    db = sqlite3.connect(path)
    db.execute("CREATE TABLE photos (id INTEGER)")
    db.execute("INSERT INTO photos VALUES (42)")
    db.commit()
    db.close()
    original = path.read_bytes()
    with pytest.warns(StoreRecoveredWarning, match="an SQLite file of another program, not a Zero-TVM chat store"):
        store = ConversationStore(path)
    with store:
        assert store.recovered.moved_to.name.startswith("chats.db.foreign-")
        assert store.recovered.moved_to.read_bytes() == original  # kept as it was, under another name
        assert store.list_conversations() == [] and "another program" in store.notice


def test_a_corrupt_file_is_kept_aside_and_a_fresh_store_started(tmp_path):
    path = tmp_path / "chats.db"
    junk = os.urandom(8192)
    path.write_bytes(junk)
    path.with_name("chats.db-wal").write_bytes(b"stale wal")
    with pytest.warns(StoreRecoveredWarning, match="could not be read") as caught:
        store = ConversationStore(path)
    with store:
        warning = store.recovered
        assert warning is caught[0].message and warning.path == path
        assert warning.moved_to.name.startswith("chats.db.corrupt-") and warning.moved_to.read_bytes() == junk
        assert warning.moved_to.with_name(warning.moved_to.name + "-wal").read_bytes() == b"stale wal"
        assert store.list_conversations() == [] and store.schema_version() == SCHEMA_VERSION
        store.add_message(store.create_conversation(), "user", "works again")
    with ConversationStore(path) as store:
        assert store.recovered is None and len(store.list_conversations()) == 1


def test_damaged_pages_are_found_by_the_check_on_open(tmp_path):
    path = tmp_path / "chats.db"
    with ConversationStore(path) as store:
        cid = store.create_conversation()
        for i in range(200):
            store.add_message(cid, "user", f"message {i} " + "x" * 200)
    data = bytearray(path.read_bytes())
    page = 4096
    assert len(data) > 4 * page
    data[2 * page:4 * page] = bytes(range(256)) * (2 * page // 256)  # scribble over b-tree pages, keep the header
    path.write_bytes(bytes(data))
    with pytest.warns(StoreRecoveredWarning):
        store = ConversationStore(path)
    with store:
        assert store.list_conversations() == []
    assert len(list(tmp_path.glob("chats.db.corrupt-*"))) == 1


# --- damaged contents: the app starts, says what happened, keeps a backup, and keeps every valid row --------------

def _store_with_chats(path) -> tuple[int, int]:
    with ConversationStore(path, clock=Clock()) as store:
        a = store.create_conversation("Keep me", settings={"thinking": True})
        store.add_message(a, "user", "question")
        store.add_message(a, "assistant", "answer", stats={"tokens": 5})
        b = store.create_conversation("Second")
        store.add_message(b, "user", "more")
    return a, b


def _dump(path) -> list[str]:
    db = sqlite3.connect(path)
    try:
        return list(db.iterdump())
    finally:
        db.close()


def _damage(path, *statements) -> list[str]:
    db = sqlite3.connect(path)
    db.execute("PRAGMA foreign_keys=OFF")
    for sql in statements:
        db.execute(sql)
    db.commit()
    db.close()
    return _dump(path)


def _assert_backup_is(store, before: list[str]) -> None:
    assert store.backup is not None and store.backup.name.startswith("chats.db.backup-")
    assert _dump(store.backup) == before  # the file exactly as it was, before anything was repaired


@pytest.mark.parametrize("version_sql, said", [
    ("UPDATE schema_version SET version = 'abc'", "its schema version was 'abc' instead of one number"),
    ("UPDATE schema_version SET version = -1", "its schema version was -1"),
    ("UPDATE schema_version SET version = 2.5", "its schema version was 2.5"),
    ("DELETE FROM schema_version", "its schema version was nothing"),
    ("DROP TABLE schema_version", "its schema_version table was missing"),
    ("UPDATE schema_version SET version = 0", "its schema version was 0"),
])
def test_a_bad_schema_version_is_repaired_keeping_the_chats(tmp_path, version_sql, said):
    path = tmp_path / "chats.db"
    a, b = _store_with_chats(path)
    before = _damage(path, version_sql)
    with ConversationStore(path) as store:
        assert store.schema_version() == SCHEMA_VERSION
        assert [c["title"] for c in store.list_conversations()] == ["Second", "Keep me"]
        assert store.messages(a) == [{"role": "user", "content": "question"},
                                     {"role": "assistant", "content": "answer"}]
        assert said in store.notice and "has been repaired" in store.notice
        _assert_backup_is(store, before)
    with ConversationStore(path) as store:  # repaired once: the next start is clean
        assert store.repairs == [] and store.notice is None
    assert len(list(tmp_path.glob("chats.db.backup-*"))) == 1


def test_a_missing_messages_table_is_recreated_and_the_chats_kept(tmp_path):
    path = tmp_path / "chats.db"
    a, _ = _store_with_chats(path)
    before = _damage(path, "DROP TABLE messages")
    with ConversationStore(path) as store:
        assert [c["title"] for c in store.list_conversations()] == ["Second", "Keep me"]
        assert store.message_rows(a) == []
        store.add_message(a, "user", "it works again")
        assert "the messages table was missing" in store.notice
        assert "the missing messages table was recreated (empty)" in store.notice
        _assert_backup_is(store, before)


def test_missing_columns_are_added_back(tmp_path):
    path = tmp_path / "chats.db"
    a, _ = _store_with_chats(path)
    before = _damage(path, "ALTER TABLE conversations DROP COLUMN pinned", "ALTER TABLE messages DROP COLUMN thinking")
    with ConversationStore(path) as store:
        assert "the conversations table lacked pinned" in store.notice
        assert "the messages table's missing thinking column was added back" in store.notice
        assert not store.conversation(a)["pinned"] and store.messages(a)[1]["content"] == "answer"
        store.update_conversation(a, pinned=True)
        _assert_backup_is(store, before)


def test_a_table_without_its_keys_is_set_aside_not_dropped(tmp_path):
    path = tmp_path / "chats.db"
    a, _ = _store_with_chats(path)
    _damage(path, "ALTER TABLE messages DROP COLUMN role")
    with ConversationStore(path) as store:
        assert "had lost its role column(s) and was set aside as messages_damaged" in store.notice
        assert store.message_rows(a) == [] and store.list_conversations()[1]["title"] == "Keep me"
    db = sqlite3.connect(path)
    assert [r[0] for r in db.execute("SELECT content FROM messages_damaged ORDER BY id")] == \
        ["question", "answer", "more"]  # still in the file
    db.close()


def test_invalid_json_and_non_text_values_get_defaults_and_nothing_else_changes(tmp_path):
    path = tmp_path / "chats.db"
    a, b = _store_with_chats(path)
    before = _damage(path, f"UPDATE conversations SET settings = '{{not json' WHERE id = {a}",
                     f"UPDATE messages SET stats = '[' || '[' || 'deep' WHERE conversation_id = {a}",
                     f"UPDATE conversations SET title = x'ff00fe' WHERE id = {b}",
                     f"UPDATE messages SET content = x'48ff49' WHERE conversation_id = {b}",  # not UTF-8
                     f"UPDATE conversations SET updated_at = 'yesterday' WHERE id = {b}")
    with ConversationStore(path) as store:
        assert store.conversation(a)["settings"] == {}
        assert [m["stats"] for m in store.message_rows(a)] == [None, None]
        assert [m["content"] for m in store.message_rows(a)] == ["question", "answer"]
        assert store.messages(b) == [{"role": "user", "content": "H\ufffdI"}]
        assert isinstance(store.conversation(b)["title"], str)
        assert store.export_markdown(b) and store.export_json(a)["settings"] == {}
        notice = store.notice
        for words in ("chat settings that were not valid JSON were reset (1)",
                      "reply statistics that were not valid JSON were cleared (2)", "message texts that were not text",
                      "chat titles that were not text were restored (1)", "chat dates that were not numbers"):
            assert words in notice, notice
        _assert_backup_is(store, before)


def test_rows_damaged_after_opening_still_read(tmp_path):
    """Reads never raise on a bad value, even one written behind the store's back while it is open."""
    path = tmp_path / "chats.db"
    a, _ = _store_with_chats(path)
    with ConversationStore(path) as store:
        other = sqlite3.connect(path)
        other.execute(f"UPDATE conversations SET settings = 'nope' WHERE id = {a}")
        other.execute(f"UPDATE messages SET stats = '{{\"a\": ' WHERE conversation_id = {a}")
        other.commit()
        other.close()
        assert store.conversation(a)["settings"] == {} and store.message_rows(a)[1]["stats"] is None


def test_open_store_never_fails(tmp_path, monkeypatch):
    from app.store import open_store

    blocked = tmp_path / "file-not-folder"
    blocked.write_text("x")
    store = open_store(blocked / "chats.db")  # the data folder is a file
    with store:
        assert store.temporary and "cannot be opened for writing" in store.notice and "will not be saved" in \
            store.notice
        store.add_message(store.create_conversation(), "user", "kept in memory")  # the app still works

    newer = tmp_path / "newer.db"
    ConversationStore(newer).close()
    _damage(newer, "UPDATE schema_version SET version = 99")
    before = newer.read_bytes()
    with open_store(newer) as store:
        assert "only knows up to 2" in store.notice and store.list_conversations() == []
    assert newer.read_bytes() == before  # never touched

    path = tmp_path / "chats.db"
    a, _ = _store_with_chats(path)

    def read_only(self, db=None):  # what a read-only folder or file answers (tests may run as root: no chmod)
        if db is None and self.temporary is None and str(self.path) != ":memory:":
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return real_open(self, db)

    real_open = ConversationStore._open
    monkeypatch.setattr(ConversationStore, "_open", read_only)
    with open_store(path) as store:
        assert "attempt to write a readonly database" in store.notice
        assert store.messages(a)[1] == {"role": "assistant", "content": "answer"}  # the chats are shown
        store.add_message(a, "user", "only in memory")
    monkeypatch.undo()
    with ConversationStore(path) as store:
        assert len(store.messages(a)) == 2  # the file was not written


def test_a_schema_whose_key_declaration_was_damaged_is_rebuilt_with_every_row(tmp_path):
    """Found by tests/test_fuzz_store.py: one flipped bit made 'PRIMARY KEY' read 'PRIMASY KEY', so every chat's
    id read as NULL. The rows keep their ids in the rowid: the table is rebuilt from it."""
    path = tmp_path / "chats.db"
    a, b = _store_with_chats(path)
    db = sqlite3.connect(path)
    db.execute("PRAGMA writable_schema=ON")
    db.execute("UPDATE sqlite_master SET sql = replace(sql, 'id INTEGER PRIMARY KEY,', 'id INTEGER PRIMASY KEY,') "
               "WHERE name = 'conversations'")
    db.commit()
    db.close()
    before = _dump(path)
    with ConversationStore(path) as store:
        assert "the conversations table's id column was no longer its key" in store.notice
        assert "the conversations table was rebuilt with all 2 rows" in store.notice
        assert [c["id"] for c in store.list_conversations()] == [b, a]
        assert store.messages(a)[1] == {"role": "assistant", "content": "answer"}
        _assert_backup_is(store, before)


def test_a_version_row_behind_its_tables_is_repaired(tmp_path):
    """Found by tests/test_fuzz_store.py: version 1 on version 2 tables made migration 2 fail (duplicate column)."""
    path = tmp_path / "chats.db"
    a, _ = _store_with_chats(path)
    _damage(path, "UPDATE schema_version SET version = 1")
    with ConversationStore(path) as store:
        assert "its schema version was 1 but its tables are those of version 2" in store.notice
        assert store.schema_version() == 2 and len(store.messages(a)) == 2
