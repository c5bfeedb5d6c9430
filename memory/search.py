"""Full-text matching and ranking of memories, one implementation per database.

PostgreSQL: a stored `to_tsvector('english', text)` column behind a GIN index that also holds
the scope columns, ranked by `ts_rank` with length normalisation. SQLite: an FTS5 table (porter stemming) kept in step with
`memory_entries` by triggers, ranked by `bm25()`. The query is reduced to its searchable words
in Python the same way for both (lower case, PostgreSQL's English stop words removed, OR of the
rest), so the two databases match the same entries and agree on clear winners.

The DDL for both is in memory.fulltext (applied by migration 0002_full_text_search).
"""

from __future__ import annotations

import re
import unicodedata
from typing import TYPE_CHECKING

from django.db import connections
from django.db.models import FloatField
from django.db.models.expressions import RawSQL, Value

from memory.fulltext import PG_VECTOR_COLUMN

if TYPE_CHECKING:
    from memory.models import MemoryEntryQuerySet

TEXT_SEARCH_CONFIG = "english"
MAX_QUERY_TERMS = 32

# PostgreSQL's `english` stop-word list (tsearch_data/english.stop). Removing the same words
# on SQLite keeps "the", "my"… from matching every memory there while PostgreSQL ignores them.
STOP_WORDS = frozenset(
    """
    i me my myself we our ours ourselves you your yours yourself yourselves he him his himself
    she her hers herself it its itself they them their theirs themselves what which who whom
    this that these those am is are was were be been being have has had having do does did
    doing a an the and but if or because as until while of at by for with about against
    between into through during before after above below to from up down in out on off over
    under again further then once here there when where why how all any both each few more
    most other some such no nor not only own same so than too very s t can will just don
    should now
    """.split()
)

_WORD = re.compile(r"\w+")


def search_terms(query: str) -> list[str]:
    """The words of `query` worth searching for, in order, without duplicates."""
    words = _WORD.findall(unicodedata.normalize("NFC", query or "").lower())
    terms: list[str] = []
    for word in words:
        for piece in word.split("_"):
            if piece and piece not in STOP_WORDS and piece not in terms:
                terms.append(piece)
    return terms[:MAX_QUERY_TERMS]


def _vendor(qs: MemoryEntryQuerySet) -> str:
    return connections[qs.db].vendor


# --- PostgreSQL -------------------------------------------------------------------------------------


def _pg_vector() -> RawSQL:
    from django.contrib.postgres.search import SearchVectorField

    # The stored column memory.fulltext adds; unqualified so the expression survives aliasing.
    return RawSQL(PG_VECTOR_COLUMN, [], output_field=SearchVectorField())


def _pg_query(terms: list[str]):
    from django.contrib.postgres.search import SearchQuery

    return SearchQuery(_raw_tsquery(terms), search_type="raw", config=TEXT_SEARCH_CONFIG)


def _raw_tsquery(terms: list[str]) -> str:
    # Terms are \w+ runs, so quoting them as tsquery lexemes cannot be escaped out of.
    return " | ".join(f"'{term}'" for term in terms)


# --- SQLite FTS5 --------------------------------------------------------------------------------------


def _fts_query(terms: list[str]) -> str:
    return " OR ".join(f'"{term}"' for term in terms)


def _fts_rowids(terms: list[str]) -> RawSQL:
    return RawSQL("SELECT rowid FROM memory_fts WHERE memory_fts MATCH %s", (_fts_query(terms),))


def _fts_rank(terms: list[str]) -> RawSQL:
    # bm25() only exists inside a query on the FTS table; correlating by rowid keeps the scope
    # filter on memory_entries in charge of which rows are looked at.
    return RawSQL(
        "(SELECT bm25(memory_fts) FROM memory_fts WHERE memory_fts MATCH %s AND memory_fts.rowid = memory_entries.id)",
        (_fts_query(terms),),
        output_field=FloatField(),
    )


# --- Entry points ---------------------------------------------------------------------------------------


def matching(qs: MemoryEntryQuerySet, query: str) -> MemoryEntryQuerySet:
    terms = search_terms(query)
    if not terms:
        return qs.none()
    if _vendor(qs) == "postgresql":
        return qs.alias(search_vector=_pg_vector()).filter(search_vector=_pg_query(terms))
    return qs.filter(id__in=_fts_rowids(terms))


def ranked(qs: MemoryEntryQuerySet, query: str) -> MemoryEntryQuerySet:
    terms = search_terms(query)
    if not terms:
        return qs.none()
    if _vendor(qs) == "postgresql":
        from django.contrib.postgres.search import SearchRank

        tsquery = _pg_query(terms)
        return (
            qs.alias(search_vector=_pg_vector())
            .filter(search_vector=tsquery)
            # Normalisation 1 divides by 1 + log(length), like BM25's length penalty.
            .alias(rank=SearchRank(_pg_vector(), tsquery, normalization=Value(1)))
            .order_by("-rank", "-timestamp", "-id")
        )
    # bm25() is negative, more negative = more relevant.
    return qs.alias(rank=_fts_rank(terms)).filter(rank__isnull=False).order_by("rank", "-timestamp", "-id")


# --- Compiled once, sent from the agent loop (PostgreSQL) ---------------------------------------------

# Stand-ins the ranked search is compiled with once; each search puts its own values in their places.
_AGENT_STAND_IN = "\x00agent"
_OWNER_STAND_IN = "\x00owner"
_QUERY_STAND_IN = "standinquery"
# What a preloaded memory needs, in this order: no model object is built for a row.
RANKED_COLUMNS = ("event_id", "author", "timestamp", "text", "session_id", "run_id")
_compiled: dict[tuple[str, int], tuple[str, tuple]] = {}


def compiled_ranked(qs: MemoryEntryQuerySet, *, agent: str, owner_id: str, query: str, limit: int):
    """`ranked(for_scope(agent, owner_id), query)[:limit]` as (sql, params) of RANKED_COLUMNS rows,
    from SQL Django compiles once per process and limit (PostgreSQL); None when `query` has no
    searchable word (nothing matches). `qs` is `MemoryEntry.objects`, for the compile."""
    terms = search_terms(query)
    if not terms:
        return None
    cache_key = (qs.db, limit)
    built = _compiled.get(cache_key)
    if built is None:
        scoped = qs.for_scope(agent=_AGENT_STAND_IN, owner_id=_OWNER_STAND_IN)
        compiled = ranked(scoped, _QUERY_STAND_IN)[:limit].values_list(*RANKED_COLUMNS).query.sql_with_params()
        built = _compiled[cache_key] = (compiled[0], tuple(compiled[1]))
    sql, params = built
    stand_ins = {
        _AGENT_STAND_IN: agent,
        _OWNER_STAND_IN: owner_id,
        _raw_tsquery([_QUERY_STAND_IN]): _raw_tsquery(terms),
    }
    return sql, tuple(stand_ins.get(value, value) if isinstance(value, str) else value for value in params)
