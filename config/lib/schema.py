"""Who may read the OpenAPI schema and its docs page."""

from __future__ import annotations

from django.conf import settings
from rest_framework.permissions import BasePermission


class SchemaAccess(BasePermission):
    """Signed-in users only, unless API_SCHEMA_PUBLIC is set: the schema maps every endpoint and
    field, which is for the API's users, not for anyone who can reach the host."""

    def has_permission(self, request, view) -> bool:
        if settings.API_SCHEMA_PUBLIC:
            return True
        return bool(request.user and request.user.is_authenticated)
