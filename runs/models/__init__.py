"""The runs app's models, one module per product; everything is importable from `runs.models`.

Tables and app label are those of the single module this package grew from, so splitting it
needed no migration.
"""

from runs.models.approvals import Decision, PendingCall, WaitKind
from runs.models.chat import Conversation
from runs.models.effects import EffectStatus, ToolEffect
from runs.models.inbox import EventStatus, SignatureScheme, WebhookEvent, WebhookSource
from runs.models.ledger import (
    IN_FLIGHT,
    KEPT_ON_ANSWER,
    NEVER_RAN,
    SETTLED,
    STREAMED_TRIGGERS,
    UNSETTLED,
    AgentRun,
    EffectsChoice,
    Recovery,
    RunStatus,
    RunStep,
    SettledOutcome,
    StepStatus,
    ToolCall,
    ToolCallStatus,
    Trigger,
)
from runs.models.owners import OwnerGrant
from runs.models.schedules import FiringOutcome, RunSchedule, ScheduleFiring, ScheduleKind
from runs.models.tokens import ApiToken

__all__ = [
    "IN_FLIGHT",
    "KEPT_ON_ANSWER",
    "NEVER_RAN",
    "SETTLED",
    "STREAMED_TRIGGERS",
    "UNSETTLED",
    "Decision",
    "PendingCall",
    "WaitKind",
    "AgentRun",
    "ApiToken",
    "Conversation",
    "EffectStatus",
    "EffectsChoice",
    "EventStatus",
    "FiringOutcome",
    "OwnerGrant",
    "Recovery",
    "RunSchedule",
    "RunStatus",
    "RunStep",
    "ScheduleFiring",
    "ScheduleKind",
    "SettledOutcome",
    "SignatureScheme",
    "StepStatus",
    "ToolCall",
    "ToolCallStatus",
    "ToolEffect",
    "Trigger",
    "WebhookEvent",
    "WebhookSource",
]
