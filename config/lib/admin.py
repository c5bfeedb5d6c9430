"""The admin kit every app's desk is built from.

- `ReadOnlyAdminMixin`: records, not forms.
- `CheckedSelectionMixin`: an action's selected keys are checked before the action runs.
- `CappedCountPaginator`: list pages that stay fast on tables of millions of rows.
- `act_on_each`: an action applied object by object, each refusal reported as a message of its
  own (the admin's one translation of the refusal family).
- `confirm_with_reason`: Django's `delete_selected` shape for a dangerous action — a
  confirmation page listing what each object would do, a reason (and, if the action asks, one
  choice among options), then the action.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from django.contrib import messages
from django.contrib.admin import helpers
from django.contrib.admin.utils import model_ngettext
from django.core.exceptions import PermissionDenied, ValidationError
from django.core.paginator import Paginator
from django.http import HttpRequest, HttpResponse, HttpResponseRedirect
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils.functional import cached_property
from django.utils.http import url_has_allowed_host_and_scheme

from config.lib.refusals import Refusal

CONFIRMATION_TEMPLATE = "admin/confirm_with_reason.html"


class ReadOnlyAdminMixin:
    """Records, not forms: nothing can be added, changed or deleted by hand."""

    def has_add_permission(self, request, obj=None):
        return False

    def has_change_permission(self, request, obj=None):
        return False

    def has_delete_permission(self, request, obj=None):
        return False


class CheckedSelectionMixin:
    """An action's selected keys are read before the action: a malformed one (a crafted post) is
    answered with a message, not a 500 from the query that would compare it with the keys."""

    def response_action(self, request, queryset):
        field = self.model._meta.pk
        for value in request.POST.getlist(helpers.ACTION_CHECKBOX_NAME):
            try:
                field.to_python(value)
            except (ValidationError, ValueError, TypeError):
                self.message_user(request, f"{str(value)[:64]!r} is not the key of any "
                                           f"{self.model._meta.verbose_name}; nothing was done.", messages.ERROR)
                return HttpResponseRedirect(request.get_full_path())
        return super().response_action(request, queryset)


class CappedCountPaginator(Paginator):
    """Counts at most `cap` rows: COUNT(*) over millions of rows is what makes a list page slow.

    Past the cap the list says “10000+”; filters and search narrow it down from there.
    """

    cap = 10_000

    @cached_property
    def count(self) -> int:
        # Only the primary keys, unordered: the list's annotations and ordering cost nothing here.
        counted = self.object_list.order_by().values("pk")[: self.cap + 1].count()
        self.capped = counted > self.cap
        return min(counted, self.cap)


class PrimaryKeySearchMixin:
    """A full id is the most common search and has its own index: it never scans the text columns."""

    def get_search_results(self, request, queryset, search_term):
        try:
            key = uuid.UUID(search_term.strip())
        except ValueError:
            return super().get_search_results(request, queryset, search_term)
        return queryset.filter(pk=key), False


@dataclass(frozen=True)
class ObjectButton:
    """A button on an object's page that runs one admin action on that object alone."""

    action: str
    label: str
    element_id: str
    # Why the rules refuse the action now: the button is shown greyed with this reason ("" = allowed).
    refused: str = ""


def object_buttons(modeladmin: Any, buttons: list[ObjectButton]) -> dict:
    """The change form's context for `admin/object_buttons.html`: each button posts its action."""
    opts = modeladmin.opts
    return {
        "object_buttons": buttons,
        "changelist_url": reverse(f"admin:{opts.app_label}_{opts.model_name}_changelist"),
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
    }


def safe_next(request: HttpRequest) -> str | None:
    """The page to go back to after an action, if it is one of this site's."""
    target = request.POST.get("next", "")
    if target and url_has_allowed_host_and_scheme(target, allowed_hosts={request.get_host()}):
        return target
    return None


def back(request: HttpRequest) -> HttpResponse | None:
    """Back where the person was (None lets Django show the change list again)."""
    target = safe_next(request)
    return HttpResponseRedirect(target) if target else None


def act_on_each(
    modeladmin: Any,
    request: HttpRequest,
    objects: Iterable[Any],
    *,
    act: Callable[[Any], Any],
    label: Callable[[Any], str],
    success: Callable[[Any, Any], str],
    refused: Callable[[Refusal], str] = lambda refusal: refusal.admin_detail,
) -> list[Any]:
    """Apply `act` to each object; report each outcome (or refusal) as one message. Returns the results."""
    results = []
    for obj in objects:
        try:
            result = act(obj)
        except Refusal as refusal:
            modeladmin.message_user(request, f"{label(obj)}: {refused(refusal)}", messages.WARNING)
            continue
        results.append(result)
        modeladmin.message_user(request, f"{label(obj)}: {success(obj, result)}", messages.SUCCESS)
    return results


@dataclass(frozen=True)
class ActionChoice:
    """One extra question a confirmed action asks, answered by picking an option (radio buttons)."""

    name: str  # the form field, passed to `perform` as a keyword argument
    label: str
    options: tuple[tuple[str, str, str], ...]  # (value, label, what it does)
    default: str

    def clean(self, value: str | None) -> str | None:
        value = self.default if value in (None, "") else value
        return value if value in {option[0] for option in self.options} else None


@dataclass(frozen=True)
class ReasonedAction:
    """What a confirmed action with a reason needs to know; the page's words come from here."""

    name: str  # the action's function name, posted back by the confirmation form
    slug: str  # names the page for styles and tests, e.g. "force-replay"
    title: str  # e.g. "Force replay"
    question: str  # the sentence above the list, with {objects_name}
    submit: str  # e.g. "Yes, force the replay"
    row_template: str  # renders one row of `rows`
    check_reason: Callable[[str], str]  # the one reason rule: returns the cleaned reason or raises a Refusal
    max_reason_chars: int
    reason_label: str = "Reason (recorded on each new run and in the admin log):"
    choice: ActionChoice | None = None


def confirm_with_reason(
    modeladmin: Any,
    request: HttpRequest,
    queryset: Any,
    objects: list[Any],
    *,
    action: ReasonedAction,
    permitted: bool,
    rows: Callable[[list[Any]], list[dict]],
    perform: Callable[..., HttpResponse | None],
) -> HttpResponse | None:
    """Confirm, with a reason, then `perform` (Django's delete_selected pattern).

    The first request shows the confirmation page; the confirmed post (`post=yes`) checks the
    reason with the same rule the services apply and performs, or shows the page again with the
    refusal's words. An action with a `choice` gets the picked option as a keyword argument:
    `perform(objects, reason, **{choice.name: value})`.
    """
    if not permitted:
        raise PermissionDenied
    reason = request.POST.get("reason", "").strip()
    error = ""
    chosen = action.choice.clean(request.POST.get(action.choice.name)) if action.choice else None
    if request.POST.get("post"):
        if action.choice is not None and chosen is None:
            error = f"Choose one of the options for “{action.choice.label}”."
        else:
            try:
                cleaned = action.check_reason(reason)
            except Refusal as refusal:
                error = refusal.admin_detail
            else:
                extra = {action.choice.name: chosen} if action.choice is not None else {}
                return perform(objects, cleaned, **extra)
    return confirmation_page(
        modeladmin,
        request,
        CONFIRMATION_TEMPLATE,
        title=action.title,
        objects=objects,
        action=action,
        question=action.question.format(objects_name=model_ngettext(queryset)),
        rows=rows(objects),
        reason=reason,
        reason_error=error,
        choice=action.choice,
        chosen=chosen if chosen is not None else (action.choice.default if action.choice else None),
        max_reason_chars=action.max_reason_chars,
    )


def confirmation_page(
    modeladmin: Any, request: HttpRequest, template: str, *, title: str, objects: list[Any], **context: Any
) -> TemplateResponse:
    """A confirmation page on `admin/confirm_base.html`: the admin's frame and the selected `objects`,
    which its form posts back (with `next`) so the confirmed post acts on the same ones."""
    request.current_app = modeladmin.admin_site.name
    return TemplateResponse(request, template, {
        **modeladmin.admin_site.each_context(request),
        "title": title,
        "subtitle": None,
        "queryset": objects,
        "next": safe_next(request) or "",
        "opts": modeladmin.model._meta,
        "action_checkbox_name": helpers.ACTION_CHECKBOX_NAME,
        "media": modeladmin.media,
        **context,
    })
