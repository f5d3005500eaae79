# The two set-up commands: `make demo` and `make check`. Both create .venv on first use.
.PHONY: demo check setup setup-dev lint types test test-fast bench chaos-smoke drills gpu-wheels

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

# The one wheel bench/gpu_check.sh needs beyond torch, numpy and safetensors on a bare GPU
# machine (Python 3.12, x86-64), into .whl/ (git-ignored): carry it with the working tree.
ORJSON_VERSION ?= $(shell $(VENV)/python -c "import orjson; print(orjson.__version__)" 2>/dev/null)
gpu-wheels:
	python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 \
		--implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
		-d .whl orjson$(if $(ORJSON_VERSION),==$(ORJSON_VERSION))
