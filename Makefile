# Agent Ledger — the two commands: `make run` and `make test`.
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PORT ?= 8000

.PHONY: run test install migrate demo serve clean

$(VENV)/.installed: requirements.txt
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -r requirements.txt
	touch $@

install: $(VENV)/.installed

migrate: install
	$(PY) manage.py migrate --noinput

# Demo defaults: DEBUG on (scripted tool faults allowed), everything else from the environment.
run: export DEBUG ?= true
run: migrate
	$(PY) manage.py setup_schedules
	$(PY) manage.py ensure_admin
	$(PY) manage.py seed_demo
	$(PY) manage.py serve --port $(PORT)

test: install
	$(VENV)/bin/pytest $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) var db.sqlite3* .test-db.sqlite3* .pytest_cache
