"""Nothing waits forever: each kind of a cluster's processes SIGKILLed with runs queued and in flight.

Real `manage.py qcluster` processes on PostgreSQL. After the kill nobody helps: the cluster itself
notices the death (`runs.deaths`), releases the locks of its queues the dead process held
(`runs.queue_locks`), sweeps every second on these settings (`runs.sweeper`: stale runs, runs whose
task was lost) and continues the runs that died (`runs.recovery`). Every run must then end
`success`, or wait for a person with a call in doubt; none stays `queued`; no effect happens twice;
and the cluster goes on delivering results.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from django.db import connection
from django_q.models import OrmQ

from agents.models import CrmNote, OutboxEmail
from runs import services
from runs.models import AgentRun, Recovery, RunStatus
from tests.helpers import (
    UPDATE_CRM,
    alive,
    chain_end,
    chain_ids,
    cluster_pids,
    postgres_only,
    run_python,
    script_params,
    start_cluster,
    stop_cluster,
    wait_for_cluster,
    wait_until,
)

pytestmark = [pytest.mark.slow, postgres_only, pytest.mark.django_db(transaction=True)]

# Small windows, so that staleness, a lost task and a recovery's backoff each take seconds; two
# runs per worker, so that most of the burst is still queued when the kill comes.
FAST = {
    "RUN_STALE_AFTER_SECONDS": "4",
    "RUN_REQUEUE_AFTER_SECONDS": "5",
    "RUN_CONCURRENCY": "2",
    "RUN_SLOT_WAIT_SECONDS": "1",
    "RUN_RECOVERY_BACKOFF_SECONDS": "1",
}
BURST = 10
SETTLE_SECONDS = 150


def _burst(count: int = BURST) -> list[AgentRun]:
    return [
        services.start_run(
            agent_name="support", message=f"Email customer {i}.", owner_id=f"c{i}",
            params=script_params(
                {"call": "send_email", "args": {"to": f"c{i}@example.com", "subject": "Hi", "body": "Hello."}},
                dict(UPDATE_CRM, latency=1),
                {"say": "Done.", "latency": 0.5},
            ),
        )
        for i in range(count)
    ]


def _one_sent_and_some_queued(runs: list[AgentRun]) -> AgentRun | None:
    """A run in flight that sent its email, while other runs of the burst are still queued."""
    ids = [run.pk for run in runs]
    if not AgentRun.objects.filter(pk__in=ids, status=RunStatus.QUEUED).exists():
        return None
    return AgentRun.objects.filter(
        pk__in=ids, status=RunStatus.RUNNING, tool_calls__tool_name="send_email", tool_calls__status="answered"
    ).exclude(worker="").first()


def _done(end: AgentRun) -> bool:
    return end.status == RunStatus.SUCCESS or (
        end.status in (RunStatus.ERROR, RunStatus.CANCELLED) and end.recovery in (Recovery.NEEDS_PERSON, Recovery.EXHAUSTED)
    )


def _states(runs: list[AgentRun]) -> list[tuple]:
    return [(e.status, e.error_code, e.recovery, e.attempts) for e in map(chain_end, runs)]


def _last_task() -> int:
    return OrmQ.objects.order_by("-id").values_list("id", flat=True).first() or 0


def assert_nothing_waits_forever(runs: list[AgentRun], *, last_task_before_kill: int) -> None:
    try:
        wait_until(lambda: all(_done(chain_end(run)) for run in runs), timeout=SETTLE_SECONDS,
                   what="every run to finish or wait for a person", step=0.5)
    except AssertionError as timed_out:
        raise AssertionError(f"{timed_out}: (status, code, recovery, attempts) = {_states(runs)}") from None
    for run in runs:
        end, ids = chain_end(run), chain_ids(run)
        assert not AgentRun.objects.filter(pk__in=ids, status=RunStatus.QUEUED).exists()
        emails = OutboxEmail.objects.filter(run_id__in=ids).count()
        notes = CrmNote.objects.filter(run_id__in=ids).count()
        assert emails <= 1 and notes <= 1, (run.pk, emails, notes)
        if end.status == RunStatus.SUCCESS:
            assert (emails, notes) == (1, 1), (run.pk, emails, notes)
        else:
            # Waiting for a person for a reason the desk shows: a call that may have acted.
            assert end.recovery == Recovery.NEEDS_PERSON and "doubt" in end.recovery_detail, (
                end.error_code, end.recovery, end.recovery_detail)
    # Every task enqueued after the kill (hand-backs of a full worker, runs enqueued again) was
    # delivered and its result acknowledged, which deletes it: a dead monitor, or a dead holder of
    # one of the cluster's queue locks, would leave them there for good.
    wait_until(lambda: not OrmQ.objects.filter(id__gt=last_task_before_kill).exists(), timeout=60,
               what="the tasks enqueued after the kill to be acknowledged")


@pytest.mark.parametrize("kind", ["worker", "pusher", "monitor", "cluster"])
def test_a_sigkilled_cluster_process_leaves_no_run_behind(kind, tmp_path):
    log = tmp_path / "cluster.log"
    cluster = start_cluster(log, **FAST)
    replacement = None
    try:
        pids = wait_for_cluster(log, cluster)
        runs = _burst()
        victim = wait_until(lambda: _one_sent_and_some_queued(runs), timeout=90,
                            what="a run in flight that sent its email, others queued")
        started = len(cluster_pids(log)[kind]) if kind != "cluster" else 0
        last_task = _last_task()
        if kind == "cluster":
            stop_cluster(cluster)
            replacement = start_cluster(tmp_path / "cluster-2.log", **FAST)
        else:
            pid = int(victim.worker.rsplit(":", 1)[1]) if kind == "worker" else pids[kind][-1]
            os.kill(pid, signal.SIGKILL)
            # The sentinel starts another of its kind.
            wait_until(lambda: len(cluster_pids(log)[kind]) > started, timeout=30, what=f"a new {kind}")
        assert_nothing_waits_forever(runs, last_task_before_kill=last_task)
    finally:
        stop_cluster(cluster)
        if replacement is not None:
            stop_cluster(replacement)


def test_idle_workers_killed_while_waiting_for_a_task_leave_the_cluster_starting_runs(tmp_path):
    # An idle worker waits for the next task holding the task queue's reader lock (one of them
    # does at any time). Before the lock was released on its death, the cluster never started a
    # run again: the tasks stayed in its queue and the runs `queued`.
    log = tmp_path / "cluster.log"
    cluster = start_cluster(log, **FAST)
    try:
        pids = wait_for_cluster(log, cluster)
        time.sleep(2)  # both workers are in their queue's get by now
        for pid in pids["worker"]:
            os.kill(pid, signal.SIGKILL)
        wait_until(lambda: len([p for p in cluster_pids(log)["worker"] if p not in pids["worker"]]) >= 2,
                   timeout=30, what="two new workers")
        last_task = _last_task()
        runs = _burst(4)
        assert_nothing_waits_forever(runs, last_task_before_kill=last_task)
        assert all(chain_end(run).pk == run.pk for run in runs)  # each started once, by the cluster
        assert "reader lock: released" in log.read_text()
    finally:
        stop_cluster(cluster)


# --- Database faults ----------------------------------------------------------------------------------


def _terminate_other_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def test_the_database_ends_the_clusters_connections_with_runs_in_flight(tmp_path):
    # pg_terminate_backend of every connection of the cluster (its workers' among them: the ORM's,
    # ADK's pool, the heartbeat's) while runs call their tools: a run goes on, or dies and is
    # recovered, never settled as if it failed on its own; and the same workers go on serving.
    log = tmp_path / "cluster.log"
    cluster = start_cluster(log, **FAST)
    try:
        pids = wait_for_cluster(log, cluster)
        runs = _burst()
        wait_until(lambda: _one_sent_and_some_queued(runs), timeout=90,
                   what="a run in flight that sent its email, others queued")
        last_task = _last_task()
        assert _terminate_other_connections() > 0
        assert_nothing_waits_forever(runs, last_task_before_kill=last_task)
        assert [pid for pid in pids["worker"] if not alive(pid)] == []
        later = _burst(2)
        wait_until(lambda: all(chain_end(run).status == RunStatus.SUCCESS for run in later), timeout=60,
                   what="runs started after the fault to succeed")
        assert {int(chain_end(run).worker.rsplit(":", 1)[1]) for run in later} <= set(pids["worker"])
    finally:
        stop_cluster(cluster)


PG_BIN = Path("/usr/lib/postgresql/15/bin")


class PrivatePostgres:
    """A PostgreSQL server of this test's own (initdb in a temporary directory, another port), so it
    can be restarted: the shared server is never touched. Run as the `postgres` user when the test
    runs as root (the server refuses root)."""

    def __init__(self) -> None:
        self.directory = Path(tempfile.mkdtemp(prefix="ledger-pg-"))
        self.data = self.directory / "data"
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.user = "postgres" if os.geteuid() == 0 else None
        if self.user:
            os.chown(self.directory, pwd.getpwnam(self.user).pw_uid, pwd.getpwnam(self.user).pw_gid)
        self._run(PG_BIN / "initdb", "-D", self.data, "-U", "postgres", "--auth=trust", "--no-sync", "-E", "UTF8")

    def _run(self, *command: object, check: bool = True) -> subprocess.CompletedProcess:
        argv = [str(part) for part in command]
        if self.user:
            argv = ["runuser", "-u", self.user, "--", *argv]
        return subprocess.run(argv, capture_output=True, text=True, timeout=120, check=check)

    def start(self) -> None:
        options = f"-p {self.port} -k {self.directory} -c listen_addresses=127.0.0.1 -c fsync=off"
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-o", options, "-l", self.directory / "server.log", "-w", "start")

    def restart(self) -> None:
        # `fast`: every session is ended (57P01), as a restart of the service does.
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-m", "fast", "-w", "stop")
        self.start()

    def stop(self) -> None:
        self._run(PG_BIN / "pg_ctl", "-D", self.data, "-m", "immediate", "-w", "stop", check=False)
        shutil.rmtree(self.directory, ignore_errors=True)

    def url(self, database: str) -> str:
        return f"postgres://postgres@127.0.0.1:{self.port}/{database}"


def _sql(url: str, query: str, *params) -> list[tuple]:
    import psycopg

    with psycopg.connect(url.replace("postgres://", "postgresql://"), autocommit=True) as db:
        cursor = db.execute(query, params)
        return cursor.fetchall() if cursor.description else []


def _chain_on(url: str, run_id) -> list[tuple]:
    """(run_id, status, error_code, recovery, recovery_detail) of the run and its continuations."""
    chain = _sql(url, "SELECT run_id, status, error_code, recovery, recovery_detail FROM agent_runs WHERE run_id = %s",
                 run_id)
    while nxt := _sql(url, "SELECT run_id, status, error_code, recovery, recovery_detail FROM agent_runs "
                           "WHERE resume_of_id = %s OR replay_of_id = %s", chain[-1][0], chain[-1][0]):
        chain.append(nxt[0])
    return chain


@pytest.fixture
def private_postgres():
    if not (PG_BIN / "initdb").exists() or (os.geteuid() == 0 and shutil.which("runuser") is None):
        pytest.skip(f"needs PostgreSQL's server binaries in {PG_BIN} (and runuser when run as root)")
    server = PrivatePostgres()
    try:
        server.start()
        yield server
    finally:
        server.stop()


def test_a_postgresql_restart_with_runs_in_flight(private_postgres, tmp_path):
    server = private_postgres
    _sql(server.url("postgres"), "CREATE DATABASE ledger")
    url = server.url("ledger")
    # The test database's schema, copied: quicker than migrating again.
    test_db = connection.settings_dict
    source = [str(PG_BIN / "pg_dump"), "--no-owner", "-h", test_db.get("HOST") or "127.0.0.1",
              "-p", str(test_db.get("PORT") or 5432), "-U", test_db.get("USER") or "postgres", test_db["NAME"]]
    schema = "".join(
        subprocess.run(source + extra, capture_output=True, text=True, check=True, timeout=120).stdout
        # ADK's sessions read their schema version from their metadata table's one row.
        for extra in (["--schema-only"], ["--data-only", "-t", "adk_internal_metadata"])
    )
    subprocess.run([str(PG_BIN / "psql"), "-q", "-v", "ON_ERROR_STOP=1", url.replace("postgres://", "postgresql://")],
                   input=schema, capture_output=True, text=True, check=True, timeout=120)
    log = tmp_path / "cluster.log"
    cluster = start_cluster(log, DATABASE_URL=url, **FAST)
    try:
        wait_for_cluster(log, cluster)
        started = run_python(
            "from runs import services\n"
            "for i in range(6):\n"
            "    run = services.start_run(agent_name='support', message=f'Email customer {i}.', owner_id=f'c{i}',\n"
            "        params={'script': [{'call': 'send_email', 'args': {'to': f'c{i}@example.com', 'subject': 'Hi',\n"
            "            'body': 'Hello.'}}, {'call': 'update_crm', 'args': {'contact_id': 'C-1001', 'note': 'Done.'},\n"
            "            'latency': 1}, {'say': 'Done.', 'latency': 0.5}]})\n"
            "    print(run.run_id)\n",
            DATABASE_URL=url, **FAST,
        )
        assert started.returncode == 0, started.stderr[-3000:]
        run_ids = started.stdout.split()
        wait_until(lambda: _sql(url, "SELECT 1 FROM tool_calls WHERE tool_name = 'send_email' AND status = 'answered'"),
                   timeout=90, what="an email sent")
        server.restart()

        def settled() -> bool:
            ends = [_chain_on(url, run_id)[-1] for run_id in run_ids]
            return all(status == "success" or (status in ("error", "cancelled") and recovery in ("needs_person", "exhausted"))
                       for _id, status, _code, recovery, _detail in ends)

        try:
            wait_until(settled, timeout=SETTLE_SECONDS, step=0.5, what="every run to finish or wait for a person")
        except AssertionError as timed_out:
            raise AssertionError(f"{timed_out}: {[_chain_on(url, run_id)[-1][1:4] for run_id in run_ids]}") from None
        for run_id in run_ids:
            chain = _chain_on(url, run_id)
            ids = [row[0] for row in chain]
            assert not [row for row in chain if row[1] == "queued"]
            emails = _sql(url, "SELECT count(*) FROM agents_outboxemail WHERE run_id = ANY(%s)", ids)[0][0]
            notes = _sql(url, "SELECT count(*) FROM agents_crmnote WHERE run_id = ANY(%s)", ids)[0][0]
            assert emails <= 1 and notes <= 1, (run_id, emails, notes)
            _id, status, code, recovery, detail = chain[-1]
            if status == "success":
                assert (emails, notes) == (1, 1)
            else:
                assert recovery == "needs_person" and "doubt" in detail, (code, recovery, detail)
    finally:
        stop_cluster(cluster)
