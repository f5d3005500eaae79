"""A model version's name is a promise about the outputs labelled with it: once outputs are
committed under a version, a config that gives its name another model, checkpoint, dtype or
autocast is refused, by the run before it claims, by a routed batch (charged to the
candidate), by ``rollout start`` and by ``batching check``. Real queues (SQLite and
PostgreSQL), real torch models, ``run_score``, the Parquet outputs read back.

The case that made it (a review): after a promote, the promoted entry was copied into
``model`` without its ``dtype: bfloat16`` line; fp32 weights then scored items labelled with
the bf16 version, and nothing told them apart.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any

import pytest
import sqlalchemy as sa

from batching import config as cfg
from batching import errors, models
from batching.compose import checks, rollouts
from batching.compose import run as wiring
from batching.loop.stats import RunLimits
from batching.store import schema
from tests.conftest import REPO
from tests.integration import test_rollout
from tests.integration.test_rollout import engine_of, enqueue, outputs, settings, states

ckpt = test_rollout.ckpt  # the rollout tests' empty checkpoint, a fixture


def configured(tmp_path: Path, ckpt: tuple[str, str], **changes: Any) -> cfg.PipelineConfig:
    """The rollout tests' config; ``changes`` set on ``model`` (``v2__dtype``: on v2)."""
    raw = settings(tmp_path, ckpt)
    for key, value in changes.items():
        where, _, field = key.rpartition("__")
        target = raw["model_versions"][0] if where == "v2" else raw["model"]
        target[field] = value
    return cfg.load_config(REPO / "deployments" / "tabular.yaml", raw)


def pinned(url: str, config: cfg.PipelineConfig) -> dict[str, str]:
    engine = engine_of(url, config)
    p = schema.model_versions
    with engine.connect() as conn:
        rows = conn.execute(sa.select(p.c.version, p.c.dtype)).all()
    engine.dispose()
    return dict(rows)


def relabelled(config: cfg.PipelineConfig, url: str) -> list[str]:
    """``batching check``'s errors about a version given another identity."""
    found = checks.check_config(config, url).errors
    return [e for e in found if "need a version name of their own" in e]


def test_a_version_that_committed_outputs_keeps_its_identity(
    db_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    fp32 = configured(tmp_path, ckpt)
    enqueue(db_url, fp32, [f"a-{i}" for i in range(40)])
    wiring.run_score(fp32, db_url=db_url, limits=RunLimits())
    assert pinned(db_url, fp32) == {"v1": "float32"}

    bf16 = configured(tmp_path, ckpt, dtype="bfloat16")  # v1's name, other numbers
    later = [f"b-{i}" for i in range(40)]
    enqueue(db_url, bf16, later)
    says = (
        r"model version 'v1' of queue .* first scored with dtype float32 .* gives it dtype bfloat16"
    )
    with pytest.raises(errors.CheckpointError, match=says):
        wiring.run_score(bf16, db_url=db_url, limits=RunLimits())
    left = states(db_url)
    assert {left[k] for k in later} == {int(models.State.READY)}  # refused before any claim
    assert sum(r["model_version"] == "v1" for r in outputs(tmp_path / "out")) == 40

    (found,) = relabelled(bf16, db_url)  # the same, at plan time
    assert "'v1'" in found

    # A factory name mistyped under that version is that mistake, not a changed identity
    # (the run pinned before it loaded, and sent the user to rename the version).
    typo = configured(tmp_path, ckpt, name="tests.integration.test_rollout:nothere")
    with pytest.raises(errors.ConfigError, match=r"cannot be imported"):
        wiring.run_score(typo, db_url=db_url, limits=RunLimits())
    assert relabelled(fp32, db_url) == []

    renamed = configured(tmp_path, ckpt, dtype="bfloat16", version="v1-bf16")  # the fix
    wiring.run_score(renamed, db_url=db_url, limits=RunLimits())
    by_version: dict[str, int] = {}
    for r in outputs(tmp_path / "out"):
        by_version[r["model_version"]] = by_version.get(r["model_version"], 0) + 1
    assert by_version == {"v1": 40, "v1-bf16": 40}
    assert pinned(db_url, fp32) == {"v1": "float32", "v1-bf16": "bfloat16"}


def test_a_pin_nothing_was_committed_under_follows_the_config(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """A run that found the queue empty pinned v1 as fp32; a config fixed before the first
    batch is not refused (nothing is labelled yet), and the pin moves to it."""
    fp32 = configured(tmp_path, ckpt)
    enqueue(sqlite_url, fp32, [])
    wiring.run_score(fp32, db_url=sqlite_url, limits=RunLimits())
    assert pinned(sqlite_url, fp32) == {"v1": "float32"}
    bf16 = configured(tmp_path, ckpt, dtype="bfloat16")
    enqueue(sqlite_url, bf16, ["a", "b"])
    assert relabelled(bf16, sqlite_url) == []
    assert (
        wiring.run_score(bf16, db_url=sqlite_url, limits=RunLimits()).summary["items_committed"]
        == 2
    )
    assert pinned(sqlite_url, bf16) == {"v1": "bfloat16"}


def test_a_candidate_given_another_identity_fails_its_own_items_and_cannot_start_again(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = configured(tmp_path, ckpt)
    enqueue(sqlite_url, config, [f"a-{i}" for i in range(30)])
    rollouts.start(config, sqlite_url, candidate="v2", percent=100, actor="o", reason="canary")
    wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
    assert {r["model_version"] for r in outputs(tmp_path / "out")} == {"v2"}

    # the scorers' config changes v2's dtype while the canary runs: its items fail, charged
    # to it (the guard rolls it back), none is labelled v2 by other numbers
    edited = configured(tmp_path, ckpt, v2__dtype="bfloat16")
    later = [f"b-{i}" for i in range(30)]
    enqueue(sqlite_url, edited, later)
    wiring.run_score(edited, db_url=sqlite_url, limits=RunLimits())
    assert len(outputs(tmp_path / "out")) == 30
    engine = engine_of(sqlite_url, edited)
    t = schema.items
    with engine.connect() as conn:
        dead = conn.execute(
            sa.select(t.c.item_key, t.c.model_version, t.c.last_error).where(
                t.c.state == int(models.State.DEAD)
            )
        ).all()
    engine.dispose()
    assert sorted(k for k, _, _ in dead) == sorted(later)
    assert {v for _, v, _ in dead} == {"v2"}
    assert all("first scored with dtype float32" in (e or "") for _, _, e in dead)

    rollouts.rollback(edited, sqlite_url, actor="o", reason="dtype changed")
    with pytest.raises(errors.InputError, match=r"model version 'v2' .*; nothing changed"):
        rollouts.start(edited, sqlite_url, candidate="v2", percent=10, actor="o", reason="r")


def test_migration_18_adds_the_pins_to_a_queue_of_version_17(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = configured(tmp_path, ckpt)
    engine = engine_of(sqlite_url, config)
    with engine.begin() as conn:
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 18))
        schema.model_versions.drop(conn)
    engine.dispose()
    queue = engine_of(sqlite_url, config)
    from batching.ingress import queue as q

    sq = q.SqlQueue(queue, config.queue.name)
    assert sq.migrate().from_version == 17
    assert sq.migrate().applied is False
    queue.dispose()
    enqueue(sqlite_url, config, ["a"])
    wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
    assert pinned(sqlite_url, config) == {"v1": "float32"}


def test_a_queue_upgraded_with_outputs_keeps_the_checkpoint_its_run_ledger_recorded(
    db_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """Migration 18 starts with no pins. The first run after it pinned whatever weights it
    brought under a version that had labelled rows with others, then refused the weights
    that made them (an upgrade review). The run ledger kept each run's checkpoint sha256."""
    from safetensors.torch import save_file

    original = configured(tmp_path, ckpt)
    enqueue(db_url, original, [f"a-{i}" for i in range(40)])
    wiring.run_score(original, db_url=db_url, limits=RunLimits())
    engine = engine_of(db_url, original)
    with engine.begin() as conn:  # as a queue of schema 17 has it after migration 18
        conn.execute(schema.model_versions.delete())
    engine.dispose()

    other = tmp_path / "other.safetensors"  # v1's name, other weights
    save_file({}, str(other), metadata={"weights": "other"})
    sha = hashlib.sha256(other.read_bytes()).hexdigest()
    swapped = configured(tmp_path, (str(other), sha), checkpoint=str(other), sha256=sha)
    (found,) = relabelled(swapped, db_url)  # at plan time, before any pin
    assert f"first scored with sha256 {ckpt[1][:12]}" in found
    later = [f"b-{i}" for i in range(40)]
    enqueue(db_url, swapped, later)
    with pytest.raises(errors.CheckpointError, match=f"first scored with sha256 {ckpt[1][:12]}"):
        wiring.run_score(swapped, db_url=db_url, limits=RunLimits())
    assert {states(db_url)[k] for k in later} == {int(models.State.READY)}
    wiring.run_score(original, db_url=db_url, limits=RunLimits())  # its own weights: scored
    assert sum(r["model_version"] == "v1" for r in outputs(tmp_path / "out")) == 80
