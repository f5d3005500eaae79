"""Tenant fair share in batch forming, through a real scoring run (SQLite and PostgreSQL, the
W1 model): one claim takes a flood and a quiet tenant's few items together, and the batcher
cuts the quiet tenant's items into the first batches, not behind the flood; every item is
committed once. Without ``fair_share`` the quiet items go last (the order arithmetic is
tests/unit/test_batcher_fair.py)."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import models
from batching.compose import run as wiring
from batching.store import database, schema
from tests.integration.test_pipeline import enqueue, load, w1_records


@pytest.mark.parametrize("fair", [True, False])
def test_a_quiet_tenant_is_batched_beside_a_flood_not_behind_it(
    db_url: str, tmp_path: Path, fair: bool
) -> None:
    config = load(
        "tabular.yaml",
        tmp_path,
        output={"kind": "sql"},
        queue={"fair_share": fair},
        batching={"max_batch_size": 16, "claim_size": 4096},
    )
    flood = [dataclasses.replace(r, tenant="flood") for r in w1_records(320, tmp_path)]
    quiet = [
        dataclasses.replace(r, tenant="quiet", item_key=f"quiet-{k}")
        for k, r in enumerate(w1_records(16, tmp_path))
    ]
    enqueue(db_url, config, flood)
    enqueue(db_url, config, quiet)  # enqueued after the whole flood
    released: list[list[str]] = []

    def watch(scorer: Any) -> None:
        poll = scorer.batcher.poll

        def recorded(*args: Any, **kwargs: Any) -> models.Batch | None:
            batch: models.Batch | None = poll(*args, **kwargs)
            if batch is not None:
                released.append([i.tenant for i in batch.items])
            return batch

        scorer.batcher.poll = recorded

    outcome = wiring.run_score(config, db_url=db_url, output=None, on_scorer=watch)
    assert outcome.summary["items_committed"] == 336

    quiet_in = [k for k, tenants in enumerate(released) if "quiet" in tenants]
    if fair:  # after the first item (the flood's oldest), half of each batch
        assert quiet_in == [0, 1]
    else:
        assert quiet_in == [len(released) - 1]
    engine = database.create_engine(db_url)
    with engine.connect() as conn:
        done = conn.execute(
            sa.select(sa.func.count()).where(schema.items.c.state == int(models.State.DONE))
        ).scalar()
        results = conn.execute(sa.select(sa.func.count()).select_from(schema.results)).scalar()
    engine.dispose()
    assert done == results == 336
