"""Rollouts for real: two torch models that tell their outputs apart, a real queue (SQLite, and
PostgreSQL where it matters), ``run_score``, the Parquet outputs read back, the audit and the
lineage events validated against the OpenLineage schemas.

* a 10% canary over 10,000 items: the candidate scores 8.5-11.5% of them, each key exactly
  once and by the version its key routes to (sticky: enqueued again, a key keeps it), each
  version recorded in its output rows, the ledger and the run's lineage;
* a broken candidate: the guard rolls it back on its own (``auto-rollback``), recorded;
* a promote killed by SIGKILL inside its transaction leaves the old route and no audit row;
* a scorer killed by SIGKILL while a rollout is promoted under it: after a restart every item
  is committed exactly once, by one version.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.dataset as pads
import pytest
import sqlalchemy as sa
import torch
import yaml
from safetensors.torch import save_file
from torch import nn

from batching import config as cfg
from batching import errors, models
from batching.compose import build, checks, rollouts, shadow
from batching.compose import run as wiring
from batching.evidence import lineage
from batching.ingress import controls, ingest, rollout
from batching.loop.stats import RunLimits
from batching.outputs import contract
from batching.routing import Route, bucket
from batching.store import database, schema
from tests import olspec
from tests.conftest import REPO, wait_for

BATCHING = str(Path(sys.executable).with_name("batching"))
OFFSET = {"v1": 0.0, "v2": 1000.0}  # what each version adds: an output names its version


class Plus(nn.Module):
    """Dense, 4 inputs -> 1 output: their sum plus the version's offset."""

    batching_input = "dense"
    batching_input_dim = 4
    batching_output_dim = 1

    def __init__(self, offset: float) -> None:
        super().__init__()
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.sum(dim=1, keepdim=True) + self.offset


class Slow(Plus):
    """A pass takes 50 ms: a run of 20,000 items lasts seconds, long enough to be killed."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return super().forward(x)


class Broken(Plus):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("candidate cannot score")


def build_v1() -> nn.Module:
    return Plus(OFFSET["v1"])


def build_v2() -> nn.Module:
    return Plus(OFFSET["v2"])


def build_broken() -> nn.Module:
    return Broken(0.0)


def build_unbuildable() -> nn.Module:
    raise RuntimeError("the candidate's factory cannot build it")


def build_v1_slow() -> nn.Module:
    return Slow(OFFSET["v1"])


def build_v2_slow() -> nn.Module:
    return Slow(OFFSET["v2"])


# ----------------------------------------------------------------------------- helpers


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, str]:
    path = tmp_path_factory.mktemp("ckpt") / "empty.safetensors"
    save_file({}, str(path))
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def settings(
    tmp_path: Path,
    ckpt: tuple[str, str],
    candidate: str = "build_v2",
    lease_s: float = 60.0,
    stable: str = "build_v1",
) -> dict[str, Any]:
    def spec(version: str, factory: str) -> dict[str, Any]:
        name = f"{__name__}:{factory}"
        return {"name": name, "version": version, "checkpoint": ckpt[0], "sha256": ckpt[1]}

    return {
        "model": spec("v1", stable) | {"device": "cpu"},
        "model_versions": [spec("v2", candidate) | {"device": "cpu"}],
        "batching": {"max_batch_size": 256, "claim_size": 1024, "max_wait_s": 0.005},
        "queue": {"max_attempts": 1, "lease_s": lease_s},
        "output": {"kind": "parquet", "path": str(tmp_path / "out")},
        "lineage": {"path": str(tmp_path / "lineage" / "events.jsonl")},
        "rollout": {"min_items": 20},
        "service_profile": None,
    }


def make_config(tmp_path: Path, ckpt: tuple[str, str], **kw: Any) -> cfg.PipelineConfig:
    return cfg.load_config(REPO / "deployments" / "tabular.yaml", settings(tmp_path, ckpt, **kw))


def enqueue(url: str, config: cfg.PipelineConfig, keys: list[str], tenant: str = "t") -> None:
    queue = build.open_queue(config, url, create=True)
    records = [
        ingest.record_from_mapping(
            {"item_key": k, "tenant": tenant, "payload": {"x": [1.0, 2.0, 3.0, 4.0]}}, k
        )
        for k in keys
    ]
    try:
        queue.migrate()
        queue.enqueue(records)
    finally:
        queue.engine.dispose()


def outputs(root: Path) -> list[dict[str, Any]]:
    """Every published output row, as a reader of the dataset sees it (hive partitions)."""
    dataset = pads.dataset(root, format="parquet", partitioning="hive")
    table = dataset.to_table(columns=["item_key", "output", "model_version", "batch_id"])
    rows: list[dict[str, Any]] = table.to_pylist()
    return rows


def states(url: str) -> dict[str, int]:
    engine = database.create_engine(url)
    with engine.connect() as conn:
        rows = conn.execute(sa.select(schema.items.c.item_key, schema.items.c.state)).all()
    engine.dispose()
    return {k: s for k, s in rows}


def ledger_versions(url: str) -> dict[str, int]:
    """Rows committed per model version, as the batch ledger records them."""
    engine = database.create_engine(url)
    b = schema.batches
    q = sa.select(b.c.model_version, sa.func.sum(b.c.n_rows)).group_by(b.c.model_version)
    with engine.connect() as conn:
        found = {v: int(n) for v, n in conn.execute(q)}
    engine.dispose()
    return found


def events(config: cfg.PipelineConfig) -> list[dict[str, Any]]:
    path = Path(config.lineage.path or "")
    return [json.loads(line) for line in path.read_text().splitlines()]


def engine_of(url: str, config: cfg.PipelineConfig) -> Any:
    return build.open_queue(config, url).engine


# ----------------------------------------------------------------------------- canary


def test_a_ten_percent_canary_scores_each_item_once_by_the_version_its_key_routes_to(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    keys = [f"item-{i}" for i in range(10_000)]
    enqueue(sqlite_url, config, keys)
    change = rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=10,
        actor="ops",
        reason="canary v2",
    )
    route = change.after
    result = wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())

    rows = outputs(tmp_path / "out")
    assert sorted(r["item_key"] for r in rows) == sorted(keys)  # each exactly once
    for r in rows:
        version = route.version_for(r["item_key"], "t")
        assert r["model_version"] == version
        assert r["output"][0] == pytest.approx(10.0 + OFFSET[version])  # that model scored it
    by_version = {v: sum(r["model_version"] == v for r in rows) for v in ("v1", "v2")}
    assert 850 <= by_version["v2"] <= 1150, by_version
    assert ledger_versions(sqlite_url) == by_version
    assert result.summary["items_by_version"] == by_version
    assert set(states(sqlite_url).values()) == {int(models.State.DONE)}

    # the run's lineage says which version committed how many, and validates
    registry = olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())
    evs = events(config)
    for ev in evs:
        olspec.assert_valid_event(ev, registry)
    (complete,) = [
        e for e in evs if e["eventType"] == "COMPLETE" and e["job"]["name"] == config.name
    ]
    assert complete["run"]["facets"]["batching_model"]["versions"] == by_version
    (started,) = [
        e["run"]["facets"]["batching_rollout"]
        for e in evs
        if e["job"]["name"] == f"{config.name}.rollout" and e["eventType"] == "COMPLETE"
    ]
    assert (started["action"], started["actor"], started["reason"]) == (
        "rollout-start",
        "ops",
        "canary v2",
    )
    assert started.get("before") is None  # no route before (nulls are left out)
    assert started["to"]["candidate"] == "v2"

    # sticky: purged and enqueued again, keys keep their version
    queue = build.open_queue(config, sqlite_url)
    assert queue.purge(-1.0) == 10_000
    queue.engine.dispose()
    again = keys[:2000]
    enqueue(sqlite_url, config, again)
    wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
    versions: dict[str, set[str]] = {}
    for r in outputs(tmp_path / "out"):
        versions.setdefault(r["item_key"], set()).add(r["model_version"])
    assert all(len(versions[k]) == 1 for k in again)


def test_tenants_scope_the_canary_and_promote_and_rollback_are_recorded(
    db_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    enqueue(db_url, config, [f"a-{i}" for i in range(300)], tenant="acme")
    enqueue(db_url, config, [f"b-{i}" for i in range(300)], tenant="beta")
    rollouts.start(
        config,
        db_url,
        candidate="v2",
        percent=100,
        tenants=["acme"],
        actor="ops",
        reason="acme first",
    )
    wiring.run_score(config, db_url=db_url, limits=RunLimits())
    rows = outputs(tmp_path / "out")
    assert {r["model_version"] for r in rows if r["item_key"].startswith("a-")} == {"v2"}
    assert {r["model_version"] for r in rows if r["item_key"].startswith("b-")} == {"v1"}

    seen = rollouts.status(config, db_url)
    by_role = {s.role: s for s in seen.stats}
    assert (by_role["stable"].committed, by_role["candidate"].committed) == (300, 300)

    promoted = rollouts.promote(config, db_url, actor="ops", reason="acme is happy")
    assert promoted.after == Route("v2", epoch=2, since=promoted.after.since)
    with pytest.raises(errors.InputError, match="no candidate to promote"):
        rollouts.promote(config, db_url, actor="ops", reason="again")
    with pytest.raises(errors.InputError, match="already the stable version"):
        rollouts.start(
            config,
            db_url,
            candidate="v2",
            percent=5,
            actor="ops",
            reason="x",
        )
    with pytest.raises(errors.InputError, match="not in the registry"):
        rollouts.start(
            config,
            db_url,
            candidate="v9",
            percent=5,
            actor="ops",
            reason="x",
        )
    rollouts.start(
        config,
        db_url,
        candidate="v1",
        percent=50,
        actor="ops",
        reason="back to v1 for half",
    )
    rolled = rollouts.rollback(config, db_url, actor="ops", reason="changed my mind")
    assert (rolled.after.stable, rolled.after.candidate) == ("v2", None)

    engine = engine_of(db_url, config)
    audit = [(a.action, a.actor, a.reason) for a in rollout.history(engine, config.queue.name)]
    engine.dispose()
    assert audit == [
        ("rollout-start", "ops", "acme first"),
        ("promote", "ops", "acme is happy"),
        ("rollout-start", "ops", "back to v1 for half"),
        ("rollback", "ops", "changed my mind"),
    ]


def test_the_guard_rolls_a_failing_candidate_back_on_its_own(
    db_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt, candidate="build_broken")
    keys = [f"item-{i}" for i in range(1000)]
    enqueue(db_url, config, keys)
    rollouts.start(
        config,
        db_url,
        candidate="v2",
        percent=30,
        actor="ops",
        reason="try the broken one",
    )
    wiring.run_score(config, db_url=db_url, limits=RunLimits())

    seen, change = rollouts.guard(config, db_url, dry_run=True)
    assert change is None
    assert seen.breach is not None
    assert "max_error_rate" in seen.breach
    cand = next(s for s in seen.stats if s.role == "candidate")
    assert cand.committed == 0
    assert cand.errors == cand.items == cand.dead > 200
    engine = engine_of(db_url, config)
    assert rollout.current(engine, config.queue.name) == seen.route  # judged, not changed
    engine.dispose()

    seen, change = rollouts.guard(config, db_url)
    assert change is not None
    assert change.action == "auto-rollback"
    assert (change.after.stable, change.after.candidate) == ("v1", None)
    seen, again = rollouts.guard(config, db_url)
    assert again is None
    assert seen.breach is None

    engine = engine_of(db_url, config)
    (last,) = rollout.history(engine, config.queue.name, 1)
    engine.dispose()
    assert (last.action, last.actor) == ("auto-rollback", "guard")
    assert "max_error_rate" in (last.reason or "")
    registry = olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())
    facets = [
        e["run"]["facets"]["batching_rollout"]
        for e in events(config)
        if e["job"]["name"] == f"{config.name}.rollout" and e["eventType"] == "COMPLETE"
    ]
    for ev in events(config):
        olspec.assert_valid_event(ev, registry)
    assert [f["action"] for f in facets] == ["rollout-start", "auto-rollback"]
    # the stable items were scored; the candidate's items failed by their own version's fault
    stable_rows = outputs(tmp_path / "out")
    assert {r["model_version"] for r in stable_rows} == {"v1"}
    assert len(stable_rows) == 1000 - cand.dead


def test_a_judged_rollback_is_refused_when_the_route_changed_meanwhile(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    enqueue(sqlite_url, config, ["k"])
    first = rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=10,
        actor="ops",
        reason="r",
    )
    engine = engine_of(sqlite_url, config)
    rollout.promote(engine, config.queue.name, actor="ops", reason="r", now=time.time())
    rollout.start(
        engine,
        config.queue.name,
        stable="v1",
        candidate="v1",
        percent=10,
        actor="ops",
        reason="r",
        now=time.time(),
    )
    with pytest.raises(errors.InputError, match="changed while it was judged"):
        rollout.rollback(
            engine,
            config.queue.name,
            actor="guard",
            reason="r",
            now=time.time(),
            expect_epoch=first.after.epoch,
        )
    engine.dispose()


# ----------------------------------------------------------------------------- costs


def test_device_seconds_are_charged_to_tenants_by_cost_and_to_versions(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    # one batch of both tenants: the large items (cost 3) pay three times the small ones'
    config = make_config(tmp_path, ckpt)
    config = config.model_copy(
        update={"batching": config.batching.model_copy(update={"max_batch_size": 2048})}
    )
    queue = build.open_queue(config, sqlite_url, create=True)
    queue.migrate()
    records = [
        ingest.record_from_mapping(
            {
                "item_key": f"{tenant}-{i}",
                "tenant": tenant,
                "cost": cost,
                "payload": {"x": [1.0, 2.0, 3.0, 4.0]},
            },
            str(i),
        )
        for i in range(500)
        for tenant, cost in (("small", 1), ("large", 3))
    ]
    queue.enqueue(records)
    queue.engine.dispose()
    summary = wiring.run_score(config, db_url=sqlite_url, limits=RunLimits()).summary
    assert summary["batches"] == 1
    total = summary["device_s"]
    assert total > 0
    by_tenant = summary["device_s_by_tenant"]
    assert by_tenant["large"] == pytest.approx(3 * by_tenant["small"])
    assert by_tenant["large"] + by_tenant["small"] == pytest.approx(total)
    assert summary["device_s_by_version"] == pytest.approx({"v1": total})

    registry = olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())
    (complete,) = [
        e
        for e in events(config)
        if e["eventType"] == "COMPLETE" and e["job"]["name"] == config.name
    ]
    olspec.assert_valid_event(complete, registry)
    facet = complete["run"]["facets"]["batching_cost"]
    assert facet["deviceSeconds"] == pytest.approx(total)
    assert facet["byTenant"] == pytest.approx(by_tenant)

    shown = subprocess.run(
        [BATCHING, "status", "--db", sqlite_url, "-q", config.queue.name, "--costs", "--json"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert shown.returncode == 0, shown.stderr
    costs = json.loads(shown.stdout)["costs"]
    assert costs["runs"] == 1
    assert costs["device_s"] == pytest.approx(total)
    assert costs["by_tenant"] == pytest.approx(by_tenant)


# ----------------------------------------------------------------------------- shadow


def test_a_shadow_sample_is_scored_by_both_and_only_the_stable_output_is_published(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    keys = [f"item-{i}" for i in range(3000)]
    enqueue(sqlite_url, config, keys)
    route = rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=10,
        shadow=30,
        actor="ops",
        reason="shadow v2",
    ).after
    wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())

    rows = outputs(tmp_path / "out")  # published: one row a key, by its routed version
    assert sorted(r["item_key"] for r in rows) == sorted(keys)
    assert all(r["model_version"] == route.version_for(r["item_key"], "t") for r in rows)
    side = pads.dataset(shadow.folder(config), format="parquet", partitioning="hive").to_table()
    shadowed = side.column("item_key").to_pylist()
    expected = {k for k in keys if route.version_for(k, "t") == "v1" and route.shadowed(k)}
    assert set(shadowed) == expected
    assert 0.25 < len(expected) / 2700 < 0.35
    assert set(side.column("model_version").to_pylist()) == {"v2"}
    for stable_out, cand_out in zip(
        side.column("stable_output").to_pylist(),
        side.column("candidate_output").to_pylist(),
        strict=True,
    ):
        assert cand_out[0] - stable_out[0] == pytest.approx(OFFSET["v2"])

    drift = rollouts.status(config, sqlite_url).drift
    assert drift is not None
    assert drift["items"] == len(expected)
    assert drift["mean_abs_diff"] == pytest.approx(OFFSET["v2"])
    assert drift["ks"] == 1.0  # every candidate score is above every stable one


def test_status_finds_the_shadow_of_scorers_given_another_output(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    enqueue(sqlite_url, config, [f"item-{i}" for i in range(200)])
    rollouts.start(
        config, sqlite_url, candidate="v2", percent=0, shadow=100, actor="o", reason="shadow"
    )
    elsewhere = str(tmp_path / "other" / "out")
    wiring.run_score(config, db_url=sqlite_url, output=elsewhere, limits=RunLimits())
    assert (tmp_path / "other" / "shadow").is_dir()
    assert rollouts.status(config, sqlite_url).drift is None  # beside the config's output
    drift = rollouts.status(config, sqlite_url, output=elsewhere).drift
    assert drift is not None
    assert drift["items"] == 200
    seen, change = rollouts.guard(config, sqlite_url, dry_run=True, output=elsewhere)
    assert seen.drift == drift
    assert change is None


def test_a_rollback_after_a_promote_says_how_to_go_back(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    enqueue(sqlite_url, config, ["a"])
    rollouts.start(config, sqlite_url, candidate="v2", percent=10, actor="o", reason="r")
    rollouts.promote(config, sqlite_url, actor="o", reason="good")
    with pytest.raises(
        errors.InputError, match=r"v2 is the stable version.*--candidate VERSION --percent 100"
    ):
        rollouts.rollback(config, sqlite_url, actor="o", reason="regressed")


def test_a_promote_by_a_config_that_does_not_list_the_candidate_changes_nothing(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """The scorers of a config without the candidate would fail at their first batch once it
    is stable; ``rollout start`` refuses such a version, and promote succeeded (a sweep)."""
    config = make_config(tmp_path, ckpt)
    enqueue(sqlite_url, config, ["a"])
    rollouts.start(config, sqlite_url, candidate="v2", percent=10, actor="o", reason="r")
    without = config.model_copy(update={"model_versions": []})
    with pytest.raises(errors.InputError, match=r"candidate 'v2' is not in this config's regi"):
        rollouts.promote(without, sqlite_url, actor="o", reason="good")
    seen = rollouts.status(config, sqlite_url, 10, None)
    route = seen.route
    assert route is not None
    assert (route.stable, route.candidate) == ("v1", "v2")
    assert [h.action for h in seen.history] == ["rollout-start"]
    rollouts.promote(config, sqlite_url, actor="o", reason="good")  # the config that lists it


def test_tenants_that_name_no_tenant_are_refused(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    path = config_file(tmp_path, ckpt)
    enqueue(sqlite_url, cfg.load_config(path), ["a"])
    run = subprocess.run(
        [
            BATCHING,
            "rollout",
            "start",
            "-c",
            str(path),
            "--db",
            sqlite_url,
            "--candidate",
            "v2",
            "--percent",
            "5",
            "--tenants",
            ",,,",
            "--reason",
            "r",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert run.returncode == 2
    assert "names no tenant" in run.stderr
    assert "Traceback" not in run.stderr
    config = cfg.load_config(path)
    engine = engine_of(sqlite_url, config)
    assert rollout.current(engine, config.queue.name) is None
    engine.dispose()


def test_a_failing_shadow_never_fails_the_batch_it_shadows(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt, candidate="build_broken")
    keys = [f"item-{i}" for i in range(500)]
    enqueue(sqlite_url, config, keys)
    rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=0,
        shadow=50,
        actor="ops",
        reason="shadow only",
    )
    scorers: list[Any] = []
    summary = wiring.run_score(
        config, db_url=sqlite_url, limits=RunLimits(), on_scorer=scorers.append
    ).summary
    assert summary["device_s_by_version"]["v2"] > 0  # its shadow passes cost the device
    assert {r["model_version"] for r in outputs(tmp_path / "out")} == {"v1"}
    assert len(outputs(tmp_path / "out")) == 500
    assert scorers[0].router.shadow_failures > 0
    assert scorers[0].router.shadowed == 0
    assert summary["shadow_failed"] == scorers[0].router.shadow_failures  # reported
    assert summary["items_shadowed"] == 0
    assert rollouts.status(config, sqlite_url).drift is None


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("sha256", "0" * 64, r"model_versions 'v2'.*sha256.*nothing changed"),
        ("name", "mypkg.models:nope", r"model_versions 'v2'.*cannot be imported.*nothing changed"),
    ],
)
def test_a_candidate_whose_checkpoint_or_factory_is_wrong_is_refused_at_start(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str], field: str, value: str, says: str
) -> None:
    raw = settings(tmp_path, ckpt)
    raw["model_versions"][0][field] = value
    config = cfg.load_config(REPO / "deployments" / "tabular.yaml", raw)
    enqueue(sqlite_url, config, ["a"])
    with pytest.raises(errors.InputError, match=says):
        rollouts.start(config, sqlite_url, candidate="v2", percent=20, actor="o", reason="r")
    engine = engine_of(sqlite_url, config)
    assert rollout.current(engine, config.queue.name) is None
    engine.dispose()


@pytest.mark.parametrize("broken", ["sha256", "factory"])
def test_a_candidate_that_cannot_load_fails_its_own_items_and_the_stable_ones_commit(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str], broken: str
) -> None:
    """Started while it loaded, the candidate's file changes under the scorers (or its factory
    raises): the run goes on, the stable version's items commit, the candidate's fail charged
    to it (so the guard rolls it back). Before, the run ended, every run of the queue with it,
    and the guard saw nothing."""
    config = make_config(tmp_path, ckpt)
    keys = [f"item-{i}" for i in range(1000)]
    enqueue(sqlite_url, config, keys)
    rollouts.start(config, sqlite_url, candidate="v2", percent=30, actor="o", reason="canary")
    raw = settings(
        tmp_path, ckpt, candidate="build_unbuildable" if broken == "factory" else "build_v2"
    )
    if broken == "sha256":
        raw["model_versions"][0]["sha256"] = "0" * 64
    scoring = cfg.load_config(REPO / "deployments" / "tabular.yaml", raw)

    summary = wiring.run_score(scoring, db_url=sqlite_url, limits=RunLimits()).summary

    rows = outputs(tmp_path / "out")
    assert {r["model_version"] for r in rows} == {"v1"}
    seen, _ = rollouts.guard(scoring, sqlite_url, dry_run=True)
    cand = next(s for s in seen.stats if s.role == "candidate")
    assert cand.committed == 0
    assert cand.errors == cand.dead == cand.items > 200  # max_attempts 1: dead at once
    assert len(rows) + cand.dead == 1000 == summary["items_committed"] + summary["items_failed"]
    assert seen.breach is not None
    assert "max_error_rate" in seen.breach
    engine = engine_of(sqlite_url, scoring)
    with engine.connect() as conn:
        errors_ = conn.execute(
            sa.select(schema.items.c.last_error, schema.items.c.model_version).where(
                schema.items.c.state == int(models.State.DEAD)
            )
        ).all()
    engine.dispose()
    assert {v for _, v in errors_} == {"v2"}
    want = "sha256" if broken == "sha256" else "factory cannot build it"
    assert all(want in (e or "") and "guard rolls it back" in (e or "") for e, _ in errors_)


def test_a_promoted_version_that_cannot_load_stops_the_run_and_charges_nothing(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """Only a candidate's unloadable part fails charged to it: a stable version (promoted)
    that cannot load has no guard to roll it back, and failing its items dead-lettered the
    queue (found by a review)."""
    config = make_config(tmp_path, ckpt, candidate="build_unbuildable")
    keys = [f"item-{i}" for i in range(50)]
    enqueue(sqlite_url, config, keys)
    rollouts.start(config, sqlite_url, candidate="v2", percent=100, actor="o", reason="r")
    rollouts.promote(config, sqlite_url, actor="o", reason="r")
    with pytest.raises(errors.ModelError, match="'v2' cannot be loaded"):
        wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
    engine = engine_of(sqlite_url, config)
    with engine.connect() as conn:
        t = schema.items
        found = conn.execute(sa.select(t.c.state, t.c.attempts).distinct()).all()
    engine.dispose()
    assert found == [(int(models.State.READY), 0)]


def test_a_version_that_failed_to_load_is_not_read_again_for_a_while(
    tmp_path: Path, ckpt: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    from batching.compose import versions

    config = make_config(tmp_path, ckpt, candidate="build_unbuildable")
    now = [100.0]
    models_ = versions.ModelSet(config, clock=lambda: now[0])
    loads: list[str] = []
    real = versions.ModelSet._load

    def counted(self: versions.ModelSet, version: str) -> Any:
        loads.append(version)
        return real(self, version)

    monkeypatch.setattr(versions.ModelSet, "_load", counted)
    for _ in range(3):
        with pytest.raises(
            errors.ModelError, match=r"'v2' cannot be loaded: model factory .* failed: RuntimeError"
        ):
            models_("v2")
    assert loads == ["v2"]
    now[0] += versions.RETRY_LOAD_S
    with pytest.raises(errors.ModelError):
        models_("v2")
    assert loads == ["v2", "v2"]
    assert models_("v1") is models_("v1")  # a version that loads is kept


def test_a_version_the_config_does_not_list_names_both_ways_out(
    tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """After a promote the queue's stable version may be one an older config does not list:
    'roll back' alone was advice that failed there (no candidate to roll back)."""
    from batching.compose import versions

    models_ = versions.ModelSet(make_config(tmp_path, ckpt))
    with pytest.raises(errors.ConfigError) as found:
        models_("v9")
    assert str(found.value).endswith(
        "add it under model_versions (a version promoted since: make it the config's model), "
        "or, if it is a rollout's candidate, roll it back with `batching rollout rollback`"
    )


# ----------------------------------------------------------------------------- kills


def config_file(tmp_path: Path, ckpt: tuple[str, str], **kw: Any) -> Path:
    """``make_config``'s settings as a file, for the commands run as processes."""
    path = tmp_path / "pipeline.yaml"
    settled = make_config(tmp_path, ckpt, **kw).model_dump(mode="json", exclude_none=True)
    path.write_text(yaml.safe_dump(settled))
    return path


def test_a_promote_killed_inside_its_transaction_leaves_the_old_route_and_no_record(
    pg_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    enqueue(pg_url, config, ["k"])
    before = rollouts.start(
        config,
        pg_url,
        candidate="v2",
        percent=10,
        actor="ops",
        reason="canary",
    ).after
    engine = engine_of(pg_url, config)
    path = config_file(tmp_path, ckpt)
    with engine.connect() as holder:
        holder.execute(sa.text("LOCK TABLE batching_queue_audit IN EXCLUSIVE MODE"))
        proc = subprocess.Popen(
            [BATCHING, "rollout", "promote", "-c", str(path), "--db", pg_url, "--reason", "go"],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )

        def blocked() -> bool | None:
            # the promote has written the new route and waits to insert its audit row
            q = sa.text(
                "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
                "AND query LIKE 'INSERT INTO batching_queue_audit%'"
            )
            with engine.connect() as probe:
                return bool(probe.execute(q).scalar()) or None

        wait_for(blocked, 60, "the promote to wait inside its transaction")
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        holder.rollback()
    assert proc.returncode == -signal.SIGKILL
    assert rollout.current(engine, config.queue.name) == before
    assert [a.action for a in rollout.history(engine, config.queue.name)] == ["rollout-start"]

    done = subprocess.run(
        [BATCHING, "rollout", "promote", "-c", str(path), "--db", pg_url, "--reason", "go"],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    # the next edit: v2's whole entry becomes the model (renaming model.version would give
    # v1's weights v2's name on every output)
    assert "move that whole model_versions entry" in " ".join(done.stdout.split())
    after = rollout.current(engine, config.queue.name)
    assert after is not None
    assert (after.stable, after.candidate) == ("v2", None)
    assert [a.action for a in rollout.history(engine, config.queue.name)] == [
        "rollout-start",
        "promote",
    ]
    engine.dispose()


def test_a_scorer_killed_while_its_rollout_is_promoted_loses_and_doubles_nothing(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    slow = {"lease_s": 2.0, "stable": "build_v1_slow", "candidate": "build_v2_slow"}
    config = make_config(tmp_path, ckpt, **slow)
    keys = [f"item-{i}" for i in range(20_000)]
    enqueue(sqlite_url, config, keys)
    canary = rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=30,
        actor="ops",
        reason="canary",
    ).after
    path = config_file(tmp_path, ckpt, **slow)
    proc = subprocess.Popen(
        [BATCHING, "score", "-c", str(path), "--db", sqlite_url, "--quiet"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        cwd=tmp_path,
        env=os.environ | {"PYTHONPATH": str(REPO)},  # the models are this module's
        start_new_session=True,
    )
    try:

        def some_done() -> bool | None:
            assert proc.poll() is None, proc.communicate()
            done = sum(s == int(models.State.DONE) for s in states(sqlite_url).values())
            return done >= 2000 or None

        wait_for(some_done, 120, "the scorer to commit 2,000 items")
        at_promote = ledger_versions(sqlite_url).get("v2", 0)
        rollouts.promote(config, sqlite_url, actor="ops", reason="mid-run")

        def after_promote() -> bool | None:  # the scorer took the promote at a claim
            return ledger_versions(sqlite_url).get("v2", 0) >= at_promote + 2000 or None

        wait_for(after_promote, 60, "a batch after the promote")
        os.killpg(proc.pid, signal.SIGKILL)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    left = sum(s != int(models.State.DONE) for s in states(sqlite_url).values())
    assert left > 0, "the scorer finished before it was killed"

    def restarted() -> bool | None:  # the killed scorer's leases expire, then its items score
        wiring.run_score(config, db_url=sqlite_url, limits=RunLimits())
        return set(states(sqlite_url).values()) == {int(models.State.DONE)} or None

    wait_for(restarted, 60, "every item to be committed after the restart")

    rows = outputs(tmp_path / "out")
    assert sorted(r["item_key"] for r in rows) == sorted(keys), f"{left} were left"
    for r in rows:  # one version each: the canary's for its key, or the promoted one
        assert r["model_version"] in {canary.version_for(r["item_key"], "t"), "v2"}
        assert r["output"][0] == pytest.approx(10.0 + OFFSET[r["model_version"]])
    assert set(states(sqlite_url).values()) == {int(models.State.DONE)}
    assert sum(ledger_versions(sqlite_url).values()) == len(keys)
    engine = database.create_engine(sqlite_url)
    assert controls.state(engine, config.queue.name).paused is False
    engine.dispose()


def test_the_plan_check_fails_a_config_that_lacks_a_version_its_queue_routes_to(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    config = make_config(tmp_path, ckpt)
    config = config.model_copy(
        update={"database": config.database.model_copy(update={"url": sqlite_url})}
    )

    def routed(c: cfg.PipelineConfig) -> list[str]:  # (no service profile here: its error)
        return [e for e in checks.check_config(c).errors if "routes items" in e]

    assert routed(config) == []  # no database yet: nothing routed
    enqueue(sqlite_url, config, ["k"])
    rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=10,
        actor="ops",
        reason="r",
    )
    assert routed(config) == []
    (problem,) = routed(config.model_copy(update={"model_versions": []}))
    assert "routes items to model version 'v2' (candidate)" in problem


def test_a_shadow_path_in_the_output_dataset_fails_the_plan_check_and_the_run(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """Shadow outputs are never published: a shadow_path that is (or lies in) the output
    dataset would publish them beside the stable ones. The check fails it before merge, and
    a shadow rollout's run refuses to write there."""
    data = settings(tmp_path, ckpt)
    data["rollout"] |= {"shadow_path": str(tmp_path / "out" / "shadow")}
    config = cfg.load_config(REPO / "deployments" / "tabular.yaml", data)
    (problem,) = [e for e in checks.check_config(config).errors if "shadow_path" in e]
    assert "overlaps the output dataset" in problem
    with pytest.raises(errors.ConfigError, match=r"give rollout\.shadow_path a folder outside"):
        shadow.folder(config)
    fine = make_config(tmp_path, ckpt)
    assert not [e for e in checks.check_config(fine).errors if "shadow_path" in e]
    assert shadow.folder(fine) == (tmp_path / "shadow").resolve()


def test_an_item_the_candidate_failed_counts_as_its_error_after_a_retry_scored_it(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # a flaky candidate must not look healthy because retries hide its failures; and a
    # backlog not yet tried, enqueued after, must not crowd the evidence out of the window
    config = make_config(tmp_path, ckpt)
    retried = {"max_attempts": 3, "backoff_base_s": 0.0, "backoff_max_s": 0.0}
    config = config.model_copy(update={"queue": config.queue.model_copy(update=retried)})
    enqueue(sqlite_url, config, ["flaky"])
    rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=100,
        actor="ops",
        reason="r",
    )
    queue = build.open_queue(config, sqlite_url)
    sink = build.open_sink(queue, build.resolve(config, sqlite_url, None))
    first = queue.claim(1, lease_s=30)
    queue.fail(first.lease_id, {first.items[0].id: "boom"}, retry=True, model_version="v2")
    engine = queue.engine
    again = queue.claim(1, lease_s=30)
    assert len(again.items) == 1
    item = again.items[0]
    contract.Outputs(sink, lineage.new_run_id(), "v1").commit(
        again.items, again.lease_id, {item.id: np.ones(1, np.float32)}, time.time(), "v2"
    )
    enqueue(sqlite_url, config, [f"later-{i}" for i in range(20)])  # a backlog, untried
    monkeypatch.setattr(rollout, "STATS_ROWS", 5)
    route = rollout.current(engine, config.queue.name)
    assert route is not None
    stats, _ = rollout.version_stats(engine, config.queue.name, route, config.latency_slo_s)
    engine.dispose()
    cand = next(s for s in stats if s.role == "candidate")
    assert (cand.items, cand.committed, cand.errors, cand.dead) == (1, 1, 1, 0)
    assert cand.error_rate == 1.0


def test_a_broken_candidate_never_trips_the_breaker_and_pauses_the_queue(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    # every batch is the candidate's and fails whole: the breaker would pause the queue for
    # everyone; the guard's judgement is the candidate's breaker instead
    config = make_config(tmp_path, ckpt, candidate="build_broken")
    small = config.batching.model_copy(update={"max_batch_size": 8, "claim_size": 8})
    config = config.model_copy(update={"batching": small})
    enqueue(sqlite_url, config, [f"a-{i}" for i in range(64)], tenant="acme")
    rollouts.start(
        config,
        sqlite_url,
        candidate="v2",
        percent=100,
        tenants=["acme"],
        actor="ops",
        reason="acme only",
    )
    summary = wiring.run_score(config, db_url=sqlite_url, limits=RunLimits()).summary
    assert summary["items_failed"] == 64
    assert set(states(sqlite_url).values()) == {int(models.State.DEAD)}
    engine = database.create_engine(sqlite_url)
    assert controls.state(engine, config.queue.name).paused is False
    engine.dispose()
    assert rollouts.guard(config, sqlite_url, dry_run=True)[0].breach is not None


# ----------------------------------------------------------------------------- one version a scorer


def test_scorers_pinned_to_one_version_each_claim_only_its_items(
    db_url: str, tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    # a device that cannot hold two versions: one scorer per version, each claiming only
    # the items the route sends to it (the stored key bucket and the tenant, in the claim)
    config = make_config(tmp_path, ckpt)
    enqueue(db_url, config, [f"a-{i}" for i in range(600)], tenant="a")
    enqueue(db_url, config, [f"b-{i}" for i in range(400)], tenant="b")
    route = rollouts.start(
        config,
        db_url,
        candidate="v2",
        percent=50,
        tenants=["a"],
        actor="ops",
        reason="r",
    ).after
    tenant_of = {f"a-{i}": "a" for i in range(600)} | {f"b-{i}": "b" for i in range(400)}
    expected = {k: route.version_for(k, t) for k, t in tenant_of.items()}

    stable = wiring.run_score(config, db_url=db_url, limits=RunLimits(), model_version="v1")
    assert stable.summary["items_committed"] == sum(v == "v1" for v in expected.values())
    left = {k for k, s in states(db_url).items() if s == int(models.State.READY)}
    assert left == {k for k, v in expected.items() if v == "v2"}
    candidate = wiring.run_score_workers(  # two processes, each serving the candidate
        config, 2, db_url=db_url, limits=RunLimits(), model_version="v2"
    )
    assert candidate.workers.error() is None
    assert candidate.summary["items_committed"] == len(left)

    rows = outputs(tmp_path / "out")
    assert sorted(r["item_key"] for r in rows) == sorted(expected)
    for r in rows:
        assert r["model_version"] == expected[r["item_key"]]
        assert r["output"][0] == pytest.approx(10.0 + OFFSET[r["model_version"]])

    # a version the route does not name claims nothing; an unlisted one is refused
    rollouts.promote(config, db_url, actor="ops", reason="r")
    enqueue(db_url, config, ["late"], tenant="a")
    idle = wiring.run_score(config, db_url=db_url, limits=RunLimits(), model_version="v1")
    assert idle.summary["items_committed"] == 0
    with pytest.raises(errors.InputError, match="not in the config's registry"):
        wiring.run_score(config, db_url=db_url, limits=RunLimits(), model_version="v9")


def test_migration_15_gives_the_items_already_queued_their_route_bucket(
    sqlite_url: str, tmp_path: Path, ckpt: tuple[str, str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(schema._fill_route_buckets, "__defaults__", (7,))  # several pages
    config = make_config(tmp_path, ckpt)
    enqueue(sqlite_url, config, [f"k-{i}" for i in range(50)])
    engine = database.create_engine(sqlite_url)
    with engine.begin() as conn:  # as a version 14 database would hold them
        conn.execute(sa.update(schema.items).values(route_bucket=None))
        conn.execute(schema.schema_version.delete().where(schema.schema_version.c.version >= 15))
    queue = build.open_queue(config, sqlite_url)
    assert queue.migrate().from_version == 14
    with engine.connect() as conn:
        rows = conn.execute(sa.select(schema.items.c.item_key, schema.items.c.route_bucket)).all()
    engine.dispose()
    queue.engine.dispose()
    assert rows
    assert all(b == bucket(k) for k, b in rows)


def test_the_plan_check_warns_of_a_candidate_whose_fit_it_could_not_check(
    tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """A factory that raises cannot be built without weights, so its checkpoint's fit is not
    checked: the check passed it without a word (found by a walk-through); the scorer then
    failed every item routed to it."""
    broken = make_config(tmp_path, ckpt, candidate="build_unbuildable")
    (said,) = [w for w in checks.check_config(broken).warnings if "could not be built" in w]
    assert "version 'v2'" in said
    assert not [w for w in checks.check_config(make_config(tmp_path, ckpt)).warnings if "v2" in w]


def test_the_plan_check_warns_of_a_beat_as_slow_as_the_heartbeat_alert(
    tmp_path: Path, ckpt: tuple[str, str]
) -> None:
    """A review: with lease_s of 900 s and no heartbeat_s, a run beats every 300 s, and an
    idle, healthy scorer pages BatchingRunNoHeartbeat."""
    raw = settings(tmp_path, ckpt)
    raw["queue"] = {**raw.get("queue", {}), "lease_s": 900}
    slow = cfg.load_config(REPO / "deployments" / "tabular.yaml", raw)
    (said,) = [w for w in checks.check_config(slow).warnings if "heartbeat_s" in w]
    assert "beats every 300 s" in said
    raw["queue"]["heartbeat_s"] = 240
    fine = cfg.load_config(REPO / "deployments" / "tabular.yaml", raw)
    assert not [w for w in checks.check_config(fine).warnings if "heartbeat_s" in w]
