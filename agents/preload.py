"""Memory preloading for every model call of a run, searched once per run."""

from __future__ import annotations

from typing import Any

from google.adk.memory.base_memory_service import SearchMemoryResponse
from google.adk.tools.preload_memory_tool import PreloadMemoryTool


class _CachedSearchContext:
    """A tool context whose search_memory answers from one search per (invocation, query)."""

    def __init__(self, tool_context: Any, cache: dict):
        self._tool_context = tool_context
        self._cache = cache

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tool_context, name)

    async def search_memory(self, query: str) -> SearchMemoryResponse:
        key = (self._tool_context.invocation_id, query)
        if key not in self._cache:
            self._cache[key] = await self._tool_context.search_memory(query)
        return self._cache[key]


class PreloadMemoryOncePerInvocation(PreloadMemoryTool):
    """ADK's preload_memory, searching once per run instead of before every model call.

    Its query (the invocation's user message) and the memories (fed only when a run settles) do
    not change within an invocation, so the first search serves every model call of the run.
    Build one per agent instance: the cache lives as long as the run's agent.
    """

    def __init__(self) -> None:
        super().__init__()
        self._searches: dict = {}

    async def process_llm_request(self, *, tool_context: Any, llm_request: Any) -> None:
        await super().process_llm_request(
            tool_context=_CachedSearchContext(tool_context, self._searches), llm_request=llm_request
        )
