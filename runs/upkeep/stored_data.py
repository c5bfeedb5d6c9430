"""Retention of what users and providers sent: webhook events, their attachments, run-input copies.

Run rows, the tool journal and ADK sessions are records and stay (ADK events have their own
purge, runs.upkeep.retention). What goes, once it is older than its setting in days (0 keeps it):

* WEBHOOK_ATTACHMENTS_RETENTION_DAYS: the attachment copies of closed events (done, resolved,
  dead). The event keeps each attachment's name, size and digest, marked `purged`; reprocessing
  it later is refused as "attachment gone", never done without the file.
* WEBHOOK_EVENTS_RETENTION_DAYS: closed events themselves (payload, headers, copies). Their runs
  stay, unlinked from the event (each run's message still holds what the event said).
* RUN_INPUTS_RETENTION_DAYS: a run's input copy once every run using it (the run and its
  replays) has settled that long ago; a later replay answers `input_gone` (never "almost").

Nothing that belongs to a queued or running run, or to an event still being worked on, is touched.
Files are removed after the rows that point at them are committed, so a failure leaves at worst a
file nobody points at, which the next day's sweep of orphaned folders removes.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass
from datetime import datetime, timedelta
from pathlib import Path

from django.conf import settings
from django.db import transaction
from django.db.models import Count, Max, Q
from django.utils import timezone

from runs.models.inbox import EventStatus, WebhookEvent
from runs.models.ledger import UNSETTLED, AgentRun

logger = logging.getLogger(__name__)

CLOSED_EVENTS = (EventStatus.DONE, EventStatus.RESOLVED, EventStatus.DEAD)
BATCH_SIZE = 500
# A folder without its row may be a receipt still in progress (files are written first): only
# folders left alone this long are orphans.
ORPHAN_GRACE = timedelta(days=1)


@dataclass
class RetentionReport:
    events_deleted: int = 0
    attachment_folders_deleted: int = 0
    run_inputs_deleted: int = 0
    orphans_deleted: int = 0

    def __str__(self) -> str:
        return (
            f"Retention: {self.events_deleted} webhook event(s), {self.attachment_folders_deleted} attachment "
            f"folder(s), {self.run_inputs_deleted} run input copy(ies) and {self.orphans_deleted} orphaned "
            "folder(s) deleted."
        )


def _inside(root: Path, path: Path) -> bool:
    try:
        path.resolve().relative_to(root.resolve())
    except ValueError:
        return False
    return True


def _remove_folder(root: Path, folder: Path) -> bool:
    """Remove `folder` if it is a folder under `root` (never anything else); True if it went."""
    if folder == root or not _inside(root, folder) or not folder.is_dir():
        return False
    shutil.rmtree(folder, ignore_errors=True)
    return not folder.exists()


def _unsettled_event_runs() -> Q:
    return Q(runs__status__in=UNSETTLED)


def purge_webhook_attachments(*, now: datetime, report: RetentionReport) -> None:
    days = settings.WEBHOOK_ATTACHMENTS_RETENTION_DAYS
    if not days:
        return
    root = Path(settings.WEBHOOK_ATTACHMENTS_DIR)
    candidates = (
        WebhookEvent.objects.filter(status__in=CLOSED_EVENTS, finished_at__lt=now - timedelta(days=days))
        .filter(attachments__0__has_key="path")
        .exclude(_unsettled_event_runs())
        .order_by("finished_at")
    )
    while batch := list(candidates[:BATCH_SIZE]):
        for event in batch:
            with transaction.atomic():
                locked = WebhookEvent.objects.select_for_update().filter(pk=event.pk, status__in=CLOSED_EVENTS).first()
                if locked is None:
                    continue
                kept = [
                    {key: value for key, value in item.items() if key != "path"} | {"purged": True}
                    for item in locked.attachments
                ]
                WebhookEvent.objects.filter(pk=locked.pk).update(attachments=kept)
            if _remove_folder(root, root / str(event.pk)):
                report.attachment_folders_deleted += 1


def purge_webhook_events(*, now: datetime, report: RetentionReport) -> None:
    days = settings.WEBHOOK_EVENTS_RETENTION_DAYS
    if not days:
        return
    root = Path(settings.WEBHOOK_ATTACHMENTS_DIR)
    candidates = (
        WebhookEvent.objects.filter(status__in=CLOSED_EVENTS, finished_at__lt=now - timedelta(days=days))
        .exclude(_unsettled_event_runs())
        .order_by("finished_at")
        .values_list("pk", flat=True)
    )
    while batch := list(candidates[:BATCH_SIZE]):
        with transaction.atomic():
            # Locked and re-checked: an event reprocessed meanwhile is no longer closed.
            ids = list(
                WebhookEvent.objects.select_for_update()
                .filter(pk__in=batch, status__in=CLOSED_EVENTS)
                .values_list("pk", flat=True)
            )
            AgentRun.objects.filter(webhook_event_id__in=ids).exclude(status__in=UNSETTLED).update(webhook_event=None)
            deleted, _ = WebhookEvent.objects.filter(pk__in=ids).exclude(_unsettled_event_runs()).delete()
        report.events_deleted += deleted
        for event_id in ids:
            _remove_folder(root, root / str(event_id))
        if not ids:
            break


def purge_run_inputs(*, now: datetime, report: RetentionReport) -> None:
    days = settings.RUN_INPUTS_RETENTION_DAYS
    if not days:
        return
    root = Path(settings.RUN_INPUTS_DIR)
    # One copy may serve a run and all its replays: it goes only when the last of them settled
    # long enough ago and none is queued or running.
    paths = (
        AgentRun.objects.exclude(input_file="")
        .values("input_file")
        .annotate(last=Max("finished_at"), open=Count("pk", filter=Q(status__in=UNSETTLED)))
        .filter(open=0, last__lt=now - timedelta(days=days))
        .values_list("input_file", flat=True)
    )
    for stored in paths.iterator():
        folder = Path(stored).parent
        if folder.exists() and _remove_folder(root, folder):
            report.run_inputs_deleted += 1


def purge_orphaned_folders(*, now: datetime, report: RetentionReport) -> None:
    root = Path(settings.WEBHOOK_ATTACHMENTS_DIR)
    if not root.is_dir():
        return
    cutoff = (now - ORPHAN_GRACE).timestamp()
    folders = {path.name: path for path in root.iterdir() if path.is_dir() and path.stat().st_mtime < cutoff}
    known = {str(pk) for pk in WebhookEvent.objects.filter(pk__in=list(folders)).values_list("pk", flat=True)}
    for name, folder in folders.items():
        if name not in known and _remove_folder(root, folder):
            report.orphans_deleted += 1


def purge_stored_inputs(*, now: datetime | None = None) -> RetentionReport:
    now = now or timezone.now()
    report = RetentionReport()
    purge_webhook_attachments(now=now, report=report)
    purge_webhook_events(now=now, report=report)
    purge_run_inputs(now=now, report=report)
    purge_orphaned_folders(now=now, report=report)
    if report.events_deleted or report.attachment_folders_deleted or report.run_inputs_deleted:
        logger.info("%s", report)
    return report
