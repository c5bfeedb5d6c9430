import json

from django import forms
from django.contrib import admin
from django.db import models
from django.forms.fields import InvalidJSONInput
from django.template.response import TemplateResponse
from django.urls import path, reverse
from django.utils import timezone
from django.utils.html import format_html

from agents import services
from agents.models import AdkEvent, AdkSession, CrmNote, Customer, OutboxEmail, Refund, WorkflowDefinition
from agents.registry import runnable_agents
from agents.workflow_html import GRAPH_CSS, render_graph
from agents.workflows import FUNCTION_STEPS
from config.lib.admin import ReadOnlyAdminMixin


@admin.register(Customer)
class CustomerAdmin(admin.ModelAdmin):
    list_display = ["email", "name", "contact_id", "plan"]
    search_fields = ["email", "name", "contact_id"]


@admin.register(OutboxEmail)
class OutboxEmailAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["sent_at", "to", "subject", "run_id", "call_id"]
    search_fields = ["=run_id", "to", "subject"]
    show_full_result_count = False


@admin.register(CrmNote)
class CrmNoteAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["created_at", "contact_id", "note", "run_id", "call_id"]
    search_fields = ["=run_id", "=contact_id"]
    show_full_result_count = False


@admin.register(Refund)
class RefundAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["issued_at", "order_id", "amount_cents", "run_id", "call_id"]
    search_fields = ["=run_id", "=order_id"]
    show_full_result_count = False


@admin.register(AdkSession)
class AdkSessionAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["id", "app_name", "user_id", "create_time", "update_time"]
    list_filter = ["app_name"]
    search_fields = ["=id", "=user_id"]
    show_full_result_count = False


@admin.register(AdkEvent)
class AdkEventAdmin(ReadOnlyAdminMixin, admin.ModelAdmin):
    list_display = ["id", "session_id", "invocation_id", "author", "timestamp"]
    list_filter = ["app_name"]
    search_fields = ["=session_id", "=invocation_id"]
    show_full_result_count = False


class IndentedJSONField(forms.JSONField):
    """A graph is easier to edit one step per line."""

    def prepare_value(self, value):
        if isinstance(value, InvalidJSONInput):
            return value
        return json.dumps(value, ensure_ascii=False, indent=2)


@admin.register(WorkflowDefinition)
class WorkflowDefinitionAdmin(admin.ModelAdmin):
    """Staff edit workflows here; the model's clean() runs the same checks as the API."""

    formfield_overrides = {
        models.JSONField: {"form_class": IndentedJSONField, "widget": forms.Textarea(attrs={"rows": 24, "cols": 90})}
    }

    list_display = ["name", "description", "steps_count", "updated_at", "updated_by"]
    search_fields = ["name", "description"]
    fields = ["name", "description", "graph", "graph_preview", "known_parts", "updated_at", "updated_by"]
    readonly_fields = ["graph_preview", "known_parts", "updated_at", "updated_by"]

    @admin.display(description="steps")
    def steps_count(self, definition: WorkflowDefinition) -> int:
        return len((definition.graph or {}).get("steps") or {}) if isinstance(definition.graph, dict) else 0

    @admin.display(description="drawn")
    def graph_preview(self, definition: WorkflowDefinition) -> str:
        if not definition.pk or not isinstance(definition.graph, dict):
            return "Saved definitions are drawn here."
        return format_html("<style>{}</style>{}", GRAPH_CSS, render_graph(definition.graph))

    @admin.display(description="available steps")
    def known_parts(self, definition: WorkflowDefinition) -> str:
        return format_html(
            "Agents: {}.<br>Function steps: {}.<br>Other workflows can run as a step: "
            '{{"workflow": "name"}}. A join is {{"join": true}}.',
            ", ".join(runnable_agents()),
            ", ".join(f"{name} ({step.description})" for name, step in sorted(FUNCTION_STEPS.items())),
        )

    def save_model(self, request, obj, form, change):
        obj.updated_at = timezone.now()
        obj.updated_by = request.user
        super().save_model(request, obj, form, change)


# --- The loaded agents: a page of the admin with no model behind it ----------------------------------

LOADED_AGENTS_URL_NAME = "agents_loaded"


def loaded_agents_page(request):
    agents = services.agent_views(user=request.user)
    context = {
        **admin.site.each_context(request),
        "title": "Loaded agents",
        "agents": agents,
        "broken": sum(1 for agent in agents if agent["load_error"]),
        "agents_dir": services.agents_dir_view(user=request.user),
        "sources_redacted": not services.can_configure_agents(request.user),
    }
    return TemplateResponse(request, "admin/agents/loaded_agents.html", context)


def _with_loaded_agents_url(get_urls):
    def urls():
        # Before the site's own patterns, whose agents/<model>/ routes would otherwise be tried first.
        page = path("agents-loaded/", admin.site.admin_view(loaded_agents_page), name=LOADED_AGENTS_URL_NAME)
        return [page, *get_urls()]

    return urls


def _with_loaded_agents_entry(get_app_list):
    def app_list(request, app_label=None):
        apps = get_app_list(request, app_label)
        for app in apps:
            if app["app_label"] == "agents":
                # Listed with the app's models so the index and the sidebar link to it.
                app["models"].append({
                    "name": "Loaded agents",
                    "object_name": "LoadedAgents",
                    "admin_url": reverse(f"admin:{LOADED_AGENTS_URL_NAME}"),
                    "add_url": None,
                    "view_only": True,
                    "perms": {"view": True},
                })
        return apps

    return app_list


admin.site.get_urls = _with_loaded_agents_url(admin.site.get_urls)
admin.site.get_app_list = _with_loaded_agents_entry(admin.site.get_app_list)
