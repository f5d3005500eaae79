"""The emitter with a spool (an in-memory twin): what it cannot send waits, a run's later
events wait behind its spooled ones, and a spool that fails only costs that event."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from batching import config
from batching.evidence import lineage
from batching.testing import FakeClock
from tests.unit.test_lineage import PRODUCER, ListTransport, run_context


class ListSpool:
    """Keeps spooled events in memory; ``broken``: every call raises."""

    def __init__(self, broken: bool = False) -> None:
        self.rows: list[tuple[str, str, str, str, str | None]] = []
        self.broken = broken

    def add(
        self, run_id: str, event_type: str, event_time: str, body: str, error: str | None = None
    ) -> None:
        if self.broken:
            raise OSError("database is locked")
        self.rows.append((run_id, event_type, event_time, body, error))

    def pending(self, run_id: str) -> bool:
        if self.broken:
            raise OSError("database is locked")
        return any(r[0] == run_id for r in self.rows)


def emitter(transport: Any, clock: FakeClock, kept: ListSpool) -> lineage.LineageEmitter:
    return lineage.LineageEmitter(
        config.LineageConfig(),
        base_dir=Path("/cfg"),
        producer=PRODUCER,
        transport=transport,
        clock=clock,
        spool=kept,
    )


def other_run() -> lineage.RunContext:
    return lineage.RunContext(run_id=lineage.new_run_id(), job_name="other")


def test_a_failed_event_is_spooled_as_the_json_it_was_sent_as(clock: FakeClock) -> None:
    kept = ListSpool()
    em = emitter(ListTransport(fail_next=1), clock, kept)
    assert em.start(run_context()) is False
    ((run_id, kind, when, body, error),) = kept.rows
    assert (run_id, kind) == (run_context().run_id, "START")
    assert json.loads(body)["eventTime"] == when == "2027-01-15T08:00:00+00:00"
    assert error is not None
    assert error.startswith("ConnectionError: backend down at")
    assert "secret" not in error
    assert (em.failures, em.spooled, em.lost) == (1, 1, 0)


def test_in_a_cooldown_events_are_spooled_not_dropped(clock: FakeClock) -> None:
    kept = ListSpool()
    transport = ListTransport(fail_next=1)
    em = emitter(transport, clock, kept)
    assert em.start(run_context()) is False
    assert em.start(other_run()) is False  # cooling down: not sent, kept
    assert [r[1] for r in kept.rows] == ["START", "START"]
    assert transport.events == []


def test_a_runs_later_event_waits_behind_its_spooled_ones_and_others_go(clock: FakeClock) -> None:
    kept = ListSpool()
    transport = ListTransport(fail_next=1)
    em = emitter(transport, clock, kept)
    run = run_context()
    assert em.start(run) is False
    clock.advance(31.0)  # the cooldown is over, the backend is back
    assert em.complete(run) is False
    assert em.start(other := other_run())
    assert [(r[0], r[1]) for r in kept.rows] == [(run.run_id, "START"), (run.run_id, "COMPLETE")]
    assert [e["run"]["runId"] for e in transport.events] == [other.run_id]


def test_a_spool_that_fails_costs_that_event_only(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    em = emitter(ListTransport(fail_next=1), clock, ListSpool(broken=True))
    assert em.start(run_context()) is False  # not sent, not kept: lost, counted
    assert (em.failures, em.spooled, em.lost) == (1, 0, 1)
    assert "lineage spool not writable" in caplog.text
    clock.advance(31.0)
    assert em.complete(run_context())  # an unreadable spool does not hold the next event
    assert em.emitted == 1
