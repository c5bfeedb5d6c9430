"""User schedules in the admin: staff schedule an agent or a workflow; each firing is a run."""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from config.lib.admin import CheckedSelectionMixin, ReadOnlyAdminMixin
from runs.admin.filters import SkippedRecentlyFilter
from runs.admin.owners import OwnerCheckedAdminMixin
from runs.models.schedules import RunSchedule, ScheduleFiring


class ScheduleFiringInline(ReadOnlyAdminMixin, admin.TabularInline):
    model = ScheduleFiring
    verbose_name_plural = "firings (newest first)"
    fields = ["slot", "fired_at", "outcome", "run_link", "blocking_run_link", "detail"]
    readonly_fields = fields
    extra = 0
    can_delete = False
    ordering = ["-slot"]
    max_num = 0

    def get_queryset(self, request):
        return super().get_queryset(request).order_by("-slot")

    @admin.display(description="run")
    def run_link(self, firing: ScheduleFiring) -> str:
        return _run_link(firing.run_id)

    @admin.display(description="blocked by")
    def blocking_run_link(self, firing: ScheduleFiring) -> str:
        return _run_link(firing.blocking_run_id)


def _run_link(run_id) -> str:
    if run_id is None:
        return "—"
    return format_html('<a href="{}">{}</a>', reverse("admin:runs_agentrun_change", args=[run_id]), str(run_id)[:8])


@admin.register(RunSchedule)
class RunScheduleAdmin(CheckedSelectionMixin, OwnerCheckedAdminMixin, admin.ModelAdmin):
    """Staff schedule an agent or a workflow; each firing is a run with trigger `schedule`.

    Its runs have no actor, so the owner they act for is checked here: only a staff member who
    may act for that owner saves the schedule.
    """

    list_display = ["name", "enabled", "agent_name", "timing", "next_fire_at", "last_fired_at", "last_run_link",
                    "last_skipped_at"]
    list_filter = ["enabled", "kind", SkippedRecentlyFilter]
    search_fields = ["name", "agent_name", "owner_id"]
    inlines = [ScheduleFiringInline]
    readonly_fields = ["next_fire_at", "last_fired_at", "last_run_link", "last_skipped_at", "last_skip_reason",
                       "created_by", "created_at"]
    fieldsets = [
        (None, {"fields": ["name", "enabled"]}),
        ("What runs", {"fields": ["agent_name", "message", "owner_id", "params"],
                       "description": "A registered agent or a workflow, and the input each run gets."}),
        ("When", {"fields": ["kind", "interval_minutes", "cron", "next_fire_at"],
                  "description": "Checked every minute. A firing while the previous run of this schedule is "
                                 "still queued or running is skipped and recorded below."}),
        ("History", {"fields": ["last_fired_at", "last_run_link", "last_skipped_at", "last_skip_reason",
                                "created_by", "created_at"]}),
    ]

    @admin.display(description="when")
    def timing(self, schedule: RunSchedule) -> str:
        if schedule.kind == "cron":
            return f"cron {schedule.cron}"
        return f"every {schedule.interval_minutes} min"

    @admin.display(description="last run")
    def last_run_link(self, schedule: RunSchedule) -> str:
        return _run_link(schedule.last_run_id)

    def save_model(self, request, obj, form, change):
        # Who created it is the admin's to record; the first slot is the model's own rule.
        if not change:
            obj.created_by = request.user
        super().save_model(request, obj, form, change)
