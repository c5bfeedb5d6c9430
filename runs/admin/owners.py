"""Who may act for whom, in the admin: owner grants (configuration), and the owner rule on staff's forms.

A form that fixes an owner for runs nobody starts by hand (a schedule, a webhook source, a grant)
is saved only by a staff member who may act for that owner themselves (`runs.rules.permissions`), so a
system trigger's owner was always chosen under the rule.
"""

from __future__ import annotations

from django import forms
from django.contrib import admin

from config.lib.admin import CheckedSelectionMixin
from runs.models.owners import OwnerGrant
from runs.refusals import FaultsNotPermitted, OwnerNotPermitted
from runs.rules import permissions
from runs.rules.faults import faults_in, may_place_faults


def owner_checked(form_class: type[forms.ModelForm], *, actor) -> type[forms.ModelForm]:
    """`form_class`, refusing an `owner_id` that `actor` may not act for (an error on the field, naming it)
    and `params` carrying scripted faults when `actor` may not place them (`runs.rules.faults`)."""

    class OwnerCheckedForm(form_class):
        def clean(self):
            cleaned = super().clean()
            owner_id = cleaned.get("owner_id")
            if isinstance(owner_id, str) and owner_id.strip():
                owner_id = owner_id.strip()
                if not permissions.may_act_for_owner(user=actor, owner_id=owner_id):
                    self.add_error("owner_id", OwnerNotPermitted(owner_id).admin_detail)
            # Saved params run later with no person behind them (a schedule, a webhook source): a
            # scripted fault in them is placed now, by whoever saves them, under the same permission.
            placed = faults_in(cleaned.get("params"))
            if placed and not may_place_faults(actor):
                self.add_error("params", FaultsNotPermitted(placed).admin_detail)
            return cleaned

    OwnerCheckedForm.__name__ = form_class.__name__
    return OwnerCheckedForm


class OwnerCheckedAdminMixin:
    """A ModelAdmin whose form refuses an owner the staff member saving it may not act for, and
    params with scripted faults they may not place."""

    def get_form(self, request, obj=None, change=False, **kwargs):
        return owner_checked(super().get_form(request, obj, change=change, **kwargs), actor=request.user)


@admin.register(OwnerGrant)
class OwnerGrantAdmin(CheckedSelectionMixin, OwnerCheckedAdminMixin, admin.ModelAdmin):
    """Configuration, not a record: grants are added, changed and taken back here."""

    list_display = ["user", "owner_id", "granted_by", "note", "created_at"]
    list_filter = ["created_at", ("user", admin.RelatedOnlyFieldListFilter),
                   ("granted_by", admin.RelatedOnlyFieldListFilter)]
    search_fields = ["=owner_id", "user__username", "note"]
    search_help_text = "An owner id (exactly), a username, or words from the note."
    list_select_related = ["user", "granted_by"]
    raw_id_fields = ["user"]
    fields = ["user", "owner_id", "note", "granted_by", "created_at"]
    readonly_fields = ["granted_by", "created_at"]
    ordering = ["owner_id", "user__username"]

    def save_model(self, request, obj, form, change):
        # Whoever saves a grant vouches for it: they may act for that owner themselves (the form's rule).
        obj.granted_by = request.user
        super().save_model(request, obj, form, change)
