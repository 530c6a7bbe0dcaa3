"""The app's conversation store: chats and their messages in one SQLite file (stdlib sqlite3, no Qt).

Every write is its own committed transaction, so a message the user sent survives the app being killed right after.
The app uses one store from the GUI thread only: the connection is opened with check_same_thread=True, so a call
from any other thread raises sqlite3.ProgrammingError instead of racing.

Schema changes are ordered migrations (MIGRATIONS[i] takes a file from version i to i + 1), recorded in the one-row
schema_version table. A file written by a newer app raises SchemaTooNewError and is left as it is; a file that is not
a readable database, or an SQLite file of another program, is moved aside to <name>.corrupt-<timestamp> (never
deleted), a fresh one is started, and that is reported as a StoreRecoveredWarning (also kept on `store.recovered`
for the app to show). A readable store with damaged contents (a bad schema_version, missing tables or columns,
settings or stats that are not JSON) is first copied to <name>.backup-<timestamp>, then repaired keeping every
valid row (app/store_repair.py); `store.repairs` says what was done. open_store() never fails: when the file
cannot be opened for writing, the app gets a temporary in-memory store holding what could be read, and says so.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import sqlite3
import tempfile
import time
import unicodedata
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import datetime, timezone
from pathlib import Path

from app import store_repair
from engine.errors import ZeroTVMError

MIGRATIONS: list[str] = [
    # 1: the initial schema. Times are Unix seconds; settings and stats are JSON text.
    """
    CREATE TABLE schema_version (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        version INTEGER NOT NULL
    );
    CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        auto_title INTEGER NOT NULL DEFAULT 1,  -- 1 until the user names it: the first user message names it
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        model TEXT,
        system_prompt TEXT,
        settings TEXT NOT NULL DEFAULT '{}'
    );
    CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL DEFAULT '',
        thinking TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        stats TEXT,
        UNIQUE (conversation_id, position)
    );
    """,
    # 2: pinned chats, and the model that wrote each reply (a chat can switch models); old replies get the chat's.
    """
    ALTER TABLE conversations ADD COLUMN pinned INTEGER NOT NULL DEFAULT 0;
    ALTER TABLE messages ADD COLUMN model TEXT;
    UPDATE messages SET model = (SELECT model FROM conversations WHERE conversations.id = messages.conversation_id)
        WHERE role = 'assistant';
    """,
]
SCHEMA_VERSION = len(MIGRATIONS)
EXPORT_FORMAT, EXPORT_VERSION = "zerotvm-chat", 1
DEFAULT_TITLE = "New chat"
TITLE_LIMIT = 60
ROLES = ("system", "user", "assistant")
_CONVERSATION_FIELDS = ("model", "system_prompt", "settings", "pinned")
_FENCE = re.compile(r"^ {0,3}(`{3,}|~{3,})")
_SQLITE_CORRUPT, _SQLITE_NOTADB = 11, 26


class StoreError(ZeroTVMError):
    """The chat file cannot be used as it is; str() says why and what to do."""


class SchemaTooNewError(StoreError):
    """The file was written by a newer version of the app; it is left untouched (never downgraded)."""

    def __init__(self, path: Path, found: int, known: int):
        self.path, self.found, self.known = path, found, known
        super().__init__(
            f"{path} holds chat store version {found}, but this version of Zero-TVM only knows up to {known}; "
            "update the app to open it (the file was left unchanged)"
        )


class StoreRecoveredWarning(UserWarning):
    """The chat file could not be read: it was kept aside (not deleted) and a fresh store was started."""

    def __init__(self, path: Path, moved_to: Path, error: BaseException):
        self.path, self.moved_to, self.error = path, moved_to, error
        super().__init__(
            f"{path} could not be read ({error}); it was kept as {moved_to.name} and a new, empty chat store "
            "was started"
        )


class _CorruptFile(sqlite3.DatabaseError):
    """Damage found by our own checks (the file header, quick_check) rather than raised by SQLite."""


class _ForeignFile(_CorruptFile):
    """An SQLite file that holds none of our tables: another program's, moved aside like a corrupt one."""


class ConversationStore:
    """Chats and messages in one SQLite file. Use it from the thread that made it (the GUI thread); close() when done.
    Conversation and message ids are SQLite rowids; a message's position is its index in the chat."""

    def __init__(self, path: str | os.PathLike, *, clock: Callable[[], float] = time.time):
        self.path = Path(path)
        self.clock = clock  # injectable so tests can order conversations without sleeping
        self.recovered: StoreRecoveredWarning | None = None
        self.repairs: list[str] = []  # what was repaired at open, in words
        self.backup: Path | None = None  # the copy made before repairing
        self.temporary: str | None = None  # why this store lives in memory only (see open_store)
        if str(path) == ":memory:":
            self._db = self._open()
            return
        self.path.parent.mkdir(parents=True, exist_ok=True)
        try:
            _check_header(self.path)
            self._db = self._open()
        except (sqlite3.DatabaseError, UnicodeDecodeError) as e:  # the latter: SQLite's message quoting bad bytes
            if not _is_corrupt(e):  # locked, read-only, disk full...: not ours to move aside
                raise
            kind = "foreign" if isinstance(e, _ForeignFile) else "corrupt"
            self.recovered = StoreRecoveredWarning(self.path, _move_aside(self.path, kind), e)
            warnings.warn(self.recovered, stacklevel=2)
            self._db = self._open()

    def _open(self, db: sqlite3.Connection | None = None) -> sqlite3.Connection:
        # isolation_level=None: transactions are ours (see _tx), so every write is committed when the call returns.
        target = ":memory:" if self.temporary is not None or str(self.path) == ":memory:" else self.path
        db = db or sqlite3.connect(target, isolation_level=None, check_same_thread=True, timeout=10)
        try:
            db.row_factory = sqlite3.Row
            db.text_factory = _text  # a damaged row's bytes that are not UTF-8 read as text, never an exception
            # quick_check reads every page once: milliseconds for a chat history, and it finds damage at open time
            # rather than in the middle of a session.
            problems = [row[0] for row in db.execute("PRAGMA quick_check")]
            if problems != ["ok"]:
                raise _CorruptFile("; ".join(problems[:3]))
            version, bad = store_repair.read_version(db)
            if version is not None and version > SCHEMA_VERSION:
                raise SchemaTooNewError(self.path, version, SCHEMA_VERSION)
            tables = store_repair.user_tables(db)
            if version is None and bad is None and tables:
                if not tables & store_repair.OUR_TABLES:
                    raise _ForeignFile("it is an SQLite file of another program, not a Zero-TVM chat store")
                bad = "its schema_version table was missing"
            if version == 0:
                bad = "its schema version was 0"
            elif version and (ahead := store_repair.structure_ahead(db, version)):
                bad = f"its schema version was {version} but its tables are those of version {ahead}"
            damage = [bad] if bad else store_repair.structure_problems(db, version) if version else []
            found = {} if damage or not version else store_repair.row_problems(db)
            if damage or found:
                self._backup(db)
            db.execute("PRAGMA journal_mode=WAL")
            # In WAL mode NORMAL already survives a killed process, but can lose the last commits on power loss or
            # an OS crash; FULL syncs the WAL at each commit, which at ~2 commits/s while streaming costs nothing.
            db.execute("PRAGMA synchronous=FULL")
            if damage:
                self.repairs += damage + store_repair.repair_structure(db, SCHEMA_VERSION)
                found = store_repair.row_problems(db)
            else:
                for step in range(version or 0, SCHEMA_VERSION):
                    _migrate(db, step)
            if found:
                self.repairs += store_repair.repair_rows(db, found)
            db.execute("PRAGMA foreign_keys=ON")
        except BaseException:
            db.close()
            raise
        return db

    def _backup(self, db: sqlite3.Connection) -> None:
        """A consistent copy of the file as it is (WAL included), before anything repairs it."""
        if self.backup is not None or str(self.path) == ":memory:" or self.temporary is not None:
            return
        stamp = time.strftime("%Y%m%d-%H%M%S")
        target, n = self.path.with_name(f"{self.path.name}.backup-{stamp}"), 1
        while target.exists():
            target, n = self.path.with_name(f"{self.path.name}.backup-{stamp}-{n}"), n + 1
        copy = sqlite3.connect(target)
        try:
            db.backup(copy)
        finally:
            copy.close()
        self.backup = target

    @classmethod
    def in_memory(cls, reason: str, copy_from: Path | None = None, *,
                  clock: Callable[[], float] = time.time) -> ConversationStore:
        """A store that lives in memory only (`temporary` = reason), holding a copy of `copy_from`'s chats when
        that file can be read at all (read-only, even from a read-only folder)."""
        store = cls(":memory:", clock=clock)
        unsaved = "new chats and changes in this session are kept in memory and will not be saved."
        store.temporary = f"{reason} This session starts with no chats: {unsaved}"
        if copy_from is None or not Path(copy_from).is_file():
            return store
        base = Path(copy_from).resolve().as_uri()
        # immutable=1 reads the file alone and creates nothing (a read-only folder could not take a -shm file);
        # with a -wal file beside it, mode=ro first, so the last commits in the WAL are not missed.
        wal = Path(str(copy_from) + "-wal").exists()
        for uri in ([f"{base}?mode=ro"] if wal else []) + [f"{base}?immutable=1"]:
            try:
                source = sqlite3.connect(uri, uri=True)
                try:
                    fresh = sqlite3.connect(":memory:", isolation_level=None, check_same_thread=True)
                    source.backup(fresh)
                finally:
                    source.close()
                db = store._open(fresh)
            except (sqlite3.Error, StoreError, ValueError):
                continue
            store._db.close()
            store._db = db
            store.temporary = f"{reason} The chats it holds are shown, but {unsaved}"
            break
        return store

    @property
    def notice(self) -> str | None:
        """What the app should tell the user about this store's file, or None when all is well."""
        parts = []
        if self.recovered is not None:
            parts.append(f"{self.recovered}.")
        if self.repairs:
            kept = f" A copy of the file as it was is kept as {self.backup.name}." if self.backup else ""
            parts.append(f"Your chat history ({self.path}) was damaged and has been repaired: "
                         f"{'; '.join(self.repairs)}.{kept} Everything that could be read is still there.")
        if self.temporary is not None:
            parts.append(self.temporary)
        return "\n\n".join(parts) or None

    def close(self) -> None:
        self._db.close()

    def __enter__(self) -> ConversationStore:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        # IMMEDIATE takes the write lock up front, so a second app instance waits instead of failing mid-transaction.
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    def schema_version(self) -> int:
        return _version(self._db)

    # ---- conversations --------------------------------------------------------------------------
    def create_conversation(self, title: str | None = None, model: str | None = None, *,
                            system_prompt: str | None = None, settings: dict | None = None) -> int:
        """A new chat. Without a title it is named after its first user message (until renamed)."""
        title = (title or "").strip()
        now = self.clock()
        with self._tx() as db:
            cur = db.execute(
                "INSERT INTO conversations (title, auto_title, created_at, updated_at, model, system_prompt, settings)"
                " VALUES (?, ?, ?, ?, ?, ?, ?)",
                (title or DEFAULT_TITLE, not title, now, now, model, system_prompt, json.dumps(settings or {})),
            )
        return cur.lastrowid

    def list_conversations(self) -> list[dict]:
        """Pinned chats first, then the most recently updated (updated_at moves when its messages change)."""
        rows = self._db.execute(
            "SELECT c.id, c.title, c.created_at, c.updated_at, c.model, c.pinned,"
            " (SELECT COUNT(*) FROM messages m WHERE m.conversation_id = c.id) AS message_count"
            " FROM conversations c ORDER BY c.pinned DESC, c.updated_at DESC, c.id DESC"
        )
        return [{**dict(r), "pinned": bool(r["pinned"])} for r in rows]

    def conversation(self, conv_id: int) -> dict:
        r = self._db.execute("SELECT * FROM conversations WHERE id = ?", (conv_id,)).fetchone()
        if r is None:
            raise KeyError(f"no conversation {conv_id}")
        return {**dict(r), "title": r["title"] if isinstance(r["title"], str) else DEFAULT_TITLE,
                "auto_title": bool(r["auto_title"]), "pinned": bool(r["pinned"]),
                "settings": _json_object(r["settings"]) or {}}

    def rename(self, conv_id: int, title: str) -> None:
        title = title.strip()
        if not title:
            raise ValueError("a chat title cannot be empty")
        with self._tx() as db:
            _found(db.execute("UPDATE conversations SET title = ?, auto_title = 0 WHERE id = ?", (title, conv_id)),
                   conv_id)

    def update_conversation(self, conv_id: int, **changes) -> None:
        """Set any of model, system_prompt, settings (a dict) and pinned; other keys are refused."""
        unknown = set(changes) - set(_CONVERSATION_FIELDS)
        if unknown:
            raise TypeError(f"unknown conversation fields: {', '.join(sorted(unknown))}")
        if "settings" in changes:
            changes["settings"] = json.dumps(changes["settings"] or {})
        if "pinned" in changes:
            changes["pinned"] = bool(changes["pinned"])
        if not changes:
            return
        assignments = ", ".join(f"{name} = ?" for name in changes)  # names checked against the allowed list above
        with self._tx() as db:
            _found(db.execute(f"UPDATE conversations SET {assignments} WHERE id = ?", (*changes.values(), conv_id)),
                   conv_id)

    def delete(self, conv_id: int) -> None:
        """Delete a chat and (by the foreign key's ON DELETE CASCADE) its messages."""
        with self._tx() as db:
            _found(db.execute("DELETE FROM conversations WHERE id = ?", (conv_id,)), conv_id)

    # ---- messages -------------------------------------------------------------------------------
    def add_message(self, conv_id: int, role: str, content: str, thinking: str = "", stats: dict | None = None,
                    model: str | None = None) -> int:
        """Append a message, committed before this returns. A reply's model defaults to the chat's."""
        if role not in ROLES:
            raise ValueError(f"role must be one of {ROLES}, got {role!r}")
        now = self.clock()
        with self._tx() as db:
            conv = db.execute("SELECT auto_title, model FROM conversations WHERE id = ?", (conv_id,)).fetchone()
            if conv is None:
                raise KeyError(f"no conversation {conv_id}")
            position, users = db.execute(
                "SELECT COALESCE(MAX(position) + 1, 0), COALESCE(SUM(role = 'user'), 0) FROM messages"
                " WHERE conversation_id = ?", (conv_id,)).fetchone()
            if role == "assistant" and model is None:
                model = conv["model"]
            cur = db.execute(
                "INSERT INTO messages (conversation_id, position, role, content, thinking, created_at, stats, model)"
                " VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (conv_id, position, role, content, thinking, now, _dump(stats), model),
            )
            if role == "user" and users == 0 and conv["auto_title"]:
                db.execute("UPDATE conversations SET title = ? WHERE id = ?", (auto_title(content), conv_id))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conv_id))
        return cur.lastrowid

    def update_message(self, msg_id: int, content: str | None = None, thinking: str | None = None,
                       stats: dict | None = None) -> None:
        """Replace what is given (None leaves a field as it is). Called every ~0.5 s while a reply streams:
        one small transaction on primary keys."""
        now = self.clock()
        with self._tx() as db:
            msg = db.execute("SELECT conversation_id, role, position FROM messages WHERE id = ?", (msg_id,)).fetchone()
            if msg is None:
                raise KeyError(f"no message {msg_id}")
            db.execute(
                "UPDATE messages SET content = COALESCE(?, content), thinking = COALESCE(?, thinking),"
                " stats = COALESCE(?, stats) WHERE id = ?", (content, thinking, _dump(stats), msg_id))
            conv_id = msg["conversation_id"]
            if msg["role"] == "user" and content is not None:  # an edited first question renames an unnamed chat
                db.execute(
                    "UPDATE conversations SET title = ? WHERE id = ? AND auto_title AND NOT EXISTS (SELECT 1"
                    " FROM messages WHERE conversation_id = ? AND role = 'user' AND position < ?)",
                    (auto_title(content), conv_id, conv_id, msg["position"]))
            db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (now, conv_id))

    def truncate_after(self, conv_id: int, position: int) -> int:
        """Delete every message after `position` (edit or regenerate); returns how many went. -1 empties the chat."""
        with self._tx() as db:
            _found(db.execute("UPDATE conversations SET updated_at = ? WHERE id = ?", (self.clock(), conv_id)),
                   conv_id)
            cur = db.execute("DELETE FROM messages WHERE conversation_id = ? AND position > ?", (conv_id, position))
        return cur.rowcount

    def messages(self, conv_id: int) -> list[dict]:
        """The chat as engine ChatSession messages: role and content, plus reasoning_content when it thought."""
        out = []
        for m in self.message_rows(conv_id):
            msg = {"role": m["role"], "content": m["content"]}
            if m["thinking"]:
                msg["reasoning_content"] = m["thinking"]
            out.append(msg)
        return out

    def message_rows(self, conv_id: int) -> list[dict]:
        """Every message with its id, position, thinking, created_at, stats (a dict or None) and model, for the UI."""
        self.conversation(conv_id)  # a KeyError for an unknown chat rather than an empty list
        rows = self._db.execute(
            "SELECT id, position, role, content, thinking, created_at, stats, model FROM messages"
            " WHERE conversation_id = ? AND role IN ('system', 'user', 'assistant') ORDER BY position", (conv_id,))
        return [{**dict(r), "content": r["content"] if isinstance(r["content"], str) else "",
                 "thinking": r["thinking"] if isinstance(r["thinking"], str) else "",
                 "stats": _json_object(r["stats"])} for r in rows]

    # ---- export ---------------------------------------------------------------------------------
    def export_json(self, conv_id: int) -> dict:
        conv = self.conversation(conv_id)
        return {
            "format": EXPORT_FORMAT,
            "version": EXPORT_VERSION,
            "title": conv["title"],
            "created_at": _iso(conv["created_at"]),
            "updated_at": _iso(conv["updated_at"]),
            "model": conv["model"],
            "system_prompt": conv["system_prompt"],
            "settings": conv["settings"],
            "messages": [
                {"role": m["role"], "content": m["content"], "thinking": m["thinking"],
                 "created_at": _iso(m["created_at"]), "model": m["model"], "stats": m["stats"]}
                for m in self.message_rows(conv_id)
            ],
        }

    def export_markdown(self, conv_id: int) -> str:
        conv = self.conversation(conv_id)
        meta = [f"Started {_iso(conv['created_at'])}"] + ([f"model {conv['model']}"] if conv["model"] else [])
        parts = [f"# {conv['title']}", " · ".join(meta)]
        if conv["system_prompt"]:
            parts += ["## System prompt", _close_fences(conv["system_prompt"])]
        for m in self.message_rows(conv_id):
            parts.append(f"## {m['role'].capitalize()}")
            if m["thinking"]:
                # Blank lines around the body so Markdown inside <details> still renders (GitHub, most viewers).
                parts.append(f"<details>\n<summary>Thinking</summary>\n\n{_close_fences(m['thinking'])}\n\n</details>")
            parts.append(_close_fences(m["content"]))
        return "\n\n".join(parts) + "\n"

    def export(self, conv_id: int, path: str | os.PathLike) -> Path:
        """Write the chat as Markdown (.md, .markdown) or JSON (.json), atomically; returns the path."""
        path = Path(path)
        suffix = path.suffix.lower()
        if suffix in (".md", ".markdown"):
            text = self.export_markdown(conv_id)
        elif suffix == ".json":
            text = json.dumps(self.export_json(conv_id), indent=2, ensure_ascii=False) + "\n"
        else:
            raise ValueError(f"export to .md or .json, not {path.name!r}")
        _write_atomic(path, text.encode("utf-8"))
        return path


def auto_title(text: str, limit: int = TITLE_LIMIT) -> str:
    """A chat title from its first user message: the first line of prose (code only when there is nothing else),
    whitespace collapsed, at most `limit` characters, cut on a word boundary with an ellipsis."""
    prose, code, fence = [], [], None
    for line in text.splitlines():
        fence, marker = _fence_after(line, fence)
        if not marker and line.strip():
            (code if fence else prose).append(line)
    first = (prose or code or [""])[0]
    title = re.sub(r"^#{1,6}\s+", "", " ".join(first.split()))  # a Markdown heading's marks are not its name
    if not title:
        return DEFAULT_TITLE
    if len(title) <= limit:
        return title
    head = title[:limit - 1]  # one character left for the ellipsis
    if not title[limit - 1].isspace():  # the cut falls inside a word: back up to its start, unless that loses half
        space = head.rfind(" ")
        if space > limit // 2:
            head = head[:space]
    while len(head) > 1 and unicodedata.combining(title[len(head)]):  # never split a letter from its accents
        head = head[:-1]
    return head.rstrip(" ,.;:-") + "…"


def _version(db: sqlite3.Connection) -> int:
    version, _ = store_repair.read_version(db)
    return version or 0


def _text(data: bytes) -> str:
    return data.decode("utf-8", "replace")


def _json_object(text) -> dict | None:
    """A stored JSON object, or None when the stored text is not one (the open-time repair normally fixed it)."""
    try:
        value = json.loads(text) if isinstance(text, str) else None
    except (ValueError, RecursionError):
        return None
    return value if isinstance(value, dict) else None


def open_store(path: str | os.PathLike, *, clock: Callable[[], float] = time.time) -> ConversationStore:
    """The chat store at `path`, repaired or recovered as ConversationStore does. Never raises: a file that
    cannot be opened for writing (written by a newer app, a read-only or unusable folder, another app holding
    it) gives a temporary in-memory store with a copy of what could be read, and `store.notice` says so."""
    path = Path(path)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", StoreRecoveredWarning)  # shown through store.notice instead
            return ConversationStore(path, clock=clock)
    except SchemaTooNewError as e:
        return ConversationStore.in_memory(f"{e}.", clock=clock)
    except (StoreError, sqlite3.Error, OSError, ValueError) as e:
        reason = str(e).strip().splitlines()[0][:200] if str(e).strip() else type(e).__name__
        return ConversationStore.in_memory(f"Your chat history ({path}) cannot be opened for writing ({reason}).",
                                           path, clock=clock)


def _migrate(db: sqlite3.Connection, step: int) -> None:
    """Apply MIGRATIONS[step] and record version step + 1 in one transaction: a failed step changes nothing.
    executescript commits whatever is open before it runs, so the script carries its own BEGIN and COMMIT."""
    try:
        db.executescript(
            f"BEGIN IMMEDIATE;\n{MIGRATIONS[step]};\n"
            f"INSERT OR REPLACE INTO schema_version (id, version) VALUES (1, {step + 1});\nCOMMIT;")
    except BaseException:
        if db.in_transaction:
            db.execute("ROLLBACK")
        raise


def _check_header(path: Path) -> None:
    """Refuse a file that is not SQLite before SQLite opens it: on close it would delete a -wal file it cannot use."""
    try:
        with open(path, "rb") as f:
            head = f.read(16)
    except FileNotFoundError:
        return
    if head and head != b"SQLite format 3\x00":
        raise _CorruptFile("not an SQLite database")


def _is_corrupt(e: Exception) -> bool:
    """Only a damaged or foreign file is moved aside; a locked or unwritable one is the caller's to report."""
    if isinstance(e, (_CorruptFile, UnicodeDecodeError)):  # an error message with bytes that are not text:
        return True  # SQLite quoting a damaged schema
    if "unsupported file format" in str(e):  # a header whose version bytes are damaged
        return True
    code = getattr(e, "sqlite_errorcode", None)  # Python 3.11+
    if code is not None:
        return code & 0xFF in (_SQLITE_CORRUPT, _SQLITE_NOTADB)
    return type(e) is sqlite3.DatabaseError and ("not a database" in str(e) or "malformed" in str(e))


def _move_aside(path: Path, kind: str = "corrupt") -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target, n = path.with_name(f"{path.name}.{kind}-{stamp}"), 1
    while target.exists():
        target, n = path.with_name(f"{path.name}.{kind}-{stamp}-{n}"), n + 1
    os.replace(path, target)
    # Its WAL and index go with it, keeping the copy openable: a stale WAL must never be replayed into the new file.
    for suffix in ("-wal", "-shm", "-journal"):
        side = path.with_name(path.name + suffix)
        if side.exists():
            os.replace(side, target.with_name(target.name + suffix))
    return target


def _close_fences(text: str) -> str:
    """Text as it is, plus a closing fence if a code block was left open, so it cannot swallow the next heading."""
    fence = None
    for line in text.splitlines():
        fence, _ = _fence_after(line, fence)
    text = text.rstrip("\n")
    return f"{text}\n{fence}" if fence else text


def _fence_after(line: str, fence: str | None) -> tuple[str | None, bool]:
    """The code fence open after `line` (None outside code), and whether the line opened or closed one.
    As in CommonMark, only a bare run of the same character, at least as long, closes a block."""
    m = _FENCE.match(line)
    if not m:
        return fence, False
    mark = m.group(1)
    if fence is None:
        return mark, True
    if mark[0] == fence[0] and len(mark) >= len(fence) and not line[m.end():].strip():
        return None, True
    return fence, False


def _dump(stats: dict | None) -> str | None:
    return None if stats is None else json.dumps(stats)


def _found(cur: sqlite3.Cursor, conv_id: int) -> None:
    if cur.rowcount == 0:
        raise KeyError(f"no conversation {conv_id}")


def _iso(ts: float) -> str:
    try:
        return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="seconds")
    except (TypeError, ValueError, OverflowError, OSError):  # a damaged date: say so rather than fail the export
        return "unknown"


def _write_atomic(path: Path, data: bytes) -> None:
    """A temporary file in the same folder, synced and renamed over the target: a crash never leaves half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
