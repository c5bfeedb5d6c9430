"""`GET /api/memory/`: one scope's memories, ranked by relevance to `q`; read under the owner rule (runs.rules.permissions).

Errors answer `{"code": ..., "detail": ...}` like the rest of the API.
"""

from __future__ import annotations

from drf_spectacular.openapi import AutoSchema
from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from agents.registry import runnable_agents
from config.lib.api_errors import ErrorSerializer
from config.lib.serializers import PRINTABLE
from memory import services
from memory.models import MemoryEntry
from runs.rules import permissions


class MemorySerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="event_id", help_text="The memory's id (the remembered ADK event's id).")

    class Meta:
        model = MemoryEntry
        fields = ["id", "author", "text", "session_id", "run_id", "timestamp", "added_at"]




# A word needs a letter or digit of any script. JSON Schema reads patterns as ECMA-262 does, where
# \w is ASCII only (Python's is Unicode's), so the pattern names ASCII's and every character beyond
# ASCII, one reading in both; `search-words` says which of those make a word.
SOME_LETTER = r"[0-9A-Za-z]|[^\x00-\x7F]"
OWNER = {"type": "string", "minLength": 1, "maxLength": services.MAX_SCOPE_CHARS, "format": PRINTABLE}


class MemorySearchSchema(AutoSchema):
    """The query parameters as clean_scope, clean_query and clean_limit read them; the agents are
    those loaded when the schema is generated."""

    def get_override_parameters(self):
        agents = runnable_agents()
        return [
            OpenApiParameter("agent", {"type": "string", "enum": agents} if agents else OWNER, required=True,
                             description="A registered agent, e.g. support."),
            OpenApiParameter("owner_id", OWNER, required=True, description="The end user the memories belong to."),
            OpenApiParameter(
                "q",
                # `search-words`: at least one word that is not a very common one (memory.services.search_terms).
                {"type": "string", "maxLength": services.MAX_QUERY_CHARS, "pattern": SOME_LETTER, "format": "search-words"},
                required=True,
                description="Words to search for; ranked by relevance (very common words such as 'the' are not).",
            ),
            OpenApiParameter(
                "limit", {"type": "integer", "minimum": 1, "maximum": services.MAX_RESULTS}, required=False,
                description=f"At most this many (1–{services.MAX_RESULTS}).",
            ),
        ]


class MemorySearchView(APIView):
    schema = MemorySearchSchema()

    @extend_schema(
        operation_id="memory_search",
        summary="Search one owner's long-term memories of one agent",
        responses={
            200: inline_serializer(
                name="MemorySearch",
                fields={
                    "agent": serializers.CharField(),
                    "owner_id": serializers.CharField(),
                    "q": serializers.CharField(),
                    "results": MemorySerializer(many=True),
                },
            ),
            400: OpenApiResponse(ErrorSerializer, description="missing_scope, unknown_agent, empty_query, invalid_limit"),
            401: OpenApiResponse(ErrorSerializer, description="No or bad credentials."),
            404: OpenApiResponse(
                ErrorSerializer, description="Not a scope the caller may read: the owner is not theirs to act for."
            ),
        },
    )
    def get(self, request):
        params = request.query_params
        agent, owner_id = services.clean_scope(agent=params.get("agent"), owner_id=params.get("owner_id"))
        query = services.clean_query(params.get("q"))
        limit = services.clean_limit(params.get("limit"))
        permissions.check_may_read_memory(user=request.user, agent=agent, owner_id=owner_id)
        entries = services.search_memories(agent=agent, owner_id=owner_id, query=query, limit=limit)
        return Response(
            {"agent": agent, "owner_id": owner_id, "q": query, "results": MemorySerializer(entries, many=True).data}
        )
