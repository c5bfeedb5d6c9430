"""Long-term memories in the admin, read under the owner rule (runs.rules.permissions), as `/api/memory/` reads them.

`memory` owns the admin class and knows no users or grants; registering it here lets the same
rule decide for every door: a staff member with `memory.view_memoryentry` sees the memories of
the owners they may act for (their own username, the owners an admin granted them, or every
owner with `runs.act_for_any_owner`), and any other entry answers as if it did not exist.
"""

from __future__ import annotations

from django.contrib import admin

from memory.admin import MemoryEntryAdmin
from memory.models import MemoryEntry
from runs.rules import permissions


@admin.register(MemoryEntry)
class OwnerScopedMemoryEntryAdmin(MemoryEntryAdmin):
    def get_queryset(self, request):
        return super().get_queryset(request).filter(permissions.owners_q(user=request.user))
