# Agent Ledger — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000

.PHONY: run test test-fast check install migrate clean bench bench-smoke bench-crash fuzz-live

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

install: $(VENV)/.installed

migrate: install
	$(PY) manage.py migrate --noinput

# Demo defaults: DEBUG on (a development key), scripted tool faults and user scripts allowed;
# everything else from the environment.
run: export DEBUG ?= true
run: export SCRIPTED_FAULTS_ENABLED ?= true
run: export SCRIPTS_FROM_USERS_ALLOWED ?= true
# One Django start-up migrates, sets up the periodic jobs, the admin user and the demo, then serves.
run: install
	$(PY) manage.py serve --setup --port $(PORT)

# The suite runs on PYTEST_WORKERS processes (pytest-xdist), each on its own test database: most
# of its time is spent waiting on the child processes and servers it starts, not on the 2 cores.
# PYTEST_WORKERS=0 runs it in this one process.
PYTEST_WORKERS ?= 4
test: install
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) $(PYTEST_ARGS)

# The inner loop: everything but the tests marked slow (child processes, servers, the browser,
# the fuzzer). `make test` still runs all of them.
test-fast: install
	$(VENV)/bin/pytest -n $(PYTEST_WORKERS) -m "not slow" $(PYTEST_ARGS)

# The fast, strict checks CI runs before the suite: style, migrations, the import contract.
check: install
	$(VENV)/bin/ruff check .
	$(PY) manage.py makemigrations --check --dry-run
	$(VENV)/bin/lint-imports

# schemathesis, every check, against a live production-like server (uvicorn, DEBUG off, the
# offline model) on PostgreSQL, as a plain user and as a superuser; a few minutes at most.
FUZZ_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/agentledger_fuzz
fuzz-live: install
	psql "$(patsubst %/,%,$(dir $(FUZZ_DATABASE_URL)))/postgres" -tAc "SELECT 1 FROM pg_database WHERE datname = '$(notdir $(FUZZ_DATABASE_URL))'" | grep -q 1 \
		|| psql "$(patsubst %/,%,$(dir $(FUZZ_DATABASE_URL)))/postgres" -qc 'CREATE DATABASE "$(notdir $(FUZZ_DATABASE_URL))"'
	.ci/schemathesis-live $(FUZZ_DATABASE_URL)

# Benchmarks: PostgreSQL only. Each script makes (and drops) its own agentledger_bench_* database
# on the server BENCH_DATABASE_URL points at, writes bench/results/<name>.json, and report.py
# prints them all in one table. Sizes are the full ones; a run takes a while on a small machine.
BENCH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/postgres
BENCH_REPORT ?= bench/results/report.md
CRASH_DATABASE_URL ?= postgres://postgres@127.0.0.1:5432/agentledger
CRASH_MATRIX_REPEATS ?= 20

$(VENV)/.bench-installed: $(VENV)/.installed bench/requirements.txt
	$(PY) -m pip install --quiet -r bench/requirements.txt
	touch $@

bench bench-smoke: export DATABASE_URL = $(BENCH_DATABASE_URL)
# The benchmarks drive one user hard on purpose: no request rates or in-flight caps apply there.
bench bench-smoke: export SECRET_KEY ?= bench-only-not-a-secret-0000000000000000000000000000
bench bench-smoke: export SCRIPTED_FAULTS_ENABLED ?= true
# The benchmarks play the demo's scripts offline, on purpose, without DEBUG.
bench bench-smoke: export AGENT_MODEL ?= scripted
bench bench-smoke: export SCRIPTED_DEFAULT_SCRIPTS ?= true
bench bench-smoke: export SCRIPTS_FROM_USERS_ALLOWED ?= true
bench bench-smoke: export THROTTLE_RUNS_START ?= off
bench bench-smoke: export THROTTLE_REPLAYS ?= off
bench bench-smoke: export THROTTLE_CHAT_TURNS ?= off
bench bench-smoke: export MAX_RUNS_IN_FLIGHT_PER_USER ?= 0
bench bench-smoke: export MAX_CHAT_STREAMS_PER_USER ?= 0
bench bench-smoke: export BENCH_POSTGRES = $(patsubst %/,%,$(dir $(BENCH_DATABASE_URL)))
bench: $(VENV)/.bench-installed
	mkdir -p bench/results
	$(PY) bench/overhead.py --runs 200 --warmup 20
	$(PY) bench/run_indexes.py --runs 200 --rounds 2
	$(PY) bench/dbos_peer.py --units 300 --warmup 30
	$(PY) bench/replay_load.py --runs 1000 --clients 50 --seconds 30 --workers 4
	$(PY) bench/reconcile_sweep.py
	$(PY) bench/purge_events.py
	$(PY) bench/memory_search.py --rows 1000000 --owners 10000
	$(PY) bench/admin_changelist.py --runs 1000000
	$(PY) bench/desk_overview.py --runs 1000000
	$(PY) bench/approvals.py --runs 1000000 --waiting 10000
	$(PY) bench/diet_request_size.py
	$(PY) bench/chat_ttfe.py --turns 40
	$(PY) bench/adk_wire.py --turns 40
	$(PY) bench/workflow_steps.py --runs 60 --warmup 5 --block 5
	$(PY) bench/webhook_throughput.py
	$(PY) bench/concurrency.py --runs 500 --latency 1 --serial-runs 20
	$(PY) bench/concurrency.py --wire --runs 100 --latency 1
	$(PY) bench/recovery.py --kills 20 --lost-machine 2
	$(PY) bench/claim_rate.py --runs 400 --processes 1,2,4,8 --latency-runs 40
	$(PY) bench/report.py --markdown $(BENCH_REPORT) --docs docs/benchmarks.md

# Every benchmark at its smallest size, so none can rot unseen (CI runs this on PostgreSQL). The
# figures mean nothing at these sizes: they go to a scratch directory, not bench/results/. The
# databases are copies of one migrated template.
BENCH_SMOKE_RESULTS ?= $(or $(TMPDIR),/tmp)/agentledger-bench-smoke
bench-smoke: export BENCH_TEMPLATE = true
bench-smoke: export BENCH_RESULTS_DIR = $(BENCH_SMOKE_RESULTS)
bench-smoke: $(VENV)/.bench-installed
	rm -rf $(BENCH_SMOKE_RESULTS)
	$(PY) bench/_benchdb.py template
	$(PY) bench/overhead.py --runs 3 --warmup 1 --block 1 --accounting-runs 2 --events 5
	$(PY) bench/run_indexes.py --runs 2 --rounds 1
	$(PY) bench/dbos_peer.py --units 3 --warmup 1 --block 1
	$(PY) bench/replay_load.py --runs 20 --clients 2 --seconds 2 --workers 1
	$(PY) bench/reconcile_sweep.py --runs 3000 --stale 100 --sweeps 1
	$(PY) bench/purge_events.py --events 10000
	$(PY) bench/memory_search.py --rows 2000 --owners 20 --queries 30 --vocabulary 200 --heavy 200
	$(PY) bench/admin_changelist.py --runs 1000 --repeat 1
	$(PY) bench/desk_overview.py --runs 1000 --repeat 1
	$(PY) bench/approvals.py --runs 1000 --waiting 20 --real 2 --repeat 1
	$(PY) bench/diet_request_size.py
	$(PY) bench/chat_ttfe.py --turns 2 --warmup 1
	$(PY) bench/adk_wire.py --turns 2 --warmup 1 --block 1
	$(PY) bench/workflow_steps.py --runs 2 --warmup 1 --block 1
	$(PY) bench/webhook_throughput.py --events 5
	$(PY) bench/concurrency.py --runs 10 --latency 0.1 --serial-runs 2 --warmup 1
	$(PY) bench/recovery.py --kills 1 --lost-machine 1 --events 5
	$(PY) bench/claim_rate.py --runs 10 --processes 1,2 --latency-runs 3
	$(PY) bench/report.py --results $(BENCH_SMOKE_RESULTS) --strict
	$(PY) bench/_benchdb.py drop-template

# A worker SIGKILLed at each of the seven points of a run, CRASH_MATRIX_REPEATS times per point.
bench-crash: install
	mkdir -p bench/results
	CRASH_MATRIX_REPEATS=$(CRASH_MATRIX_REPEATS) CRASH_MATRIX_OUTPUT=bench/results/crash_matrix.json \
		DATABASE_URL=$(CRASH_DATABASE_URL) $(VENV)/bin/pytest -q tests/processes/test_crash_matrix.py
	$(PY) bench/report.py

clean:
	rm -rf $(VENV) var db.sqlite3* .test-db.sqlite3* .pytest_cache
