"""Nothing waits forever: each kind of process SIGKILLed with runs queued, in flight and waiting.

Real `manage.py runworker` (and `qcluster`) processes on PostgreSQL. After the kill nobody helps:
a worker's parent notices its child's death (`waitpid`), another machine's workers notice a whole
`runworker` gone by its advisory locks (`runs.ledger.presence`), each worker sweeps every second on these
settings (`runs.worker.sweeper`) and the runs that died are continued (`runs.upkeep.recovery`). Every run must
then end `success`, wait for a person with a call in doubt, or wait for its approval; none stays
`queued`; no effect happens twice.
"""

from __future__ import annotations

import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from pathlib import Path

import pytest
from django.db import connection

from agents.models import CrmNote, OutboxEmail, Refund
from runs.models.approvals import PendingCall
from runs.models.ledger import AgentRun, Recovery, RunStatus
from runs.services import run as services
from tests.helpers import (
    UPDATE_CRM,
    alive,
    chain_end,
    chain_ids,
    pid_of_worker,
    postgres_only,
    run_python,
    script_params,
    start_cluster,
    start_workers,
    stop_group,
    wait_for_workers,
    wait_until,
    worker_pids,
)
from tests.services.test_approvals import BIG_REFUND, REFUNDED

pytestmark = [pytest.mark.slow, postgres_only, pytest.mark.django_db(transaction=True)]

# Small windows, so that staleness and a recovery's backoff each take seconds; two runs per worker
# process, so that most of the burst is still queued when the kill comes.
FAST = {
    "RUN_STALE_AFTER_SECONDS": "4",
    "RUN_CONCURRENCY": "2",
    "RUN_RECOVERY_BACKOFF_SECONDS": "1",
    "RUN_POLL_SECONDS": "0.5",
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


def _refund() -> AgentRun:
    """A run that asks for a refund's approval and waits for it (holding no worker)."""
    return services.start_run(agent_name="support", message="Refund order A-1001.", owner_id="jane",
                              params=script_params(BIG_REFUND, REFUNDED))


def _one_sent_and_some_queued(runs: list[AgentRun], *, host: str = "") -> AgentRun | None:
    """A run in flight (on `host`, if given) that sent its email, while other runs of the burst are still queued."""
    ids = [run.pk for run in runs]
    if not AgentRun.objects.filter(pk__in=ids, status=RunStatus.QUEUED).exists():
        return None
    return AgentRun.objects.filter(
        pk__in=ids, status=RunStatus.RUNNING, tool_calls__tool_name="send_email", tool_calls__status="answered",
        worker__startswith=f"{host}:" if host else "",
    ).exclude(worker="").first()


def _done(end: AgentRun) -> bool:
    return end.status == RunStatus.SUCCESS or (
        end.status in (RunStatus.ERROR, RunStatus.CANCELLED) and end.recovery in (Recovery.NEEDS_PERSON, Recovery.EXHAUSTED)
    )


def _states(runs: list[AgentRun]) -> list[tuple]:
    return [(e.status, e.error_code, e.recovery, e.attempts) for e in map(chain_end, runs)]


def assert_nothing_waits_forever(runs: list[AgentRun], *, refund: AgentRun | None = None) -> None:
    def settled() -> bool:
        waiting = refund is None or chain_end(refund).status == RunStatus.WAITING or _done(chain_end(refund))
        return waiting and all(_done(chain_end(run)) for run in runs)

    try:
        wait_until(settled, timeout=SETTLE_SECONDS, what="every run to finish or wait", step=0.5)
    except AssertionError as timed_out:
        extra = _states([refund]) if refund is not None else []
        raise AssertionError(f"{timed_out}: (status, code, recovery, attempts) = {_states(runs)} {extra}") from None
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
    if refund is not None:
        # It waits for its approval, once; or, killed between asking and parking, for a person who
        # sees the call in doubt. Nothing was refunded without an approval.
        end = chain_end(refund)
        if end.status == RunStatus.WAITING:
            assert PendingCall.objects.filter(run=end, decision="").count() == 1
        else:
            assert end.recovery == Recovery.NEEDS_PERSON and "doubt" in end.recovery_detail, (
                end.error_code, end.recovery, end.recovery_detail)
        assert Refund.objects.count() == 0


@pytest.fixture
def started():
    processes: list[subprocess.Popen] = []
    yield processes
    for process in processes:
        stop_group(process)


@pytest.mark.parametrize("kind", ["child", "runworker", "periodic", "machine"])
def test_a_sigkilled_process_leaves_no_run_behind(kind, tmp_path, started):
    log = tmp_path / "workers.log"
    here = start_workers(log, WORKER_HOST="here", **FAST)
    started.append(here)
    cluster = start_cluster(tmp_path / "cluster.log", **FAST)
    started.append(cluster)
    if kind == "machine":
        there = start_workers(tmp_path / "there.log", WORKER_HOST="there", **FAST)
        started.append(there)
        wait_for_workers(tmp_path / "there.log", there)
    wait_for_workers(log, here)
    refund = _refund()
    runs = _burst()
    victim = wait_until(lambda: _one_sent_and_some_queued(runs, host="here"), timeout=90,
                        what="a run in flight here that sent its email, others queued")
    before = worker_pids(log)
    if kind == "child":
        os.kill(pid_of_worker(victim.worker), signal.SIGKILL)
        # Its parent starts another.
        wait_until(lambda: len(worker_pids(log)) > len(before), timeout=30, what="a new worker process")
    elif kind == "runworker":
        stop_group(here)
        started.append(start_workers(tmp_path / "workers-2.log", WORKER_HOST="here", **FAST))
    elif kind == "periodic":
        stop_group(cluster)
    else:
        # The whole machine "here": its workers and its periodic jobs. The other machine's workers
        # see its locks go and continue its runs.
        stop_group(here)
        stop_group(cluster)
    assert_nothing_waits_forever(runs, refund=refund)
    if kind == "machine":
        victim_end = chain_end(victim)
        assert victim_end.worker.startswith("there:"), victim_end.worker
        # Noticed by its lock, not by staleness.
        assert "lock it held while alive" in AgentRun.objects.get(pk=victim.pk).error_message


def test_two_machines_share_a_burst_and_one_finishes_the_others_runs(tmp_path, started):
    logs = {host: tmp_path / f"{host}.log" for host in ("one", "two")}
    machines = {host: start_workers(log, WORKER_HOST=host, **FAST) for host, log in logs.items()}
    started.extend(machines.values())
    for host, process in machines.items():
        wait_for_workers(logs[host], process)
    runs = _burst(16)
    wait_until(lambda: _one_sent_and_some_queued(runs, host="one"), timeout=90, what="runs in flight on one")
    hosts = {name.split(":", 1)[0] for name in AgentRun.objects.filter(pk__in=[r.pk for r in runs])
             .exclude(worker="").values_list("worker", flat=True)}
    assert hosts == {"one", "two"}, hosts
    stop_group(machines["one"])
    assert_nothing_waits_forever(runs)
    # Whatever "one" held when it died was continued by "two".
    for run in runs:
        end = chain_end(run)
        if end.pk != run.pk:
            assert end.worker.startswith("two:"), end.worker


def test_idle_worker_processes_killed_leave_the_machine_claiming_runs(tmp_path, started):
    log = tmp_path / "workers.log"
    here = start_workers(log, **FAST)
    started.append(here)
    pids = wait_for_workers(log, here)
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    wait_until(lambda: len([p for p in worker_pids(log) if p not in pids and alive(p)]) >= 2,
               timeout=30, what="two new worker processes")
    runs = _burst(4)
    assert_nothing_waits_forever(runs)
    assert all(chain_end(run).pk == run.pk for run in runs)  # each started once


# --- Database faults ----------------------------------------------------------------------------------


def _terminate_other_connections() -> int:
    with connection.cursor() as cursor:
        cursor.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()"
        )
        return cursor.fetchone()[0]


def test_the_database_ends_the_workers_connections_with_runs_in_flight(tmp_path, started):
    # pg_terminate_backend of every connection of the workers (the ORM's, ADK's pool, the
    # heartbeat's, the listener's with its lock) while runs call their tools: a run goes on, or dies
    # and is recovered, never settled as if it failed on its own; and the same workers go on serving.
    log = tmp_path / "workers.log"
    here = start_workers(log, **FAST)
    started.append(here)
    pids = wait_for_workers(log, here)
    runs = _burst()
    wait_until(lambda: _one_sent_and_some_queued(runs), timeout=90,
               what="a run in flight that sent its email, others queued")
    assert _terminate_other_connections() > 0
    assert_nothing_waits_forever(runs)
    assert [pid for pid in pids if not alive(pid)] == []
    later = _burst(2)
    wait_until(lambda: all(chain_end(run).status == RunStatus.SUCCESS for run in later), timeout=60,
               what="runs started after the fault to succeed")
    assert {pid_of_worker(chain_end(run).worker) for run in later} <= set(pids)


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


def test_a_postgresql_restart_with_runs_in_flight(private_postgres, tmp_path, started):
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
    log = tmp_path / "workers.log"
    cluster = start_workers(log, DATABASE_URL=url, **FAST)
    started.append(cluster)
    try:
        wait_for_workers(log, cluster)
        started = run_python(
            "from runs.services import run as services\n"
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
        stop_group(cluster)
