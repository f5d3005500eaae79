# The two set-up commands: `make demo` and `make check`. Both create .venv on first use.
.PHONY: demo check setup setup-dev lint types test test-fast bench

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

test: setup-dev
	$(VENV)/pytest -q --timeout=600

test-fast: setup-dev
	$(VENV)/pytest -q -m "not slow"

check: lint types test

bench: setup-dev
	$(VENV)/python bench/queue_bench.py
