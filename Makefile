# The two set-up commands: `make demo` and `make check`. Both create .venv on first use.
.PHONY: demo check setup setup-dev lint types test test-fast bench chaos-smoke drills

VENV := .venv/bin

setup:
	scripts/setup.sh runtime

setup-dev:
	scripts/setup.sh dev

demo: setup
	$(VENV)/batching demo

lint: setup-dev
	$(VENV)/ruff format --check .
	$(VENV)/ruff check .

types: setup-dev
	$(VENV)/mypy

# Two test processes by default (the suite waits on subprocesses and databases more than it
# computes); PYTEST_WORKERS=0 runs it in one.
PYTEST_WORKERS ?= 2
test: setup-dev
	$(VENV)/pytest -q --timeout=600 -n $(PYTEST_WORKERS) --dist loadfile

test-fast: setup-dev
	$(VENV)/pytest -q -m "not slow and not drill"

check: lint types test

# Every fault drill (tests/drills/: credentials revoked, database restart, slow dependencies,
# full disk, lost output files) on a private PostgreSQL cluster, marked `drill` or not (CI runs
# the unmarked few); -s prints each drill's figures (drill=NAME items=... lost=... duplicated=...).
drills: setup-dev
	$(VENV)/pytest -q -s tests/drills -m "drill or not drill"

bench: setup-dev
	$(VENV)/python bench/queue_bench.py

# A few crash-fuzz rounds (bench/chaos.py) on SQLite and PostgreSQL; CI runs it after `check`
# with the commit count as SEED: another plan per commit, each replayable with its seed;
# --faults cycle puts every fault (a killer item, a full disk, an immutable folder, a backend
# terminate) in these few rounds rather than leaving them to chance.
SEED ?= 1
PG_URL ?= postgresql://postgres@127.0.0.1:5432/postgres
chaos-smoke: setup-dev
	$(VENV)/python bench/chaos.py --rounds 4 --seed $(SEED) --faults cycle
	$(VENV)/python bench/chaos.py --rounds 2 --seed $(SEED) --pg $(PG_URL) --faults cycle
