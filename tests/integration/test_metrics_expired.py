"""Items that expire in a claim (their deadline passed before scoring) are counted: a real
scoring run's ``batching_items_expired_total`` equals the rows the queue table holds as
expired, by tenant (the claim's own report: tests/integration/test_queue_verbs.py)."""

from __future__ import annotations

import dataclasses
import time
from collections import Counter
from pathlib import Path

import sqlalchemy as sa
from prometheus_client import CollectorRegistry

from batching import models
from batching.compose import run as wiring
from batching.loop import scorer as pipeline
from batching.metrics.recorder import ProcessMetrics, Recorder
from batching.store import database, schema
from tests.integration.test_pipeline import enqueue, load, w1_records


def expired_in_table(url: str) -> Counter[str]:
    engine = database.create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(schema.items.c.tenant).where(
                schema.items.c.state == int(models.State.EXPIRED)
            )
        ).all()
    engine.dispose()
    return Counter(r.tenant for r in rows)


def test_a_run_counts_the_items_its_claims_expired_by_tenant(db_url: str, tmp_path: Path) -> None:
    config = load("tabular.yaml", tmp_path, output={"kind": "sql"}, batching={"max_batch_size": 8})
    past = time.time() - 60
    tenants = ["a"] * 5 + ["b"] * 3 + ["c"] * 12  # c: not one expires
    recs = [
        dataclasses.replace(r, tenant=t, deadline_at=past if t != "c" else None)
        for r, t in zip(w1_records(len(tenants), tmp_path), tenants, strict=True)
    ]
    enqueue(db_url, config, recs)
    rec = Recorder(config, ProcessMetrics(CollectorRegistry()))

    def observe(scorer: pipeline.Scorer[object]) -> None:
        scorer.observer = rec

    outcome = wiring.run_score(config, db_url=db_url, output=None, on_scorer=observe)
    assert outcome.summary["items_committed"] == 12

    def counted(tenant: str) -> float | None:
        labels = {
            "environment": config.metrics.environment,
            "queue": config.queue.name,
            "tenant": tenant,
            "model_version": config.model.version,
        }
        return rec.metrics.registry.get_sample_value("batching_items_expired_total", labels)

    assert expired_in_table(db_url) == {"a": 5, "b": 3}
    assert (counted("a"), counted("b"), counted("c")) == (5, 3, None)
