"""Long-term memory: scoped per (agent, owner), fed by successful runs, searchable and forgettable."""

from __future__ import annotations

import base64
import dataclasses
import io
import uuid
from datetime import timedelta

import pytest
from django.core.exceptions import ImproperlyConfigured
from django.core.management import CommandError, call_command
from django.db import connection
from django.urls import reverse
from django.utils import timezone
from google.adk.events.event import Event
from google.adk.memory.memory_entry import MemoryEntry as AdkMemoryEntry
from google.adk.sessions.session import Session
from google.genai import types
from rest_framework.authtoken.models import Token
from rest_framework.test import APIClient

from agents import registry
from agents.adk import run_coroutine
from agents.models import AdkEvent
from memory import services, tasks
from memory.adk import LedgerMemoryService, memory_service, to_adk
from memory.models import MemoryEntry, ScopeRequired
from runs.ledger import lifecycle
from runs.models.ledger import AgentRun, RunStatus
from tests.helpers import LOOKUP, SAY_DONE, SEND_EMAIL, postgres_only, read_settings, run_now, run_python, script_params

# Runs execute on the agent loop: its ORM thread and ADK's engine read what the test committed.
pytestmark = pytest.mark.django_db(transaction=True)

URL = "/api/memory/"


# --- Fixtures and helpers ----------------------------------------------------------------------------


@pytest.fixture
def billing(monkeypatch):
    """A second registered agent, so that scopes can differ by agent only."""
    spec = dataclasses.replace(registry.get_agent_spec("support"), name="billing", description="Answers billing questions.")
    monkeypatch.setitem(registry.AGENTS, "billing", spec)
    return spec


def remember(agent: str, owner_id: str, *texts: str, author: str = "user", age_days: float = 0) -> list[str]:
    """Store memories directly through the ingestion service; returns their ids."""
    base = timezone.now() - timedelta(days=age_days)
    items = [
        services.Remembered(
            event_id=f"ev-{uuid.uuid4()}",
            author=author,
            text=text,
            timestamp=base - timedelta(seconds=len(texts) - i),
        )
        for i, text in enumerate(texts)
    ]
    services.ingest(agent=agent, owner_id=owner_id, items=items)
    return [item.event_id for item in items]


def search(agent: str, owner_id: str, query: str) -> list[str]:
    response = run_coroutine(memory_service().search_memory(app_name=agent, user_id=owner_id, query=query))
    return [memory.content.parts[0].text for memory in response.memories]


def texts_of(agent: str, owner_id: str) -> list[str]:
    return list(
        MemoryEntry.objects.filter(agent_name=agent, owner_id=owner_id).order_by("timestamp", "id").values_list("text", flat=True)
    )


@pytest.fixture
def three_scopes(billing):
    remember("support", "alice", "Alice's parcel goes to the Lyon office.")
    remember("support", "bob", "Bob's parcel goes to the Lyon warehouse.")
    remember("billing", "alice", "Alice pays the Lyon parcel invoice by card.")


def api_client_for(user) -> APIClient:
    client = APIClient()
    token = Token.objects.create(user=user)
    client.credentials(HTTP_AUTHORIZATION=f"Token {token.key}")
    return client


def started_by(user, owner_id: str, agent: str = "support") -> AgentRun:
    from runs.services.run import start_run

    return start_run(agent_name=agent, message="Hello.", owner_id=owner_id, created_by=user, enqueue=False)


# --- Isolation ------------------------------------------------------------------------------------------


def test_the_memory_service_never_crosses_owners_or_agents(three_scopes):
    assert search("support", "alice", "Lyon parcel") == ["Alice's parcel goes to the Lyon office."]
    assert search("support", "bob", "Lyon parcel") == ["Bob's parcel goes to the Lyon warehouse."]
    assert search("billing", "alice", "Lyon parcel") == ["Alice pays the Lyon parcel invoice by card."]
    assert search("billing", "bob", "Lyon parcel") == []
    assert search("support", "carol", "Lyon parcel") == []


def test_the_agent_loops_search_answers_as_the_orm_search_does(three_scopes):
    # On PostgreSQL the ADK service sends SQL compiled once on the loop's own connection; on
    # SQLite it is the ORM search. Either way: the same entries, in the same order, as ADK's.
    remember("support", "alice", "The Lyon office parcel was late twice.", "Lyon parcel parcel again.")
    for query in ("Lyon parcel", "office", "the and of", "parcel late", "nothing like it"):
        expected = services.search_memories(agent="support", owner_id="alice", query=query)
        response = run_coroutine(memory_service().search_memory(app_name="support", user_id="alice", query=query))
        assert [memory.id for memory in response.memories] == [entry.event_id for entry in expected], query
        for memory, entry in zip(response.memories, expected, strict=True):
            assert memory.model_dump() == to_adk(entry).model_dump()
    with pytest.raises(ScopeRequired):
        run_coroutine(memory_service().search_memory(app_name="support", user_id="", query="Lyon"))


def test_a_search_without_a_scope_is_an_error_not_a_leak(three_scopes):
    with pytest.raises(ScopeRequired):
        MemoryEntry.objects.search("Lyon", limit=10)
    with pytest.raises(ScopeRequired):
        MemoryEntry.objects.filter(owner_id="alice").search("Lyon", limit=10)
    with pytest.raises(ScopeRequired):
        MemoryEntry.objects.for_scope(agent="support", owner_id="")
    # The scope survives further filtering, so narrowing a scoped queryset still searches.
    scoped = MemoryEntry.objects.for_scope(agent="support", owner_id="alice").filter(author="user")
    assert [entry.owner_id for entry in scoped.search("Lyon", limit=10)] == ["alice"]


def test_the_api_returns_one_scope_only(alice, three_scopes):
    started_by(alice, "alice")
    response = api_client_for(alice).get(URL, {"agent": "support", "owner_id": "alice", "q": "Lyon parcel"})
    assert response.status_code == 200, response.content
    body = response.json()
    assert body["agent"] == "support" and body["owner_id"] == "alice"
    assert [result["text"] for result in body["results"]] == ["Alice's parcel goes to the Lyon office."]
    assert set(body["results"][0]) == {"id", "author", "text", "session_id", "run_id", "timestamp", "added_at"}


def test_a_scope_the_caller_cannot_see_answers_404(bob, billing, three_scopes):
    client = api_client_for(bob)
    # Alice's memories, under either agent: bob may not act for alice.
    for params in ({"agent": "support", "owner_id": "alice"}, {"agent": "billing", "owner_id": "alice"}):
        response = client.get(URL, {**params, "q": "Lyon"})
        assert response.status_code == 404
        assert response.json()["code"] == "not_found"
        assert "Lyon" not in response.content.decode()
    # His own memories need no run of his: the owner is his username.
    response = client.get(URL, {"agent": "support", "owner_id": "bob", "q": "Lyon"})
    assert response.status_code == 200
    assert [result["text"] for result in response.json()["results"]] == ["Bob's parcel goes to the Lyon warehouse."]


def test_reading_any_scope_needs_the_owner_rule_not_the_runs_visibility(support_agent, alice, admin_user, three_scopes):
    # Seeing every run is not acting for every owner.
    response = api_client_for(support_agent).get(URL, {"agent": "support", "owner_id": "bob", "q": "Lyon"})
    assert response.status_code == 404
    # A service account (runs.act_for_any_owner) and a superuser read any owner's memories.
    for user in (alice, admin_user):
        response = api_client_for(user).get(URL, {"agent": "support", "owner_id": "bob", "q": "Lyon"})
        assert response.status_code == 200
        assert [result["text"] for result in response.json()["results"]] == ["Bob's parcel goes to the Lyon warehouse."]


def test_the_api_accepts_a_session_login_and_refuses_anonymous_callers(client, alice, three_scopes):
    started_by(alice, "alice")
    params = {"agent": "support", "owner_id": "alice", "q": "Lyon"}
    assert client.get(URL, params).status_code in (401, 403)
    client.force_login(alice)
    assert client.get(URL, params).status_code == 200


@pytest.mark.parametrize(
    ("params", "code", "words"),
    [
        ({"owner_id": "alice", "q": "Lyon"}, "missing_scope", "agent is required"),
        ({"agent": "support", "q": "Lyon"}, "missing_scope", "owner_id is required"),
        ({"q": "Lyon"}, "missing_scope", "agent and owner_id are required"),
        ({"agent": " ", "owner_id": "alice", "q": "Lyon"}, "missing_scope", "agent is required"),
        ({"agent": "nobody", "owner_id": "alice", "q": "Lyon"}, "unknown_agent", "no agent named 'nobody'"),
        ({"agent": "support", "owner_id": "alice"}, "empty_query", "q is required"),
        ({"agent": "support", "owner_id": "alice", "q": "   "}, "empty_query", "q is required"),
        ({"agent": "support", "owner_id": "alice", "q": "the and of"}, "empty_query", "no searchable words"),
        ({"agent": "support", "owner_id": "alice", "q": "x" * 2001}, "empty_query", "limit is 2000"),
        ({"agent": "support", "owner_id": "alice", "q": "\x13\x0fé,"}, "empty_query", "control or invisible"),
        ({"agent": "support", "owner_id": "alice", "q": "refund\u200b"}, "empty_query", "control or invisible"),
        ({"agent": "support", "owner_id": "alice", "q": "Lyon", "limit": "ten"}, "invalid_limit", "not a whole number"),
        ({"agent": "support", "owner_id": "alice", "q": "Lyon", "limit": "0"}, "invalid_limit", "between 1 and 100"),
        ({"agent": "support", "owner_id": "alice", "q": "Lyon", "limit": ""}, "invalid_limit", "limit is empty"),
        ({"agent": "support", "owner_id": "a" * 129, "q": "Lyon"}, "missing_scope", "longer than 128"),
    ],
)
def test_bad_input_is_refused_with_a_code_and_a_message(alice, params, code, words):
    started_by(alice, "alice")
    response = api_client_for(alice).get(URL, params)
    assert response.status_code == 400
    body = response.json()
    assert body["code"] == code
    assert words in body["detail"]


def test_the_admin_filters_memories_by_agent_and_owner(admin_client, three_scopes):
    changelist = reverse("admin:memory_memoryentry_changelist")
    page = admin_client.get(changelist, {"agent_name": "support", "owner_id": "alice"})
    assert page.status_code == 200
    body = page.content.decode()
    assert "Alice&#x27;s parcel goes to the Lyon office." in body
    assert "Bob" not in body
    assert "invoice" not in body

    everything = admin_client.get(changelist).content.decode()
    assert "Bob&#x27;s parcel" in everything and "invoice" in everything


def test_the_admin_searches_through_the_full_text_index(admin_client, three_scopes):
    changelist = reverse("admin:memory_memoryentry_changelist")
    # "invoices" finds "invoice" by stemming, which a LIKE search would not.
    body = admin_client.get(changelist, {"q": "invoices"}).content.decode()
    assert "Alice pays the Lyon parcel invoice by card." in body
    assert "warehouse" not in body


def test_memories_are_read_only_records_in_the_admin(admin_client, three_scopes):
    entry = MemoryEntry.objects.get(owner_id="bob")
    page = admin_client.get(reverse("admin:memory_memoryentry_change", args=[entry.pk]))
    assert page.status_code == 200
    assert 'name="_save"' not in page.content.decode()
    assert admin_client.get(reverse("admin:memory_memoryentry_add")).status_code == 403
    assert admin_client.post(reverse("admin:memory_memoryentry_delete", args=[entry.pk])).status_code == 403


def test_the_admin_forgets_the_selected_owners_after_a_confirmation(admin_client, three_scopes):
    changelist = reverse("admin:memory_memoryentry_changelist")
    selected = MemoryEntry.objects.get(agent_name="support", owner_id="alice")
    form = {"action": "forget_selected_owners", "_selected_action": [selected.pk]}

    confirmation = admin_client.post(changelist, form)
    assert confirmation.status_code == 200
    body = confirmation.content.decode()
    assert "Forget these owners?" in body
    assert "billing" in body  # every agent's memories of the owner are listed
    assert MemoryEntry.objects.filter(owner_id="alice").count() == 2

    done = admin_client.post(changelist, {**form, "post": "yes"}, follow=True)
    assert "Forgot 2 memories of 1 owner: alice." in done.content.decode()
    assert not MemoryEntry.objects.filter(owner_id="alice").exists()
    assert texts_of("support", "bob") == ["Bob's parcel goes to the Lyon warehouse."]


def test_staff_without_the_delete_permission_cannot_forget(client, support_agent, three_scopes):
    from django.contrib.auth.models import Permission

    # They may read every owner's memories, so it is the missing delete permission that stops them.
    support_agent.user_permissions.add(*Permission.objects.filter(codename__in=["view_memoryentry", "act_for_any_owner"]))
    client.force_login(support_agent)
    changelist = reverse("admin:memory_memoryentry_changelist")
    assert "forget_selected_owners" not in client.get(changelist).content.decode()
    selected = MemoryEntry.objects.get(agent_name="support", owner_id="alice")
    client.post(changelist, {"action": "forget_selected_owners", "_selected_action": [selected.pk], "post": "yes"})
    assert MemoryEntry.objects.filter(owner_id="alice").count() == 2


def test_the_admin_lists_only_the_memories_of_owners_one_may_act_for(client, support_agent, three_scopes):
    from django.contrib.auth.models import Permission

    from runs.models.owners import OwnerGrant

    support_agent.user_permissions.add(Permission.objects.get(codename="view_memoryentry"))
    client.force_login(support_agent)
    changelist = reverse("admin:memory_memoryentry_changelist")
    alices = MemoryEntry.objects.get(agent_name="support", owner_id="alice")
    # Neither alice nor bob is sam's to act for: the list is empty and an entry's page is not found.
    page = client.get(changelist).content.decode()
    assert "Lyon" not in page
    assert client.get(reverse("admin:memory_memoryentry_change", args=[alices.pk])).status_code == 302

    OwnerGrant.objects.create(user=support_agent, owner_id="alice", note="covers alice's account")
    page = client.get(changelist).content.decode()
    assert "Alice&#x27;s parcel goes to the Lyon office." in page and "Alice pays" in page
    assert "Bob&#x27;s parcel" not in page
    assert client.get(reverse("admin:memory_memoryentry_change", args=[alices.pk])).status_code == 200


# --- Feeding and recall -----------------------------------------------------------------------------------


def test_a_second_run_recalls_what_the_owner_said_in_the_first(model_requests):
    first = run_now(owner_id="alice", message="My dog is called Biscuit and he hates thunder.", params=script_params(SAY_DONE))
    assert first.status == RunStatus.SUCCESS

    model_requests.clear()
    second = run_now(owner_id="alice", message="What is my dog called?", params=script_params(SAY_DONE))
    assert second.status == RunStatus.SUCCESS
    assert "<PAST_CONVERSATIONS>" in model_requests[0]
    assert "My dog is called Biscuit" in model_requests[0]

    model_requests.clear()
    other = run_now(owner_id="bob", message="What is my dog called?", params=script_params(SAY_DONE))
    assert other.status == RunStatus.SUCCESS
    assert "Biscuit" not in model_requests[0]
    assert "<PAST_CONVERSATIONS>" not in model_requests[0]


def test_memory_is_searched_once_per_run_yet_reaches_every_model_call(model_requests, monkeypatch):
    run_now(owner_id="alice", message="My dog is called Biscuit and he hates thunder.", params=script_params(SAY_DONE))
    searches: list[str] = []
    original = LedgerMemoryService.search_memory

    async def counting(self, **kwargs):
        searches.append(kwargs["query"])
        return await original(self, **kwargs)

    monkeypatch.setattr(LedgerMemoryService, "search_memory", counting)
    model_requests.clear()
    second = run_now(owner_id="alice", message="What is my dog called?", params=script_params(LOOKUP, SEND_EMAIL, SAY_DONE))

    assert second.status == RunStatus.SUCCESS
    assert len(model_requests) == 3
    assert all("My dog is called Biscuit" in request for request in model_requests)
    assert searches == ["What is my dog called?"]


def test_only_what_was_said_is_remembered_not_tool_payloads_or_files(tmp_path):
    secret = b"\x89PNG fake image bytes that must never reach memory " * 20
    attachment = tmp_path / "photo.png"
    attachment.write_bytes(secret)
    with attachment.open("rb") as handle:
        run = run_now(
            owner_id="alice",
            message="Please answer the customer about the refund.",
            params=script_params(LOOKUP, SEND_EMAIL, SAY_DONE),
            file=handle,
            file_name="photo.png",
        )
    assert run.status == RunStatus.SUCCESS
    entries = list(MemoryEntry.objects.filter(owner_id="alice").order_by("timestamp"))
    assert [(entry.author, entry.text) for entry in entries] == [
        ("user", "Please answer the customer about the refund."),
        ("support", "Done."),
    ]
    assert {entry.run_id for entry in entries} == {run.run_id}
    assert {entry.session_id for entry in entries} == {run.session_id}
    stored = " ".join(entry.text for entry in entries)
    assert "jane@example.com" not in stored  # tool arguments and results
    assert base64.b64encode(secret)[:40].decode() not in stored


def test_base64_pasted_into_a_message_is_not_remembered():
    blob = base64.b64encode(bytes(range(256)) * 4).decode()
    run_now(owner_id="alice", message=f"Here is the file: data:image/png;base64,{blob} thanks", params=script_params(SAY_DONE))
    stored = texts_of("support", "alice")[0]
    assert stored == "Here is the file: [data omitted] thanks"


def test_a_failed_run_is_not_remembered():
    run = run_now(owner_id="alice", message="Remember my locker code 4512.", params=script_params({"fail": "error", "message": "boom"}))
    assert run.status == RunStatus.ERROR
    assert not MemoryEntry.objects.exists()
    assert lifecycle.remember_run(run_id=run.run_id) == 0


def test_a_memory_failure_never_turns_a_successful_run_into_a_failure(monkeypatch, caplog):
    def broken(**kwargs):
        # A real failed statement: on PostgreSQL it poisons the surrounding transaction, which
        # the recorded outcome must survive.
        with connection.cursor() as cursor:
            cursor.execute("SELECT * FROM memory_table_that_does_not_exist")

    monkeypatch.setattr(services, "ingest", broken)
    run = run_now(owner_id="alice", message="My dog is called Biscuit.", params=script_params(SAY_DONE))
    assert run.status == RunStatus.SUCCESS
    assert run.error_code == ""
    assert not MemoryEntry.objects.exists()
    assert "could not be added to long-term memory" in caplog.text


def test_feeding_the_same_run_twice_stores_it_once():
    run = run_now(owner_id="alice", message="My dog is called Biscuit.", params=script_params(SAY_DONE))
    assert MemoryEntry.objects.count() == 2
    assert lifecycle.remember_run(run_id=run.run_id) == 0
    assert MemoryEntry.objects.count() == 2


def test_the_worker_remembers_the_stored_events_so_feeding_again_adds_nothing():
    run = run_now(owner_id="alice", message="My dog is called Biscuit.", params=script_params(LOOKUP, SAY_DONE))
    stored_ids = set(
        AdkEvent.objects.filter(session_id=run.session_id).values_list("id", flat=True)
    )
    remembered = set(MemoryEntry.objects.filter(owner_id="alice").values_list("event_id", flat=True))
    assert remembered and remembered <= stored_ids
    assert lifecycle.remember_run(run_id=run.run_id) == 0
    assert MemoryEntry.objects.filter(owner_id="alice").count() == len(remembered)


def test_the_adk_service_ingests_idempotently_and_keeps_only_text():
    service = memory_service()
    events = [
        Event(author="user", content=types.Content(role="user", parts=[
            types.Part(text="Ship to Lyon please."),
            types.Part(inline_data=types.Blob(mime_type="image/png", data=b"\x89PNG...")),
        ])),
        Event(author="support", content=types.Content(role="model", parts=[
            types.Part(text="Let me check the address."),
            types.Part(function_call=types.FunctionCall(id="c1", name="lookup_customer", args={"email": "x@y.z"})),
        ])),
        Event(author="support", content=types.Content(role="user", parts=[
            types.Part(function_response=types.FunctionResponse(id="c1", name="lookup_customer", response={"plan": "gold"})),
        ])),
        Event(author="support", content=types.Content(role="model", parts=[
            types.Part(text="thinking about it", thought=True), types.Part(text="It ships to Lyon."),
        ])),
        Event(author="support", partial=True, content=types.Content(role="model", parts=[types.Part(text="It ships")])),
    ]
    session = Session(id="s-1", app_name="support", user_id="alice", events=events)
    run_coroutine(service.add_session_to_memory(session))
    run_coroutine(service.add_session_to_memory(session))
    run_coroutine(service.add_events_to_memory(app_name="support", user_id="alice", events=events[:2], session_id="s-1"))
    assert texts_of("support", "alice") == ["Ship to Lyon please.", "Let me check the address.", "It ships to Lyon."]

    note = AdkMemoryEntry(content=types.Content(parts=[types.Part(text="Prefers email to phone.")]), author="user")
    run_coroutine(service.add_memory(app_name="support", user_id="alice", memories=[note]))
    run_coroutine(service.add_memory(app_name="support", user_id="alice", memories=[note]))
    assert texts_of("support", "alice").count("Prefers email to phone.") == 1


def test_delete_memory_removes_one_memory_of_its_scope_only():
    [kept_id] = remember("support", "bob", "Bob lives in Lyon.")
    [gone_id, other_id] = remember("support", "alice", "Alice lives in Lyon.", "Alice likes Lyon.")
    service = memory_service()
    found = run_coroutine(service.search_memory(app_name="support", user_id="alice", query="lives Lyon"))
    assert found.memories[0].id == gone_id
    # Another scope's id does nothing here, and no id does nothing at all.
    run_coroutine(service.delete_memory(app_name="support", user_id="alice", memory_id=kept_id))
    run_coroutine(service.delete_memory(app_name="support", user_id="alice"))
    run_coroutine(service.delete_memory(app_name="support", user_id="alice", memory_id=gone_id))
    assert texts_of("support", "alice") == ["Alice likes Lyon."]
    assert texts_of("support", "bob") == ["Bob lives in Lyon."]
    assert other_id and search("support", "alice", "lives") == []


@pytest.mark.slow
def test_memory_survives_a_restart():
    run_now(owner_id="alice", message="My dog is called Biscuit.", params=script_params(SAY_DONE))
    code = """
from agents.adk import run_coroutine
from memory.adk import memory_service
found = run_coroutine(memory_service().search_memory(app_name="support", user_id="alice", query="dog Biscuit"))
print(repr([(m.author, m.content.parts[0].text) for m in found.memories]))
"""
    child = run_python(code)
    assert child.returncode == 0, child.stderr[-2000:]
    assert child.stdout.strip().splitlines()[-1] == repr([("user", "My dog is called Biscuit.")])


# --- Forgetting and retention -----------------------------------------------------------------------------


def test_forget_owner_removes_exactly_that_owners_entries(three_scopes):
    out = io.StringIO()
    call_command("forget_owner", "alice", "--agent", "support", stdout=out)
    assert out.getvalue().strip() == "Forgot 1 memory of agent 'support' for owner 'alice'."
    assert texts_of("billing", "alice") == ["Alice pays the Lyon parcel invoice by card."]

    out = io.StringIO()
    call_command("forget_owner", "alice", stdout=out)
    assert out.getvalue().strip() == "Forgot 1 memory for owner 'alice'."
    assert not MemoryEntry.objects.filter(owner_id="alice").exists()
    assert texts_of("support", "bob") == ["Bob's parcel goes to the Lyon warehouse."]
    # The full-text index forgot them too.
    assert search("support", "alice", "Lyon") == [] and search("billing", "alice", "invoice") == []

    out = io.StringIO()
    call_command("forget_owner", "alice", stdout=out)
    assert "Forgot 0 memories" in out.getvalue()


@pytest.mark.parametrize(("args", "words"), [(["alice", "--agent", "nobody"], "no agent named"), (["  "], "owner_id is required")])
def test_forget_owner_refuses_bad_input(args, words):
    with pytest.raises(CommandError, match=words):
        call_command("forget_owner", *args)


def test_retention_prunes_only_old_memories_and_only_when_configured(settings):
    remember("support", "alice", "An old memory about Lyon.", age_days=40)
    remember("support", "alice", "A fresh memory about Lyon.", age_days=1)

    settings.MEMORY_RETENTION_DAYS = None
    assert tasks.prune_memories() == 0
    assert MemoryEntry.objects.count() == 2

    settings.MEMORY_RETENTION_DAYS = 30
    settings.PURGE_BATCH_SIZE = 1
    assert tasks.prune_memories() == 1
    assert texts_of("support", "alice") == ["A fresh memory about Lyon."]
    assert search("support", "alice", "Lyon") == ["A fresh memory about Lyon."]
    assert tasks.prune_memories() == 0


def test_a_bad_retention_setting_stops_start_up():
    with pytest.raises(ImproperlyConfigured, match="MEMORY_RETENTION_DAYS=0 is too small"):
        read_settings(MEMORY_RETENTION_DAYS="0")


# --- Relevance ---------------------------------------------------------------------------------------------

CORPUS = [
    "My dog Biscuit is allergic to chicken, so I order the salmon food.",
    "The refund for order 88123 was issued on Monday.",
    "Please ship my next order to the office address in Lyon.",
    "I prefer email over phone calls.",
    "Biscuit the dog loves long walks in the park.",
    "Refunds usually arrive within five working days.",
]


@pytest.mark.parametrize(
    ("query", "expected_first"),
    [
        ("Is my dog allergic to anything?", 0),
        ("When was the refund for order 88123 issued?", 1),
        ("Where should we ship my orders?", 2),
        ("How do I like to be contacted, email or phone?", 3),
        ("walks in the park", 4),
    ],
)
def test_the_most_relevant_memory_ranks_first(query, expected_first):
    remember("support", "alice", *CORPUS)
    remember("support", "bob", *CORPUS)  # another scope with the same words changes nothing
    assert search("support", "alice", query)[0] == CORPUS[expected_first]


def test_both_databases_match_the_same_entries():
    remember("support", "alice", *CORPUS)
    # Stemming on both: "refunds" matches "refund" and "Refunds"; stop words match nothing.
    assert sorted(search("support", "alice", "refunds")) == sorted([CORPUS[1], CORPUS[5]])
    assert sorted(search("support", "alice", "dogs")) == sorted([CORPUS[0], CORPUS[4]])
    assert search("support", "alice", "the of and") == []
    assert len(search("support", "alice", "order")) == 3


def test_results_are_capped_by_the_setting(settings):
    remember("support", "alice", *[f"Lyon note number {i}" for i in range(15)])
    settings.MEMORY_SEARCH_RESULTS = 4
    assert len(search("support", "alice", "Lyon")) == 4


# --- The index is used -------------------------------------------------------------------------------------


@postgres_only
def test_postgres_answers_one_owners_search_from_the_gin_index():
    big = [f"Order {i} for customer number {i} was shipped" for i in range(3000)]
    remember("support", "heavy", *big, "The parcel to Reykjavik was delayed.")
    for owner in range(20):
        remember("support", f"owner-{owner}", *big[:50])
    with connection.cursor() as cursor:
        cursor.execute("VACUUM ANALYZE memory_entries")
    query = MemoryEntry.objects.for_scope(agent="support", owner_id="heavy")
    from memory.search import matching, ranked

    plan = ranked(query, "Reykjavik")[:10].explain()
    assert "memory_text_search" in plan, plan
    # Admin search across owners has no scope, and still reads the index.
    assert "memory_text_search" in matching(MemoryEntry.objects.all(), "Reykjavik").explain()


@pytest.mark.skipif(connection.vendor != "sqlite", reason="SQLite's FTS5 path")
def test_sqlite_answers_searches_from_the_fts5_table():
    remember("support", "alice", *CORPUS)
    from memory.search import ranked

    plan = ranked(MemoryEntry.objects.for_scope(agent="support", owner_id="alice"), "dog")[:10].explain()
    assert "memory_fts VIRTUAL TABLE INDEX" in plan, plan
