"""API tokens in the admin: only a prefix of each key is ever shown after it was made.

DRF's own token admin lists whole keys, so anyone who may view the list could act as every API
user, and names each token by its key (page titles, the admin's history). Here a token is an
`ApiToken`, named by a prefix; the list shows that prefix, each token's expiry (config.lib.auth), and a new key is
shown once, in the message after it was made.
"""

from __future__ import annotations

from datetime import timedelta

from django.conf import settings
from django.contrib import admin, messages
from django.http import Http404, HttpResponseRedirect
from django.urls import reverse
from rest_framework.authtoken.admin import TokenAdmin as DRFTokenAdmin
from rest_framework.authtoken.models import TokenProxy

from config.lib.auth import is_expired, key_prefix
from runs.models.tokens import ApiToken

admin.site.unregister(TokenProxy)


@admin.register(ApiToken)
class TokenAdmin(DRFTokenAdmin):
    list_display = ("key_start", "user", "created", "expires")
    change_form_template = "admin/runs/apitoken/change_form.html"

    def has_change_permission(self, request, obj=None):
        return False  # a token is made or deleted, never edited

    # The admin's history records an object by its primary key, which here is the key itself:
    # each entry is recorded against the token's user instead, naming the token by its prefix.
    def history_view(self, request, object_id, extra_context=None):
        token = self.get_object(request, object_id)
        if token is None:
            raise Http404("No such token.")
        return HttpResponseRedirect(reverse("admin:auth_user_history", args=[token.user_id]))

    def log_addition(self, request, obj, message):
        return super().log_addition(request, obj.user, f"Made the API token {key_prefix(obj.key)}.")

    def log_change(self, request, obj, message):
        return super().log_change(request, obj.user, f"Changed the API token {key_prefix(obj.key)}.")

    def log_deletions(self, request, queryset):
        return [
            super(TokenAdmin, self).log_change(request, token.user, f"Deleted the API token {key_prefix(token.key)}.")
            for token in queryset
        ]

    @admin.display(description="key")
    def key_start(self, token) -> str:
        return key_prefix(token.key)

    @admin.display(description="expires")
    def expires(self, token) -> str:
        if not settings.API_TOKEN_TTL_DAYS:
            return "never"
        at = token.created + timedelta(days=settings.API_TOKEN_TTL_DAYS)
        return f"{at:%Y-%m-%d %H:%M} UTC{' (expired)' if is_expired(token.created) else ''}"

    def response_add(self, request, obj, post_url_continue=None):
        self.message_user(
            request,
            f"The new API token for {obj.user}: {obj.key} — copy it now: from here on only its first "
            "characters are shown.",
            messages.SUCCESS,
        )
        return self.response_post_save_add(request, obj)
