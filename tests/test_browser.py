"""End to end, as a support lead would: a real headless Chromium against a live server.

Debian's `chromium` package provides the browser (.ci/run installs it); Playwright for Python
drives it. The test skips itself only where that browser is absent.

Set DOCS_SCREENSHOTS=1 to refresh docs/force-replay-confirmation.png from this run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections

from runs import executor, lifecycle
from runs.models import AgentRun, RunStatus
from tests.helpers import SEND_EMAIL, UPDATE_CRM, run_now, script_params

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

pytestmark = [
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"Chromium is not installed at {CHROMIUM}"),
]


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


def test_a_support_lead_force_replays_a_failed_run(live_server, support_lead, monkeypatch, tmp_path):
    enqueued: list = []
    # No worker runs beside the live server: the test executes the replay itself.
    monkeypatch.setattr(lifecycle, "enqueue_run", enqueued.append)
    failed = run_now(params=script_params(SEND_EMAIL, UPDATE_CRM, {"fail": "error", "message": "CRM timed out"}))
    assert failed.status == RunStatus.ERROR
    assert failed.tools_executed == ["send_email", "update_crm"]

    # Playwright's sync API keeps an event loop running in this thread; the test's own ORM calls
    # below are still ordinary blocking calls, not calls from async code. While that loop runs,
    # Django keys this thread's connection by context, so it gets (and must close) its own.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with chromium_page() as page:
        try:
            drive_the_desk(page, live_server, support_lead, failed, enqueued, tmp_path)
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
    if os.environ.get("DOCS_SCREENSHOTS") == "1":
        page.screenshot(path=str(DOCS_SCREENSHOT.with_name("run-page.png")), full_page=True)
    chain = page.locator(".run-chain").inner_text()
    assert str(failed.run_id)[:8] in chain and "forced by lee" in chain
    assert page.locator(".field-status .readonly").inner_text().strip() == replay.status
    assert "called send_email" in page.locator(".run-timeline").inner_text()
