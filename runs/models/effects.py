"""Effect records: what an idempotent tool did under a key from stable intent.

A record is written and committed before its tool acts, so a worker that dies inside the tool
leaves a record that says `started`: in doubt, never silently run again (docs/architecture.md,
"Effects").
"""

from django.db import models
from django.utils import timezone


class EffectStatus(models.TextChoices):
    STARTED = "started", "started (in doubt until it finishes or a person settles it)"
    DONE = "done", "done"
    FAILED = "failed", "failed (known not to have acted: may run again)"


class ToolEffect(models.Model):
    key = models.CharField(max_length=64, unique=True, help_text="sha256 of intent, tool and business key.")
    intent_id = models.CharField(max_length=320, help_text="The run's intent: its replay chain's root, or its webhook.")
    tool_name = models.CharField(max_length=128)
    business_key = models.JSONField(help_text="The arguments the tool's declaration picks as its key.")
    stable_fields = models.JSONField(default=dict, blank=True, help_text="Arguments a repeat must agree on.")
    status = models.CharField(max_length=8, choices=EffectStatus.choices, default=EffectStatus.STARTED)
    result = models.JSONField(null=True, blank=True, help_text="What the tool answered: served to repeats.")
    error = models.TextField(blank=True)
    first_run = models.ForeignKey("runs.AgentRun", on_delete=models.PROTECT, related_name="+")
    first_call_id = models.CharField(max_length=128)
    started_at = models.DateTimeField(default=timezone.now)
    finished_at = models.DateTimeField(null=True, blank=True)

    class Meta:
        db_table = "tool_effects"
        ordering = ["-started_at"]
        indexes = [
            models.Index(fields=["first_run", "first_call_id"], name="tooleffect_first_call"),
            # Records that never finished are few: the desk's calls in doubt start from them.
            models.Index(
                fields=["first_run", "first_call_id"],
                condition=models.Q(status="started"),
                name="tooleffect_started_call",
            ),
        ]

    def __str__(self) -> str:
        return f"{self.tool_name} {self.business_key} ({self.status})"
