"""The desk at 1400 px in a real headless Chromium: nothing wider than the window, no hidden column.

Debian's `chromium` and Playwright, as in tests/processes/test_browser.py; skipped where the browser is absent.
"""

from __future__ import annotations

import pytest
from django.db import connections

from runs.models.ledger import AgentRun, ToolCall
from tests.factories import make_run, with_journal
from tests.processes.test_browser import CHROMIUM, CHROMIUM_ARGS

WIDTH = 1400

pytestmark = [
    pytest.mark.browser,
    # The live server's threads read what the test wrote: it must be committed.
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not __import__("pathlib").Path(CHROMIUM).exists(), reason=f"Chromium is not installed at {CHROMIUM}"),
]

OVERFLOW = """() => {
  const page = document.documentElement.scrollWidth;
  const results = document.querySelector('#changelist .results');
  const clipped = [...document.querySelectorAll('#result_list thead th')]
    .filter(th => th.scrollWidth > th.clientWidth + 1).map(th => th.innerText.trim());
  return {page, results: results ? results.scrollWidth - results.clientWidth : 0, clipped};
}"""


@pytest.fixture
def seeded_desk(admin_user):
    long_body = "Dear Jane, " + "refund-" * 400
    failed = with_journal(
        make_run(status="error", tools=["lookup_customer", "send_email", "update_crm"], error_code="tool_failed",
                 error_message="A tool failed: ScriptedToolError: the CRM timed out after 30 s"),
        [("lookup_customer", "read_only", "answered"), ("send_email", "idempotent", "answered"),
         ("update_crm", "idempotent", "failed")],
    )
    ToolCall.objects.filter(run=failed, tool_name="send_email").update(
        args={"to": "jane@example.com", "subject": "Your refund", "body": long_body},
        response_summary='{"status": "sent", "message_id": "outbox-1", "detail": "' + "x" * 600 + '"}',
    )
    replay = make_run(status="success", tools=[])
    AgentRun.objects.filter(pk=replay.pk).update(replay_of=failed)
    resumed = make_run(status="success", tools=[])
    AgentRun.objects.filter(pk=resumed.pk).update(resume_of=failed)
    for _ in range(5):
        make_run(status="error", tools=None, error_code="reconciled")
    return failed


def test_the_admin_index_the_desk_the_run_list_and_a_run_page_fit_1400_px(live_server, seeded_desk, monkeypatch):
    from playwright.sync_api import sync_playwright

    # Playwright's sync API runs a loop in this thread; the test's ORM calls stay blocking calls.
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    try:
        with sync_playwright() as playwright:
            browser = playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_ARGS)
            try:
                page = browser.new_context(viewport={"width": WIDTH, "height": 900}).new_page()
                page.set_default_timeout(20_000)
                page.goto(f"{live_server.url}/admin/login/?next=/admin/")
                page.fill("#id_username", "admin")
                page.fill("#id_password", "password")
                page.click("input[type=submit]")
                page.wait_for_url("**/admin/")

                link = page.get_by_role("link", name="Desk overview").bounding_box()
                assert link["width"] > 3 * link["height"], f"the Desk overview link is drawn {link}"
                for path in ("/admin/", "/admin/desk/", "/admin/runs/agentrun/",
                             f"/admin/runs/agentrun/{seeded_desk.run_id}/change/"):
                    page.goto(f"{live_server.url}{path}")
                    measured = page.evaluate(OVERFLOW)
                    assert measured["page"] <= WIDTH, f"{path} is {measured['page']} px wide"
                    assert measured["results"] <= 0, f"{path}: {measured['results']} px of columns hidden"
                    assert measured["clipped"] == [], f"{path}: headers cut: {measured['clipped']}"

                page.goto(f"{live_server.url}/admin/runs/agentrun/")
                headers = page.locator("#result_list thead th").all_inner_texts()
                for header in ("CREATED", "ERROR", "REPLAYS / RESUMES"):
                    assert any(header in text.upper() for text in headers), headers
                row = page.locator("#result_list tbody tr",
                                   has=page.locator(".field-short_id", has_text=str(seeded_desk.run_id)[:8]))
                assert "tool_failed" in row.inner_text()
            finally:
                browser.close()
    finally:
        connections.close_all()
