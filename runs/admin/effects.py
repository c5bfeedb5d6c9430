"""Effect records in the admin: what an idempotent tool did under each key (records, never forms).

A record changes only through the tools themselves and through settling a call in doubt on its
run's page, so the desk can read it here and act there.
"""

from django.contrib import admin
from django.urls import reverse
from django.utils.html import format_html

from config.lib.admin import CappedCountPaginator, ReadOnlyAdminMixin
from runs.models.effects import ToolEffect


@admin.register(ToolEffect)
class ToolEffectAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["tool_name", "business_key", "status", "first_run_link", "first_call_id", "started_at",
                    "finished_at"]
    list_filter = ["status", "tool_name"]
    search_fields = ["=key", "=intent_id", "=first_call_id"]
    search_help_text = "A full key, an intent id (e.g. run:<uuid>) or a call id."
    show_full_result_count = False
    show_facets = admin.ShowFacets.NEVER
    paginator = CappedCountPaginator
    list_select_related = ["first_run"]
    readonly_fields = ["key", "intent_id", "tool_name", "business_key", "stable_fields", "status", "result", "error",
                       "first_run_link", "first_call_id", "started_at", "finished_at"]
    fields = readonly_fields

    @admin.display(description="first run", ordering="first_run")
    def first_run_link(self, effect: ToolEffect) -> str:
        url = reverse("admin:runs_agentrun_change", args=[effect.first_run_id])
        return format_html('<a href="{}">{}</a>', url, str(effect.first_run_id)[:8])
