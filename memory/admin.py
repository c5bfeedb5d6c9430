from __future__ import annotations

from django.contrib import admin, messages
from django.db.models import Count, Min
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.html import format_html

from agents.registry import AGENTS
from config.lib.admin import ReadOnlyAdminMixin
from memory import services
from memory.models import MemoryEntry


class AgentFilter(admin.SimpleListFilter):
    """Registered agents, without a DISTINCT over every memory to find them."""

    title = "agent"
    parameter_name = "agent_name"

    def lookups(self, request, model_admin):
        return [(name, name) for name in sorted(AGENTS)]

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(agent_name=self.value())
        return queryset


class OwnerFilter(admin.SimpleListFilter):
    """A text box: there are too many owners to list them."""

    title = "owner"
    parameter_name = "owner_id"
    template = "admin/memory/input_filter.html"

    def __init__(self, request, params, model, model_admin):
        super().__init__(request, params, model, model_admin)
        self.other_params = [
            (key, value)
            for key, values in request.GET.lists()
            for value in values
            if key not in {self.parameter_name, "p"}
        ]

    def lookups(self, request, model_admin):
        return ()

    def has_output(self):
        return True

    def choices(self, changelist):
        yield {
            "selected": self.value() is None,
            "query_string": changelist.get_query_string(remove=[self.parameter_name]),
            "display": "All",
        }

    def queryset(self, request, queryset):
        if self.value():
            return queryset.filter(owner_id=self.value().strip())
        return queryset


class MemoryEntryAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    """Memories as records. Registered by `runs.admin.memory`, which applies the owner rule the
    API's memory door applies (memory knows no users or grants)."""

    list_display = ["timestamp", "agent_name", "owner_id", "author", "short_text", "run_link"]
    list_filter = [AgentFilter, OwnerFilter]
    # Searched through the full-text index (see get_search_results), not with LIKE.
    search_fields = ["text"]
    search_help_text = "Words to find, matched through the full-text index (stemmed, common words ignored)."
    show_full_result_count = False
    ordering = ["-timestamp", "-id"]
    list_per_page = 50
    actions = ["forget_selected_owners"]
    fields = ["agent_name", "owner_id", "author", "text", "timestamp", "added_at", "session_id", "run_link", "event_id"]
    readonly_fields = fields

    @admin.display(description="text")
    def short_text(self, entry: MemoryEntry) -> str:
        return entry.text if len(entry.text) <= 120 else entry.text[:120] + "…"

    @admin.display(description="run")
    def run_link(self, entry: MemoryEntry) -> str:
        if entry.run_id is None:
            return "—"
        url = reverse("admin:runs_agentrun_change", args=[entry.run_id])
        return format_html('<a href="{}">{}</a>', url, str(entry.run_id)[:8])

    def get_search_results(self, request, queryset, search_term):
        if not search_term.strip():
            return queryset, False
        return queryset.matching(search_term), False

    def has_forget_permission(self, request) -> bool:
        return request.user.has_perm("memory.delete_memoryentry")

    @admin.action(description="Forget the selected owners (delete all their memories)…", permissions=["forget"])
    def forget_selected_owners(self, request, queryset):
        owners = sorted(set(queryset.values_list("owner_id", flat=True)))
        if request.POST.get("post") == "yes":
            total = sum(services.forget_owner(owner_id=owner) for owner in owners)
            self.message_user(
                request,
                f"Forgot {total} memor{'y' if total == 1 else 'ies'} of {len(owners)} "
                f"owner{'' if len(owners) == 1 else 's'}: {', '.join(owners)}.",
                messages.SUCCESS,
            )
            return None
        counts = (
            MemoryEntry.objects.filter(owner_id__in=owners)
            .values("owner_id", "agent_name")
            .annotate(count=Count("id"))
            .order_by("owner_id", "agent_name")
        )
        context = {
            **self.admin_site.each_context(request),
            "title": "Forget these owners?",
            "opts": self.model._meta,
            "owners": owners,
            "counts": list(counts),
            "total": sum(row["count"] for row in counts),
            # One selected row per owner is enough to name the same owners again on confirmation.
            "selected_pks": list(
                queryset.order_by().values("owner_id").annotate(first=Min("id")).values_list("first", flat=True)
            ),
            "action_checkbox_name": admin.helpers.ACTION_CHECKBOX_NAME,
        }
        return TemplateResponse(request, "admin/memory/memoryentry/forget_confirmation.html", context)
