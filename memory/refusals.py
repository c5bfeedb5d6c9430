"""What the memory rules refuse: one branch of the refusal family."""

from __future__ import annotations

from config.lib.refusals import Refusal


class MemoryRefusal(Refusal):
    """A request the memory rules refuse."""

    code = "invalid"
    status = 400


class MissingScope(MemoryRefusal):
    code = "missing_scope"


class UnknownAgent(MemoryRefusal):
    code = "unknown_agent"


class InvalidQuery(MemoryRefusal):
    code = "empty_query"


class InvalidLimit(MemoryRefusal):
    code = "invalid_limit"


class ScopeNotVisible(MemoryRefusal):
    code = "not_found"
    status = 404
