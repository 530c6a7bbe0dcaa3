"""Checks and repairs of a chat store that SQLite can read but whose contents are damaged: a bad schema_version
row, missing tables or columns, settings or stats that are not JSON objects, text that is not text.

Repairs keep every row they can: a missing table or column is recreated (empty, or with its default), a value
that cannot be read gets its default, and a table too damaged to use (its key columns are gone) is renamed
inside the file, not dropped. The caller makes a backup copy of the file before any of this writes, and shows
the sentences these functions return.
"""

from __future__ import annotations

import json
import sqlite3

DEFAULT_TITLE = "New chat"
ROLES = ("system", "user", "assistant")

# The schema as the last migration leaves it (app/store.py MIGRATIONS), to recreate what is missing.
CREATE = {
    "schema_version": """CREATE TABLE schema_version (
        id INTEGER PRIMARY KEY CHECK (id = 1),
        version INTEGER NOT NULL)""",
    "conversations": """CREATE TABLE conversations (
        id INTEGER PRIMARY KEY,
        title TEXT NOT NULL,
        auto_title INTEGER NOT NULL DEFAULT 1,
        created_at REAL NOT NULL,
        updated_at REAL NOT NULL,
        model TEXT,
        system_prompt TEXT,
        settings TEXT NOT NULL DEFAULT '{}',
        pinned INTEGER NOT NULL DEFAULT 0)""",
    "messages": """CREATE TABLE messages (
        id INTEGER PRIMARY KEY,
        conversation_id INTEGER NOT NULL REFERENCES conversations(id) ON DELETE CASCADE,
        position INTEGER NOT NULL,
        role TEXT NOT NULL CHECK (role IN ('system', 'user', 'assistant')),
        content TEXT NOT NULL DEFAULT '',
        thinking TEXT NOT NULL DEFAULT '',
        created_at REAL NOT NULL,
        stats TEXT,
        model TEXT,
        UNIQUE (conversation_id, position))""",
}
# table -> column -> (the schema version that added it, its ALTER TABLE ADD COLUMN definition; None: a key the
# table cannot work without, so the table is set aside instead)
COLUMNS = {
    "conversations": {
        "id": (1, None), "title": (1, f"TEXT NOT NULL DEFAULT '{DEFAULT_TITLE}'"),
        "auto_title": (1, "INTEGER NOT NULL DEFAULT 1"), "created_at": (1, "REAL NOT NULL DEFAULT 0"),
        "updated_at": (1, "REAL NOT NULL DEFAULT 0"), "model": (1, "TEXT"), "system_prompt": (1, "TEXT"),
        "settings": (1, "TEXT NOT NULL DEFAULT '{}'"), "pinned": (2, "INTEGER NOT NULL DEFAULT 0"),
    },
    "messages": {
        "id": (1, None), "conversation_id": (1, None), "position": (1, None), "role": (1, None),
        "content": (1, "TEXT NOT NULL DEFAULT ''"), "thinking": (1, "TEXT NOT NULL DEFAULT ''"),
        "created_at": (1, "REAL NOT NULL DEFAULT 0"), "stats": (1, "TEXT"), "model": (2, "TEXT"),
    },
}
OUR_TABLES = set(COLUMNS)
# What a copied row gets for a NULL where the schema wants a value.
COPY_DEFAULTS = {"title": f"'{DEFAULT_TITLE}'", "auto_title": "1", "created_at": "0", "updated_at": "0",
                 "settings": "'{}'", "pinned": "0", "content": "''", "thinking": "''"}


def user_tables(db: sqlite3.Connection) -> set[str]:
    return {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table' AND name NOT LIKE "
                                     "'sqlite_%'")}


def read_version(db: sqlite3.Connection) -> tuple[int | None, str | None]:
    """(version, None) from a sound schema_version table; (None, None) without one; (None, why) when it is
    there but does not hold exactly one non-negative integer."""
    if "schema_version" not in user_tables(db):
        return None, None
    try:
        rows = db.execute("SELECT id, version FROM schema_version").fetchall()
    except sqlite3.OperationalError as e:
        return None, f"its schema_version table is damaged ({e})"
    if len(rows) != 1 or rows[0][0] != 1 or type(rows[0][1]) is not int or rows[0][1] < 0:
        shown = ", ".join(repr(r[1])[:20] for r in rows[:3]) or "nothing"
        return None, f"its schema version was {shown} instead of one number"
    return rows[0][1], None


def columns(db: sqlite3.Connection, table: str) -> set[str]:
    return {r[1] for r in db.execute(f"PRAGMA table_info({table})")}


def id_is_key(db: sqlite3.Connection, table: str) -> bool:
    """Whether `id` is still the table's INTEGER PRIMARY KEY (the rowid): a damaged schema text can lose it, and
    then every id reads as NULL."""
    for _, name, kind, _, _, pk in db.execute(f"PRAGMA table_info({table})"):
        if name == "id":
            return pk == 1 and str(kind).upper() == "INTEGER"
    return False


def structure_problems(db: sqlite3.Connection, version: int) -> list[str]:
    """What a file at `version` should hold and does not: missing tables, missing columns, a lost key."""
    problems = []
    tables = user_tables(db)
    for table, cols in COLUMNS.items():
        if table not in tables:
            problems.append(f"the {table} table was missing")
            continue
        have = columns(db, table)
        missing = [c for c, (added, _) in cols.items() if added <= version and c not in have]
        if missing:
            problems.append(f"the {table} table lacked {', '.join(missing)}")
        elif not id_is_key(db, table):
            problems.append(f"the {table} table's id column was no longer its key")
    return problems


def structure_ahead(db: sqlite3.Connection, version: int) -> int | None:
    """The highest later version whose columns the tables already hold (the version row went back), or None."""
    tables = user_tables(db)
    found = [added for table, cols in COLUMNS.items() if table in tables
             for name, (added, _) in cols.items() if added > version and name in columns(db, table)]
    return max(found) if found else None


def repair_structure(db: sqlite3.Connection, schema_version: int) -> list[str]:
    """Bring the tables to the final schema keeping their rows; returns what was done, in words. Runs with
    foreign keys off and legacy renames, so setting a table aside does not rewrite other tables' references."""
    done = []
    db.execute("PRAGMA foreign_keys=OFF")
    db.execute("PRAGMA legacy_alter_table=ON")
    db.execute("BEGIN IMMEDIATE")
    try:
        tables = user_tables(db)
        for table, cols in COLUMNS.items():
            if table in tables:
                have = columns(db, table)
                keys_missing = [c for c, (_, definition) in cols.items() if definition is None and c not in have]
                if not keys_missing and not id_is_key(db, table):
                    done.append(_rebuild(db, table))
                    continue
                if not keys_missing:
                    for name, (_, definition) in cols.items():
                        if name not in have:
                            db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {definition}")
                            done.append(f"the {table} table's missing {name} column was added back")
                    continue
                aside = _free_name(db, f"{table}_damaged")
                db.execute(f"ALTER TABLE {table} RENAME TO {aside}")
                done.append(f"the {table} table had lost its {', '.join(keys_missing)} column(s) and was set aside "
                            f"as {aside} inside the file")
            db.execute(CREATE[table])
            if table not in tables:
                done.append(f"the missing {table} table was recreated (empty)")
        if "schema_version" in tables:
            db.execute("DROP TABLE schema_version")  # our own bookkeeping: nothing of the user's is in it
        db.execute(CREATE["schema_version"])
        db.execute("INSERT INTO schema_version (id, version) VALUES (1, ?)", (schema_version,))
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    finally:
        db.execute("PRAGMA legacy_alter_table=OFF")
    return done


def _rebuild(db: sqlite3.Connection, table: str) -> str:
    """Copy every row into a freshly created table (ids from the rowid, which kept them), then drop the old one
    if every row made it; otherwise the old one stays beside it."""
    old = _free_name(db, f"{table}_old")
    db.execute(f"ALTER TABLE {table} RENAME TO {old}")
    db.execute(CREATE[table])
    names = [c for c in COLUMNS[table] if c in columns(db, old)]
    values = ["COALESCE(id, rowid)" if c == "id" else f"COALESCE({c}, {COPY_DEFAULTS[c]})" if c in COPY_DEFAULTS
              else c for c in names]
    db.execute(f"INSERT OR IGNORE INTO {table} ({', '.join(names)}) SELECT {', '.join(values)} FROM {old}")
    copied = db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0]
    total = db.execute(f"SELECT COUNT(*) FROM {old}").fetchone()[0]
    if copied == total:
        db.execute(f"DROP TABLE {old}")
        return f"the {table} table was rebuilt with all {total} rows"
    return f"the {table} table was rebuilt with {copied} of its {total} rows; the others are kept in {old}"


def _free_name(db: sqlite3.Connection, base: str) -> str:
    tables = user_tables(db)
    name, n = base, 1
    while name in tables:
        n += 1
        name = f"{base}_{n}"
    return name


def is_json_object(text) -> bool:
    if not isinstance(text, str):
        return False
    try:
        return isinstance(json.loads(text), dict)
    except (ValueError, RecursionError):
        return False


def _bad_json_ids(db: sqlite3.Connection, table: str, column: str, nullable: bool) -> list[int]:
    """Rows whose `column` is not a JSON object (NULL allowed when `nullable`). SQLite's json_valid narrows the
    rows down when the library has it; Python's parser has the last word (it also reads NaN, which we write)."""
    null_test = f"{column} IS NOT NULL AND " if nullable else ""
    try:
        rows = db.execute(
            f"SELECT id, {column} FROM {table} WHERE {null_test}(typeof({column}) != 'text' OR CASE WHEN "
            f"json_valid({column}) THEN json_type({column}) != 'object' ELSE 1 END)").fetchall()
    except sqlite3.OperationalError:  # an SQLite without JSON functions: every row
        rows = db.execute(f"SELECT id, {column} FROM {table}" + (f" WHERE {column} IS NOT NULL" if nullable
                                                                 else "")).fetchall()
    return [r[0] for r in rows if not is_json_object(r[1])]


def row_problems(db: sqlite3.Connection) -> dict[str, list[int]]:
    """Rows that cannot be read as they are, by kind (nothing is changed)."""
    found = {
        "settings": _bad_json_ids(db, "conversations", "settings", nullable=False),
        "stats": _bad_json_ids(db, "messages", "stats", nullable=True),
        "title": [r[0] for r in db.execute("SELECT id FROM conversations WHERE typeof(title) != 'text'")],
        "conv_time": [r[0] for r in db.execute(
            "SELECT id FROM conversations WHERE typeof(created_at) NOT IN ('real', 'integer') "
            "OR typeof(updated_at) NOT IN ('real', 'integer')")],
        "text": [r[0] for r in db.execute(
            "SELECT id FROM messages WHERE typeof(content) != 'text' OR typeof(thinking) != 'text'")],
        "msg_time": [r[0] for r in db.execute(
            "SELECT id FROM messages WHERE typeof(created_at) NOT IN ('real', 'integer')")],
    }
    return {k: v for k, v in found.items() if v}


def repair_rows(db: sqlite3.Connection, found: dict[str, list[int]]) -> list[str]:
    """Give each unreadable value its default, in one transaction; returns what was done, in words."""
    statements = {
        "settings": ("UPDATE conversations SET settings = '{}' WHERE id = ?",
                     "chat settings that were not valid JSON were reset"),
        "stats": ("UPDATE messages SET stats = NULL WHERE id = ?",
                  "reply statistics that were not valid JSON were cleared"),
        "title": (f"UPDATE conversations SET title = COALESCE(CAST(title AS TEXT), '{DEFAULT_TITLE}') WHERE id = ?",
                  "chat titles that were not text were restored"),
        "conv_time": ("UPDATE conversations SET created_at = CASE WHEN typeof(created_at) IN ('real', 'integer') "
                      "THEN created_at ELSE 0 END, updated_at = CASE WHEN typeof(updated_at) IN ('real', "
                      "'integer') THEN updated_at ELSE 0 END WHERE id = ?", "chat dates that were not numbers "
                      "were reset"),
        "text": ("UPDATE messages SET content = COALESCE(CAST(content AS TEXT), ''), thinking = "
                 "COALESCE(CAST(thinking AS TEXT), '') WHERE id = ?", "message texts that were not text were "
                 "restored"),
        "msg_time": ("UPDATE messages SET created_at = 0 WHERE id = ?", "message dates that were not numbers were "
                     "reset"),
    }
    done = []
    db.execute("BEGIN IMMEDIATE")
    try:
        for kind, ids in found.items():
            sql, words = statements[kind]
            db.executemany(sql, [(i,) for i in ids])
            done.append(f"{words} ({len(ids)})")
        db.execute("COMMIT")
    except BaseException:
        db.execute("ROLLBACK")
        raise
    return done
