from django.contrib import admin

from agents.models import AdkEvent, AdkSession, CrmNote, Customer, OutboxEmail
from runs.admin import ReadOnlyAdminMixin


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
