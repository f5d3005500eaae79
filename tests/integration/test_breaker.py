"""The retry-storm breaker for real: a torch model that fails every batch, on SQLite and
PostgreSQL, through ``run_score``. The run fails with ``RetryStorm``, no item used an attempt,
none is dead, the queue is paused and the model ran a bounded number of times; a scored batch
breaks a streak (the held failures then use one attempt each); a poison item still fails
alone."""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa
import torch
from safetensors.torch import save_file
from torch import nn

from batching import config as cfg
from batching import errors, models
from batching.compose import build
from batching.compose import run as wiring
from batching.ingress import controls, ingest
from batching.store import database, schema
from tests.conftest import REPO

BAD = 999.0  # column 0 of a row the marked model refuses
BATCH = 8
MODEL_ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"


class StormModel(nn.Module):
    """Dense, 4 inputs -> 1 output; every forward pass fails, as on a broken device."""

    batching_input = "dense"
    batching_input_dim = 4
    batching_output_dim = 1

    def __init__(self) -> None:
        super().__init__()
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        raise RuntimeError("CUDA error: an illegal memory access was encountered")


class MarkedModel(StormModel):
    """Fails any batch holding a row whose column 0 is ``BAD`` (a poison item)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        if bool((x[:, 0] == BAD).any()):
            raise ValueError("poison marker seen")
        return x.sum(dim=1, keepdim=True)


def build_storm() -> nn.Module:
    return StormModel()


def build_marked() -> nn.Module:
    return MarkedModel()


class ShortModel(StormModel):
    """Returns one output too few for a batch holding a ``BAD`` row (a broken contract that
    one item causes)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = x.sum(dim=1, keepdim=True)
        return out[1:] if bool((x[:, 0] == BAD).any()) else out


class SpreadModel(StormModel):
    """A ``BAD`` row makes every row of its batch NaN (as a norm over the batch would)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = x.sum(dim=1, keepdim=True)
        return out * math.nan if bool((x[:, 0] == BAD).any()) else out


class NanModel(StormModel):
    """NaN for everything: a checkpoint with NaN weights."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x.sum(dim=1, keepdim=True) * math.nan


class BatchShortModel(StormModel):
    """Drops the last output of any batch past one item, and scores one item alone right:
    a broken batched model that a probe of one item cannot see."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        out = x.sum(dim=1, keepdim=True)
        return out[:-1] if len(out) > 1 else out


def build_short() -> nn.Module:
    return ShortModel()


def build_batch_short() -> nn.Module:
    return BatchShortModel()


def build_spread() -> nn.Module:
    return SpreadModel()


def build_nan() -> nn.Module:
    return NanModel()


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def empty_ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp("ckpt") / "empty.safetensors"
    save_file({}, str(path))
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def config(factory: str, ckpt: tuple[str, str], tmp_path: Path) -> cfg.PipelineConfig:
    model = {"name": f"{__name__}:{factory}", "version": "t1", "checkpoint": ckpt[0]}
    return cfg.load_config(
        REPO / "deployments" / "tabular.yaml",
        {
            "model": model | {"sha256": ckpt[1], "device": "cpu"},
            "batching": {"max_batch_size": BATCH, "claim_size": 2 * BATCH},
            "queue": {"max_attempts": 3, "backoff_base_s": 60, "backoff_max_s": 60},
            "lineage": {"path": str(tmp_path / "lineage" / "events.jsonl")},
            "service_profile": None,
        },
    )


def enqueue(url: str, config: cfg.PipelineConfig, rows: list[tuple[str, float]]) -> None:
    queue = build.open_queue(config, url, create=True)
    queue.migrate()
    records = [
        ingest.record_from_mapping({"item_key": k, "payload": {"x": [v, 1.0, 1.0, 1.0]}}, k)
        for k, v in rows
    ]
    assert queue.enqueue(records).inserted == len(records)
    queue.engine.dispose()


def rows_of(url: str) -> dict[str, Any]:
    engine = database.create_engine(url)
    with engine.connect() as conn:
        rows = {r.item_key: r for r in conn.execute(sa.select(schema.items))}
    engine.dispose()
    return rows


class Watch:
    """``run_score``'s ``on_scorer`` hook: counts the model's calls from the scorer's start
    (warm-up excluded)."""

    def __init__(self) -> None:
        self.model: Any = None
        self.calls_before = 0

    def __call__(self, scorer: Any) -> None:
        self.model = scorer.runner.model
        self.calls_before = self.model.calls

    @property
    def calls(self) -> int:
        return int(self.model.calls - self.calls_before)


# ----------------------------------------------------------------------------- tests


def test_a_model_failing_every_batch_trips_the_breaker_without_burning_attempts(
    db_url: str, tmp_path: Path, empty_ckpt: tuple[str, str]
) -> None:
    conf = config("build_storm", empty_ckpt, tmp_path)
    keys = [f"k{i}" for i in range(10 * BATCH)]
    enqueue(db_url, conf, [(k, 1.0) for k in keys])
    watch = Watch()
    with pytest.raises(errors.RetryStorm) as caught:
        wiring.run_score(conf, db_url=db_url, output=str(tmp_path / "out"), on_scorer=watch)
    message = str(caught.value)
    assert message.startswith(f"retry storm on queue 'tabular': 3 batches in a row ({BATCH}, ")
    assert MODEL_ERROR in message
    rows = rows_of(db_url)
    assert {(rows[k].state, rows[k].attempts) for k in keys} == {(models.State.READY, 0)}
    # three batches bisected (2n - 1 calls each), the model's probe, then nothing more
    assert 2 * BATCH - 1 <= watch.calls <= 3 * (2 * BATCH - 1) + 1, watch.calls
    engine = database.create_engine(db_url)
    paused = controls.state(engine, "tabular")
    (row,) = [a for a in controls.audit(engine, "tabular") if a.action == "pause"]
    engine.dispose()
    assert paused.paused
    assert paused.reason == f"retry storm: 3 batches in a row failed: {MODEL_ERROR}"
    assert (paused.paused_by or "").startswith("breaker:")
    assert row.actor == paused.paused_by


def test_a_scored_batch_breaks_the_streak_and_the_held_failures_use_one_attempt(
    db_url: str, tmp_path: Path, empty_ckpt: tuple[str, str]
) -> None:
    conf = config("build_marked", empty_ckpt, tmp_path)
    bad = [(f"bad{i}", BAD) for i in range(2 * BATCH)]  # two whole batches of poison
    good = [(f"ok{i}", 1.0) for i in range(2 * BATCH)]
    enqueue(db_url, conf, [*bad, *good])
    watch = Watch()
    done = wiring.run_score(conf, db_url=db_url, output=str(tmp_path / "out"), on_scorer=watch)
    assert (done.summary["items_committed"], done.summary["items_failed"]) == (2 * BATCH, 2 * BATCH)
    engine = database.create_engine(db_url)
    assert not controls.state(engine, "tabular").paused
    engine.dispose()
    rows = rows_of(db_url)
    for key, _ in bad:
        assert (rows[key].state, rows[key].attempts) == (models.State.READY, 1), key
        assert "poison marker seen" in rows[key].last_error
    assert {rows[k].state for k, _ in good} == {models.State.DONE}


def test_a_poison_item_still_fails_alone(
    sqlite_url: str, tmp_path: Path, empty_ckpt: tuple[str, str]
) -> None:
    conf = config("build_marked", empty_ckpt, tmp_path)
    rows = [(f"ok{i}", 1.0) for i in range(BATCH)]
    rows[3] = ("poison", BAD)
    enqueue(sqlite_url, conf, rows)
    done = wiring.run_score(conf, db_url=sqlite_url, output=str(tmp_path / "out"))
    assert (done.summary["items_committed"], done.summary["items_failed"]) == (BATCH - 1, 1)
    assert done.stats is not None
    assert done.stats.breaker_trips == 0
    after = rows_of(sqlite_url)
    assert (after["poison"].state, after["poison"].attempts) == (models.State.READY, 1)
    assert {after[k].state for k, _ in rows if k != "poison"} == {models.State.DONE}


def test_a_run_of_poison_items_longer_than_the_breaker_is_charged_not_a_storm(
    db_url: str, tmp_path: Path, empty_ckpt: tuple[str, str]
) -> None:
    """Four whole batches of poison in a row, then good items: the model scores its own probe
    input, so the streak is the items' fault; they use an attempt each and the good items
    commit. Before, the breaker tripped at every run, paused the queue, and charged none."""
    conf = config("build_marked", empty_ckpt, tmp_path)
    bad = [(f"bad{i}", BAD) for i in range(4 * BATCH)]
    good = [(f"ok{i}", 1.0) for i in range(BATCH)]
    enqueue(db_url, conf, [*bad, *good])
    done = wiring.run_score(conf, db_url=db_url, output=str(tmp_path / "out"))
    assert (done.summary["items_committed"], done.summary["items_failed"]) == (BATCH, 4 * BATCH)
    assert done.stats is not None
    assert done.stats.breaker_trips == 0
    engine = database.create_engine(db_url)
    assert not controls.state(engine, "tabular").paused
    engine.dispose()
    rows = rows_of(db_url)
    assert {(rows[k].state, rows[k].attempts) for k, _ in bad} == {(models.State.READY, 1)}
    assert {rows[k].state for k, _ in good} == {models.State.DONE}


@pytest.mark.parametrize(
    ("factory", "error"),
    [
        ("build_nan", "not finite"),  # NaN for everything
        # Its probe of one item passes, but the streak's batches showed the model at fault:
        # the breaker trips and charges nothing (a review found the probe let it dead-letter
        # the queue).
        ("build_batch_short", "outputs for"),
    ],
)
def test_a_model_broken_for_every_batch_trips_the_breaker_and_charges_nothing(
    sqlite_url: str, tmp_path: Path, empty_ckpt: tuple[str, str], factory: str, error: str
) -> None:
    conf = config(factory, empty_ckpt, tmp_path)
    keys = [f"k{i}" for i in range(5 * BATCH)]
    enqueue(sqlite_url, conf, [(k, 1.0) for k in keys])
    with pytest.raises(errors.RetryStorm, match=error):
        wiring.run_score(conf, db_url=sqlite_url, output=str(tmp_path / "out"))
    rows = rows_of(sqlite_url)
    assert {(rows[k].state, rows[k].attempts) for k in keys} == {(models.State.READY, 0)}


@pytest.mark.parametrize("factory", ["build_short", "build_spread"])
def test_one_items_broken_output_is_charged_to_it_alone(
    sqlite_url: str, tmp_path: Path, empty_ckpt: tuple[str, str], factory: str
) -> None:
    """An item that makes the model return one output too few, or NaN for its whole batch,
    is found alone and charged; before, every batch-mate used an attempt for it, and came
    back together to use the next."""
    conf = config(factory, empty_ckpt, tmp_path)
    rows = [(f"ok{i}", 1.0) for i in range(BATCH)]
    rows[5] = ("poison", BAD)
    enqueue(sqlite_url, conf, rows)
    done = wiring.run_score(conf, db_url=sqlite_url, output=str(tmp_path / "out"))
    assert (done.summary["items_committed"], done.summary["items_failed"]) == (BATCH - 1, 1)
    after = rows_of(sqlite_url)
    assert (after["poison"].state, after["poison"].attempts) == (models.State.READY, 1)
    assert {after[k].state for k, _ in rows if k != "poison"} == {models.State.DONE}
