"""The run page a support person opens, in a real headless Chromium at 1366×900: the outcome and what
needs them first, nothing raw before it; no table cell breaks a word at 1366 or 1920 px.

Debian's `chromium` and Playwright, as in tests/processes/test_browser.py; skipped where the browser is absent.
Set DOCS_SCREENSHOTS=1 to refresh docs/screenshots/ from this run.
"""

from __future__ import annotations

import os
from contextlib import contextmanager
from pathlib import Path

import pytest
from django.conf import settings
from django.db import connections

from runs.models.ledger import AgentRun, ToolCall
from tests.factories import make_run, with_journal
from tests.processes.test_browser import CHROMIUM, CHROMIUM_ARGS
from tests.services.test_approvals import waiting_refund

SCREENSHOTS = Path(settings.BASE_DIR) / "docs" / "screenshots"
FOLD = 900
PLUMBING = ("adk_request_confirmation", "FunctionResponse", "ToolConfirmation", "originalFunctionCall")

pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"Chromium is not installed at {CHROMIUM}"),
]

# Every word of every table cell (outside JSON shown as code) on one line: a word split over two
# lines is returned with its cell's column.
BROKEN_WORDS = """() => {
  const broken = [];
  for (const cell of document.querySelectorAll('table td, table th')) {
    if (!cell.offsetParent) continue;
    const walker = document.createTreeWalker(cell, NodeFilter.SHOW_TEXT);
    for (let node = walker.nextNode(); node; node = walker.nextNode()) {
      if (node.parentElement.closest('pre, code, .help')) continue;
      for (const match of node.textContent.matchAll(/\\S+/g)) {
        if (match[0].length > 40) continue;
        const range = document.createRange();
        range.setStart(node, match.index);
        range.setEnd(node, match.index + match[0].length);
        const tops = new Set([...range.getClientRects()].filter(r => r.width > 0).map(r => Math.round(r.top)));
        if (tops.size > 1) broken.push(`${cell.className || cell.tagName}: ${match[0]}`);
      }
    }
  }
  return broken;
}"""


def save_screenshot(page, name: str) -> None:
    if os.environ.get("DOCS_SCREENSHOTS") == "1":
        SCREENSHOTS.mkdir(parents=True, exist_ok=True)
        page.screenshot(path=str(SCREENSHOTS / name))


@contextmanager
def admin_page(live_server, monkeypatch, width: int = 1366):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs a loop in this thread; the test's ORM calls stay blocking calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_context(viewport={"width": width, "height": FOLD}).new_page()
                page.set_default_timeout(20_000)
                page.goto(f"{live_server.url}/admin/login/?next=/admin/")
                page.fill("#id_username", "admin")
                page.fill("#id_password", "password")
                page.click("input[type=submit]")
                page.wait_for_url("**/admin/")
                yield page
            finally:
                browser.close()
    finally:
        connections.close_all()


def top(page, selector: str) -> float:
    return page.locator(selector).first.bounding_box()["y"]


def run_with_a_call_in_doubt() -> AgentRun:
    run = with_journal(
        make_run(status="error", tools=["lookup_customer", "send_email"], error_code="reconciled",
                 error_message="The worker stopped sending heartbeats; what it did last is unknown."),
        [("lookup_customer", "read_only", "answered"), ("send_email", "idempotent", "called")],
    )
    ToolCall.objects.filter(run=run, tool_name="send_email").update(
        agent_name="support", args={"to": "jane@example.com", "subject": "Your refund"})
    return run


def test_a_waiting_run_opens_with_its_decision(live_server, admin_user, alice, monkeypatch):
    run, pending = waiting_refund(alice)
    with admin_page(live_server, monkeypatch) as page:
        page.goto(f"{live_server.url}/admin/runs/agentrun/{run.run_id}/change/")
        decide = page.locator(f'[id="waiting-{pending.call_id}"] input[value="Decide"]').bounding_box()
        assert decide["y"] + decide["height"] < FOLD, decide
        form = page.locator(f'[id="waiting-{pending.call_id}"]').inner_text()
        assert "issue_refund" in form and "by agent support" in form and "A-1001" in form
        order = [top(page, selector) for selector in
                 ("#run-outcome", "#what-needs-you", "#replay-decision", "#run-live", "#tool_calls-group")]
        assert order == sorted(order), order
        assert "waiting" in page.locator("#run-outcome .ledger-badge").inner_text()
        journal = page.locator("#tool_calls-group").inner_text()
        assert "waiting for approval" in journal and "answered" not in journal
        shown = page.locator("body").inner_text()
        assert all(word not in shown for word in PLUMBING), [word for word in PLUMBING if word in shown]
        assert "holds no worker" in page.locator("#run-live").inner_text()
        # What the rules refuse is offered greyed, with the rules' reason.
        replay = page.locator("#replay-button")
        assert replay.is_disabled() and "waiting for a decision" in replay.get_attribute("title")
        save_screenshot(page, "run-page-waiting.png")


def test_a_run_with_a_call_in_doubt_opens_with_the_settle_form(live_server, admin_user, monkeypatch):
    run = run_with_a_call_in_doubt()
    with admin_page(live_server, monkeypatch) as page:
        page.goto(f"{live_server.url}/admin/runs/agentrun/{run.run_id}/change/")
        settle = page.locator("#doubt-call-2 input[value='Settle this call']").bounding_box()
        assert settle["y"] + settle["height"] < FOLD, settle
        doubt = page.locator("#doubt-call-2").inner_text()
        assert "send_email" in doubt and "by agent support" in doubt and "jane@example.com" in doubt
        order = [top(page, selector) for selector in
                 ("#run-outcome", "#what-needs-you", "#replay-decision", "#tool_calls-group", "#timeline-fold")]
        assert order == sorted(order), order
        assert page.locator("#needs-summary a").get_attribute("href") == "#what-needs-you"
        assert "in doubt" in page.locator("#tool_calls-group").inner_text()
        save_screenshot(page, "run-page-in-doubt.png")


def test_a_successful_run_opens_with_its_outcome(live_server, admin_user, monkeypatch):
    run = make_run(status="success", tools=[], result="I told Jane her refund left on Monday.")
    with admin_page(live_server, monkeypatch) as page:
        page.goto(f"{live_server.url}/admin/runs/agentrun/{run.run_id}/change/")
        outcome = page.locator("#outcome-words")
        assert outcome.inner_text() == "I told Jane her refund left on Monday."
        assert outcome.bounding_box()["y"] < FOLD / 2
        assert top(page, "#run-outcome") < top(page, "#replay-decision")
        assert page.locator("#what-needs-you").count() == 0
        assert page.locator("#timeline-fold").evaluate("element => !element.open")
        save_screenshot(page, "run-page-success.png")


@pytest.mark.parametrize("width", [1366, 1920])
def test_no_table_cell_breaks_a_word(live_server, admin_user, alice, monkeypatch, width):
    in_doubt = run_with_a_call_in_doubt()
    waiting, _ = waiting_refund(alice)
    make_run(status="error", tools=None, error_code="model_error", error_message="The model service failed.")
    make_run(status="success", tools=["lookup_customer", "send_email", "update_crm"], trigger="workflow")
    replay = make_run(status="success", tools=[])
    AgentRun.objects.filter(pk=replay.pk).update(resume_of=in_doubt)
    with admin_page(live_server, monkeypatch, width=width) as page:
        for path in ("/admin/runs/agentrun/", "/admin/desk/", f"/admin/runs/agentrun/{in_doubt.run_id}/change/",
                     f"/admin/runs/agentrun/{waiting.run_id}/change/"):
            page.goto(f"{live_server.url}{path}")
            assert page.evaluate(BROKEN_WORDS) == [], path
            if width == 1366 and path == "/admin/runs/agentrun/":
                save_screenshot(page, "run-list.png")
            if width == 1366 and path == "/admin/desk/":
                save_screenshot(page, "desk.png")
