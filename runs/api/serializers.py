"""What the API reads and writes. Reading is strict: wrong types and unknown fields are refused."""

from __future__ import annotations

from django.conf import settings
from django.db import DatabaseError
from drf_spectacular.extensions import OpenApiSerializerFieldExtension
from drf_spectacular.utils import extend_schema_field
from rest_framework import serializers

from agents.models import WorkflowDefinition
from agents.registry import runnable_agents
from config.lib import safe_json
from config.lib.serializers import (
    NOT_BLANK_TEXT,
    PLAIN_WORDS,
    PRINTABLE,
    SOME_WORD,
    StrictBooleanField,
    StrictCharField,
    StrictSerializer,
)
from config.lib.user_params import SCRIPT_KEYS, scripts_refusal
from runs.inputs.run_input import MAX_OWNER_ID_CHARS
from runs.ledger import approvals
from runs.models.approvals import PERSON_DECISIONS, Decision, PendingCall
from runs.models.ledger import AgentRun, EffectsChoice, Recovery, RunStep, SettledOutcome, ToolCall
from runs.refusals import REPLAY_REFUSAL_ORDER, RESUME_REFUSAL_ORDER
from runs.rules import call_states, resume
from runs.rules import replay as rules
from runs.rules.public_text import public_error_message, public_step_error
from runs.rules.visibility import can_see_every_run
from runs.services import decisions
from runs.services.decisions import MAX_NOTE_CHARS
from runs.services.run import MAX_FORCE_REASON_CHARS

# A schema no value satisfies: a choice among no names.
NOTHING = {"not": {}}


def workflow_names() -> list[str]:
    try:
        return sorted(WorkflowDefinition.objects.values_list("name", flat=True))
    except DatabaseError:  # `manage.py spectacular` on a database not migrated yet: none exist
        return []


def one_of_names(names: list[str]) -> dict:
    return {"enum": names} if names else NOTHING


def params_schema() -> dict:
    """A JSON object; where API users may not send scripts, one without them."""
    schema: dict = {"type": "object"}
    if not settings.SCRIPTS_FROM_USERS_ALLOWED:
        schema["not"] = {"anyOf": [{"required": [key]} for key in SCRIPT_KEYS]}
    return schema


class ParamsField(serializers.Field):
    """A JSON object; in a multipart form it arrives as a JSON string."""

    default_error_messages = {
        "not_object": "Must be a JSON object.",
        "not_json": "Must be a JSON object. {error}.",
    }

    def to_internal_value(self, data):
        request = self.context.get("request")
        if isinstance(data, str) and request is not None and not request.content_type.startswith("application/json"):
            try:
                data = safe_json.loads(data)
            except safe_json.UnsafeInput as exc:
                self.fail("not_json", error=str(exc).rstrip("."))
        if not isinstance(data, dict):
            self.fail("not_object")
        return data

    def to_representation(self, value):
        return value


class ParamsFieldSchema(OpenApiSerializerFieldExtension):
    target_class = ParamsField

    def map_serializer_field(self, auto_schema, direction):
        return params_schema()


class UploadParamsField(ParamsField):
    """`params` in a multipart form."""


class UploadParamsFieldSchema(OpenApiSerializerFieldExtension):
    # Said in words rather than with `not`: fuzzers cannot check a `not` beside a file's bytes.
    target_class = UploadParamsField

    def map_serializer_field(self, auto_schema, direction):
        return {"type": "object"}


# --- Input -----------------------------------------------------------------------------------------


class RunCreateSerializer(StrictSerializer):
    # The names that exist when the schema is read: a loaded agent or a stored workflow.
    agent = StrictCharField(
        required=False, trim_whitespace=False,
        help_text="A registered agent (e.g. support) or a workflow's name.",
        schema=lambda: one_of_names(runnable_agents() + workflow_names()),
    )
    workflow = StrictCharField(
        required=False, trim_whitespace=False,
        help_text="A workflow's name; the same as passing it as `agent`. Give one of agent and workflow.",
        schema=lambda: one_of_names(workflow_names()),
    )
    message = StrictCharField(
        help_text="What the agent should do.", allow_blank=True, trim_whitespace=False,
        schema=lambda: {"pattern": NOT_BLANK_TEXT, "maxLength": settings.MAX_MESSAGE_CHARS},
    )
    owner_id = StrictCharField(
        help_text="The end user the run acts for.", allow_blank=True, trim_whitespace=False,
        schema={"minLength": 1, "maxLength": MAX_OWNER_ID_CHARS, "format": PRINTABLE},
    )
    params = ParamsField(required=False, help_text="Run parameters, e.g. a scripted model's `script`.")

    schema_extra = {"oneOf": [{"required": ["agent"]}, {"required": ["workflow"]}]}

    def validate(self, attrs):
        given = [name for name in ("agent", "workflow") if name in attrs]
        if len(given) != 1:
            message = (
                "Give agent (a registered agent or a workflow) or workflow (a workflow), not both."
                if given else "agent is required: a registered agent or a workflow (or give workflow)."
            )
            raise serializers.ValidationError({"agent": [message]})
        if given == ["workflow"]:

            if not WorkflowDefinition.objects.filter(name=attrs["workflow"]).exists():
                raise serializers.ValidationError(
                    {"workflow": [f"There is no workflow named {attrs['workflow']!r}."]}
                )
        attrs["agent"] = attrs.pop(given[0])
        refused = scripts_refusal(attrs.get("params"))
        if refused:
            raise serializers.ValidationError({"params": [refused]})
        return attrs


class RunUploadSerializer(RunCreateSerializer):
    """A run started from a multipart form (to attach a file): the agent or workflow is `agent`."""

    agent = StrictCharField(
        trim_whitespace=False, help_text="A registered agent (e.g. support) or a workflow's name.",
        schema=lambda: one_of_names(runnable_agents() + workflow_names()),
    )
    workflow = None
    params = UploadParamsField(
        required=False,
        help_text="Run parameters as a JSON object; script and scripts only where SCRIPTS_FROM_USERS_ALLOWED is on.",
    )
    file = serializers.FileField(
        required=False, allow_empty_file=True, use_url=False, help_text="An input file; a copy is kept with the run."
    )
    schema_extra = None


class ReplayRequestSerializer(StrictSerializer):
    # A replay is plain (effects reused) or forced with a reason; redo is only for a forced one.
    # (Each enum sits in an allOf so the schema's enum components, named by property, keep apart.)
    schema_extra = {
        "oneOf": [
            {"properties": {
                "force": {"allOf": [{"enum": [False]}]},
                "effects": {"allOf": [{"enum": [EffectsChoice.REUSE.value]}]},
            }},
            {
                "required": ["force", "reason"],
                "properties": {"force": {"allOf": [{"enum": [True]}]}, "reason": {"pattern": SOME_WORD}},
            },
        ]
    }

    force = StrictBooleanField(required=False, default=False, help_text="Override a refusal (needs the permission).")
    reason = StrictCharField(
        required=False, default="", allow_blank=True, max_length=MAX_FORCE_REASON_CHARS,
        schema={"format": PLAIN_WORDS},
        help_text="Why forcing is acceptable; required with force. Plain text (line breaks and tabs are fine; other "
                  "control characters and invisible formatting characters such as bidi overrides are refused).",
    )
    effects = serializers.ChoiceField(
        choices=EffectsChoice.choices, required=False, default=EffectsChoice.REUSE,
        help_text="A forced replay's choice: reuse recorded effects (an effect recorded as done is served from "
                  "its record, e.g. no second email) or redo them (new keys: the email is sent again). redo "
                  "needs force.",
    )


class SettleRequestSerializer(StrictSerializer):
    outcome = serializers.ChoiceField(
        choices=SettledOutcome.choices, help_text="done: the call acted; not_done: it did not."
    )
    note = StrictCharField(
        allow_blank=True, max_length=MAX_NOTE_CHARS, trim_whitespace=False,
        schema={"pattern": SOME_WORD, "format": PLAIN_WORDS},
        help_text="How you know (required), e.g. what the outbox shows: plain text (line breaks and tabs are "
                  "fine; other control characters and invisible formatting characters such as bidi overrides "
                  "are refused).",
    )


# --- Output ----------------------------------------------------------------------------------------

# Who did it; null when nobody did (or the run was started by a schedule, a webhook, a command).
_username = {"slug_field": "username", "read_only": True, "allow_null": True}


class RunSerializer(serializers.ModelSerializer):
    created_by = serializers.SlugRelatedField(**_username)
    forced_by = serializers.SlugRelatedField(**_username)
    cancel_requested_by = serializers.SlugRelatedField(**_username)
    replay_of = serializers.UUIDField(source="replay_of_id", read_only=True, allow_null=True)
    resume_of = serializers.UUIDField(source="resume_of_id", read_only=True, allow_null=True,
                                      help_text="The run this one continues in its session (a resume).")
    error_message = serializers.SerializerMethodField(
        help_text="What went wrong, in words; an exception's own text stays on the run's page in the admin."
    )
    worker = serializers.SerializerMethodField(
        help_text="The worker process that holds or held the run: shown to holders of runs.view_agentrun only."
    )
    # Empty for a run that never died (or whose death the system has not looked at yet).
    recovery = serializers.ChoiceField(
        choices=[("", "nothing to recover"), *Recovery.choices], read_only=True,
        help_text="What the system did with a run that died: continued it by itself, will, or left it for a "
        "person (`recovery_detail` says why); empty when there was nothing to recover.",
    )

    class Meta:
        model = AgentRun
        # The stored file's path on disk is never exposed (input_file is left out on purpose).
        fields = [
            "run_id", "status", "trigger", "agent_name", "owner_id", "created_by", "config",
            "input_file_name", "input_file_sha256", "input_file_size",
            "attempts", "error_code", "error_message", "tools_executed", "result",
            "replay_of", "forced", "forced_by", "force_reason", "effects", "session_id", "conversation_id",
            "created_at", "started_at", "heartbeat_at", "finished_at", "worker",
            "cancel_requested_at", "cancel_requested_by",
            "resume_of", "agent_fingerprint", "resume_reason", "recovery", "recovery_detail",
        ]
        read_only_fields = fields

    def get_error_message(self, run: AgentRun) -> str:
        return public_error_message(error_code=run.error_code, error_message=run.error_message, worker=run.worker)

    def get_worker(self, run: AgentRun) -> str:
        request = self.context.get("request")
        return run.worker if request is not None and can_see_every_run(request.user) else ""


class ToolCallSerializer(serializers.ModelSerializer):
    in_doubt = serializers.BooleanField(
        read_only=True,
        help_text="The run is over, no person settled it, and it never answered or its effect never finished.",
    )
    effect = serializers.SerializerMethodField(help_text="read_only, idempotent or effectful, as at call time.")
    state = serializers.SerializerMethodField(
        help_text="What became of the call (runs.rules.call_states): " + ", ".join(call_states.LABELS) + "."
    )
    settled_by = serializers.SlugRelatedField(**_username)
    settled_outcome = serializers.ChoiceField(
        choices=SettledOutcome.choices, allow_blank=True, read_only=True, help_text="Empty until a person settles it."
    )

    class Meta:
        model = ToolCall
        fields = ["seq", "call_id", "tool_name", "agent_name", "args", "effect", "effect_key", "status", "state", "in_doubt",
                  "called_at", "answered_at", "response_summary", "settled_outcome", "settled_by", "settled_at",
                  "settle_note"]
        read_only_fields = fields

    @extend_schema_field(serializers.ChoiceField(choices=list(call_states.LABELS)))
    def get_state(self, call: ToolCall) -> str:
        return call_states.states_of(call.run, [call])[call.call_id].code

    def get_effect(self, call: ToolCall) -> str:
        # Not known at call time (e.g. a journal written before effect classes existed) is effectful.
        return call.effect or "effectful"


class ReplaySummarySerializer(serializers.ModelSerializer):
    class Meta:
        model = AgentRun
        fields = ["run_id", "status", "forced", "created_at", "finished_at"]
        read_only_fields = fields


class CallPreviewSerializer(serializers.Serializer):
    seq = serializers.IntegerField()
    call_id = serializers.CharField()
    tool_name = serializers.CharField()
    effect = serializers.CharField()
    reuse = serializers.CharField(help_text="With effects reused: served from record, runs again, refused or "
                                            "needs a person (for the same arguments).")
    redo = serializers.CharField(help_text="With effects redone (new keys).")


class ReplayDecisionSerializer(serializers.Serializer):
    allowed = serializers.BooleanField()
    status = serializers.IntegerField(help_text="What POST .../replay/ without force would answer.")
    code = serializers.CharField(
        help_text="replayable, or the first refusal that applies, in this order: "
        + ", ".join(refusal.code for refusal in REPLAY_REFUSAL_ORDER) + "."
    )
    detail = serializers.CharField()
    tools = serializers.ListField(child=serializers.CharField(), required=False)
    replay_run_id = serializers.UUIDField(required=False)
    resume_run_id = serializers.UUIDField(required=False, help_text="The run's resume (resume_in_flight, "
                                                                    "already_resumed).")
    resume_status = serializers.CharField(required=False)
    run_status = serializers.CharField(required=False, help_text="The run's own status, where it is why.")
    calls = serializers.ListField(child=serializers.CharField(), required=False,
                                  help_text="The ids of the calls in doubt (calls_in_doubt).")
    force_would_replay = serializers.BooleanField()
    preview = CallPreviewSerializer(many=True, help_text="What a replay would do with each recorded call.")


class ResumePreviewSerializer(serializers.Serializer):
    call_id = serializers.CharField()
    tool_name = serializers.CharField()
    effect = serializers.CharField()
    answer = serializers.CharField(help_text="answered from the record / from a settlement (done or not done) / "
                                             "it did not happen / it failed / in doubt: a person must settle it.")
    model_sees = serializers.JSONField(allow_null=True, help_text="The function response the model will see.")


class ResumeDecisionSerializer(serializers.Serializer):
    allowed = serializers.BooleanField()
    status = serializers.IntegerField(help_text="What POST .../resume/ would answer.")
    code = serializers.CharField(
        help_text="resumable, or the first refusal that applies, in this order: "
        + ", ".join(refusal.code for refusal in RESUME_REFUSAL_ORDER) + "."
    )
    detail = serializers.CharField()
    tools = serializers.ListField(child=serializers.CharField(), required=False)
    calls = serializers.ListField(child=serializers.CharField(), required=False,
                                  help_text="The ids of the calls in doubt (calls_in_doubt).")
    successor_run_id = serializers.UUIDField(required=False, help_text="The run's resume or replay, where it is why.")
    successor_status = serializers.CharField(required=False)
    run_status = serializers.CharField(required=False, help_text="The run's own status, where it is why.")
    agent = serializers.CharField(required=False)
    later_run_id = serializers.UUIDField(required=False, help_text="A chat's later turn (conversation_moved_on).")
    later_status = serializers.CharField(required=False)
    preview = ResumePreviewSerializer(many=True, help_text="How a resume would answer each dangling call.")


class RunStepSerializer(serializers.ModelSerializer):
    """One workflow step: started at step_start, settled at step_complete or step_error."""

    error = serializers.SerializerMethodField(help_text="Why the step did not complete; empty if it did.")

    def get_error(self, step: RunStep) -> str:
        return public_step_error(step.error)

    class Meta:
        model = RunStep
        fields = ["seq", "node_path", "step_name", "kind", "target", "status", "attempts", "started_at",
                  "finished_at", "output_summary", "error"]
        read_only_fields = fields


class ModelRetrySerializer(serializers.Serializer):
    """One model call sent again at the model-call boundary (docs/runs.md, "Retries that cannot repeat a side effect")."""

    reason = serializers.CharField(help_text="What the provider answered: rate_limit, empty_turn, stopped, "
                                             "malformed_function_call, recitation, server_error, connection_lost, "
                                             "not_json or timeout.")
    attempt = serializers.IntegerField(help_text="The retry's number within its budget, from 1.")
    waited_s = serializers.FloatField(help_text="Seconds waited before sending the call again.")
    at = serializers.DateTimeField()
    detail = serializers.CharField(required=False, help_text="What came back, e.g. 503 UNAVAILABLE: …")


# --- Calls that wait (runs.ledger.approvals) -----------------------------------------------------------------


class DecisionSerializer(StrictSerializer):
    decision = serializers.ChoiceField(
        choices=PERSON_DECISIONS,
        help_text="approve: the call runs (under every rule); reject: the model is told it was rejected.",
    )
    note = StrictCharField(required=False, allow_blank=True, max_length=decisions.NOTE_MAX_CHARS,
                           trim_whitespace=False, schema={"format": PLAIN_WORDS},
                           help_text="Why (recorded with the decision): plain text (line breaks and tabs are fine; other control characters and invisible formatting characters such as bidi overrides are refused).")
    payload = serializers.JSONField(required=False, allow_null=True,
                                    help_text="What the tool asked for (its confirmation payload), if anything.")


class CallResultSerializer(StrictSerializer):
    # Any JSON value, null included (a tool may answer nothing): the schema cannot say "not null" for it.
    result = serializers.JSONField(allow_null=True,
                                   help_text="The long-running call's answer: the function response the model sees "
                                             "(an object; anything else, null included, is sent as {\"result\": …}).")
    note = StrictCharField(required=False, allow_blank=True, max_length=decisions.NOTE_MAX_CHARS,
                           trim_whitespace=False, schema={"format": PLAIN_WORDS},
                           help_text="Plain text (line breaks and tabs are fine; other control characters and invisible formatting characters such as bidi overrides are refused).")


class PendingCallSerializer(serializers.ModelSerializer):
    decided_by = serializers.SlugRelatedField(**_username)
    decision = serializers.ChoiceField(choices=Decision.choices, allow_blank=True, read_only=True,
                                       help_text="Empty while the call waits.")
    consumed = serializers.SerializerMethodField(help_text="The run went on with this answer.")

    class Meta:
        model = PendingCall
        fields = ["call_id", "kind", "tool_name", "agent_name", "args", "hint", "payload_asked", "asked_at",
                  "decision", "decided_by", "by_system", "decided_at", "note", "payload", "consumed"]
        read_only_fields = fields

    def get_consumed(self, pending: PendingCall) -> bool:
        return pending.delivered_attempt is not None


class AnsweredCallSerializer(PendingCallSerializer):
    run_status = serializers.CharField(source="run.status", read_only=True,
                                       help_text="queued: the run goes on; waiting: it waits for other calls.")

    class Meta(PendingCallSerializer.Meta):
        fields = [*PendingCallSerializer.Meta.fields, "run_status"]
        read_only_fields = fields


class RunDetailSerializer(RunSerializer):
    tool_calls = ToolCallSerializer(many=True, read_only=True)
    model_retries = ModelRetrySerializer(many=True, read_only=True,
                                         help_text="The run's model calls sent again, in order.")
    steps = RunStepSerializer(many=True, read_only=True, help_text="A workflow run's steps, in the order they started.")
    replays = ReplaySummarySerializer(many=True, read_only=True)
    replay_decision = serializers.SerializerMethodField()
    resumes = ReplaySummarySerializer(many=True, read_only=True, help_text="The runs that continue this one.")
    resume_decision = serializers.SerializerMethodField()
    pending_calls = serializers.SerializerMethodField(help_text="The calls the run waits for, or waited for, with "
                                                                "their decisions (runs.ledger.approvals).")

    class Meta(RunSerializer.Meta):
        fields = RunSerializer.Meta.fields + ["tool_calls", "steps", "replays", "replay_decision"]
        fields += ["resumes", "resume_decision", "model_retries", "pending_calls"]
        read_only_fields = fields

    @extend_schema_field(ReplayDecisionSerializer)
    def get_replay_decision(self, run: AgentRun) -> dict:

        return rules.describe_now(run)

    @extend_schema_field(ResumeDecisionSerializer)
    def get_resume_decision(self, run: AgentRun) -> dict:
        return resume.describe_resume_now(run)

    @extend_schema_field(PendingCallSerializer(many=True))
    def get_pending_calls(self, run: AgentRun) -> list:
        return PendingCallSerializer(approvals.pending_calls_of(run), many=True, context=self.context).data


class AttachmentSerializer(serializers.Serializer):
    display_name = serializers.CharField()
    mime_type = serializers.CharField()
    size = serializers.IntegerField(allow_null=True)


class FunctionCallSerializer(serializers.Serializer):
    id = serializers.CharField()
    name = serializers.CharField()
    args = serializers.DictField()


class FunctionResponseSerializer(serializers.Serializer):
    id = serializers.CharField()
    name = serializers.CharField()
    response = serializers.JSONField()
    aborted = serializers.BooleanField(help_text="Sealed by the run's abort, not answered by the tool.")


class EventSerializer(serializers.Serializer):
    id = serializers.CharField()
    timestamp = serializers.DateTimeField()
    author = serializers.CharField(help_text="user, or the agent's name.")
    invocation_id = serializers.CharField()
    text = serializers.CharField()
    attachments = AttachmentSerializer(many=True)
    function_calls = FunctionCallSerializer(many=True)
    function_responses = FunctionResponseSerializer(many=True)
    error_code = serializers.CharField()
    error_message = serializers.CharField()


class RunEventsSerializer(serializers.Serializer):
    run_id = serializers.UUIDField()
    session_id = serializers.CharField()
    events = EventSerializer(many=True)

