"""End to end, as a support lead would: a real headless Chromium against a live server.

Debian's `chromium` package provides the browser (.ci/run installs it); Playwright for Python
drives it. The test skips itself only where that browser is absent.

Set DOCS_SCREENSHOTS=1 to refresh the screenshots under docs/ from this run (the force-replay
confirmation, a run's page, the desk overview and a live run page).
"""

from __future__ import annotations

import os
import re
import threading
import time
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connection, connections
from django.utils import timezone
from playwright.sync_api import expect

from runs.execution import executor
from runs.models.ledger import AgentRun, RunStatus
from runs.services import run as services
from tests.factories import make_run, run_in_state
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, UPDATE_CRM, run_now, script_params

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
DOCS_SCREENSHOT = Path(settings.BASE_DIR) / "docs" / "force-replay-confirmation.png"

# The browser talks to a live server thread, which reads what the test committed.
pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"Chromium is not installed at {CHROMIUM}"),
]


def save_docs_screenshot(shot: bytes, name: str) -> None:
    if os.environ.get("DOCS_SCREENSHOTS") == "1":
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        DOCS_SCREENSHOT.with_name(name).write_bytes(shot)


def log_in(page, live_server, next_url: str) -> None:
    page.goto(f"{live_server.url}/admin/login/?next={next_url}")
    page.fill("#id_username", "lee")
    page.fill("#id_password", "lee-pass-123")
    page.click("input[type=submit]")
    page.wait_for_url(f"**{next_url}")


@contextmanager
def chromium_page():
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
        try:
            context = browser.new_context(viewport={"width": 1280, "height": 900})
            page = context.new_page()
            page.set_default_timeout(20_000)
            yield page
        finally:
            browser.close()


def test_a_support_lead_force_replays_a_failed_run(announced, live_server, support_lead, monkeypatch, tmp_path):
    # No worker runs beside the live server: the test executes the replay itself.
    failed = run_now(params=script_params(SEND_EMAIL, UPDATE_CRM, {"fail": "error", "message": "CRM timed out"}))
    assert failed.status == RunStatus.ERROR
    assert failed.tools_executed == ["send_email", "update_crm"]

    # Playwright's sync API keeps an event loop running in this thread; the test's own ORM calls
    # below are still ordinary blocking calls, not calls from async code. While that loop runs,
    # Django keys this thread's connection by context, so it gets (and must close) its own.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with chromium_page() as page:
        try:
            drive_the_desk(page, live_server, support_lead, failed, announced, tmp_path)
        finally:
            connections.close_all()


def drive_the_desk(page, live_server, support_lead, failed, enqueued, tmp_path):
    page.goto(f"{live_server.url}/admin/login/?next=/admin/runs/agentrun/")
    page.fill("#id_username", "lee")
    page.fill("#id_password", "lee-pass-123")
    page.click("input[type=submit]")
    page.wait_for_url("**/admin/runs/agentrun/")

    # The list says what the run called; open it.
    row = page.locator("#result_list tbody tr", has_text=str(failed.run_id)[:8])
    assert "send_email, update_crm" in row.inner_text()
    row.get_by_role("link", name=str(failed.run_id)[:8]).click()
    page.wait_for_url(f"**/admin/runs/agentrun/{failed.run_id}/change/")

    decision = page.locator("#replay-decision").inner_text()
    assert "This run already called send_email, update_crm before failing" in decision
    assert "Use “Force replay…” to run it again anyway." in decision
    # The raw timeline comes last, folded: a click opens it.
    page.locator("#timeline-fold > summary").click()
    timeline = page.locator(".run-timeline").inner_text()
    assert "called send_email" in timeline and "jane@example.com" in timeline
    assert "CRM timed out" in timeline

    # Force replay…: the confirmation lists what the run already called and asks for a reason.
    page.click("#force-replay-button")
    page.wait_for_selector("body.force-replay-confirmation")
    confirmation = page.locator("#content").inner_text()
    assert "Already called: send_email, update_crm" in confirmation
    assert "Forcing overrides: This run already called send_email, update_crm" in confirmation
    shot = page.screenshot(path=str(tmp_path / "force-replay-confirmation.png"), full_page=True)
    assert shot[:8] == b"\x89PNG\r\n\x1a\n"
    if os.environ.get("DOCS_SCREENSHOTS") == "1":
        DOCS_SCREENSHOT.parent.mkdir(exist_ok=True)
        DOCS_SCREENSHOT.write_bytes(shot)

    # The browser refuses an empty reason (required); then confirm with one.
    page.fill("#id_reason", "The customer says the email never arrived; sending it again is fine.")
    page.click("input[value='Yes, force the replay']")

    replay = AgentRun.objects.get(replay_of=failed)
    page.wait_for_url(f"**/admin/runs/agentrun/{replay.run_id}/change/")
    assert f"Force-replayed as run {str(replay.run_id)[:8]}" in page.locator(".messagelist").inner_text()
    assert replay.forced and replay.forced_by == support_lead
    assert replay.force_reason.startswith("The customer says")
    assert replay.session_id != failed.session_id
    assert enqueued == [replay.run_id]

    # The worker's part, done here; the page then shows the new run's outcome and its chain.
    executor.execute(replay.run_id)
    replay.refresh_from_db()
    page.reload()
    chain = page.locator(".run-chain").inner_text()
    assert str(failed.run_id)[:8] in chain and "forced by lee" in chain
    assert page.locator(".field-status .readonly").inner_text().strip() == replay.status
    page.locator("#timeline-fold > summary").click()
    assert "called send_email" in page.locator(".run-timeline").inner_text()


def test_the_desk_overview_and_a_live_run_page(no_worker, live_server, support_lead, monkeypatch, tmp_path):
    """The desk counts what needs a person; a running run's page follows it, then stops polling."""
    # A ledger with something in each tile and a day of history for the chart.
    now = timezone.now()
    for hours, status, tools in [(1, RunStatus.SUCCESS, ["send_email"]), (2, RunStatus.SUCCESS, []),
                                 (3, RunStatus.ERROR, ["send_email"]), (5, RunStatus.SUCCESS, []),
                                 (8, RunStatus.CANCELLED, []), (26, RunStatus.SUCCESS, []),
                                 (50, RunStatus.ERROR, None), (75, RunStatus.SUCCESS, [])]:
        make_run(status=status, tools=tools, created_at=now - timedelta(hours=hours))
    run_in_state("error_unknown")
    make_run(tools=None, error_code="reconciled", finished_at=now - timedelta(hours=1))

    # lee's own slow run: its script places a hang, which needs runs.place_tool_faults.
    from django.contrib.auth.models import Permission

    support_lead.user_permissions.add(Permission.objects.get(codename="place_tool_faults"))
    support_lead = type(support_lead).objects.get(pk=support_lead.pk)
    run = services.start_run(
        agent_name="support", message="Look up Jane, slowly.", owner_id=support_lead.get_username(),
        created_by=support_lead,
        params=script_params(dict(LOOKUP, hang=3), SEND_EMAIL, SAY_DONE), enqueue=False,
    )

    def work() -> None:
        try:
            executor.execute(run.run_id)
        finally:
            connection.close()

    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    worker = threading.Thread(target=work)
    with chromium_page() as page:
        try:
            log_in(page, live_server, "/admin/")
            page.click("#desk-overview-link a")
            page.wait_for_url("**/admin/desk/")
            assert page.locator("#awaiting-tools-called .count").inner_text() == "1"
            assert page.locator("#awaiting-tools-unknown .count").inner_text() == "3"
            assert page.locator("#reconciled-24h .count").inner_text() == "1"
            assert page.locator("#in-flight .count").inner_text() == "1"
            assert page.locator("svg.desk-chart").count() == 2
            save_docs_screenshot(page.screenshot(full_page=True), "desk-overview.png")
            page.click("#awaiting-tools-called")
            page.wait_for_url("**/admin/runs/agentrun/?desk=tools_called")
            page.wait_for_selector("#result_list tbody tr")
            assert page.locator("#result_list tbody tr").count() == 1

            worker.start()
            deadline = time.monotonic() + 30
            while not run.tool_calls.filter(tool_name="lookup_customer").exists():
                assert time.monotonic() < deadline, "the hanging tool never started"
                time.sleep(0.05)
            fragments: list[str] = []
            page.on("request", lambda request: fragments.append(request.url) if "/live/" in request.url else None)
            page.goto(f"{live_server.url}/admin/runs/agentrun/{run.run_id}/change/")
            panel = page.locator("#run-live")
            assert panel.get_attribute("data-in-flight") == "true"
            assert panel.get_attribute("data-polling") == "on"
            assert "lookup_customer" in panel.locator(".live-calls").inner_text()
            assert page.locator("#live-status").inner_text() == "running"
            # Updated in place while the tool hangs: the heartbeat's age is refreshed, no reload;
            # the raw timeline, opened by the reader, stays open across the updates.
            page.locator("#live-timeline-fold > summary").click()
            # Locator assertions, not wait_for_function: the admin's CSP forbids evaluating strings.
            expect(panel).to_have_attribute("data-updates", re.compile(r"^[1-9][0-9]*$"))
            assert "last heartbeat" in page.locator("#live-heartbeat").inner_text()
            save_docs_screenshot(page.screenshot(), "live-run-page.png")

            # The run goes on by itself; the panel follows it to the end, then stops asking.
            expect(panel).to_have_attribute("data-polling", "stopped", timeout=30_000)
            assert page.locator("#live-status").inner_text() == "success"
            calls = page.locator(".live-calls").inner_text()
            assert "send_email" in calls and "answered" in calls
            assert "The run has settled (success)" in page.locator(".live-settled").inner_text()
            assert "called send_email" in page.locator("#run-live .run-timeline").inner_text()
            asked = len(fragments)
            assert asked >= 2
            page.wait_for_timeout(3500)
            assert len(fragments) == asked, "the page kept polling after the run settled"
        finally:
            if worker.is_alive() or worker.ident is not None:
                worker.join(timeout=60)
            connections.close_all()
    run.refresh_from_db()
    assert run.status == RunStatus.SUCCESS
