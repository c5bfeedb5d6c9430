"""A person approves a waiting call from the run page, in a real headless Chromium against a live server.

Debian's `chromium` and Playwright, as in tests/processes/test_browser.py; skipped where the browser is absent.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
from django.db import connection, connections

from agents.models import Refund
from runs.execution import executor
from runs.models.approvals import Decision
from runs.models.ledger import AgentRun, RunStatus
from tests.processes.test_browser import CHROMIUM, chromium_page
from tests.services.test_approvals import BIG_REFUND, approver, waiting_refund  # noqa: F401 - fixture

pytestmark = [
    pytest.mark.slow,
    pytest.mark.browser,
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not Path(CHROMIUM).exists(), reason=f"Chromium is not installed at {CHROMIUM}"),
]


def test_an_approver_approves_a_waiting_refund_from_the_run_page(announced, live_server, alice, approver, monkeypatch):  # noqa: F811
    # No worker runs beside the live server: the test executes the approved run itself.
    run, pending = waiting_refund(alice)
    page_url = f"/admin/runs/agentrun/{run.run_id}/change/"

    def work() -> None:
        try:
            executor.execute(run.run_id)
        finally:
            connection.close()

    # Playwright's sync API runs an event loop in this thread (see tests/processes/test_browser.py).
    monkeypatch.setenv("DJANGO_ALLOW_ASYNC_UNSAFE", "true")
    with chromium_page() as page:
        try:
            page.goto(f"{live_server.url}/admin/login/?next={page_url}")
            page.fill("#id_username", "ada")
            page.fill("#id_password", "ada-pass-123")
            page.click("input[type=submit]")
            page.wait_for_url(f"**{page_url}")

            waiting = page.locator(f'[id="waiting-{pending.call_id}"]')
            assert page.locator("#what-needs-you h2").inner_text() == "What needs you"
            # At 1366×900 the status, the outcome and the Decide form come first, before anything raw.
            page.set_viewport_size({"width": 1366, "height": 900})
            assert page.locator("#run-outcome").bounding_box()["y"] < page.locator("#what-needs-you").bounding_box()["y"]
            decide = waiting.locator('input[type="submit"][value="Decide"]').bounding_box()
            assert decide["y"] + decide["height"] < 900, decide
            order = [page.locator(selector).bounding_box()["y"] for selector in
                     ("#run-outcome", "#what-needs-you", "#replay-decision", ".run-live")]
            assert order == sorted(order), order
            page.locator("#needs-summary a").click()
            assert page.url.endswith("#what-needs-you")
            shown = page.locator("body").inner_text()
            for word in ("adk_request_confirmation", "FunctionResponse", "ToolConfirmation", "originalFunctionCall"):
                assert word not in shown, word
            text = waiting.inner_text()
            assert "issue_refund" in text and "waits for a person's approval" in text
            assert "A-1001" in text and "25000" in text  # the arguments, as asked
            assert page.locator(".field-status .readonly").inner_text().strip() == "waiting"

            waiting.locator('input[name="decision"][value="approve"]').check()
            waiting.locator('textarea[name="note"]').fill("Order A-1001 checked with the bank.")
            waiting.locator('input[type="submit"][value="Decide"]').click()
            page.wait_for_selector("ul.messagelist li")
            assert "approved. The run goes on." in page.locator("ul.messagelist").inner_text()
            assert announced == [run.run_id]
            assert AgentRun.objects.get(pk=run.pk).status == RunStatus.QUEUED

            worker = threading.Thread(target=work)
            worker.start()
            worker.join(timeout=120)
            assert not worker.is_alive(), "the approved run did not finish"
            page.goto(f"{live_server.url}{page_url}")
            assert page.locator(".field-status .readonly").inner_text().strip() == "success"
            assert page.locator("#decisions-taken").inner_text() == "Decisions taken"
            outcome = page.locator("#outcome-words")
            assert "Refunded order A-1001." in outcome.inner_text() and outcome.bounding_box()["y"] < 900
            # The raw timeline comes last, folded.
            assert page.locator("#timeline-fold").evaluate("element => !element.open")
            assert page.locator("#timeline-fold").bounding_box()["y"] > page.locator("#replay-decision").bounding_box()["y"]
            answered = page.locator(f'[id="answered-{pending.call_id}"]').inner_text()
            assert "issue_refund" in answered and "ada" in answered and "Order A-1001 checked" in answered
            assert page.locator(f'[id="waiting-{pending.call_id}"]').count() == 0
        finally:
            connections.close_all()
    pending.refresh_from_db()
    assert (pending.decision, pending.decided_by, pending.delivered_attempt) == (Decision.APPROVE, approver, 2)
    (refund,) = Refund.objects.all()
    assert (refund.order_id, refund.amount_cents, refund.call_id) == ("A-1001", BIG_REFUND["args"]["amount_cents"],
                                                                      pending.call_id)
