"""``late_policy: expire`` for real: a scoring run on SQLite and PostgreSQL, with a service
profile that predicts every forward pass to take 30 s. Items whose deadline is in the future
at the claim (the claim does not expire them) but before the predicted finish are expired
unscored with a reason naming their deadline and the prediction, counted in the run's stats
and the metrics; their batch-mates commit, and no result row is written for them. The same
run with ``batching.adaptive`` scores everything (the controller is wired in)."""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from batching import models
from batching.compose import run as wiring
from batching.loop import scorer as pipeline
from batching.metrics.recorder import ProcessMetrics, Recorder
from batching.plan.profile import ProfilePoint, ServiceProfile
from batching.store import database, schema
from tests.integration.test_pipeline import enqueue, load, w1_records
from tests.integration.test_queue_verbs import Queue, queue, rec, row

__all__ = ["queue"]  # the queue verbs' fixture: memory, SQLite, PostgreSQL


def slow_profile(path: Path) -> Path:
    """A W1 profile predicting 30 s per forward pass, whatever its size."""
    points = tuple(ProfilePoint(n, 1, 30.0) for n in (1, 8, 64))
    return ServiceProfile(points, "w1-mlp", "w1-mlp-v1", "cpu").save(path)


def items_and_results(db_url: str) -> tuple[dict[str, Any], set[str]]:
    """The item rows by key, and the keys with a result row."""
    engine = database.create_engine(db_url)
    with engine.connect() as conn:
        rows = {r.item_key: r for r in conn.execute(sa.select(schema.items)).all()}
        results = {r.item_key for r in conn.execute(sa.select(schema.results)).all()}
    engine.dispose()
    return rows, results


def test_late_items_expire_with_their_reason_and_their_batch_mates_commit(
    db_url: str, tmp_path: Path
) -> None:
    config = load(
        "tabular.yaml",
        tmp_path,
        output={"kind": "sql"},
        queue={"late_policy": "expire"},
        batching={"max_batch_size": 8},
        service_profile=str(slow_profile(tmp_path / "slow.json")),
    )
    soon = time.time() + 20  # after the claim, before the predicted finish (now + 30 s)
    later = time.time() + 3600
    kinds = ["late"] * 6 + ["later"] * 5 + ["none"] * 5
    deadlines = {"late": soon, "later": later, "none": None}
    recs = [
        dataclasses.replace(r, tenant=k, deadline_at=deadlines[k])
        for r, k in zip(w1_records(len(kinds), tmp_path), kinds, strict=True)
    ]
    enqueue(db_url, config, recs)
    rec = Recorder(config, ProcessMetrics(CollectorRegistry()))

    def observe(scorer: pipeline.Scorer[object]) -> None:
        scorer.observer = rec

    outcome = wiring.run_score(config, db_url=db_url, output=None, on_scorer=observe)
    assert outcome.summary["items_committed"] == 10
    assert outcome.summary["items_expired"] == 6

    rows, results = items_and_results(db_url)
    kind_of = {r.item_key: k for r, k in zip(recs, kinds, strict=True)}
    for key, item in rows.items():
        if kind_of[key] == "late":
            assert item.state == models.State.EXPIRED
            assert key not in results  # never scored, never committed
            assert "late_policy expire: deadline " in item.last_error
            assert "before the predicted finish" in item.last_error
            assert item.lease_id is None
        else:
            assert item.state == models.State.DONE
            assert key in results

    labels = {
        "environment": config.metrics.environment,
        "queue": config.queue.name,
        "tenant": "late",
        "model_version": config.model.version,
    }
    assert rec.metrics.registry.get_sample_value("batching_items_expired_total", labels) == 6


def test_a_default_deadline_expires_items_without_one_and_keeps_their_own(
    db_url: str, tmp_path: Path
) -> None:
    """``queue.default_deadline_s``: an item enqueued without a deadline is due that long
    after its enqueue. With every forward predicted at 30 s, those (due in 5 s) expire with a
    reason naming the default; items with a later deadline of their own commit."""
    config = load(
        "tabular.yaml",
        tmp_path,
        output={"kind": "sql"},
        queue={"late_policy": "expire", "default_deadline_s": 5.0},
        batching={"max_batch_size": 8},
        service_profile=str(slow_profile(tmp_path / "slow.json")),
    )
    recs = w1_records(24, tmp_path)
    later = time.time() + 3600
    recs = [dataclasses.replace(r, deadline_at=later) for r in recs[:8]] + recs[8:]
    enqueue(db_url, config, recs)
    outcome = wiring.run_score(config, db_url=db_url, output=None)
    assert outcome.summary["items_committed"] == 8
    assert outcome.summary["items_expired"] == 16

    rows, results = items_and_results(db_url)
    own = {r.item_key for r in recs[:8]}
    assert results == own
    for key, got in rows.items():
        if key in own:
            assert got.state == models.State.DONE
        else:
            assert got.state == models.State.EXPIRED
            assert "late_policy expire: default deadline " in got.last_error
            assert "(5 s after its enqueue) before the predicted finish" in got.last_error


def test_an_adaptive_run_scores_everything(db_url: str, tmp_path: Path) -> None:
    config = load(
        "tabular.yaml",
        tmp_path,
        output={"kind": "sql"},
        batching={"max_batch_size": 16, "adaptive": True},
    )
    recs = [
        dataclasses.replace(r, deadline_at=time.time() + 3600) for r in w1_records(100, tmp_path)
    ]
    enqueue(db_url, config, recs)
    outcome = wiring.run_score(config, db_url=db_url, output=None)
    assert outcome.summary["items_committed"] == 100
    assert outcome.summary["items_expired"] == 0
    assert set(outcome.summary["release_reasons"]) <= {"size", "idle", "slo", "wait", "flush"}


def test_expire_is_fenced_by_the_lease_and_keeps_each_reason(queue: Queue) -> None:
    """The queue verb, on every queue (memory, SQLite, PostgreSQL): only items the lease
    still holds move to ``expired``, each with its own reason; a redrive brings them back."""
    queue.enqueue([rec("a"), rec("b"), rec("c")])
    claim = queue.claim(3, lease_s=30)
    by_key = {i.item_key: i.id for i in claim.items}
    assert queue.expire("not-my-lease", {by_key["a"]: "x"}) == 0
    assert queue.release(claim.lease_id, [by_key["c"]]) == 1  # no longer held
    reasons = {by_key["a"]: "late a", by_key["b"]: "late b", by_key["c"]: "late c"}
    assert queue.expire(claim.lease_id, reasons) == 2
    assert queue.expire(claim.lease_id, {}) == 0
    for key in ("a", "b"):
        got = row(queue, key)
        assert (got.state, got.last_error, got.lease_id) == (
            models.State.EXPIRED,
            f"late {key}",
            None,
        )
    assert row(queue, "c").state == models.State.READY
    assert queue.redrive([models.State.EXPIRED]) == 2
