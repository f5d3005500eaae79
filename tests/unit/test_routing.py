"""Routes (``batching.routing``), the scoring loop's router (``batching.loop.routes``), the
commit's parts by version (``stages.by_lease``) and the rollout guard's verdict
(``batching.ingress.rollout.judge``): pure, no database."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

from batching import models, outcomes
from batching.compose import shadow
from batching.config import RolloutConfig
from batching.ingress.rollout import VersionStats, judge
from batching.loop.routes import Router
from batching.loop.stages import Scored, by_lease
from batching.routing import BUCKETS, Route, bucket, shadow_bucket

KEYS = [f"key-{i}" for i in range(20_000)]


def item(i: int, key: str | None = None, tenant: str = "t") -> models.WorkItem:
    return models.WorkItem(i, key or f"key-{i}", models.Payload(b"{}"), 0.0, tenant=tenant)


def batch(items: Any) -> models.Batch:
    stats = models.BatchStats(len(items), len(items), 1.0, 1.0, 0.0, 0.0)
    return models.Batch(tuple(items), "size", 0.0, stats)


def test_a_key_has_one_bucket_everywhere() -> None:
    # pinned: a release that changed the hash would move keys between versions mid-rollout
    assert [bucket(k) for k in ("a", "item-1", "")] == [3343, 4548, 9876]
    assert all(0 <= bucket(k) < BUCKETS for k in KEYS[:1000])
    assert sum(bucket(k) == shadow_bucket(k) for k in KEYS) < 20  # independent slices


@pytest.mark.parametrize("percent", [1.0, 10.0, 50.0])
def test_the_candidate_share_converges_on_the_percent(percent: float) -> None:
    route = Route("v1", "v2", percent=percent)
    share = sum(route.version_for(k, "t") == "v2" for k in KEYS) / len(KEYS)
    assert share == pytest.approx(percent / 100, abs=0.01)


def test_tenants_scope_the_candidate() -> None:
    route = Route("v1", "v2", percent=100, tenants=("acme",))
    assert route.version_for("k", "acme") == "v2"
    assert route.version_for("k", "beta") == "v1"
    half = Route("v1", "v2", percent=50, tenants=("acme",))
    assert {half.version_for(k, "beta") for k in KEYS[:500]} == {"v1"}
    assert {half.version_for(k, "acme") for k in KEYS[:500]} == {"v1", "v2"}


def test_no_candidate_routes_everything_to_stable_and_shadows_nothing() -> None:
    route = Route("v2")
    assert {route.version_for(k, "t") for k in KEYS[:100]} == {"v2"}
    assert not any(Route("v1", shadow=100).shadowed(k) for k in KEYS[:100])
    assert all(Route("v1", "v2", shadow=100).shadowed(k) for k in KEYS[:100])


def test_a_route_round_trips_through_json_keeping_unknown_fields() -> None:
    route = Route("v1", "v2", percent=12.5, tenants=("a", "b"), shadow=3, epoch=4, since=9.0)
    assert Route.from_json(route.to_json()) == route
    newer = route.to_json().replace('"epoch"', '"future": 1, "epoch"')
    assert Route.from_json(newer).extra == {"future": 1}
    assert route.describe() == "stable v1, candidate v2 at 12.5% of tenants a, b, shadow 3%"


def test_a_batch_splits_by_version_in_order_and_stays_whole_when_one_version_scores_it() -> None:
    route = Route("v1", "v2", percent=50)
    items = [item(i) for i in range(64)]
    parts = route.split(tuple(items))
    assert [v for v, _ in parts] == ["v1", "v2"]
    for version, part in parts:
        assert all(route.version_for(i.item_key, "t") == version for i in part)
        assert [i.id for i in part] == sorted(i.id for i in part)
    assert sorted(i.id for _, p in parts for i in p) == list(range(64))
    whole = tuple(items)
    assert route.split(whole)[0][1] is not whole
    assert Route("v1").split(whole) == [("v1", whole)]
    assert Route("v1", "v2", percent=100).split(whole) == [("v2", whole)]


class Runner:
    def __init__(self, name: str) -> None:
        self.name = name

    def decode(self, items: Any) -> Any:
        return items

    def forward(self, decoded: Any) -> outcomes.ScoreResult:
        raise NotImplementedError


def test_the_router_follows_the_claims_route_and_finds_each_versions_runner() -> None:
    own, loaded = Runner("own"), {"v1": Runner("v1"), "v2": Runner("v2")}
    router: Router[Any] = Router(own, loaded.__getitem__)
    b = batch([item(i) for i in range(32)])
    assert router.split(b) == [b]  # no route: the run's own model
    assert router.runner_for(b) is own
    router.observe(Route("v1", "v2", percent=50).to_json())
    parts = router.split(b)
    assert [p.model_version for p in parts] == ["v1", "v2"]
    assert [router.runner_for(p) for p in parts] == [loaded["v1"], loaded["v2"]]
    router.observe(Route("v2", epoch=2).to_json())  # promoted: the next claim says so
    (whole,) = router.split(b)
    assert whole.model_version == "v2"
    assert router.runner_for(whole) is loaded["v2"]
    router.observe(None)
    assert router.split(b) == [b]
    ignoring: Router[Any] = Router(own)  # a run without a model set ignores routes
    ignoring.observe(Route("v1", "v2", percent=50).to_json())
    assert ignoring.split(b) == [b]


def test_a_group_commit_keeps_each_versions_items_apart_within_a_lease() -> None:
    items = [item(i) for i in range(6)]
    leases = {i.id: "L" for i in items}

    def scored(part: list[models.WorkItem], version: str) -> Scored:
        outs = {i.id: np.zeros(1, np.float32) for i in part}
        result = outcomes.ScoreResult(outs, {}, 0.0, 0, 0)
        return Scored(dataclasses.replace(batch(part), model_version=version), leases, result)

    parts = by_lease([scored(items[:4], "v1"), scored(items[4:], "v2")])
    assert [(lease, p.model_version, len(p.ok)) for lease, p in parts] == [
        ("L", "v1", 4),
        ("L", "v2", 2),
    ]


def stats(role: str, items: int, errors: int = 0, p99: float | None = 0.1) -> VersionStats:
    return VersionStats(role, role, items, items - errors, errors, 0, p99, p99, 0)


@pytest.mark.parametrize(
    ("candidate", "stable", "breach"),
    [
        (stats("candidate", 10, errors=10), stats("stable", 100), None),  # too few to judge
        (stats("candidate", 100, errors=6), stats("stable", 100), "max_error_rate"),
        (stats("candidate", 100, errors=5), stats("stable", 100), None),  # at the bound
        (stats("candidate", 100, p99=0.2), stats("stable", 100, p99=0.1), "stable"),
        (stats("candidate", 100, p99=0.14), stats("stable", 100, p99=0.1), None),
        (stats("candidate", 100, p99=0.2), stats("stable", 10, p99=0.1), None),
        (stats("candidate", 100, p99=3.0), stats("stable", 100, p99=2.5), "max_p99_s"),
    ],
)
def test_the_guard_judges_the_candidate_against_its_bounds(
    candidate: VersionStats, stable: VersionStats, breach: str | None
) -> None:
    guard = RolloutConfig(min_items=50, max_error_rate=0.05, max_p99_ratio=1.5, max_p99_s=2.0)
    found = judge([stable, candidate], guard)
    if breach is None:
        assert found is None
    else:
        assert found is not None
        assert breach in found


def test_ks_and_psi_are_zero_for_one_distribution_and_grow_with_a_shift() -> None:
    rng = np.random.default_rng(7)
    a = rng.normal(size=5000)
    assert shadow.ks_statistic(a, a) == 0.0
    assert shadow.psi(a, a) == 0.0
    near, far = a + 0.1, a + 1.0
    assert 0 < shadow.ks_statistic(a, near) < shadow.ks_statistic(a, far) <= 1.0
    assert 0 < shadow.psi(a, near) < 0.1 < shadow.psi(a, far)  # 0.1: the usual "stable" bound
    assert shadow.ks_statistic(np.zeros(10), np.ones(10)) == 1.0


def test_a_block_splits_into_blocks_with_each_items_own_payload() -> None:
    n, width = 64, 8
    template = models.WorkItem(
        0, "", models.Payload(b"", models.PayloadFormat.TENSOR, "uint8", (width,)), 0.0
    )
    data = b"".join(bytes([i]) * width for i in range(n))
    block = models.ItemBlock(
        template,
        list(range(n)),
        [f"key-{i}" for i in range(n)],
        [float(i) for i in range(n)],
        [1] * n,
        [5] * n,
        data,
    )
    route = Route("v1", "v2", percent=50)
    parts = route.split(block)
    assert [v for v, _ in parts] == ["v1", "v2"]
    for version, part in parts:
        assert isinstance(part, models.ItemBlock)
        for item in part:  # built from the part's own columns and bytes
            assert route.version_for(item.item_key, item.tenant) == version
            assert item.payload.data == bytes([item.id]) * width
            assert item.enqueued_at == float(item.id)
    assert sorted(i.id for _, p in parts for i in p) == list(range(n))
