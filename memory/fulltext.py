"""DDL of the memory full-text index, per database.

Kept out of the migration file so a later migration that makes SQLite rebuild
`memory_entries` (SQLite's ALTER TABLE does that by copying into a new table, which drops the
triggers) can call `install(schema_editor)` again.
"""

from __future__ import annotations

# Must stay the very expression memory.search builds, or PostgreSQL will not use the index.
PG_INDEX_NAME = "memory_text_search"
PG_CREATE = (
    f"CREATE INDEX IF NOT EXISTS {PG_INDEX_NAME} ON memory_entries "
    "USING gin (to_tsvector('english'::regconfig, COALESCE(text, '')))"
)
PG_DROP = f"DROP INDEX IF EXISTS {PG_INDEX_NAME}"

SQLITE_CREATE = [
    # External content: the text is stored once, in memory_entries; FTS5 keeps only the index.
    "CREATE VIRTUAL TABLE IF NOT EXISTS memory_fts USING fts5("
    "text, content='memory_entries', content_rowid='id', tokenize='porter unicode61 remove_diacritics 2')",
    "CREATE TRIGGER IF NOT EXISTS memory_fts_insert AFTER INSERT ON memory_entries BEGIN "
    "INSERT INTO memory_fts(rowid, text) VALUES (new.id, new.text); END",
    "CREATE TRIGGER IF NOT EXISTS memory_fts_delete AFTER DELETE ON memory_entries BEGIN "
    "INSERT INTO memory_fts(memory_fts, rowid, text) VALUES ('delete', old.id, old.text); END",
    "CREATE TRIGGER IF NOT EXISTS memory_fts_update AFTER UPDATE OF text ON memory_entries BEGIN "
    "INSERT INTO memory_fts(memory_fts, rowid, text) VALUES ('delete', old.id, old.text); "
    "INSERT INTO memory_fts(rowid, text) VALUES (new.id, new.text); END",
    # Index whatever the table already holds (nothing on a fresh install).
    "INSERT INTO memory_fts(memory_fts) VALUES ('rebuild')",
]
SQLITE_DROP = [
    "DROP TRIGGER IF EXISTS memory_fts_insert",
    "DROP TRIGGER IF EXISTS memory_fts_delete",
    "DROP TRIGGER IF EXISTS memory_fts_update",
    "DROP TABLE IF EXISTS memory_fts",
]


def install(schema_editor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(PG_CREATE)
    elif vendor == "sqlite":
        for statement in SQLITE_CREATE:
            schema_editor.execute(statement)


def uninstall(schema_editor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        schema_editor.execute(PG_DROP)
    elif vendor == "sqlite":
        for statement in SQLITE_DROP:
            schema_editor.execute(statement)
