"""``batching metrics serve``'s collector against real SQLite and PostgreSQL: the queue gauges
equal ``SqlQueue.stats(all_queues=True)`` (what ``status --json`` prints), pause and cap come
from the controls table when it exists (schema 13) and default without it (schema 12), the
lineage spool and the last reconcile show, and a database that fails at scrape time shows as
``batching_exporter_up 0`` without an exception."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import config, errors, models
from batching.evidence import reconcile_result
from batching.evidence.findings import Finding, Kind, Report, Severity
from batching.ingress import controls
from batching.ingress.queue import SqlQueue
from batching.metrics import exporter
from batching.metrics.exporter import TableCollector
from batching.store import database, schema
from batching.testing import FakeClock
from tests import prometheus as prom

Key = tuple[str, tuple[tuple[str, str], ...]]


def cfg(top_tenants: int = 20) -> config.PipelineConfig:
    return config.PipelineConfig(
        model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
        queue=config.QueueConfig(name="q1"),
        backlog_alert_age_s=300.0,
        latency_slo_s=2.0,
        latency_objective=0.995,
        metrics=config.MetricsConfig(environment="it", top_tenants=top_tenants),
    )


def scrape(c: config.PipelineConfig, queue: SqlQueue) -> dict[Key, float]:
    """One scrape by a new exporter, then its first done count waited for: left running,
    the count's connection outlived the test's engine and was charged to a later test as a
    leak (a ResourceWarning at another test's teardown)."""
    collector = TableCollector(c, queue, queue.clock)
    try:
        return scrape_of(collector)
    finally:
        assert collector.done.wait(30)


def pick(found: dict[Key, float], name: str, **labels: str) -> dict[Key, float]:
    return {
        k: v
        for k, v in found.items()
        if k[0] == name and all(dict(k[1]).get(n) == want for n, want in labels.items())
    }


def records(prefix: str, n: int, tenant: str) -> list[models.EnqueueRecord]:
    return [
        models.EnqueueRecord(f"{prefix}{i}", models.Payload(b"{}"), tenant=tenant) for i in range(n)
    ]


def workload(url: str, clock: FakeClock) -> SqlQueue:
    """Two queues; tenants a (6), b (3), c (1) in q1: some leased, dead, one lease expired."""
    engine = database.create_engine(url)
    q1 = SqlQueue(engine, "q1", clock=clock, max_attempts=1)
    q1.enqueue(records("a", 6, "a") + records("b", 3, "b") + records("c", 1, "c"))
    SqlQueue(engine, "q2", clock=clock).enqueue(records("x", 2, "a"))
    dead = q1.claim(2, lease_s=60)
    q1.fail(dead.lease_id, {i.id: "boom" for i in dead.items}, retry=False)
    q1.claim(2, lease_s=5)  # its lease expires below
    q1.claim(1, lease_s=600)
    clock.advance(30)
    return q1


@pytest.fixture
def q1(db_url: str, clock: FakeClock) -> Iterator[SqlQueue]:
    queue = workload(db_url, clock)
    yield queue
    queue.engine.dispose()


def test_queue_gauges_equal_status_and_tenants_fold(q1: SqlQueue) -> None:
    collector = TableCollector(cfg(top_tenants=2), q1, q1.clock)
    list(collector.collect())  # starts the count of done items
    assert collector.done.wait(30)
    found = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }
    stats = q1.stats(all_queues=True)
    for queue in ("q1", "q2"):
        want: dict[str, int] = {}
        for g in stats.groups:
            if g.queue == queue:
                for state in ("ready", "leased", "done", "dead", "expired"):
                    want[state] = want.get(state, 0) + getattr(g, state)
        for state, n in want.items():
            got = pick(found, "batching_queue_items", queue=queue, state=state)
            assert sum(got.values()) == n, (queue, state)
    tenants = {dict(k[1])["tenant"] for k in pick(found, "batching_queue_items", queue="q1")}
    assert tenants == {"a", "b", "other"}  # top 2 by live items: a (6), b (3); c folds
    expired = pick(found, "batching_queue_expired_leases", queue="q1")
    assert sum(expired.values()) == stats.expired_leases == 2
    ages = pick(found, "batching_queue_oldest_ready_age_seconds", queue="q1")
    assert max(ages.values()) == stats.oldest_ready_age_s
    assert pick(found, "batching_exporter_up") == {
        ("batching_exporter_up", (("environment", "it"),)): 1.0
    }


def done_by_queue(collector: TableCollector) -> dict[str, float]:
    found: dict[str, float] = {}
    for family in collector.collect():
        for s in family.samples:
            if s.name == "batching_queue_items" and s.labels["state"] == "done":
                found[s.labels["queue"]] = found.get(s.labels["queue"], 0.0) + s.value
    return found


def test_done_items_are_counted_beside_the_scrapes_not_in_them(
    q1: SqlQueue, clock: FakeClock
) -> None:
    """A count of done items reads every one of them (seconds for millions), so a scrape
    returns the last count finished and starts the next when due; the live states are read
    at each scrape."""
    acked = q1.claim(2, lease_s=60)
    q1.ack(acked.lease_id, [i.id for i in acked.items])
    collector = TableCollector(cfg(), q1, clock, done_every_s=60)
    assert done_by_queue(collector) == {}  # the first count has only just started
    assert collector.done.wait(30)
    assert done_by_queue(collector) == {"q1": 2.0, "q2": 0.0}
    more = q1.claim(1, lease_s=600)
    q1.ack(more.lease_id, [i.id for i in more.items])
    assert done_by_queue(collector) == {"q1": 2.0, "q2": 0.0}  # not due: the last count
    q2 = SqlQueue(q1.engine, "q2", clock=clock)
    drained = q2.claim(10, lease_s=60)
    q2.ack(drained.lease_id, [i.id for i in drained.items])  # q2 has no live item now
    found = {
        (s.labels["queue"], s.labels["state"]): s.value
        for family in collector.collect()
        for s in family.samples
        if s.name == "batching_queue_items"
    }
    assert (found[("q2", "ready")], found[("q2", "done")]) == (0.0, 0.0)  # shown, not gone
    ready = pick(scrape(cfg(), q1), "batching_queue_items", queue="q1", state="ready")
    assert sum(ready.values()) == q1.stats().by_state["ready"]  # live: this scrape's
    clock.advance(61)
    done_by_queue(collector)  # due: starts a count
    assert collector.done.wait(30)
    assert done_by_queue(collector) == {"q1": 3.0, "q2": 2.0}
    assert q1.stats().by_state["done"] == 3


def test_a_tenant_whose_items_were_all_purged_drops_out_once_a_done_count_lands(
    db_url: str, clock: FakeClock
) -> None:
    """Every (queue, lane, tenant) ever shown was kept as zeros for the process's life: with
    many short-lived tenants, each scrape walked all of them (a soak review)."""
    queue = SqlQueue(database.create_engine(db_url), "q1", clock=clock)
    queue.enqueue(records("z", 2, "z"))
    claim = queue.claim(2, lease_s=60)
    queue.ack(claim.lease_id, [i.id for i in claim.items])
    queue.enqueue(records("a", 1, "a"))
    collector = TableCollector(cfg(), queue, clock, done_every_s=60)

    def tenants() -> set[str]:
        found = pick(scrape_of(collector), "batching_queue_items")
        return {dict(k[1])["tenant"] for k in found}

    try:
        tenants()  # the first count starts
        assert collector.done.wait(30)
        assert tenants() == {"a", "z"}  # z: 2 done
        clock.advance(1)
        assert queue.purge(0) == 2
        assert tenants() == {"a", "z"}  # the last count still has z's done items
        clock.advance(61)
        tenants()  # due: starts a count
        assert collector.done.wait(30)
        assert tenants() == {"a"}
    finally:
        queue.engine.dispose()


def test_a_queue_of_done_items_only_is_counted_once_not_at_every_scrape(
    db_url: str, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An exporter started beside a drained queue: the queue is known from the done count once
    that has landed (a review found every scrape starting another full count)."""
    queue = SqlQueue(database.create_engine(db_url), "q1", clock=clock)
    queue.enqueue(records("d", 3, "a"))
    claim = queue.claim(3, lease_s=60)
    queue.ack(claim.lease_id, [i.id for i in claim.items])
    counted: list[int] = []
    real = queue.done_counts

    def counting(**kw: bool) -> dict[tuple[str, str, str], int]:
        counted.append(1)
        return real(**kw)

    monkeypatch.setattr(queue, "done_counts", counting)
    collector = TableCollector(cfg(), queue, clock, done_every_s=300)
    try:
        for _ in range(10):
            scrape_of(collector)
            assert collector.done.wait(30)
        assert len(counted) == 1
    finally:
        queue.engine.dispose()


def test_a_failing_done_count_is_tried_every_done_every_not_at_each_scrape(
    q1: SqlQueue, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A queue of done items the exporter has never shown starts a count at once; when that
    count fails (a statement timeout on a long scan), it is not started again at every
    scrape: the scan the live counts avoid, 15 s apart, for good."""
    counts: list[int] = []

    def failing(**_: object) -> dict[tuple[str, str, str], int]:
        counts.append(1)
        raise RuntimeError("canceling statement due to statement timeout")

    monkeypatch.setattr(q1, "done_counts", failing)
    other = SqlQueue(q1.engine, "q3", clock=clock)
    other.enqueue(records("z", 1, "z"))
    done = other.claim(1, lease_s=60)
    other.ack(done.lease_id, [i.id for i in done.items])  # q3: done items only
    collector = TableCollector(cfg(), q1, clock, done_every_s=300)
    for _ in range(10):
        assert pick(scrape_of(collector), "batching_exporter_up") == {UP: 1.0}
        assert collector.done.wait(30)
        clock.advance(15)
    assert len(counts) == 1  # 150 s: the first count only
    clock.advance(300)
    scrape_of(collector)
    assert collector.done.wait(30)
    assert len(counts) == 2


def test_top_tenants_are_ranked_by_live_items_as_each_scrape_reads_them(
    db_url: str, clock: FakeClock
) -> None:
    """Ranked with the done count (absent at first, minutes old later), the top tenant
    flipped when a count landed and its series went stale."""
    queue = SqlQueue(database.create_engine(db_url), "q1", clock=clock)
    queue.enqueue(records("a", 20, "a"))
    claim = queue.claim(19, lease_s=60)
    assert queue.ack(claim.lease_id, [i.id for i in claim.items]) == 19
    queue.enqueue(records("b", 3, "b"))
    collector = TableCollector(cfg(top_tenants=1), queue, clock)
    try:
        shown = []
        for _ in range(2):
            found = scrape_of(collector)
            tenants = {dict(k[1])["tenant"] for k in pick(found, "batching_queue_items")}
            shown.append(tenants)
            assert collector.done.wait(30)
        assert shown == [{"b", "other"}, {"b", "other"}]  # b: 3 ready; a: 1 ready, 19 done
    finally:
        queue.engine.dispose()


def test_objectives_come_from_the_config(q1: SqlQueue) -> None:
    found = scrape(cfg(), q1)
    e = (("environment", "it"), ("queue", "q1"))
    assert found[("batching_queue_age_bound_seconds", e)] == 300.0
    assert found[("batching_latency_slo_seconds", e)] == 2.0
    assert found[("batching_latency_objective_ratio", e)] == 0.995


def test_pause_and_cap_show_once_set_and_default_before(q1: SqlQueue) -> None:
    before = scrape(cfg(), q1)
    assert set(pick(before, "batching_queue_paused").values()) == {0.0}
    assert pick(before, "batching_queue_max_depth") == {}
    controls.pause(q1.engine, "q1", actor="it", reason="drill", now=1.0)
    controls.set_max_depth(q1.engine, "q1", 100, actor="it", reason="drill", now=1.0)
    after = scrape(cfg(), q1)
    e1, e2 = (("environment", "it"), ("queue", "q1")), (("environment", "it"), ("queue", "q2"))
    assert after[("batching_queue_paused", e1)] == 1.0
    assert after[("batching_queue_paused", e2)] == 0.0
    assert pick(after, "batching_queue_max_depth") == {("batching_queue_max_depth", e1): 100.0}


def test_the_ledger_horizon_shows_once_a_purge_recorded_it(q1: SqlQueue) -> None:
    name = "batching_queue_ledger_horizon_timestamp_seconds"
    assert pick(scrape(cfg(), q1), name) == {}
    with q1.begin() as conn:  # as purge_ledger records it, with its first rows gone
        controls.locked_row(conn, "q1", 1.0)
        controls.update_row(conn, "q1", {"ledger_horizon": 86400.0}, 1.0)
    e1 = (("environment", "it"), ("queue", "q1"))
    assert pick(scrape(cfg(), q1), name) == {(name, e1): 86400.0}


def test_the_retention_last_run_shows_each_purge_even_one_that_deleted_nothing(
    q1: SqlQueue, clock: FakeClock
) -> None:
    name = "batching_queue_retention_last_run_timestamp_seconds"
    assert pick(scrape(cfg(), q1), name) == {}
    # nothing is old enough: no item, no ledger row goes, and each run still counts
    assert q1.purge(86400.0, actor="it", reason="nightly") == 0
    e1, e2 = (("environment", "it"), ("queue", "q1")), (("environment", "it"), ("queue", "q2"))
    assert pick(scrape(cfg(), q1), name) == {(name, e1): clock()}
    clock.advance(60)
    q2 = SqlQueue(q1.engine, "q2", clock=clock)
    assert q2.purge_ledger(86400.0, actor="it", reason="nightly") == (0, None)
    clock.advance(60)
    q1.purge(86400.0)  # no actor: not recorded, not a run of the retention
    typo = SqlQueue(q1.engine, "q1-typo", clock=clock)  # no item, control or audit row
    assert typo.purge(86400.0, actor="it", reason="nightly") == 0
    assert typo.purge_ledger(86400.0, actor="it", reason="nightly") == (0, None)
    assert pick(scrape(cfg(), q1), name) == {(name, e1): clock() - 120, (name, e2): clock() - 60}


def test_the_exporter_starts_its_first_done_count_once_it_serves(q1: SqlQueue) -> None:
    """A queue whose items are all done has no series before the first count: it starts
    with the server, so Prometheus' first scrape finds it (a review)."""
    server, collector = exporter.serve(cfg(), q1, prom.free_port(), addr="127.0.0.1")
    try:
        assert collector.done.wait(30)
        assert collector.done.last() is not None  # started by serve, not by a scrape
    finally:
        server.close()
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    try:
        with pytest.raises(errors.ConfigError, match="choose a free port"):
            exporter.serve(cfg(), q1, taken.getsockname()[1], addr="127.0.0.1")
    finally:
        taken.close()


def test_the_lineage_spool_backlog_shows(q1: SqlQueue, clock: FakeClock) -> None:
    t = schema.lineage_spool
    row: dict[str, Any] = {"run_id": "r", "event_type": "START", "event_time": "t", "body": "{}"}
    with q1.begin() as conn:
        conn.execute(sa.insert(t).values(**row, spooled_at=clock() - 90, attempts=2))
        conn.execute(sa.insert(t).values(**row, spooled_at=clock() - 10, attempts=0))
    found = scrape(cfg(), q1)
    env = (("environment", "it"),)
    assert found[("batching_lineage_spool_events", env)] == 2
    assert found[("batching_lineage_spool_failing_events", env)] == 1
    assert found[("batching_lineage_spool_oldest_age_seconds", env)] == 90


def report(now: float, *findings: Finding) -> Report:
    return Report("parquet", "out", now, None, None, tuple(findings))


def test_the_last_reconcile_shows_its_findings_and_the_last_clean_one(
    q1: SqlQueue, clock: FakeClock
) -> None:
    reconcile_result.remember(q1, report(clock() - 100))  # clean
    lost = Finding(Kind.LOST_WRITE, Severity.CRITICAL, "lost", count=3)
    info = Finding(Kind.DEAD, Severity.INFO, "dead", count=2)
    reconcile_result.remember(q1, report(clock() - 10, lost, info))
    found = scrape(cfg(), q1)
    e = (("environment", "it"), ("queue", "q1"))
    assert found[("batching_reconcile_last_run_timestamp_seconds", e)] == clock() - 10
    assert found[("batching_reconcile_last_clean_timestamp_seconds", e)] == clock() - 100
    assert {
        dict(k[1])["class"]: v for k, v in pick(found, "batching_reconcile_findings").items()
    } == {
        "lost_write": 3.0,
        "dead": 2.0,
    }


def test_a_database_failing_at_scrape_time_shows_up_0_and_does_not_raise() -> None:
    broken = SqlQueue(database.create_engine("postgresql://nobody@127.0.0.1:1/none"), "q1")
    try:
        found = scrape(cfg(), broken)
    finally:
        broken.engine.dispose()
    assert found == {("batching_exporter_up", (("environment", "it"),)): 0.0}


def test_a_sqlite_file_moved_under_the_exporter_shows_up_0(
    sqlite_url: str, clock: FakeClock, tmp_path: Path
) -> None:
    """Its open connection still read the moved file: the old figures, and up 1, while the
    scorers wrote a new file at the path (or nothing)."""
    queue = workload(sqlite_url, clock)
    collector = TableCollector(cfg(), queue, clock)
    try:
        assert pick(scrape_of(collector), "batching_exporter_up") == {UP: 1.0}
        path = Path(queue.engine.url.database or "")
        path.rename(tmp_path / "moved.db")
        assert scrape_of(collector) == {UP: 0.0}
    finally:
        collector.done.wait(30)  # its first done count, not left holding a connection
        queue.engine.dispose()


def test_a_database_of_another_schema_shows_up_0(db_url: str, clock: FakeClock) -> None:
    """Its figures looked normal while every scorer refused the database (an upgrade
    review: an exporter against a database not yet migrated, or migrated by a newer
    release)."""
    queue = workload(db_url, clock)
    collector = TableCollector(cfg(), queue, clock)
    try:
        assert pick(scrape_of(collector), "batching_exporter_up") == {UP: 1.0}
        with queue.engine.begin() as conn:
            conn.execute(
                schema.schema_version.insert().values(
                    version=schema.SCHEMA_VERSION + 1, description="newer", applied_at=0.0
                )
            )
        assert scrape_of(collector) == {UP: 0.0}
    finally:
        collector.done.wait(30)  # its first done count, not left holding a connection
        queue.engine.dispose()


UP = ("batching_exporter_up", (("environment", "it"),))


def scrape_of(collector: TableCollector) -> dict[Key, float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in collector.collect()
        for s in family.samples
    }


def findings_of(found: dict[Key, float]) -> dict[str, float]:
    return {dict(k[1])["class"]: v for k, v in pick(found, "batching_reconcile_findings").items()}


def test_a_narrower_clean_reconcile_does_not_clear_what_it_did_not_look_at(
    q1: SqlQueue, clock: FakeClock
) -> None:
    """A review: the whole-queue reconcile found a missing file; the clean reconcile of
    another run (the trigger after every run) cleared the page with the file still missing."""
    e = (("environment", "it"), ("queue", "q1"))
    lost = Finding(Kind.MISSING_FILE, Severity.CRITICAL, "gone", count=1)
    reconcile_result.remember(q1, report(clock() - 100))  # clean
    reconcile_result.remember(q1, report(clock() - 50, lost))  # the whole queue: a lost file

    def scoped(at: float, since: float | None, run_id: str | None, *found: Finding) -> None:
        reconcile_result.remember(q1, Report("parquet", "out", at, since, run_id, found))

    scoped(clock() - 40, None, "another-run")  # clean, but of one other run
    scoped(clock() - 30, clock() - 3600, None)  # clean, but of the last hour only
    found = scrape(cfg(), q1)
    assert findings_of(found) == {"missing_file": 1.0}
    assert found[("batching_reconcile_last_clean_timestamp_seconds", e)] == clock() - 100
    assert found[("batching_reconcile_last_run_timestamp_seconds", e)] == clock() - 30

    dup = Finding(Kind.DUPLICATE, Severity.CRITICAL, "twice", count=2)
    scoped(clock() - 20, None, "another-run", dup)  # a run's own finding adds to those kept
    assert findings_of(scrape(cfg(), q1)) == {"missing_file": 1.0, "duplicate": 2.0}
    scoped(clock() - 10, None, "another-run")  # that run clean again: the lost file stays
    assert findings_of(scrape(cfg(), q1)) == {"missing_file": 1.0, "duplicate": 2.0}

    reconcile_result.remember(q1, report(clock() - 5))  # the whole queue, clean: cleared
    found = scrape(cfg(), q1)
    assert findings_of(found) == {}
    assert found[("batching_reconcile_last_clean_timestamp_seconds", e)] == clock() - 5


def test_a_window_clears_what_a_window_it_covers_found(q1: SqlQueue, clock: FakeClock) -> None:
    lost = Finding(Kind.MISSING_FILE, Severity.CRITICAL, "gone", count=1)
    now = clock()
    reconcile_result.remember(q1, Report("parquet", "out", now - 50, now - 3600, None, (lost,)))
    reconcile_result.remember(q1, Report("parquet", "out", now - 40, now - 1800, None, ()))
    assert findings_of(scrape(cfg(), q1)) == {"missing_file": 1.0}  # a later window: kept
    reconcile_result.remember(q1, Report("parquet", "out", now - 30, now - 7200, None, ()))
    assert findings_of(scrape(cfg(), q1)) == {}  # a wider window looked again: cleared


def test_a_queue_never_reconciled_shows_since_when_a_reconcile_is_owed(
    q1: SqlQueue, clock: FakeClock
) -> None:
    """Without a series BatchingReconcileStale (time() - last run > 2 h) never fired for a
    queue whose reconcile never ran (found by a review)."""
    e = (("environment", "it"), ("queue", "q1"))
    key = ("batching_reconcile_last_run_timestamp_seconds", e)
    assert key not in scrape(cfg(), q1)  # nothing committed: nothing owed
    runs = schema.runs
    with q1.engine.begin() as conn:
        for run_id, ended, batches in (("r1", clock() - 900, 3), ("r0", clock() - 2000, 0)):
            conn.execute(
                runs.insert().values(
                    run_id=run_id,
                    flow="score",
                    queue="q1",
                    state="completed",
                    started_at=ended - 60,
                    finished_at=ended,
                    n_batches=batches,
                )
            )
    assert scrape(cfg(), q1)[key] == clock() - 900  # the first run that committed
    reconcile_result.remember(q1, report(clock() - 10))
    assert scrape(cfg(), q1)[key] == clock() - 10
