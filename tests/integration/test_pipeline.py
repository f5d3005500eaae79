"""The whole scoring run for real: SQLite / PostgreSQL queue, torch models, Parquet read back.

Every enqueued item ends committed exactly once (one row in the dataset, state done) or dead
with its reason, whatever happens to the run: poison payloads, a lease lost before commit,
SIGTERM or SIGKILL in the middle.
"""

from __future__ import annotations

import dataclasses
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as ds
import pytest
import sqlalchemy as sa
import torch
import yaml

from batching import config as cfg
from batching import errors, models
from batching.compose import build
from batching.compose import record as run_record
from batching.compose import run as wiring
from batching.evidence import lineage, lineage_log
from batching.evidence import reconcile as rc
from batching.ingress import ingest, run_ledger
from batching.ingress import queue as q
from batching.loop import scorer as pipeline
from batching.loop.workers import worker_job_name
from batching.model import workloads
from batching.model.runner import TorchRunner
from batching.outputs import contract as sinks
from batching.store import database, schema
from tests import olspec
from tests.conftest import REPO, as_held, wait_for

DEPLOYMENTS = REPO / "deployments"
W1_DIM = 64


# ----------------------------------------------------------------------------- helpers


def load(name: str, tmp_path: Path, **overrides: Any) -> cfg.PipelineConfig:
    """A shipped config with overrides; lineage goes to ``tmp_path`` (never the repository)."""
    overrides.setdefault("lineage", {"path": str(tmp_path / "lineage" / "events.jsonl")})
    return cfg.load_config(DEPLOYMENTS / name, overrides)


def write_config(name: str, tmp_path: Path, **overrides: Any) -> Path:
    """A shipped config copied into ``tmp_path`` with overrides, for a subprocess to load."""
    data = yaml.safe_load((DEPLOYMENTS / name).read_text())
    for section, values in overrides.items():
        data[section] = {**data.get(section, {}), **values}
    data["service_profile"] = str(DEPLOYMENTS / data["service_profile"])
    data["output"]["path"] = str(tmp_path / "outputs")
    path = tmp_path / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def open_queue(url: str, config: cfg.PipelineConfig) -> q.SqlQueue:
    return build.open_queue(config, url, create=True)


def enqueue(url: str, config: cfg.PipelineConfig, records: list[models.EnqueueRecord]) -> None:
    queue = open_queue(url, config)
    queue.migrate()
    assert queue.enqueue(records).inserted == len(records)
    queue.engine.dispose()


def w1_records(n: int, tmp_path: Path) -> list[models.EnqueueRecord]:
    """W1 rows as binary tensor payloads, through the real Parquet ingest path."""
    return ingest.read_records(workloads.write_w1_parquet(tmp_path / "w1.parquet", n))


def json_record(key: str, payload: Any) -> models.EnqueueRecord:
    return ingest.record_from_mapping({"item_key": key, "payload": payload}, key)


def raw_record(key: str, payload: models.Payload) -> models.EnqueueRecord:
    return models.EnqueueRecord(key, payload)


def score(
    config: cfg.PipelineConfig, url: str, root: Path | str | None, **kw: Any
) -> wiring.ScoreOutcome:
    return wiring.run_score(config, db_url=url, output=None if root is None else str(root), **kw)


def dataset(root: Path) -> dict[str, Any]:
    """The Parquet dataset as a reader sees it; fails on a key that is there twice."""
    table = ds.dataset(root, format="parquet", partitioning="hive").to_table()
    keys = table["item_key"].to_pylist()
    twice = [k for k, n in Counter(keys).items() if n > 1]
    assert not twice, f"keys committed more than once: {twice[:5]}"
    return {
        k: {"output": o, "batch_id": b}
        for k, o, b in zip(
            keys, table["output"].to_pylist(), table["batch_id"].to_pylist(), strict=True
        )
    }


def items(url: str) -> dict[str, Any]:
    """Every item row by key, as its lease holds it (``tests.conftest.as_held``)."""
    engine = database.create_engine(url)
    with engine.connect() as conn:
        rows = {r.item_key: r for r in as_held(conn, list(conn.execute(sa.select(schema.items))))}
    engine.dispose()
    return rows


def runs(url: str) -> list[Any]:
    engine = database.create_engine(url)
    with engine.connect() as conn:
        rows = list(conn.execute(sa.select(schema.runs)))
    engine.dispose()
    return rows


def ledger(url: str) -> dict[str, Any]:
    engine = database.create_engine(url)
    with engine.connect() as conn:
        rows = {r.batch_id: r for r in conn.execute(sa.select(schema.batches))}
    engine.dispose()
    return rows


def reconcile(
    config: cfg.PipelineConfig, url: str, target: Path | str, run_id: str | None = None
) -> rc.Report:
    queue = open_queue(url, config)
    res = build.resolve(config, url, str(target))
    report = rc.reconcile(
        queue, build.open_sink(queue, res, read_only=True), now=time.time(), run_id=run_id
    )
    queue.engine.dispose()
    return report


def assert_done_once(url: str, root: Path, keys: set[str]) -> dict[str, Any]:
    """Each key is done and in the dataset exactly once, pointing at a live ledger row."""
    rows, out, batches = items(url), dataset(root), ledger(url)
    assert set(out) >= keys
    for key in keys:
        assert rows[key].state == models.State.DONE, (key, rows[key].last_error)
        assert out[key]["batch_id"] == rows[key].batch_id
        assert batches[rows[key].batch_id].state == "published"
    return out


def w1_model() -> torch.nn.Module:
    spec = cfg.load_config(DEPLOYMENTS / "tabular.yaml").model
    return TorchRunner.load(spec).model


def w1_direct(x: np.ndarray) -> np.ndarray:
    with torch.inference_mode():
        out: np.ndarray = w1_model()(torch.from_numpy(x)).numpy()
    return out


# ----------------------------------------------------------------------------- exactly once


POISON: dict[str, tuple[models.EnqueueRecord, str]] = {
    "short-vector": (
        json_record("short-vector", {"x": [1.0, 2.0, 3.0]}),
        '"x" must be a list of 64',
    ),
    "wrong-shape": (json_record("wrong-shape", {"y": [0.0] * W1_DIM}), 'no "x" (its keys: y)'),
    "not-json": (raw_record("not-json", models.Payload(b"\xffnot json")), "not valid JSON"),
    "bad-tensor": (
        raw_record(
            "bad-tensor",
            models.Payload(
                np.zeros(3, np.float32).tobytes(), models.PayloadFormat.TENSOR, "float32", (3,)
            ),
        ),
        "does not match (64,)",
    ),
    "nan-row": (
        raw_record(
            "nan-row",
            models.Payload(
                np.full(W1_DIM, np.nan, np.float32).tobytes(),
                models.PayloadFormat.TENSOR,
                "float32",
                (W1_DIM,),
            ),
        ),
        "not finite",
    ),
}


def test_every_item_commits_exactly_once_or_dies_with_its_reason(
    db_url: str, tmp_path: Path
) -> None:
    n = 300
    config = load("tabular.yaml", tmp_path, queue={"max_attempts": 2, "backoff_base_s": 0})
    x = workloads.w1_inputs(n)
    good = [json_record(f"w1-{i}", {"x": row.tolist()}) for i, row in enumerate(x)]
    records = list(good)
    for pos, (record, _) in zip(range(40, n, 50), POISON.values(), strict=False):
        records.insert(pos, record)  # poison in the middle of what becomes one batch
    enqueue(db_url, config, records)
    root = tmp_path / "outputs"

    first = score(config, db_url, root)
    # A payload the model cannot read is dead at once, nan-row too (a NaN input is refused
    # at decode); the second run finds nothing of them to retry.
    score(config, db_url, root)

    out = assert_done_once(db_url, root, {r.item_key for r in good})
    assert len(out) == n
    rows = items(db_url)
    assert {rows[r.item_key].attempts for r in good} == {1}
    for key, (_, reason) in POISON.items():
        assert rows[key].state == models.State.DEAD
        assert rows[key].attempts == 1, key
        assert reason in rows[key].last_error, rows[key].last_error
        assert key not in out
    # one batch held the poison and its batch-mates, and the batch-mates committed
    assert first.summary["batch_size_p99"] == n + len(POISON)
    assert len({out[r.item_key]["batch_id"] for r in good}) == 1
    got = np.array([out[f"w1-{i}"]["output"] for i in range(n)], dtype=np.float32)
    np.testing.assert_allclose(got, w1_direct(x), rtol=0, atol=1e-6)
    report = reconcile(config, db_url, root)
    assert report.clean, report.to_dict()
    assert report.counts == {"dead": len(POISON)}


class ReaperBeforeCommit:
    """Wraps the run's sink: before the first commit its lease expires and a reaper runs."""

    def __init__(self, sink: Any, url: str, config: cfg.PipelineConfig) -> None:
        self.sink, self.url, self.config = sink, url, config
        self.lost: list[Any] = []
        self.expired = 0  # the rows of the lease it expired (later claims add to a lease)

    def commit(self, batch: Any) -> Any:
        if not self.lost:
            self.lost.append(batch)
            reaper = open_queue(self.url, self.config)
            with reaper.begin() as conn:
                self.expired = conn.execute(
                    schema.items.update()
                    .where(schema.items.c.lease_id == batch.lease_id, schema.items.c.state == 1)
                    .values(lease_expires_at=time.time() - 1)
                ).rowcount
                self.expired += sum(  # a range lease's items, by its one row
                    r[0]
                    for r in conn.execute(
                        schema.ranges.update()
                        .where(schema.ranges.c.lease_id == batch.lease_id)
                        .values(lease_expires_at=time.time() - 1)
                        .returning(schema.ranges.c.remaining)
                    )
                )
            reaper.release_expired()  # or the run's own next claim reaps them first
            # This batch's items are no longer held (a claim of the run may have added
            # others to the lease since: its expiry was forced here, not waited out).
            ids = models.item_column(batch.items, "id")
            with reaper.engine.connect() as conn:
                held = conn.execute(
                    sa.select(sa.func.count()).where(
                        schema.items.c.lease_id == batch.lease_id,
                        schema.items.c.state == 1,
                        schema.items.c.id.in_(list(ids)),
                    )
                ).scalar()
                r = schema.ranges.c
                ranged = conn.execute(  # a range of the lease over any of the batch's items
                    sa.select(sa.func.count())
                    .select_from(schema.ranges)
                    .where(r.lease_id == batch.lease_id, r.lo <= max(ids), r.hi >= min(ids))
                ).scalar()
            assert held == ranged == 0, "the lease still holds the batch's items: nothing tested"
            reaper.engine.dispose()
        return self.sink.commit(batch)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.sink, name)


def test_a_batch_whose_lease_was_lost_is_not_committed_and_its_items_score_once_later(
    sqlite_url: str, tmp_path: Path
) -> None:
    config = load("tabular.yaml", tmp_path, batching={"max_batch_size": 50, "claim_size": 50})
    enqueue(sqlite_url, config, w1_records(200, tmp_path))
    root = tmp_path / "outputs"
    wrapped: list[ReaperBeforeCommit] = []

    def wrap(scorer: pipeline.Scorer[Any]) -> None:
        assert isinstance(scorer.outputs, sinks.Outputs)
        wrapped.append(ReaperBeforeCommit(scorer.outputs.sink, sqlite_url, config))
        scorer.outputs.sink = wrapped[0]

    first = score(config, sqlite_url, root, on_scorer=wrap)
    second = score(config, sqlite_url, root)  # picks up what the first run did not
    (lost,) = wrapped[0].lost
    assert len(lost.items) in (50, 100, 150, 200)  # one batch, or several of one lease
    # The commit's items (its batches of one lease: 50 or more) are lost; the lease's other
    # expired items are lost too when committed before the run ends, else given back.
    assert wrapped[0].expired >= len(lost.items) >= 50
    assert first.summary["lease_lost_items"] >= len(lost.items)
    assert first.summary["items_committed"] + second.summary["items_committed"] == 200
    assert lost.batch_id not in ledger(sqlite_url)
    leftovers = [p for p in tmp_path.rglob(f"*{lost.batch_id}*")]
    assert leftovers == [], "a file of the discarded batch survived"
    out = assert_done_once(sqlite_url, root, {f"w1-{i}" for i in range(200)})
    rows = items(sqlite_url)
    for item in lost.items:
        assert out[item.item_key]["batch_id"] != lost.batch_id
        # The lost lease's attempt was given back; scored again in an isolation round.
        assert (rows[item.item_key].attempts, rows[item.item_key].crash_count) == (1, 1)
    assert reconcile(config, sqlite_url, root).clean


# ----------------------------------------------------------------------------- outputs


def test_w1_outputs_read_back_match_the_model_run_directly(sqlite_url: str, tmp_path: Path) -> None:
    n = 256
    config = load("tabular.yaml", tmp_path, batching={"max_batch_size": 64})
    enqueue(sqlite_url, config, w1_records(n, tmp_path))
    root = tmp_path / "outputs"
    outcome = score(config, sqlite_url, root)
    assert outcome.summary["items_committed"] == n
    assert outcome.summary["batches"] >= n // 64
    out = dataset(root)
    got = np.array([out[f"w1-{i}"]["output"] for i in range(n)], dtype=np.float32)
    want = w1_direct(workloads.w1_inputs(n))
    assert got.shape == want.shape == (n, 1)
    np.testing.assert_allclose(got, want, rtol=0, atol=1e-6)
    assert np.std(want) > 1e-3  # the comparison can tell rows apart


def tensor_record(key: str, row: np.ndarray) -> models.EnqueueRecord:
    return raw_record(
        key, models.Payload(row.tobytes(), models.PayloadFormat.TENSOR, "float32", row.shape)
    )


class DecodeSpy:
    """Wraps the run's runner: records the kind of every batch it decodes."""

    def __init__(self, runner: Any) -> None:
        self.runner, self.kinds = runner, Counter[str]()

    def decode(self, items: Any) -> Any:
        self.kinds[type(items).__name__] += 1
        return self.runner.decode(items)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.runner, name)


def spy_on_decode(spies: list[DecodeSpy]) -> Callable[[pipeline.Scorer[Any]], None]:
    def wrap(scorer: pipeline.Scorer[Any]) -> None:
        spies.append(DecodeSpy(scorer.runner))
        scorer.runner = spies[-1]

    return wrap


def test_uniform_tensor_claims_score_as_columns_and_a_non_finite_row_fails_alone(
    sqlite_url: str, tmp_path: Path
) -> None:
    # Tensor rows of one dtype and shape are claimed as ItemBlocks and cut into batches as
    # slices. A NaN row among them is as uniform as the rest: it fails alone at decode, dead
    # at once (its own input), and its batch-mates commit.
    n = 200
    config = load(
        "tabular.yaml",
        tmp_path,
        batching={"max_batch_size": 50, "claim_size": 100},
        queue={"max_attempts": 2, "backoff_base_s": 0},
    )
    x = workloads.w1_inputs(n)
    records = [tensor_record(f"w1-{i}", row) for i, row in enumerate(x)]
    records.insert(120, tensor_record("nan-row", np.full(W1_DIM, np.nan, np.float32)))
    enqueue(sqlite_url, config, records)
    root = tmp_path / "outputs"
    spies: list[DecodeSpy] = []
    first = score(config, sqlite_url, root, on_scorer=spy_on_decode(spies))
    again = score(config, sqlite_url, root)  # nothing to retry: nan-row is dead already
    assert again.summary["items_failed"] == 0
    assert spies[0].kinds["ItemBlock"] >= 3, spies[0].kinds
    assert first.summary["items_committed"] == n
    out = assert_done_once(sqlite_url, root, {f"w1-{i}" for i in range(n)})
    got = np.array([out[f"w1-{i}"]["output"] for i in range(n)], dtype=np.float32)
    np.testing.assert_allclose(got, w1_direct(x), rtol=0, atol=1e-6)
    nan_row = items(sqlite_url)["nan-row"]
    assert (nan_row.state, nan_row.attempts) == (models.State.DEAD, 1)
    assert "not finite" in nan_row.last_error
    assert reconcile(config, sqlite_url, root).counts == {"dead": 1}


def test_a_uniform_claim_of_the_wrong_shape_is_dead_item_by_item_with_its_reason(
    sqlite_url: str, tmp_path: Path
) -> None:
    config = load("tabular.yaml", tmp_path)
    records = [tensor_record(f"short-{i}", np.zeros(3, np.float32)) for i in range(5)]
    enqueue(sqlite_url, config, records)
    outcome = score(config, sqlite_url, tmp_path / "outputs")
    assert (outcome.summary["items_committed"], outcome.summary["items_failed"]) == (0, 5)
    for row in items(sqlite_url).values():
        assert row.state == models.State.DEAD
        assert "does not match (64,)" in row.last_error


def test_w2_padded_batch_outputs_match_each_sequence_scored_alone(
    sqlite_url: str, tmp_path: Path
) -> None:
    seqs = [s for s in workloads.w2_inputs(300) if 33 <= len(s) <= 48][:6]  # one length bucket
    assert len({len(s) for s in seqs}) > 1, "need different lengths to get padding"
    config = load("online.yaml", tmp_path)
    records = [json_record(f"w2-{i}", {"tokens": s.tolist()}) for i, s in enumerate(seqs)]
    enqueue(sqlite_url, config, records)
    root = tmp_path / "outputs"
    outcome = score(config, sqlite_url, root)
    assert outcome.summary["batches"] == 1
    assert outcome.summary["padding_efficiency"] < 1.0
    out = dataset(root)
    model = TorchRunner.load(config.model, base_dir=config.base_dir).model
    for i, seq in enumerate(seqs):
        tokens = torch.from_numpy(seq)[None, :]
        with torch.inference_mode():
            alone = model(tokens, torch.zeros_like(tokens, dtype=torch.bool))[0].numpy()
        got = np.array(out[f"w2-{i}"]["output"], dtype=np.float32)
        assert got.shape == (256,)
        np.testing.assert_allclose(got, alone, rtol=0, atol=1e-5)


# ----------------------------------------------------------------------------- SQL sink


def test_the_sql_sink_commits_each_item_exactly_once(db_url: str, tmp_path: Path) -> None:
    n = 120
    config = load("tabular.yaml", tmp_path, output={"kind": "sql"}, batching={"max_batch_size": 32})
    enqueue(db_url, config, w1_records(n, tmp_path))
    outcome = score(config, db_url, None)
    assert outcome.summary["items_committed"] == n
    assert outcome.output == "batching_results"

    queue = open_queue(db_url, config)
    assert queue.enqueue(w1_records(n, tmp_path)).inserted == 0  # the producer sends it all again
    queue.engine.dispose()
    again = score(config, db_url, None)
    assert again.summary["items_committed"] == 0

    engine = database.create_engine(db_url)
    with engine.connect() as conn:
        results = conn.execute(sa.select(schema.results)).all()
    engine.dispose()
    keys = Counter(r.item_key for r in results)
    assert keys == Counter(f"w1-{i}" for i in range(n))
    rows, batches = items(db_url), ledger(db_url)
    for r in results:
        assert rows[r.item_key].state == models.State.DONE
        assert rows[r.item_key].batch_id == r.batch_id
        assert (batches[r.batch_id].sink, batches[r.batch_id].state) == ("sql", "published")
    by_key = {r.item_key: np.frombuffer(r.output, dtype="<f4") for r in results}
    got = np.stack([by_key[f"w1-{i}"] for i in range(n)])
    np.testing.assert_allclose(got, w1_direct(workloads.w1_inputs(n)), rtol=0, atol=1e-6)
    assert reconcile(config, db_url, "batching_results").clean


def refuse_results(url: str) -> sa.engine.Engine:
    """The SQL results table refusing every insert (a trigger named ``refuse``: a real
    database error at step 2 of the commit); drop the trigger through the engine returned."""
    engine = database.create_engine(url)
    with engine.begin() as conn:
        schema.ensure_results_table(conn, schema.results)
        conn.exec_driver_sql(
            "CREATE TRIGGER refuse BEFORE INSERT ON batching_results "
            "BEGIN SELECT RAISE(ABORT, 'disk full'); END"
        )
    return engine


def test_a_commit_the_database_refuses_gives_its_items_back_without_an_attempt(
    sqlite_url: str, tmp_path: Path
) -> None:
    # The results table refuses every insert (a trigger: a real database error at step 2 of
    # the commit). The run fails, and its items are ready again with their attempt unused: on
    # their only attempt, left to the reaper, they would have gone dead for the database's
    # fault. Once the table takes rows again, they commit once.
    n = 40
    config = load("tabular.yaml", tmp_path, output={"kind": "sql"}, batching={"max_batch_size": 8})
    queue = open_queue(sqlite_url, config)
    queue.migrate()
    records = [dataclasses.replace(r, max_attempts=1) for r in w1_records(n, tmp_path)]
    assert queue.enqueue(records).inserted == n
    queue.engine.dispose()
    engine = refuse_results(sqlite_url)
    with pytest.raises(errors.QueueError, match="disk full"):
        score(config, sqlite_url, None)
    assert {(r.state, r.attempts) for r in items(sqlite_url).values()} == {(models.State.READY, 0)}
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER refuse")
    engine.dispose()
    assert score(config, sqlite_url, None).summary["items_committed"] == n
    assert {r.state for r in items(sqlite_url).values()} == {models.State.DONE}
    assert reconcile(config, sqlite_url, "batching_results").clean


def test_a_retry_gives_back_what_its_failed_attempt_could_not_before_it_claims(
    sqlite_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The database refuses the commit, and then the give-back too (cut off): the items stay
    # leased. The run's retry 5 s later (Prefect's, same run id, same process) claimed
    # nothing until the leases expired, and the flow run ended Completed with the queue
    # leased (a Prefect review). It gives them back first now, then scores them.
    n = 24
    config = load("tabular.yaml", tmp_path, output={"kind": "sql"}, batching={"max_batch_size": 8})
    enqueue(sqlite_url, config, w1_records(n, tmp_path))
    engine = refuse_results(sqlite_url)

    def cut_off(*_args: Any, **_kwargs: Any) -> int:
        raise errors.Disconnected("connection to the database lost")

    run_id = lineage.new_run_id()

    def attempt(number: int) -> wiring.WorkersScoreOutcome:
        """The flow's score-queue task: one worker in process, a new worker run each time."""
        done = wiring.run_score_workers(
            config,
            1,
            db_url=sqlite_url,
            run_id=run_id,
            attempt=run_record.Attempt(number),
            in_process=True,
        )
        if (error := done.workers.error()) is not None:
            raise error
        return done

    with monkeypatch.context() as patch:
        patch.setattr(q.SqlQueue, "release", cut_off)
        with pytest.raises(errors.QueueError, match="disk full"):
            attempt(1)
    assert {r.state for r in items(sqlite_url).values()} == {models.State.LEASED}
    with engine.begin() as conn:
        conn.exec_driver_sql("DROP TRIGGER refuse")
    engine.dispose()
    assert attempt(2).summary["items_committed"] == n
    assert {(r.state, r.attempts) for r in items(sqlite_url).values()} == {(models.State.DONE, 1)}


def test_a_retry_gives_back_what_its_failed_spawned_workers_could_not(
    sqlite_url: str, tmp_path: Path
) -> None:
    # As above with two spawned workers, where the database cuts the give-back off for real
    # (triggers refuse every release: a range's delete, a leased item's return). A worker's
    # memory of its leases ends with its process, so it reports them, and the parent's next
    # attempt gives them back before its workers claim: everything commits in that attempt,
    # each item on its one attempt, not after the 300 s lease.
    n = 24
    config = load("tabular.yaml", tmp_path, output={"kind": "sql"}, batching={"max_batch_size": 8})
    enqueue(sqlite_url, config, w1_records(n, tmp_path))
    engine = refuse_results(sqlite_url)
    with engine.begin() as conn:
        conn.exec_driver_sql(
            "CREATE TRIGGER cut_ranges BEFORE DELETE ON batching_ranges "
            "BEGIN SELECT RAISE(ABORT, 'connection lost'); END"
        )
        conn.exec_driver_sql(
            "CREATE TRIGGER cut_items BEFORE UPDATE OF state ON batching_items "
            f"WHEN OLD.state = {int(models.State.LEASED)} AND NEW.state = {int(models.State.READY)} "
            "BEGIN SELECT RAISE(ABORT, 'connection lost'); END"
        )
    run_id = lineage.new_run_id()

    def attempt(number: int) -> wiring.WorkersScoreOutcome:
        return wiring.run_score_workers(
            config, 2, db_url=sqlite_url, run_id=run_id, attempt=run_record.Attempt(number)
        )

    first = attempt(1)
    assert isinstance(first.workers.error(), errors.QueueError)
    assert sum(len(r.unreleased) for r in first.workers.reports) >= 1
    assert open_queue(sqlite_url, config).stats().by_state["leased"] == n
    with engine.begin() as conn:
        for trigger in ("refuse", "cut_ranges", "cut_items"):
            conn.exec_driver_sql(f"DROP TRIGGER {trigger}")
    engine.dispose()
    second = attempt(2)
    assert second.workers.error() is None
    assert second.summary["items_committed"] == n
    assert {(r.state, r.attempts) for r in items(sqlite_url).values()} == {(models.State.DONE, 1)}


def test_a_run_that_fails_its_checks_is_on_record_in_lineage(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A pre-start failure (here a checkpoint that is not the pinned one) still emits START and
    FAIL with the error, valid against the OpenLineage schemas, and scores nothing."""
    config = load("tabular.yaml", tmp_path, model={"sha256": "0" * 64})
    enqueue(sqlite_url, config, w1_records(4, tmp_path))
    with pytest.raises(errors.CheckpointError):
        wiring.run_score(config, db_url=sqlite_url, output=str(tmp_path / "out"))
    events = lineage_log.read_events(tmp_path / "lineage" / "events.jsonl")
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    assert "sha256" in events[1]["run"]["facets"]["errorMessage"]["message"]
    registry = olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())
    for event in events:
        olspec.assert_valid_event(event, registry)
    assert open_queue(sqlite_url, config).stats().by_state["ready"] == 4


def test_a_run_that_fails_as_scoring_starts_is_failed_in_lineage_and_the_run_ledger(
    sqlite_url: str, tmp_path: Path
) -> None:
    config = load("tabular.yaml", tmp_path)
    enqueue(sqlite_url, config, w1_records(4, tmp_path))

    def broken_hook(_scorer: pipeline.Scorer[Any]) -> None:
        raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        wiring.run_score(
            config, db_url=sqlite_url, output=str(tmp_path / "out"), on_scorer=broken_hook
        )
    events = lineage_log.read_events(tmp_path / "lineage" / "events.jsonl")
    assert [e["eventType"] for e in events] == ["START", "FAIL"]
    queue = open_queue(sqlite_url, config)
    with queue.engine.connect() as conn:
        (state,) = conn.execute(sa.select(schema.runs.c.state)).scalars().all()
    assert state == "failed"


# ----------------------------------------------------------------------------- signals


def wait_for_done(
    url: str, at_least: int, proc: subprocess.Popen[Any], timeout_s: float = 60
) -> int:
    """Poll the queue until ``at_least`` items are done (the run is mid-way), return the count."""
    engine = database.create_engine(url)
    deadline = time.monotonic() + timeout_s
    try:
        while time.monotonic() < deadline:
            assert proc.poll() is None, proc.communicate()
            with engine.connect() as conn:
                done = conn.execute(
                    sa.select(sa.func.count()).where(schema.items.c.state == models.State.DONE)
                ).scalar_one()
            if done >= at_least:
                return int(done)
            time.sleep(0.02)
    finally:
        engine.dispose()
    raise AssertionError(f"fewer than {at_least} items done after {timeout_s} s")


N_SIGNAL = 3000
SLOW = {"max_batch_size": 8, "claim_size": 32, "max_wait_s": 0.01}


def slow_w1_queue(
    url: str, tmp_path: Path, n: int, **queue: Any
) -> tuple[Path, cfg.PipelineConfig]:
    """``n`` W1 items enqueued for a scorer process with small batches (a run that lasts long
    enough to be signalled mid-way); ``queue`` overrides queue settings (e.g. ``lease_s``)."""
    extra = {"queue": {"name": "tabular", **queue}} if queue else {}
    path = write_config("tabular.yaml", tmp_path, batching=SLOW, **extra)
    config = cfg.load_config(path)
    enqueue(url, config, w1_records(n, tmp_path))
    return path, config


def outlive_leases(lease_s: float) -> None:
    """Let a killed scorer's leases run out in real time (the next claim reaps them)."""
    time.sleep(lease_s + 0.2)


@pytest.mark.slow
def test_a_scorer_started_under_nohup_keeps_scoring_past_a_hangup(
    sqlite_url: str, tmp_path: Path
) -> None:
    """``nohup batching score ... &`` over SSH: the hangup at logout is ignored, as nohup
    asks (a review found the SIGHUP handler overrode it and the scorer stopped)."""
    path, _ = slow_w1_queue(sqlite_url, tmp_path, N_SIGNAL)
    batching = str(Path(sys.executable).with_name("batching"))
    proc = subprocess.Popen(
        ["nohup", batching, "score", "-c", str(path), "--db", sqlite_url, "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=tmp_path,
        start_new_session=True,
    )
    try:
        wait_for_done(sqlite_url, 200, proc)
        proc.send_signal(signal.SIGHUP)
        wait_for_done(sqlite_url, 600, proc)  # asserts it is still running while it waits
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP], ids=["SIGTERM", "SIGHUP"])
def test_sigterm_mid_run_loses_nothing_and_charges_no_attempt(
    sqlite_url: str,
    tmp_path: Path,
    score_process: Callable[..., subprocess.Popen[Any]],
    sig: signal.Signals,
) -> None:
    """SIGHUP too (a scorer whose terminal went away died with its items leased)."""
    path, config = slow_w1_queue(sqlite_url, tmp_path, N_SIGNAL)
    proc = score_process(path)
    wait_for_done(sqlite_url, 200, proc)
    proc.send_signal(sig)
    stdout, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert "items released" in stdout
    assert f"note: stopped by {sig.name}: batches in flight were committed" in stderr

    rows = items(sqlite_url)
    states = Counter(models.State(r.state) for r in rows.values())
    assert states[models.State.LEASED] == 0, "a clean stop left leased items"
    assert states[models.State.DONE] + states[models.State.READY] == N_SIGNAL
    assert states[models.State.READY] > 0, "the run finished before SIGTERM; nothing tested"
    ready = [r for r in rows.values() if r.state == models.State.READY]
    assert {r.attempts for r in ready} == {0}, "released items were charged an attempt"

    root = tmp_path / "outputs"
    second = score(config, sqlite_url, root)
    assert second.summary["items_committed"] == states[models.State.READY]
    assert_done_once(sqlite_url, root, {f"w1-{i}" for i in range(N_SIGNAL)})
    assert {r.attempts for r in items(sqlite_url).values()} == {1}
    assert reconcile(config, sqlite_url, root).clean


@pytest.mark.slow
def test_sigkill_mid_run_then_restart_and_reconcile_lose_nothing(
    sqlite_url: str, tmp_path: Path, score_process: Callable[..., subprocess.Popen[Any]]
) -> None:
    lease_s = 4.0  # heartbeats every 1.3 s: a loaded machine must not lose a live lease
    path, config = slow_w1_queue(sqlite_url, tmp_path, N_SIGNAL, lease_s=lease_s)
    proc = score_process(path)
    wait_for_done(sqlite_url, 200, proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.communicate(timeout=30)
    assert proc.returncode == -signal.SIGKILL

    leased = {k for k, r in items(sqlite_url).items() if r.state == models.State.LEASED}
    assert leased, "the kill left no leased items; nothing tested"
    (killed,) = [r.run_id for r in runs(sqlite_url) if r.state == "running"]
    outlive_leases(2 * lease_s)  # the run's heartbeat too: it counts as abandoned after that

    root = tmp_path / "outputs"
    # No reaper run: the restart recovers the sink, its claims reap the dead run's leases,
    # and it closes the dead run (ledger and lineage).
    restart = score(config, sqlite_url, root)
    dead = {r.run_id: r for r in runs(sqlite_url)}[killed]
    assert dead.state == "failed"
    assert dead.error.startswith("abandoned: no heartbeat since ")
    assert restart.events_path is not None
    killed_events = [
        e for e in lineage_log.read_events(restart.events_path) if e["run"]["runId"] == killed
    ]
    ended = [e["eventType"] for e in killed_events]
    assert ended[0] == "START"
    assert ended[-1] == "FAIL"
    # the rows it committed before it died, in its output (a review: in no event before)
    (fail_out,) = killed_events[-1]["outputs"]
    (start_out,) = killed_events[0]["outputs"]
    assert (fail_out["namespace"], fail_out["name"]) == (start_out["namespace"], start_out["name"])
    committed = fail_out["outputFacets"]["outputStatistics"]["rowCount"]
    assert committed == dead.n_items >= 200
    assert f"{committed} row(s) committed" in dead.error
    report = reconcile(config, sqlite_url, root)
    assert report.clean, json.dumps(report.to_dict())[:2000]
    out = assert_done_once(sqlite_url, root, {f"w1-{i}" for i in range(N_SIGNAL)})
    assert len(out) == N_SIGNAL
    assert restart.summary["items_committed"] >= len(leased)
    after = items(sqlite_url)
    assert all(after[k].crash_count >= 1 for k in leased), "the leases were not reaped"
    assert not list((tmp_path / "outputs.staging").iterdir()), "staging leftovers"


def test_the_workers_of_a_killed_workers_run_are_failed_in_lineage_with_their_parent(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Before: the next run closed the parent and its workers in the ledger, but lineage got
    a FAIL for the parent only (a worker's run was its parent's to close, and it was dead)."""
    config = load("tabular.yaml", tmp_path)
    enqueue(sqlite_url, config, w1_records(5, tmp_path))
    queue = open_queue(sqlite_url, config)
    ledger = run_ledger.RunLedger(queue)
    parent, lone_parent = lineage.new_run_id(), lineage.new_run_id()
    workers = [lineage.new_run_id() for _ in range(2)]
    ledger.start(parent, config.name)
    for i, worker in enumerate(workers):
        ledger.start(worker, worker_job_name(config.name, i), parent_run_id=parent)
    ledger.start(lone_parent, config.name)  # alive: its dead worker is its own to close
    lone_worker = lineage.new_run_id()
    ledger.start(lone_worker, worker_job_name(config.name, 0), parent_run_id=lone_parent)
    silent = [parent, *workers, lone_worker]
    with queue.begin() as conn:  # the whole --workers run was SIGKILLed an hour ago
        c = schema.runs.c
        conn.execute(sa.update(schema.runs).where(c.run_id.in_(silent)).values(heartbeat_at=1.0))
    queue.engine.dispose()

    restart = score(config, sqlite_url, tmp_path / "outputs")

    assert restart.events_path is not None
    failed = {
        e["run"]["runId"]: e
        for e in lineage_log.read_events(restart.events_path)
        if e["eventType"] == "FAIL"
    }
    assert set(failed) == {parent, *workers}
    registry = olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())
    for i, worker in enumerate(workers):
        event = failed[worker]
        assert event["job"]["name"] == worker_job_name(config.name, i)
        assert event["run"]["facets"]["parent"]["run"]["runId"] == parent
        olspec.assert_valid_event(event, registry)
    states = {r.run_id: r.state for r in runs(sqlite_url)}
    assert [states[r] for r in silent] == ["failed"] * 4
    assert states[lone_parent] == "running"


def test_the_reaper_returns_every_expired_lease_not_just_one_chunk(sqlite_url: str) -> None:
    from batching.testing import FakeClock

    clock = FakeClock()
    queue = q.SqlQueue(database.create_engine(sqlite_url), "tabular", clock=clock)
    queue.enqueue([models.EnqueueRecord(f"k{i}", models.Payload(b"{}")) for i in range(5)])
    for _ in range(5):
        queue.claim(1, lease_s=10)  # five claims of a scorer that was then killed
    clock.advance(11)
    assert queue.release_expired(2, this_queue=True) == models.ReapResult(released=5, dead=0)
    assert queue.stats().by_state["ready"] == 5
    queue.engine.dispose()


@pytest.mark.slow
@pytest.mark.parametrize("workers", [1, 2])
def test_sigterm_before_scoring_starts_closes_the_run_and_leaves_the_queue_as_it_was(
    sqlite_url: str,
    tmp_path: Path,
    score_process: Callable[..., subprocess.Popen[Any]],
    workers: int,
) -> None:
    """The signal lands while the run waits on its lineage START, before any scorer exists.
    Before, its default action killed the process there (exit -15), leaving the run
    ``running`` in the ledger until a later run closed it as abandoned."""
    import socket

    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        silent.settimeout(60)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        path = write_config(
            "tabular.yaml",
            tmp_path,
            lineage={"transport": "http", "url": url, "timeout_s": 2.0, "retries": 0},
        )
        enqueue(sqlite_url, cfg.load_config(path), w1_records(20, tmp_path))
        proc = score_process(path, "--workers", str(workers))
        connection, _ = silent.accept()  # the parent run's START is on its way, unanswered
        proc.send_signal(signal.SIGTERM)
        stdout, stderr = proc.communicate(timeout=120)
        connection.close()
    assert proc.returncode == 0, stderr
    assert "Traceback" not in stderr
    assert {r.state for r in items(sqlite_url).values()} == {models.State.READY}
    assert {r.state for r in runs(sqlite_url)} == {"completed"}, stdout


# A stop signal the moment ``batching score`` starts loading its command modules (the first
# ``import typer``), before the command runs: the crash fuzz once sent SIGTERM 0.53 s after the
# start, and the default action killed the run there (exit -15).
_SIGTERM_WHILE_IMPORTING = """
import builtins, os, signal, sys
real = builtins.__import__
def hook(name, *args, **kwargs):
    if name == "typer" and not getattr(hook, "fired", False):
        hook.fired = True
        os.kill(os.getpid(), signal.SIGTERM)
    return real(name, *args, **kwargs)
builtins.__import__ = hook
sys.argv = ["batching", *sys.argv[1:]]
from batching.cli import main
main()
"""


def test_sigterm_while_the_command_loads_stops_the_run_cleanly(
    sqlite_url: str, tmp_path: Path
) -> None:
    path = write_config("tabular.yaml", tmp_path)
    enqueue(sqlite_url, cfg.load_config(path), w1_records(20, tmp_path))
    args = ["score", "-c", str(path), "--db", sqlite_url, "--quiet"]
    proc = subprocess.run(
        [sys.executable, "-c", _SIGTERM_WHILE_IMPORTING, *args],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert "stopping once start-up is done" in proc.stderr
    assert {r.state for r in items(sqlite_url).values()} == {models.State.READY}
    assert {r.state for r in runs(sqlite_url)} == {"completed"}, proc.stdout


def test_sigterm_while_a_finished_run_exits_still_exits_0(
    sqlite_url: str, tmp_path: Path, score_process: Callable[..., subprocess.Popen[Any]]
) -> None:
    """At exit the interpreter puts Python's handlers back to the default action: a SIGTERM
    then killed a run that had scored everything and printed its summary (exit -15)."""
    path = write_config("tabular.yaml", tmp_path)
    enqueue(sqlite_url, cfg.load_config(path), w1_records(20, tmp_path))
    proc = score_process(path)
    assert proc.stdout is not None
    assert proc.stdout.readline(), "no summary"  # the run is over; the process is ending
    while proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.002)
    _, stderr = proc.communicate()  # and close its pipes
    assert proc.returncode == 0, stderr
    assert {r.state for r in items(sqlite_url).values()} == {models.State.DONE}


def test_a_live_run_waiting_on_lineage_is_not_taken_for_abandoned(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Its ledger row beats from the moment it is written: before, the first beat came from
    the scorer, after a lineage START that a slow backend may hold up to its deadline."""
    import socket
    import threading

    lease_s = 1.2  # silent for two leases (2.4 s) counts as abandoned
    with socket.socket() as silent:  # accepts connections, never answers
        silent.bind(("127.0.0.1", 0))
        silent.listen(8)
        url = f"http://127.0.0.1:{silent.getsockname()[1]}"
        path = write_config(
            "tabular.yaml",
            tmp_path,
            queue={"name": "tabular", "lease_s": lease_s},
            lineage={"transport": "http", "url": url, "timeout_s": 4.0, "retries": 0},
        )
        config = cfg.load_config(path)
        enqueue(sqlite_url, config, w1_records(20, tmp_path))
        done: list[wiring.ScoreOutcome] = []
        run = threading.Thread(target=lambda: done.append(score(config, sqlite_url, None)))
        run.start()
        wait_for(lambda: any(r.state == "running" for r in runs(sqlite_url)), 60, "its ledger row")
        time.sleep(2 * lease_s + 0.5)  # the START is still waiting on the silent backend
        other = open_queue(sqlite_url, config)
        closed = run_ledger.RunLedger(other).close_abandoned(2 * lease_s)
        other.engine.dispose()
        run.join(60)
    assert closed == [], "a run that was alive was closed as abandoned"
    (outcome,) = done
    assert outcome.summary["items_committed"] == 20
    assert {r.state for r in runs(sqlite_url)} == {"completed"}
