"""Fuzzing the chat store file: random combinations of damaging SQL (hypothesis, derandomized for CI) and
seeded byte-level corruption.

Properties: open_store never raises and the store it gives works (a chat can be added); when anything was
repaired, a backup equal to the file before opening exists and the notice says so; every conversation whose own
row and messages were not touched keeps its title and messages; opening again repairs nothing more; a file
SQLite cannot read is moved aside byte for byte.
"""

from __future__ import annotations

import random
import sqlite3
import warnings

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from app.store import ConversationStore, StoreRecoveredWarning, open_store

QUICK = settings(max_examples=120, deadline=None, derandomize=True, database=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
LONG = settings(max_examples=1200, deadline=None, database=None,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])

CHATS = 4  # conversations 1..4; the damage below touches only conversation 1 or its messages, or the schema


class Clock:
    def __init__(self):
        self.now = 1_700_000_000.0

    def __call__(self):
        self.now += 1
        return self.now


_TEMPLATE: dict = {}


def make_store(path) -> dict[int, tuple[str, list[dict]]]:
    """A store with CHATS chats at `path` (made once, then copied: each commit is synced, which is slow)."""
    if not _TEMPLATE:
        expected = {}
        first = path.with_name("template.db")
        with ConversationStore(first, clock=Clock()) as store:
            for i in range(CHATS):
                cid = store.create_conversation(f"Chat {i}", settings={"i": i})
                for j in range(3):
                    store.add_message(cid, "user" if j % 2 == 0 else "assistant", f"m{i}.{j}", stats={"n": j})
                expected[cid] = (f"Chat {i}", store.messages(cid))
        _TEMPLATE.update(data=first.read_bytes(), expected=expected)  # closed: the WAL is checkpointed
        first.unlink()
    path.write_bytes(_TEMPLATE["data"])
    return _TEMPLATE["expected"]


# Each damage: (SQL, whether it spares conversations 2..4 and their messages)
ROW_DAMAGE = [
    ("UPDATE conversations SET settings = '{broken' WHERE id = 1", True),
    ("UPDATE conversations SET settings = '[1, 2]' WHERE id = 1", True),
    ("UPDATE conversations SET settings = NULL WHERE id = 1", True),
    ("UPDATE conversations SET title = x'fffe' WHERE id = 1", True),
    ("UPDATE conversations SET title = 42 WHERE id = 1", True),
    ("UPDATE conversations SET created_at = 'then', updated_at = x'00' WHERE id = 1", True),
    ("UPDATE messages SET stats = 'nan' WHERE conversation_id = 1", True),
    ("UPDATE messages SET stats = '" + "[" * 3000 + "' WHERE conversation_id = 1", True),
    ("UPDATE messages SET content = x'c3' WHERE conversation_id = 1", True),
    ("UPDATE messages SET content = NULL, thinking = 7 WHERE conversation_id = 1", True),
    ("UPDATE messages SET role = 'robot' WHERE conversation_id = 1", True),
    ("UPDATE messages SET created_at = 'x' WHERE conversation_id = 1", True),
    ("DELETE FROM conversations WHERE id = 1", True),
]
SCHEMA_DAMAGE = [
    ("UPDATE schema_version SET version = 'abc'", True),
    ("UPDATE schema_version SET version = -5", True),
    ("UPDATE schema_version SET version = 1", False),  # migration 2 then fails on the existing columns: repaired
    ("DELETE FROM schema_version", True),
    ("INSERT INTO schema_version (id, version) VALUES (2, 2)", True),
    ("DROP TABLE schema_version", True),
    ("DROP TABLE messages", False),
    ("ALTER TABLE messages DROP COLUMN model", True),
    ("ALTER TABLE messages DROP COLUMN thinking", False),  # thinking comes back empty
    ("ALTER TABLE messages DROP COLUMN role", False),
    ("ALTER TABLE conversations DROP COLUMN pinned", True),
    ("ALTER TABLE conversations DROP COLUMN settings", True),
    ("ALTER TABLE conversations DROP COLUMN title", False),
    ("CREATE TABLE photos (id INTEGER)", True),
    ("PRAGMA writable_schema=ON; UPDATE sqlite_master SET sql = replace(sql, 'id INTEGER PRIMARY KEY,', "
     "'id INTEGER PRIMASY KEY,') WHERE name = 'conversations'", True),  # one flipped bit of the schema text
    ("PRAGMA writable_schema=ON; UPDATE sqlite_master SET sql = replace(sql, 'id INTEGER PRIMARY KEY,', "
     "'id INTEGER PRIMASY KEY,') WHERE name = 'messages'", True),
]


def damage(path, statements) -> None:
    db = sqlite3.connect(path)
    db.execute("PRAGMA foreign_keys=OFF")
    for sql in statements:
        try:
            db.executescript(sql)
        except sqlite3.Error:  # e.g. the column was already dropped by an earlier statement
            pass
    db.commit()
    db.close()


def dump(path) -> list[str]:
    db = sqlite3.connect(path)
    db.text_factory = lambda b: b.decode("utf-8", "replace")
    try:
        return list(db.iterdump())
    finally:
        db.close()


def check_sql_damage(folder, chosen) -> None:
    path = folder / "chats.db"
    for old in folder.glob("chats.db*"):
        old.unlink()
    expected = make_store(path)
    damage(path, [sql for sql, _ in chosen])
    before = dump(path)
    spared = all(spares for _, spares in chosen)
    store = open_store(path)
    with store:
        assert store.temporary is None, store.notice
        if store.repairs:
            assert store.backup is not None and dump(store.backup) == before
            assert "has been repaired" in store.notice
        titles = {c["id"]: c["title"] for c in store.list_conversations()}
        if spared:
            for cid in range(2, CHATS + 1):
                assert titles.get(cid) == expected[cid][0]
                assert store.messages(cid) == expected[cid][1]
        for cid in titles:  # every chat that is listed can be shown and exported
            store.message_rows(cid)
            store.export_markdown(cid)
        store.add_message(store.create_conversation(), "user", "still works")
    with ConversationStore(path) as again:
        assert again.repairs == [] and again.notice is None


@QUICK
@given(chosen=st.lists(st.sampled_from(ROW_DAMAGE + SCHEMA_DAMAGE), min_size=1, max_size=4, unique=True))
def test_sql_damage_is_repaired_keeping_every_untouched_chat(tmp_path, chosen):
    check_sql_damage(tmp_path, chosen)


@pytest.mark.slow
@LONG
@given(chosen=st.lists(st.sampled_from(ROW_DAMAGE + SCHEMA_DAMAGE), min_size=1, max_size=6, unique=True))
def test_sql_damage_long(tmp_path, chosen):
    check_sql_damage(tmp_path, chosen)


def check_byte_damage(folder, seed: int) -> None:
    rng = random.Random(seed)
    path = folder / "chats.db"
    for old in folder.glob("chats.db*"):
        old.unlink()
    make_store(path)
    data = bytearray(path.read_bytes())
    kind = rng.choice(["flip", "scribble", "truncate", "zero-header", "append"])
    if kind == "flip":
        for _ in range(rng.randint(1, 40)):
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
    elif kind == "scribble":
        at = rng.randrange(len(data))
        data[at:at + 512] = rng.randbytes(512)
    elif kind == "truncate":
        del data[rng.randrange(len(data)):]
    elif kind == "zero-header":
        data[rng.randrange(100):100] = bytes(100)[: 100 - rng.randrange(100)]
    else:
        data += rng.randbytes(rng.randint(1, 5000))
    path.write_bytes(bytes(data))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", StoreRecoveredWarning)
        store = open_store(path)
    with store:
        if store.recovered is not None:
            assert store.recovered.moved_to.read_bytes() == bytes(data)
        for c in store.list_conversations():
            store.message_rows(c["id"])
        store.add_message(store.create_conversation(), "user", "still works")


@pytest.mark.parametrize("seed", range(40))
def test_byte_damage_never_stops_the_app(tmp_path, seed):
    check_byte_damage(tmp_path, seed)


@pytest.mark.slow
@pytest.mark.parametrize("seed", range(40, 1000))
def test_byte_damage_long(tmp_path, seed):
    check_byte_damage(tmp_path, seed)
