"""`/api/runs/`: thin doors onto runs.services.run, with the same refusals as the admin."""

from __future__ import annotations

import uuid

from django.db.models import Prefetch
from drf_spectacular.utils import OpenApiExample, OpenApiParameter, extend_schema, extend_schema_view
from rest_framework import mixins, parsers, status, viewsets
from rest_framework.decorators import action
from rest_framework.exceptions import NotFound, ValidationError
from rest_framework.pagination import CursorPagination
from rest_framework.response import Response
from rest_framework.reverse import reverse

from config.lib.api_errors import InvalidCursor, errors
from config.lib.parsers import BoundedMultiPartParser, StrictJSONParser
from config.lib.serializers import EmptySerializer
from config.lib.throttles import REPLAY, START_RUN, ScopedUserRateThrottle
from config.lib.uploads import name_as_sent
from runs.api.approvals import CallAnswerActions
from runs.api.serializers import (
    ReplayRequestSerializer,
    RunCreateSerializer,
    RunDetailSerializer,
    RunEventsSerializer,
    RunSerializer,
    RunUploadSerializer,
    SettleRequestSerializer,
    ToolCallSerializer,
)
from runs.ledger import reconcile, timeline
from runs.models.ledger import AgentRun, RunStatus, RunStep, ToolCall, Trigger
from runs.refusals import REPLAY_REFUSAL_ORDER, RESUME_REFUSAL_ORDER, said_in_order
from runs.rules import visibility
from runs.rules.public_text import public_event_error
from runs.services import decisions
from runs.services import run as services

CURSOR_FORMAT = "cursor"


class RunCursorPagination(CursorPagination):
    ordering = "-created_at"
    page_size = 50
    page_size_query_param = "page_size"
    max_page_size = 200

    def decode_cursor(self, request):
        try:
            return super().decode_cursor(request)
        except Exception as exc:  # DRF raises NotFound; a bad cursor is the client's mistake

            if isinstance(exc, NotFound):
                raise InvalidCursor() from None
            raise

    def get_page_size(self, request):
        # A page size the API cannot honour is refused, not silently replaced by the default.
        given = request.query_params.get(self.page_size_query_param)
        if given is None:
            return self.page_size
        # Length first: int() refuses more than 4300 digits with a ValueError, and the answer
        # quotes the value, so a huge one is cut short.
        if (
            len(given) > len(str(self.max_page_size)) or not given.isascii() or not given.isdigit()
            or not 1 <= int(given) <= self.max_page_size
        ):
            shown = given if len(given) <= 20 else f"{given[:20]}… ({len(given)} characters)"
            raise ValidationError({self.page_size_query_param: [
                f"{shown!r} is not a whole number from 1 to {self.max_page_size}."
            ]})
        return int(given)

    def get_schema_operation_parameters(self, view):
        parameters = super().get_schema_operation_parameters(view)
        for parameter in parameters:
            if parameter["name"] == self.page_size_query_param:
                parameter["schema"].update(minimum=1, maximum=self.max_page_size)
            if parameter["name"] == self.cursor_query_param:
                # Opaque: only the `next`/`previous` links of a page this API answered.
                parameter["schema"]["format"] = CURSOR_FORMAT
        return parameters


LIST_FILTERS = [
    OpenApiParameter("status", str, enum=RunStatus.values, description="Only runs in this status."),
    OpenApiParameter("trigger", str, enum=Trigger.values, description="Only runs started this way."),
    OpenApiParameter("agent", str, description="Only runs of this agent."),
    OpenApiParameter("owner_id", str, description="Only runs acting for this end user."),
    OpenApiParameter("replay_of", uuid.UUID, description="Only the replays of this run."),
]


@extend_schema_view(
    list=extend_schema(
        summary="List runs, newest first",
        parameters=LIST_FILTERS,
        responses={200: RunSerializer(many=True), **errors(400, 401)},
    ),
    retrieve=extend_schema(
        summary="One run with its tool calls, replays and what a replay would do now",
        responses={200: RunDetailSerializer, **errors(401, 404)},
    ),
)
class RunViewSet(CallAnswerActions, mixins.ListModelMixin, mixins.RetrieveModelMixin, viewsets.GenericViewSet):
    serializer_class = RunSerializer
    pagination_class = RunCursorPagination
    parser_classes = [StrictJSONParser, parsers.FormParser, BoundedMultiPartParser]
    throttle_classes = [ScopedUserRateThrottle]
    throttle_scopes = {"create": START_RUN, "replay": REPLAY, "resume": REPLAY}
    lookup_field = "run_id"
    lookup_value_regex = "[0-9a-fA-F]{8}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{4}-?[0-9a-fA-F]{12}"
    queryset = AgentRun.objects.none()  # for the schema; get_queryset applies visibility

    def get_queryset(self):
        runs = visibility.visible_runs(self.request.user).select_related(
            "created_by", "forced_by", "cancel_requested_by"
        )
        if self.action == "retrieve":
            runs = runs.prefetch_related(
                Prefetch("tool_calls", queryset=ToolCall.objects.order_by("seq")),
                Prefetch("steps", queryset=RunStep.objects.order_by("seq")),
                Prefetch("replays", queryset=AgentRun.objects.order_by("created_at")),
                Prefetch("resumes", queryset=AgentRun.objects.order_by("created_at")),
            )
        return runs

    def filter_queryset(self, queryset):
        if self.action != "list":
            return queryset
        params = self.request.query_params
        problems: dict[str, list[str]] = {}
        lookups: dict[str, object] = {}
        for name, choices, field in (("status", RunStatus.values, "status"), ("trigger", Trigger.values, "trigger")):
            value = params.get(name)
            if value is None:
                continue
            if value not in choices:
                problems[name] = [f"{value!r} is not one of: {', '.join(choices)}."]
            lookups[field] = value
        for name, field in (("agent", "agent_name"), ("owner_id", "owner_id")):
            if params.get(name) is not None:
                lookups[field] = params[name]
        if params.get("replay_of") is not None:
            try:
                lookups["replay_of_id"] = uuid.UUID(params["replay_of"])
            except ValueError:
                problems["replay_of"] = [f"{params['replay_of']!r} is not a run id (a UUID)."]
        if problems:

            raise ValidationError(problems)
        return queryset.filter(**lookups)

    def get_object(self):
        run = super().get_object()
        # Reconcile-on-read: a run whose worker died is never shown as still running.
        reconcile.reconcile_run_if_stale(run)
        return run

    def get_serializer_class(self):
        if self.action == "retrieve":
            return RunDetailSerializer
        return super().get_serializer_class()

    def _run_response(self, run: AgentRun, *, serializer=RunSerializer) -> Response:
        url = reverse("api:run-detail", args=[run.run_id], request=self.request)
        return Response(
            serializer(run, context=self.get_serializer_context()).data,
            status=status.HTTP_202_ACCEPTED,
            headers={"Location": url},
        )

    @extend_schema(
        summary="Start a run of an agent or a workflow",
        description=(
            "`agent` names a registered agent or a workflow (or give `workflow` instead). A workflow run has "
            "trigger `workflow`, records its steps, and takes `params.scripts` (a script per agent name) "
            "for the scripted model. 403 `owner_not_permitted` unless `owner_id` is the caller's own username, "
            "an owner an admin granted them, or the caller holds runs.act_for_any_owner."
        ),
        request={"application/json": RunCreateSerializer, "multipart/form-data": RunUploadSerializer},
        responses={202: RunSerializer, **errors(400, 401, 403, 413, 415, 429)},
        examples=[
            OpenApiExample(
                "Scripted",
                value={"agent": "support", "message": "Jane asks about her refund.", "owner_id": "jane",
                       "params": {"script": [{"call": "lookup_customer", "args": {"email": "jane@example.com"}},
                                             {"say": "Done."}]}},
                request_only=True,
            )
        ],
    )
    def create(self, request, *args, **kwargs):
        form = RunUploadSerializer if request.content_type.startswith("multipart/") else RunCreateSerializer
        serializer = form(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        data = serializer.validated_data
        upload = data.get("file")
        run = services.start_run(
            agent_name=data["agent"],
            message=data["message"],
            owner_id=data["owner_id"],
            params=data.get("params"),
            file=upload,
            file_name=name_as_sent(upload) if upload is not None else None,
            created_by=request.user,
        )
        return self._run_response(run)

    @extend_schema(
        summary="Replay a settled run as a new run",
        description=(
            "Follows the replay rules, in this order (the first that applies answers): "
            + said_in_order(tuple(refusal for refusal in REPLAY_REFUSAL_ORDER if not refusal.forceable))
            + " (force cannot set these aside), then, without force, "
            + said_in_order(tuple(refusal for refusal in REPLAY_REFUSAL_ORDER if refusal.forceable))
            + ". A run whose calls were all read only is replayed without force (checked before `tools_called`). "
            "Someone else's run needs the permission "
            "runs.replay_agentrun (else 403 `replay_not_permitted`); one's own run needs none, but its owner "
            "must still be one the caller may act for (else 403 `owner_not_permitted`). `force` overrides the "
            "refusals a person may override; it needs the permission runs.force_replay_agentrun (else 403) and a `reason` (else "
            "400). `effects` (with force): `reuse` (default) serves effects recorded as done from their records, "
            "`redo` does them again; the choice is recorded on the new run."
        ),
        request={"application/json": ReplayRequestSerializer},
        responses={202: RunSerializer, **errors(400, 401, 403, 404, 409, 410, 413, 415, 429)},
        examples=[
            OpenApiExample("Replay", value={"force": False, "reason": ""}, request_only=True),
            OpenApiExample("Force", value={"force": True, "reason": "The run failed after its email; finish it.",
                                           "effects": "reuse"}, request_only=True),
            OpenApiExample("Force and redo", value={"force": True, "reason": "The email bounced; resend it.",
                                                    "effects": "redo"}, request_only=True),
            OpenApiExample(
                "Refused",
                value={"code": "tools_called",
                       "detail": "This run already called send_email, update_crm before failing: a replay would "
                                 "call them again. Pass force=true to run it again anyway.",
                       "tools": ["send_email", "update_crm"]},
                response_only=True, status_codes=["409"],
            ),
        ],
    )
    @action(detail=True, methods=["post"])
    def replay(self, request, run_id=None):
        serializer = ReplayRequestSerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        replay = services.replay_run(
            run_id,
            actor=request.user,
            force=serializer.validated_data["force"],
            reason=serializer.validated_data["reason"],
            effects=serializer.validated_data["effects"],
        )
        return self._run_response(replay)

    @extend_schema(
        summary="Resume a failed run in its own session",
        description=(
            "Continues the run instead of starting it again: a new run (`resume_of`, the same session, a new "
            "invocation) answers each call the run left without a response from evidence — its effect record's "
            "result, or a person's settlement (done: with their note; not done: the model is told it did not "
            "happen) — and lets the model go on. No tool that already ran runs again. The body may be empty. "
            "Who: the run's creator, or the permission runs.replay_agentrun (else 403 `resume_not_permitted`). "
            "Refusals, in this order (the first that applies answers): " + said_in_order(RESUME_REFUSAL_ORDER) + ". "
            "A run has one successor (`already_resumed` / `already_replayed`: resume or replay that one); "
            "`conversation_moved_on`: a chat turn the conversation went on after; `session_gone`: its events were "
            "purged; `agent_changed`: its definition changed (replay instead); `calls_in_doubt`: settle them first. "
            "`GET /api/runs/{id}/` shows the decision now as `resume_decision`. Resumes share the replays' "
            "throttle (THROTTLE_REPLAYS) and the runs-in-flight cap: 429 `throttled` or `too_many_runs_in_flight` "
            "with Retry-After."
        ),
        request=EmptySerializer,
        responses={202: RunSerializer, **errors(400, 401, 403, 404, 409, 410, 413, 415, 429)},
        examples=[
            OpenApiExample(
                "Refused",
                value={"code": "calls_in_doubt",
                       "detail": "This run's call to send_email is in doubt: started and never finished, so it is "
                                 "unknown whether it acted, and a resume must tell the model what happened. Settle "
                                 "it (done or not done) once you know, then resume.",
                       "tools": ["send_email"], "calls": ["call-1a2b3c4d5e6f"]},
                response_only=True, status_codes=["409"],
            ),
        ],
    )
    @action(detail=True, methods=["post"])
    def resume(self, request, run_id=None):
        EmptySerializer(data=request.data).is_valid(raise_exception=True)
        return self._run_response(services.resume_run(run_id, actor=request.user))

    @extend_schema(
        summary="Settle a tool call in doubt: did it act or not?",
        description=(
            "A call in doubt was started and never finished (its worker died, or the tool raised after "
            "starting its effect). A person who checked says `done` (its effect record is marked done, so a "
            "replay reuses it) or `not_done` (marked failed, so a replay may run it), with a `note`. Needs the "
            "permission runs.settle_toolcall (else 403); 400 without a note; 409 `not_in_doubt`; 404 for a run "
            "you cannot see or a call it does not have. The run's recorded outcome is never changed."
        ),
        request={"application/json": SettleRequestSerializer},
        responses={200: ToolCallSerializer, **errors(400, 401, 403, 404, 409, 413, 415)},
        examples=[
            OpenApiExample("Done", value={"outcome": "done", "note": "The outbox shows the email to Jane."},
                           request_only=True),
        ],
    )
    @action(detail=True, methods=["post"], url_path=r"calls/(?P<call_id>.+)/settle", url_name="settle-call")
    def settle(self, request, run_id=None, call_id=None):
        serializer = SettleRequestSerializer(data=request.data, context=self.get_serializer_context())
        serializer.is_valid(raise_exception=True)
        call = decisions.settle_call(
            run_id=run_id,
            call_id=call_id,
            actor=request.user,
            outcome=serializer.validated_data["outcome"],
            note=serializer.validated_data["note"],
        )
        return Response(ToolCallSerializer(call, context=self.get_serializer_context()).data)

    @extend_schema(
        summary="Cancel a queued or running run",
        description=(
            "A queued run is cancelled at once and never starts. A running run is asked to stop: its "
            "worker notices within one heartbeat, aborts the agent (pending tool calls are sealed) and "
            "the run settles as `cancelled`. 409 `run_settled` if it has already finished. Someone else's run "
            "needs the permission runs.cancel_agentrun (else 403 `cancel_not_permitted`)."
        ),
        request={"application/json": EmptySerializer},
        responses={202: RunSerializer, **errors(400, 401, 403, 404, 409, 413, 415)},
    )
    @action(detail=True, methods=["post"])
    def cancel(self, request, run_id=None):
        EmptySerializer(data=request.data).is_valid(raise_exception=True)
        run = services.cancel_run(run_id, actor=request.user)
        return self._run_response(run)

    @extend_schema(
        summary="The run's ADK session events",
        description=(
            "What the user said (attachments described, not copied), model text, calls, responses, errors. An "
            "error raised in the agent's code reads as `agent_error` with the run page's words; its class and "
            "text stay on the run's page in the admin."
        ),
        responses={200: RunEventsSerializer, **errors(401, 404)},
    )
    @action(detail=True, methods=["get"])
    def events(self, request, run_id=None):
        run = self.get_object()
        events = [
            {**event, **dict(zip(("error_code", "error_message"),
                                 public_event_error(error_code=event["error_code"], error_message=event["error_message"]),
                                 strict=True))}
            for event in timeline.run_events(run)
        ]
        body = {"run_id": run.run_id, "session_id": run.session_id, "events": events}
        return Response(RunEventsSerializer(body).data)
