"""The desk's first page: what needs a person now, each count a link to exactly its rows.

The counts come from `runs.rules.overview`; this module only checks who may look, builds the links
and draws the runs-per-hour chart as server-side SVG (readable without JavaScript).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import urlencode

from django.contrib import admin
from django.core.exceptions import PermissionDenied
from django.http import HttpRequest, HttpResponse
from django.template.response import TemplateResponse
from django.urls import reverse
from django.utils import timezone
from django.utils.html import format_html, format_html_join
from django.utils.safestring import SafeString, mark_safe
from django.utils.timesince import timesince

from runs.models.inbox import EventStatus
from runs.models.ledger import RunStatus
from runs.refusals import CallsInDoubt, ToolsCalled, ToolsUnknown
from runs.rules import overview
from runs.rules.overview import Bucket, CappedCount

# One colour per outcome, in stacking order (bottom first); queued/running on top.
STATUS_COLOURS = {
    RunStatus.SUCCESS: "#2da44e",
    RunStatus.ERROR: "#ba2121",
    RunStatus.CANCELLED: "#9a6700",
    RunStatus.RUNNING: "#1f6feb",
    RunStatus.QUEUED: "#8c959f",
    RunStatus.WAITING: "#8250df",
}
CHART_WIDTH, CHART_HEIGHT, AXIS = 720, 160, 24


@dataclass(frozen=True)
class Tile:
    """One count on the page, the link to its rows, and a sentence saying what it counts."""

    element_id: str
    label: str
    count: CappedCount
    url: str
    help: str = ""
    alert: bool = False


def runs_url(desk: str) -> str:
    return f"{reverse('admin:runs_agentrun_changelist')}?{urlencode({'desk': desk})}"


def desk_overview(request: HttpRequest) -> HttpResponse:
    """GET /admin/desk/: staff only (the admin's login), and only for those who may view runs."""
    if not request.user.has_perm("runs.view_agentrun"):
        raise PermissionDenied
    can_see_inbox = request.user.has_perm("runs.view_webhookevent")
    can_see_schedules = request.user.has_perm("runs.view_runschedule")
    now = timezone.now()
    data = overview.build_overview(now=now, inbox=can_see_inbox, schedules=can_see_schedules)
    context = {
        **admin.site.each_context(request),
        "title": "Desk overview",
        "tiles": tiles(data, inbox=can_see_inbox, schedules=can_see_schedules),
        "oldest": data.in_flight.oldest,
        "oldest_url": reverse("admin:runs_agentrun_change", args=[data.in_flight.oldest.pk])
        if data.in_flight.oldest
        else "",
        "chart_hourly": svg_chart(data.hourly, label_every=3, label_format="%H:%M", title="last 24 hours, per hour"),
        "chart_daily": svg_chart(data.daily, label_every=1, label_format="%a %d", title="last 7 days, per day"),
        "legend": legend(),
        "cap": f"{overview.CAP:,}",
    }
    return TemplateResponse(request, "admin/runs/overview.html", context)


def tiles(data: overview.Overview, *, inbox: bool, schedules: bool) -> list[Tile]:
    awaiting = data.awaiting
    result = [
        Tile("awaiting-calls-in-doubt", "Failed runs awaiting a decision: calls in doubt", awaiting[CallsInDoubt.code],
             runs_url(CallsInDoubt.code),
             "A call was started and never finished: settle it (done or not done) once you know.",
             alert=awaiting[CallsInDoubt.code].value > 0),
        Tile("awaiting-tools-called", "Failed runs awaiting a decision: tools called", awaiting[ToolsCalled.code],
             runs_url(ToolsCalled.code), "A replay would call those tools again: replay by force, or leave it.",
             alert=awaiting[ToolsCalled.code].value > 0),
        Tile("awaiting-tools-unknown", "Failed runs awaiting a decision: tools unknown",
             awaiting[ToolsUnknown.code], runs_url(ToolsUnknown.code),
             "Nobody knows what they called: check the timeline before forcing.",
             alert=awaiting[ToolsUnknown.code].value > 0),
        # The calls behind the runs counted above (a crash is counted once, by its run): no alert of its own.
        Tile("calls-in-doubt", "Calls in doubt", data.calls_in_doubt, runs_url("in_doubt"),
             "The calls of the runs above that never answered: settle each once you know whether it acted."),
        Tile("reconciled-24h", "Runs reconciled in the last 24 h", data.reconciled_24h, runs_url("reconciled_24h"),
             "Their worker went silent: what became of each is counted above, once."),
        Tile("recovered-24h", "Died and finished by themselves (24 h)", data.recovered_24h, runs_url("recovered_24h"),
             "Nothing they did was in doubt, so the system continued each one as a resume."),
        Tile("died-waiting", "Died and waiting for a person", data.died_waiting, runs_url("needs_person"),
             "The system could not continue them safely; each run says why.", alert=data.died_waiting.value > 0),
        Tile("in-flight", "Runs in flight", data.in_flight.count, runs_url("in_flight"), "Queued or running."),
        Tile("approvals-waiting", "Approvals waiting", data.approvals_waiting.count, runs_url("waiting"),
             waiting_help(data.approvals_waiting.oldest), alert=data.approvals_waiting.count.value > 0),
    ]
    if inbox and data.webhook_events is not None:
        events_url = reverse("admin:runs_webhookevent_changelist")
        result += [
            Tile("events-needs-review", "Webhook events needing review", data.webhook_events[EventStatus.NEEDS_REVIEW],
                 f"{events_url}?status__exact={EventStatus.NEEDS_REVIEW}",
                 "An attempt called tools and failed: retry by force or resolve.",
                 alert=data.webhook_events[EventStatus.NEEDS_REVIEW].value > 0),
            Tile("events-dead", "Dead webhook events", data.webhook_events[EventStatus.DEAD],
                 f"{events_url}?status__exact={EventStatus.DEAD}", "Out of attempts."),
        ]
    if schedules and data.skipped_firings_24h is not None:
        result.append(
            Tile("schedules-skipped", "Schedule slots skipped in the last 24 h", data.skipped_firings_24h,
                 f"{reverse('admin:runs_runschedule_changelist')}?skipped=24h",
                 "The previous run was still in flight at the slot; the link lists those schedules.")
        )
    return result


def waiting_help(oldest) -> str:
    if oldest is None:
        return "Tool calls that wait for a person's approval or a long-running result: none now."
    asked = timesince(oldest.asked_at)
    return (f"Tool calls that wait for a person's approval or a long-running result. The oldest, "
            f"{oldest.tool_name} in run {str(oldest.run_id)[:8]}, was asked {asked} ago.")


def legend() -> SafeString:
    return format_html_join(
        "", '<span class="legend-item"><span class="swatch" style="background:{}"></span>{}</span>',
        ((colour, status) for status, colour in STATUS_COLOURS.items()),
    )


def svg_chart(buckets: list[Bucket], *, label_every: int, label_format: str, title: str) -> SafeString:
    """Stacked bars, one per bucket; each bar's <title> gives its numbers (a tooltip, no JS)."""
    plot_height = CHART_HEIGHT - AXIS
    highest = max((bucket.total for bucket in buckets), default=0)
    peak = highest or 1
    slot = CHART_WIDTH / max(len(buckets), 1)
    bar_width = max(slot * 0.8, 1)
    parts: list[str] = []
    for index, bucket in enumerate(buckets):
        x = index * slot + (slot - bar_width) / 2
        y = float(plot_height)
        rects = []
        for status, colour in STATUS_COLOURS.items():
            n = bucket.counts.get(status, 0)
            if not n:
                continue
            height = n / peak * (plot_height - 4)
            y -= height
            rects.append(format_html('<rect x="{}" y="{}" width="{}" height="{}" fill="{}"/>',
                                     f"{x:.1f}", f"{y:.1f}", f"{bar_width:.1f}", f"{height:.1f}", colour))
        summary = ", ".join(f"{n} {status}" for status, n in sorted(bucket.counts.items())) or "no runs"
        local = timezone.localtime(bucket.start)
        parts.append(format_html('<g class="bucket"><title>{}: {}</title>{}</g>', local.strftime("%Y-%m-%d %H:%M"),
                                 summary, mark_safe("".join(rects))))
        if index % label_every == 0:
            parts.append(format_html('<text x="{}" y="{}" class="tick">{}</text>', f"{index * slot + slot / 2:.1f}",
                                     CHART_HEIGHT - 8, local.strftime(label_format)))
    return format_html(
        '<svg class="desk-chart" viewBox="0 0 {} {}" width="100%" role="img" aria-label="Runs {}">'
        '<line x1="0" y1="{}" x2="{}" y2="{}" class="axis"/>'
        '<text x="2" y="12" class="peak">peak {} runs</text>{}</svg>',
        CHART_WIDTH, CHART_HEIGHT, title, plot_height, CHART_WIDTH, plot_height, highest,
        mark_safe("".join(parts)),
    )
