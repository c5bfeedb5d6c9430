"""The run ledger's records: runs, their tool journal and their workflow steps."""

import uuid
from typing import Any

from django.conf import settings
from django.db import models
from django.utils import timezone

from agents.effects import READ_ONLY
from runs.models.effects import EffectStatus, ToolEffect


class RunStatus(models.TextChoices):
    QUEUED = "queued", "queued"
    RUNNING = "running", "running"
    # Left its worker until a person decides on a call or a long-running call answers
    # (docs/architecture.md, "Approvals and tools that wait"): neither in flight nor settled.
    WAITING = "waiting", "waiting"
    SUCCESS = "success", "success"
    ERROR = "error", "error"
    CANCELLED = "cancelled", "cancelled"


IN_FLIGHT = (RunStatus.QUEUED, RunStatus.RUNNING)
SETTLED = (RunStatus.SUCCESS, RunStatus.ERROR, RunStatus.CANCELLED)
# Not over yet: in flight, or waiting for a decision (its session, input and inbox event stay its own).
UNSETTLED = (*IN_FLIGHT, RunStatus.WAITING)


class Trigger(models.TextChoices):
    API = "api", "api"
    CHAT = "chat", "chat"
    WORKFLOW = "workflow", "workflow"
    SCHEDULE = "schedule", "schedule"
    WEBHOOK = "webhook", "webhook"
    # ADK's own wires (docs/architecture.md, "ADK's own wires"): its API server's /run and
    # /run_sse, and an A2A message.
    ADK = "adk", "adk"
    A2A = "a2a", "a2a"


# Triggers whose first attempt is executed by the web server that streams it to its client: no
# worker starts it, and a client that leaves cancels it (a replay of one runs in a worker).
STREAMED_TRIGGERS = (Trigger.CHAT, Trigger.ADK)


class EffectsChoice(models.TextChoices):
    REUSE = "reuse", "reuse recorded effects"
    REDO = "redo", "redo the effects"


class Recovery(models.TextChoices):
    """What the system did with a run that died (docs/architecture.md, "Recovery without a person")."""

    RECOVERED = "recovered", "continued by the system"
    PENDING = "pending", "to be continued by the system"
    NEEDS_PERSON = "needs_person", "waits for a person"
    EXHAUSTED = "exhausted", "recovery attempts used up"


class AgentRun(models.Model):
    """One run of an agent, written down before anything executes.

    The row holds everything needed to do the run again (`config` and the copied input
    file) and the evidence of what it did (`tools_executed`, the tool journal).
    """

    run_id = models.UUIDField(primary_key=True, default=uuid.uuid4, editable=False)
    trigger = models.CharField(max_length=16, choices=Trigger.choices, default=Trigger.API)
    agent_name = models.CharField(max_length=128)
    owner_id = models.CharField(max_length=128)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    config = models.JSONField(help_text="The run's input: message and params. No input, no replay.")

    input_file = models.CharField(max_length=500, blank=True, help_text="Path of the stored copy.")
    input_file_name = models.CharField(max_length=255, blank=True)
    input_file_sha256 = models.CharField(max_length=64, blank=True)
    input_file_size = models.BigIntegerField(null=True, blank=True)

    status = models.CharField(max_length=16, choices=RunStatus.choices, default=RunStatus.QUEUED)
    attempts = models.PositiveIntegerField(default=0)
    # The attempt that holds the run: a fresh id written by each claim. Every write made on
    # behalf of the run is conditional on the run still being running under it (runs.ledger.leases).
    lease = models.UUIDField(null=True, blank=True, editable=False)
    error_code = models.CharField(max_length=64, blank=True)
    error_message = models.TextField(blank=True)
    tools_executed = models.JSONField(
        null=True,
        blank=True,
        help_text="null = unknown, [] = checked and none called, else the tools called in order.",
    )
    result = models.TextField(blank=True)

    replay_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="replays"
    )
    forced = models.BooleanField(default=False)
    forced_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    force_reason = models.TextField(blank=True)

    session_id = models.CharField(max_length=128)
    conversation_id = models.CharField(max_length=128, blank=True, db_index=True)

    created_at = models.DateTimeField(default=timezone.now)
    started_at = models.DateTimeField(null=True, blank=True)
    heartbeat_at = models.DateTimeField(null=True, blank=True)
    finished_at = models.DateTimeField(null=True, blank=True)
    worker = models.CharField(max_length=255, blank=True)

    cancel_requested_at = models.DateTimeField(null=True, blank=True)
    cancel_requested_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    # What a worker reported after its run had already been settled by someone else (e.g. a
    # reconciliation): kept beside the first verdict instead of silently overwriting it.
    late_outcome = models.JSONField(null=True, blank=True)
    # Model-call retries that happened inside the run: [{"reason": ..., "at": ...}, ...].
    model_retries = models.JSONField(default=list, blank=True)
    # The inbox event this run processes (trigger `webhook`); an event keeps all its attempts.
    webhook_event = models.ForeignKey(
        "WebhookEvent", null=True, blank=True, on_delete=models.PROTECT, related_name="runs"
    )
    # The OpenTelemetry trace of the run's execution, when tracing was on (32 hex digits).
    trace_id = models.CharField(max_length=32, blank=True)
    # A forced replay's choice about recorded effects (docs/architecture.md, "Effects"): reuse
    # them (the same intent, so a done effect is served from its record) or redo them (a new
    # intent: new keys, so the effects happen again).
    effects = models.CharField(max_length=8, choices=EffectsChoice.choices, default=EffectsChoice.REUSE)
    # A resume continues this run's session, answering its dangling calls from evidence
    # (docs/architecture.md, "Resume rules"); one successor (replay or resume) per run.
    resume_of = models.ForeignKey(
        "self", null=True, blank=True, on_delete=models.PROTECT, related_name="resumes", db_index=True
    )
    # sha256 of the agent's definition when the run started (agents.fingerprint): a resume
    # refuses a run whose agent has changed since.
    agent_fingerprint = models.CharField(max_length=64, blank=True)
    # Why this run resumes its `resume_of`: "recovered" when the system continued a run that died;
    # blank when a person resumed it.
    resume_reason = models.CharField(max_length=16, blank=True)
    # The system wrote this run (a continuation after a death), not a person at a door: `created_by`
    # is then the chain's person, whose owner rule the worker asks again before it runs.
    continued_by_system = models.BooleanField(default=False)
    # On a run that died (reconciled, or aborted by a drain): whether the system continued it, will,
    # or left it for a person, and why (`recovery_detail`).
    recovery = models.CharField(max_length=16, choices=Recovery.choices, blank=True)
    recovery_detail = models.TextField(blank=True)

    class Meta:
        db_table = "agent_runs"
        ordering = ["-created_at"]
        get_latest_by = "created_at"
        indexes = [
            models.Index(fields=["status", "heartbeat_at"], name="run_status_heartbeat"),
            models.Index(fields=["created_by", "created_at"], name="run_creator_created"),
            models.Index(fields=["owner_id", "created_at"], name="run_owner_created"),
            models.Index(fields=["status", "created_at"], name="run_status_created"),
            models.Index(fields=["-created_at"], name="run_created_desc"),
            # The desk overview: runs per hour by outcome (an index-only scan of a time range),
            # the metrics of the last day by status and trigger, and the reconciled runs of the last day.
            models.Index(fields=["created_at", "status", "trigger"], name="run_created_status_trigger"),
            models.Index(fields=["error_code", "finished_at"], name="run_error_code_finished"),
            # The desk's runs that died: those the system continued (last 24 h), those left for a person.
            models.Index(fields=["finished_at"], condition=models.Q(recovery="recovered"), name="run_recovered_finished"),
            models.Index(
                fields=["run_id"], condition=models.Q(recovery__in=["needs_person", "exhausted"]), name="run_died_waiting"
            ),
            # The failures a replay refuses without force (runs.rules.overview's "awaiting a decision"),
            # small enough to walk whole; their conditions are the overview's filters verbatim,
            # which is what lets the planner use them.
            models.Index(
                fields=["run_id"],
                condition=models.Q(status__in=["error", "cancelled"], tools_executed__isnull=False)
                & ~models.Q(tools_executed=[]),
                name="run_failed_tools_called",
            ),
            models.Index(
                fields=["run_id"],
                condition=models.Q(status__in=["error", "cancelled"], tools_executed__isnull=True),
                name="run_failed_tools_unknown",
            ),
        ]
        # Seeing is not acting (docs/architecture.md, "Who may act for whom"): view_agentrun reads
        # every run; replaying or cancelling someone else's run, and acting for any owner, are
        # granted on their own.
        permissions = [
            ("force_replay_agentrun", "Can force a replay that the rules refuse"),
            ("replay_agentrun", "Can replay another user's run"),
            ("cancel_agentrun", "Can cancel another user's run"),
            ("act_for_any_owner", "Can start runs, chat and read memory for any owner"),
            # A crash fault kills the worker and every run in flight on it (runs.rules.faults).
            ("place_tool_faults", "Can place scripted tool faults (crash, hang, tool_fails)"),
        ]
        constraints = [
            # The database's own guarantee that an inbox event never has two runs in flight,
            # whatever path started them.
            models.UniqueConstraint(
                fields=["webhook_event"],
                condition=models.Q(status__in=["queued", "running", "waiting"]),
                name="run_one_in_flight_per_webhook_event",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.agent_name} run {self.run_id}"

    def successor_fields(self) -> dict[str, Any]:
        """What a replay or a resume of this run takes over: its trigger, agent, owner and input as
        written (the stored file included), as `runs.services.run.write_queued_run` takes them (it adds
        who started the successor)."""
        return {
            "trigger": self.trigger,
            "agent_name": self.agent_name,
            "owner_id": self.owner_id,
            "config": self.config,
            "input_file": self.input_file,
            "input_file_name": self.input_file_name,
            "input_file_sha256": self.input_file_sha256,
            "input_file_size": self.input_file_size,
        }

    @property
    def message(self) -> str:
        return (self.config or {}).get("message", "")

    @property
    def params(self) -> dict:
        return (self.config or {}).get("params") or {}

    @property
    def workflow(self) -> dict | None:
        """The workflow snapshot a workflow run executes (None for a single agent's run)."""
        return (self.config or {}).get("workflow") or None

    @property
    def invocation_id(self) -> str:
        return f"e-{self.run_id}"

    @property
    def is_in_flight(self) -> bool:
        return self.status in IN_FLIGHT

    @property
    def tools_state(self) -> str:
        if self.tools_executed is None:
            return "unknown"
        return "called" if self.tools_executed else "none"


class ToolCallStatus(models.TextChoices):
    CALLED = "called", "called (no answer yet)"
    ANSWERED = "answered", "answered"
    FAILED = "failed", "failed"
    # Answered from the effect record of an earlier call with the same key; the tool did not run.
    DEDUPLICATED = "deduplicated", "deduplicated (served from record)"
    # Answered with an error: its key was already used with other stable fields; the tool did not run.
    REFUSED = "refused", "refused (key used with other stable fields)"
    # Asked a person first and still waiting: the tool has not run (runs.ledger.approvals.park_run).
    WAITING = "waiting", "waiting for a person's approval (not run)"
    # Rejected by a person, by the approval timeout, or closed by a cancel: the tool never ran.
    NOT_RUN = "not_run", "not run (rejected, timed out or closed)"


# The statuses of calls whose tool never ran: kept when ADK's own answer to them arrives, and
# never counted in `tools_executed`.
NEVER_RAN = (ToolCallStatus.WAITING.value, ToolCallStatus.NOT_RUN.value)
# Statuses an answer event does not overwrite (the call was served from a record, refused, or never ran).
KEPT_ON_ANSWER = (ToolCallStatus.DEDUPLICATED.value, ToolCallStatus.REFUSED.value, *NEVER_RAN)


class SettledOutcome(models.TextChoices):
    DONE = "done", "done: it acted"
    NOT_DONE = "not_done", "not done: it did not act"


class ToolCall(models.Model):
    """The tool journal: one row per function call, written before the tool starts."""

    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="tool_calls")
    seq = models.PositiveIntegerField()
    call_id = models.CharField(max_length=128)
    tool_name = models.CharField(max_length=128)
    # The agent of the tree whose model made the call (the event's author in ADK).
    agent_name = models.CharField(max_length=128, blank=True, default="")
    args = models.JSONField(default=dict, blank=True)
    status = models.CharField(max_length=16, choices=ToolCallStatus.choices, default=ToolCallStatus.CALLED)
    called_at = models.DateTimeField(default=timezone.now)
    answered_at = models.DateTimeField(null=True, blank=True)
    response_summary = models.TextField(blank=True)
    # The tool's effect class when it was called ("" = not known: treated as effectful).
    effect = models.CharField(max_length=16, blank=True)
    effect_key = models.CharField(max_length=64, blank=True, help_text="The ToolEffect key this call used.")
    # A person's word on a call in doubt: evidence the replay rules read; the call's status stays.
    settled_outcome = models.CharField(max_length=8, choices=SettledOutcome.choices, blank=True)
    settled_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    settled_at = models.DateTimeField(null=True, blank=True)
    settle_note = models.TextField(blank=True)

    class Meta:
        db_table = "tool_calls"
        ordering = ["run", "seq"]
        permissions = [("settle_toolcall", "Can settle a tool call in doubt")]
        constraints = [
            models.UniqueConstraint(fields=["run", "seq"], name="toolcall_run_seq"),
            models.UniqueConstraint(fields=["run", "call_id"], name="toolcall_run_call"),
        ]
        # Calls still `called` are few (in flight or in doubt): the desk counts them from here.
        indexes = [
            models.Index(fields=["run"], name="toolcall_called_run", condition=models.Q(status="called")),
            # The desk's calls in doubt: unanswered, unsettled, not read-only (runs.rules.overview's
            # filter verbatim, so the planner proves the index applies). Settled calls keep
            # `called`, so the index above grows with them; this one stays small.
            models.Index(
                fields=["run"],
                name="toolcall_unsettled_called",
                condition=models.Q(status="called", settled_outcome="") & ~models.Q(effect="read_only"),
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tool_name} ({self.status})"

    @property
    def in_doubt(self) -> bool:
        """What the replay and resume rules call in doubt (runs.rules.replay.CallFact.in_doubt): the run is over,
        no person has settled the call, and it never answered or the effect it started never finished
        (a tool that raised may have acted first). A tool that only reads leaves nothing in doubt."""
        if self.settled_outcome or self.effect == READ_ONLY or self.run.is_in_flight:
            return False
        if self.status == ToolCallStatus.CALLED:
            return True
        return bool(self.effect_key) and ToolEffect.objects.filter(
            key=self.effect_key, first_run_id=self.run_id, first_call_id=self.call_id, status=EffectStatus.STARTED
        ).exists()


class StepStatus(models.TextChoices):
    RUNNING = "running", "running"
    SUCCESS = "success", "success"
    ERROR = "error", "error"
    CANCELLED = "cancelled", "cancelled"


class RunStep(models.Model):
    """One step of a workflow run: written at step_start, updated at step_complete or step_error.

    A step still `running` when its run settles is settled `cancelled` with it (the workflow
    stopped it: a cancel, a sibling's failure, the time limit).
    """

    run = models.ForeignKey(AgentRun, on_delete=models.CASCADE, related_name="steps")
    seq = models.PositiveIntegerField(help_text="Order in which the steps started.")
    node_path = models.CharField(max_length=512, help_text="ADK's node path, e.g. support_triage@1/billing@1.")
    step_name = models.CharField(max_length=128)
    kind = models.CharField(max_length=16, help_text="agent, function, join or workflow.")
    target = models.CharField(max_length=128, blank=True, help_text="The agent, function or workflow it runs.")
    status = models.CharField(max_length=16, choices=StepStatus.choices, default=StepStatus.RUNNING)
    attempts = models.PositiveIntegerField(default=1)
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)
    output_summary = models.TextField(blank=True)
    error = models.TextField(blank=True)

    class Meta:
        db_table = "run_steps"
        ordering = ["run", "seq"]
        constraints = [
            models.UniqueConstraint(fields=["run", "node_path"], name="runstep_run_path"),
            models.UniqueConstraint(fields=["run", "seq"], name="runstep_run_seq"),
        ]

    def __str__(self) -> str:
        return f"{self.node_path} ({self.status})"

    @property
    def depth(self) -> int:
        return max(self.node_path.count("/") - 1, 0)

    @property
    def duration_s(self) -> float | None:
        if self.finished_at is None:
            return None
        return (self.finished_at - self.started_at).total_seconds()
