"""`GET /api/memory/`: one scope's memories, ranked by relevance to `q`; read under the owner rule (runs.permissions).

Errors answer `{"code": ..., "detail": ...}` like the rest of the API.
"""

from __future__ import annotations

from drf_spectacular.utils import OpenApiParameter, OpenApiResponse, extend_schema, inline_serializer
from rest_framework import serializers
from rest_framework.response import Response
from rest_framework.views import APIView

from config.lib.api_errors import ErrorSerializer
from memory import services
from memory.models import MemoryEntry
from runs import permissions


class MemorySerializer(serializers.ModelSerializer):
    id = serializers.CharField(source="event_id", help_text="The memory's id (the remembered ADK event's id).")

    class Meta:
        model = MemoryEntry
        fields = ["id", "author", "text", "session_id", "run_id", "timestamp", "added_at"]




class MemorySearchView(APIView):
    @extend_schema(
        operation_id="memory_search",
        summary="Search one owner's long-term memories of one agent",
        parameters=[
            OpenApiParameter("agent", str, required=True, description="A registered agent, e.g. support."),
            OpenApiParameter("owner_id", str, required=True, description="The end user the memories belong to."),
            OpenApiParameter("q", str, required=True, description="Words to search for; ranked by relevance."),
            OpenApiParameter(
                "limit", int, required=False, description=f"At most this many (1–{services.MAX_RESULTS})."
            ),
        ],
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
