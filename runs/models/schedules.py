"""User schedules: runs started again and again with a fixed input, and what each slot did."""

from django.conf import settings
from django.db import models
from django.utils import timezone

from runs.inputs.schedules import ScheduleKind, check_schedule, prepare_for_save
from runs.models.ledger import AgentRun

# What decides a schedule's slots; a change to any of them sets its next slot anew.
TIMING_FIELDS = ("enabled", "kind", "interval_minutes", "cron")


class RunSchedule(models.Model):
    """An agent or workflow run with a fixed input, started again and again (trigger `schedule`).

    `next_fire_at` is the slot the schedule fires next; firing moves it on with a conditional
    update, so concurrent schedulers and redelivered jobs fire each slot at most once.
    """

    name = models.CharField(max_length=128, unique=True)
    enabled = models.BooleanField(default=True)
    agent_name = models.CharField(max_length=128, help_text="A registered agent or a workflow.")
    message = models.TextField()
    owner_id = models.CharField(max_length=128)
    params = models.JSONField(default=dict, blank=True)
    kind = models.CharField(max_length=16, choices=ScheduleKind.choices, default=ScheduleKind.INTERVAL)
    interval_minutes = models.PositiveIntegerField(null=True, blank=True)
    cron = models.CharField(max_length=128, blank=True, help_text="minute hour day month weekday, in TIME_ZONE.")
    next_fire_at = models.DateTimeField(null=True, blank=True)
    last_fired_at = models.DateTimeField(null=True, blank=True)
    last_run = models.ForeignKey(AgentRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    last_skipped_at = models.DateTimeField(null=True, blank=True)
    last_skip_reason = models.TextField(blank=True)
    created_by = models.ForeignKey(
        settings.AUTH_USER_MODEL, null=True, blank=True, on_delete=models.SET_NULL, related_name="+"
    )
    created_at = models.DateTimeField(default=timezone.now)

    class Meta:
        db_table = "run_schedules"
        ordering = ["name"]
        indexes = [models.Index(fields=["enabled", "next_fire_at"], name="schedule_due")]

    def __str__(self) -> str:
        return self.name

    def save(self, *args, **kwargs):
        # Every way of saving sets the first slot: a new schedule, or one whose timing changed,
        # fires next at its next slot after now; a disabled one has none.
        saved = getattr(self, "_saved_timing", None)
        timing_changed = self._state.adding or (saved is not None and saved != self._timing())
        prepare_for_save(self, timing_changed=timing_changed)
        super().save(*args, **kwargs)
        self._saved_timing = self._timing()

    @classmethod
    def from_db(cls, db, field_names, values):
        instance = super().from_db(db, field_names, values)
        if all(name in field_names for name in TIMING_FIELDS):
            instance._saved_timing = instance._timing()
        return instance

    def _timing(self) -> tuple:
        return tuple(getattr(self, name) for name in TIMING_FIELDS)

    def clean(self) -> None:
        check_schedule(self)


class FiringOutcome(models.TextChoices):
    STARTED = "started", "started a run"
    SKIPPED = "skipped", "skipped: the previous run was still in flight"
    FAILED = "failed", "failed to start"


class ScheduleFiring(models.Model):
    """What each slot of a schedule did: started a run, was skipped (overlap) or failed to start."""

    schedule = models.ForeignKey(RunSchedule, on_delete=models.CASCADE, related_name="firings")
    slot = models.DateTimeField(help_text="The time the schedule was due.")
    fired_at = models.DateTimeField(default=timezone.now)
    outcome = models.CharField(max_length=16, choices=FiringOutcome.choices)
    run = models.ForeignKey(AgentRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    blocking_run = models.ForeignKey(AgentRun, null=True, blank=True, on_delete=models.SET_NULL, related_name="+")
    detail = models.TextField(blank=True)

    class Meta:
        db_table = "schedule_firings"
        ordering = ["-slot"]
        constraints = [models.UniqueConstraint(fields=["schedule", "slot"], name="firing_schedule_slot")]
        indexes = [models.Index(fields=["outcome", "fired_at"], name="firing_outcome_fired")]

    def __str__(self) -> str:
        return f"{self.schedule} at {self.slot:%Y-%m-%d %H:%M}: {self.outcome}"
