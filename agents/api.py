"""`/api/workflows/`: workflow definitions. Anyone signed in reads them; writing needs the model's
add/change/delete permission (staff who edit them in the admin). Every write goes through
`agents.services.save_workflow`, the same checks as the admin form."""

from __future__ import annotations

from drf_spectacular.utils import OpenApiExample, extend_schema, extend_schema_field, extend_schema_view
from rest_framework import mixins, serializers, status, viewsets
from rest_framework.exceptions import NotFound
from rest_framework.permissions import DjangoModelPermissions, IsAuthenticated
from rest_framework.response import Response

from agents import services, workflows
from agents.demo import DEMO_WORKFLOW
from agents.models import WorkflowDefinition
from config.lib.api_errors import errors
from config.lib.serializers import StrictCharField, StrictSerializer


class WorkflowSerializer(serializers.ModelSerializer):
    updated_by = serializers.SlugRelatedField(slug_field="username", read_only=True, allow_null=True)

    class Meta:
        model = WorkflowDefinition
        fields = ["name", "description", "graph", "created_at", "updated_at", "updated_by"]
        read_only_fields = fields


# The graph's shape as agents.workflows.validate_graph reads it. What no schema can say (chains
# name steps that exist, no cycles, one end, joins where branches meet) is refused with a 400
# naming the problem.
GRAPH_SCHEMA = {
    "type": "object",
    "required": ["steps", "chains"],
    "additionalProperties": False,
    "properties": {
        "steps": {
            "type": "object",
            "minProperties": 1,
            "maxProperties": workflows.MAX_STEPS,
            "additionalProperties": {"type": "object", "minProperties": 1},
            "description": "Step name → one of {agent}, {function}, {join: true} or {workflow}, with optional retry "
                           "and timeout.",
        },
        "chains": {
            "type": "array",
            "minItems": 1,
            "items": {"type": "array", "minItems": 2, "items": {"anyOf": [
                {"type": "string"}, {"type": "array", "minItems": 1, "items": {"type": "string"}},
            ]}},
            "description": 'Each begins at "START" or a step; a list inside a chain is a fan-out.',
        },
    },
}


@extend_schema_field(GRAPH_SCHEMA)
class GraphField(serializers.JSONField):
    pass


class WorkflowWriteSerializer(StrictSerializer):
    name = StrictCharField(
        trim_whitespace=False, help_text="Letters, digits and underscores, starting with a letter.",
        schema={"pattern": r"^[A-Za-z][A-Za-z0-9_]*$", "maxLength": workflows.MAX_NAME_CHARS},
    )
    description = StrictCharField(required=False, default="", allow_blank=True)
    graph = GraphField(help_text='{"steps": {...}, "chains": [["START", ...]]}; see docs/agents.md#workflows.')


@extend_schema_view(
    list=extend_schema(summary="List workflow definitions", responses={200: WorkflowSerializer(many=True), **errors(401)}),
    retrieve=extend_schema(summary="One workflow definition", responses={200: WorkflowSerializer, **errors(401, 404)}),
    destroy=extend_schema(summary="Delete a workflow definition", responses={204: None, **errors(401, 403, 404)}),
)
class WorkflowViewSet(
    mixins.ListModelMixin, mixins.RetrieveModelMixin, mixins.DestroyModelMixin, viewsets.GenericViewSet
):
    serializer_class = WorkflowSerializer
    queryset = WorkflowDefinition.objects.select_related("updated_by").order_by("name")
    permission_classes = [IsAuthenticated, DjangoModelPermissions]
    lookup_field = "name"
    pagination_class = None

    def get_object(self):
        definition = self.get_queryset().filter(name=self.kwargs["name"]).first()
        if definition is None:
            raise NotFound(f"There is no workflow named {self.kwargs['name']!r}.")
        return definition

    def _write(self, request, instance: WorkflowDefinition | None) -> WorkflowDefinition:
        serializer = WorkflowWriteSerializer(data=request.data)
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        return services.save_workflow(
            name=data["name"], graph=data["graph"], description=data["description"], actor=request.user,
            instance=instance,
        )

    @extend_schema(
        summary="Create a workflow definition",
        description="400 with `errors.graph` naming each problem: unknown agents, functions or workflows, "
        "cycles, dangling joins, an empty graph…",
        request={"application/json": WorkflowWriteSerializer},
        responses={201: WorkflowSerializer, **errors(400, 401, 403, 413, 415)},
        examples=[OpenApiExample("Fan-out and join", value=DEMO_WORKFLOW, request_only=True)],
    )
    def create(self, request, *args, **kwargs):
        definition = self._write(request, None)
        return Response(WorkflowSerializer(definition).data, status=status.HTTP_201_CREATED)

    @extend_schema(
        summary="Replace a workflow definition",
        request={"application/json": WorkflowWriteSerializer},
        responses={200: WorkflowSerializer, **errors(400, 401, 403, 404, 413, 415)},
    )
    def update(self, request, *args, **kwargs):
        definition = self._write(request, self.get_object())
        return Response(WorkflowSerializer(definition).data)


# --- /api/agents/: the loaded agent packages --------------------------------------------------------


class AgentToolSerializer(serializers.Serializer):
    name = serializers.CharField()
    source = serializers.ChoiceField(
        choices=["function", "mcp", "agent", "builtin"],
        help_text="function: a Python function; mcp: a tool of an MCP server; agent: an agent wrapped as a tool; "
        "builtin: an ADK tool the ledger knows (e.g. preload_memory).",
    )
    detail = serializers.CharField(
        help_text="The MCP server's command line or URL, or the wrapped agent's name. Without "
        "agents.configure_agents, a server is shown redacted: the program and script names, the URL's scheme "
        "and host; never its other arguments, environment, credentials or folders."
    )
    effect = serializers.ChoiceField(
        choices=["read_only", "idempotent", "effectful"],
        help_text="read_only (touches nothing), idempotent (deduplicated by a key from stable intent) or effectful.",
    )
    effect_reason = serializers.CharField(
        help_text="Why the tool has that class: declared, the default, an MCP hint trusted or ignored (a server "
        "not in MCP_TRUSTED_SERVERS), one of ADK's own control tools."
    )
    annotations = serializers.DictField(help_text="What an MCP server says of the tool (readOnlyHint, …).")


class AgentNodeSerializer(serializers.Serializer):
    name = serializers.CharField()
    kind = serializers.CharField(help_text="ADK's class: LlmAgent, SequentialAgent, ParallelAgent, LoopAgent, …")
    description = serializers.CharField()
    tools = AgentToolSerializer(many=True)
    transfer_targets = serializers.ListField(child=serializers.CharField(), help_text="Agents it may transfer to.")
    tool_errors = serializers.ListField(child=serializers.CharField(), help_text="Toolsets that could not be listed.")


# A tree: an agent's sub-agents and the agents its tools wrap are agents too.
AgentNodeSerializer._declared_fields["sub_agents"] = AgentNodeSerializer(many=True)
AgentNodeSerializer._declared_fields["tool_agents"] = AgentNodeSerializer(
    many=True, help_text="Agents wrapped by an AgentTool of this agent."
)


class AgentSerializer(serializers.Serializer):
    name = serializers.CharField(help_text="The package's folder name.")
    description = serializers.CharField()
    path = serializers.CharField(
        help_text="Where the package was loaded from (its folders hidden without agents.configure_agents)."
    )
    load_error = serializers.CharField(
        help_text="Why the package could not be loaded (empty when it runs); paths and URLs in it are redacted "
        "without agents.configure_agents."
    )
    tool_errors = serializers.ListField(child=serializers.CharField())
    tools = AgentToolSerializer(many=True, help_text="The root agent's tools.")
    has_default_script = serializers.BooleanField(help_text="Whether the package offers the offline model a script.")
    tree = AgentNodeSerializer(allow_null=True, help_text="The agent tree; null when the package did not load.")


@extend_schema_view(
    list=extend_schema(summary="List the loaded agents", responses={200: AgentSerializer(many=True), **errors(401)}),
    retrieve=extend_schema(summary="One loaded agent", responses={200: AgentSerializer, **errors(401, 404)}),
)
class AgentViewSet(viewsets.ViewSet):
    """The agent packages of AGENTS_DIR, those that failed to load included (with their error)."""

    permission_classes = [IsAuthenticated]
    lookup_field = "name"
    lookup_value_regex = "[^/]+"

    def list(self, request):
        return Response(AgentSerializer(services.agent_views(user=request.user), many=True).data)

    def retrieve(self, request, name: str):
        view = services.find_agent_view(name, user=request.user)
        if view is None:
            raise NotFound(f"There is no agent named {name!r}.")
        return Response(AgentSerializer(view).data)
