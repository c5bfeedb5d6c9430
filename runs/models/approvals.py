"""What a waiting run waits for: a person's decision on a call, or a long-running call's result.

A run that asks ADK for a confirmation (`FunctionTool(require_confirmation=…)`,
`tool_context.request_confirmation()`) or leaves a `LongRunningFunctionTool` call unanswered
leaves its worker as `waiting` with one row here per call it waits for (docs/architecture.md,
"Approvals and tools that wait"). Each row is bound to the exact call — its id and its arguments
as asked — and is answered once.
"""

from django.conf import settings
from django.db import models
from django.utils import timezone


class WaitKind(models.TextChoices):
    CONFIRMATION = "confirmation", "a person's confirmation"
    RESULT = "result", "a long-running call's result"


class Decision(models.TextChoices):
    APPROVE = "approve", "approved"
    REJECT = "reject", "rejected"
    RESULT = "result", "result given"
    # The run was cancelled while it waited: nobody answered, and nobody will.
    CANCELLED = "cancelled", "closed: the run was cancelled"


# What a person may answer a confirmation with (the API's `decision`).
PERSON_DECISIONS = [(Decision.APPROVE.value, "approve"), (Decision.REJECT.value, "reject")]


class PendingCall(models.Model):
    run = models.ForeignKey("runs.AgentRun", on_delete=models.CASCADE, related_name="pending_calls")
    kind = models.CharField(max_length=16, choices=WaitKind.choices)
    # The call a person decides on (the tool's own call: the id the API names), and for a
    # confirmation the id of ADK's `adk_request_confirmation` call the decision answers.
    call_id = models.CharField(max_length=128)
    request_call_id = models.CharField(max_length=128, blank=True)
    tool_name = models.CharField(max_length=128)
    agent_name = models.CharField(max_length=128, blank=True)
    args = models.JSONField(default=dict, blank=True, help_text="The call's arguments, as asked.")
    hint = models.TextField(blank=True)
    # What the tool asked a person to fill in (ToolConfirmation.payload as requested), if anything.
    payload_asked = models.JSONField(null=True, blank=True)
    asked_at = models.DateTimeField(default=timezone.now)
    decision = models.CharField(max_length=16, choices=Decision.choices, blank=True)
    decided_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    decided_at = models.DateTimeField(null=True, blank=True)
    # Why: a person's note, or the system's reason (a timeout).
    note = models.TextField(blank=True)
    by_system = models.BooleanField(default=False)
    payload = models.JSONField(null=True, blank=True, help_text="The payload or result given with the decision.")
    # The worker handed the decision to ADK (the run's attempt that delivered it).
    delivered_attempt = models.PositiveIntegerField(null=True, blank=True)

    class Meta:
        db_table = "pending_calls"
        ordering = ["asked_at", "pk"]
        permissions = [
            ("approve_toolcall", "Can approve or reject a tool call that waits for a person"),
            ("answer_toolcall", "Can give the result of a long-running tool call"),
        ]
        constraints = [
            models.UniqueConstraint(fields=["run", "call_id"], name="pendingcall_run_call"),
        ]
        indexes = [
            # What waits now, oldest first: the desk, the timeout sweep and the metrics read only these.
            models.Index(fields=["asked_at"], name="pendingcall_open_asked", condition=models.Q(decision="")),
        ]

    def __str__(self) -> str:
        return f"{self.tool_name} {self.call_id} ({self.decision or 'waiting'})"

    @property
    def is_open(self) -> bool:
        return not self.decision
