"""DDL of the memory full-text index, per database.

Kept out of the migration file so a later migration that makes SQLite rebuild
`memory_entries` (SQLite's ALTER TABLE does that by copying into a new table, which drops the
triggers) can call `install(schema_editor)` again.
"""

from __future__ import annotations

# PostgreSQL: a stored generated tsvector column, so a search never re-parses text (to_tsvector
# on every candidate row cost more than the whole rest of a search), and a GIN index on
# (owner_id, search_vector) through btree_gin, so one owner's search is a single index scan
# that intersects the owner's entries with the query's lexemes. agent_name stays out of it: a
# handful of agents share every row, so its posting list is the whole table and scanning it
# made each search several times slower; the heap recheck filters the agent instead. The column is outside Django's model
# state: Django never writes it, and memory.search reads it by name. Changing the type of
# `text` on PostgreSQL therefore needs this column dropped and re-added around it.
PG_INDEX_NAME = "memory_text_search"
PG_VECTOR_COLUMN = "search_vector"
PG_CREATE = [
    f"ALTER TABLE memory_entries ADD COLUMN IF NOT EXISTS {PG_VECTOR_COLUMN} tsvector "
    "GENERATED ALWAYS AS (to_tsvector('english'::regconfig, text)) STORED",
    f"CREATE INDEX IF NOT EXISTS {PG_INDEX_NAME} ON memory_entries "
    f"USING gin (owner_id, {PG_VECTOR_COLUMN})",
]
PG_DROP_INDEX = f"DROP INDEX IF EXISTS {PG_INDEX_NAME}"
PG_DROP = [PG_DROP_INDEX, f"ALTER TABLE memory_entries DROP COLUMN IF EXISTS {PG_VECTOR_COLUMN}"]

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
        for statement in PG_CREATE:
            schema_editor.execute(statement)
    elif vendor == "sqlite":
        for statement in SQLITE_CREATE:
            schema_editor.execute(statement)


def uninstall(schema_editor) -> None:
    vendor = schema_editor.connection.vendor
    if vendor == "postgresql":
        for statement in PG_DROP:
            schema_editor.execute(statement)
    elif vendor == "sqlite":
        for statement in SQLITE_DROP:
            schema_editor.execute(statement)
