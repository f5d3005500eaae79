"""The metrics: names and labels as the contract says, tenant folding, the SLA-miss rule, what
the recorder counts when the scorer reports, and the config's checks. No I/O: a fresh
``prometheus_client`` registry per test, the in-memory rig of ``test_pipeline``."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest
from prometheus_client import CollectorRegistry

from batching import config, errors, models, outcomes, ports
from batching.loop import stats as run_stats
from batching.metrics import catalog
from batching.metrics.recorder import ProcessMetrics, Recorder
from batching.metrics.tenants import TenantFolder, fold, top_tenants
from tests.unit.test_pipeline import keys, rig

S = {"environment", "queue", "tenant", "model_version"}
H = {"environment", "queue", "model_version"}
Q = {"environment", "queue", "tenant"}
E = {"environment", "queue"}
# The names and label sets the alert rules and the dashboard are written against.
CONTRACT: dict[str, set[str]] = {
    **dict.fromkeys(
        [
            "batching_items_committed_total",
            "batching_device_seconds_total",
            "batching_items_failed_total",
            "batching_items_dead_total",
            "batching_items_expired_total",
            "batching_items_released_total",
            "batching_retries_total",
            "batching_sla_misses_total",
            "batching_poison_isolated_total",
            "batching_item_latency_seconds",
        ],
        S,
    ),
    **dict.fromkeys(
        [
            "batching_oom_splits_total",
            "batching_lease_losses_total",
            "batching_lineage_emit_failures_total",
            "batching_breaker_trips_total",
            "batching_forward_hangs_total",
            "batching_batches_total",
            "batching_batch_size_items",
            "batching_batch_cost",
            "batching_batch_fill_ratio",
            "batching_padding_efficiency_ratio",
            "batching_forward_seconds",
            "batching_commit_seconds",
        ],
        H,
    ),
    **dict.fromkeys(
        [
            "batching_run_active",
            "batching_run_heartbeat_timestamp_seconds",
            "batching_run_started_timestamp_seconds",
            "batching_adaptive_forward_margin_ratio",
            "batching_adaptive_commit_tail_seconds",
            "batching_adaptive_slack_seconds",
            "batching_queue_paused",
            "batching_queue_max_depth",
            "batching_queue_ledger_horizon_timestamp_seconds",
            "batching_queue_retention_last_run_timestamp_seconds",
            "batching_queue_age_bound_seconds",
            "batching_latency_slo_seconds",
            "batching_latency_objective_ratio",
            "batching_reconcile_last_run_timestamp_seconds",
            "batching_reconcile_last_clean_timestamp_seconds",
        ],
        E,
    ),
    "batching_queue_items": Q | {"state"},
    "batching_queue_oldest_ready_age_seconds": Q,
    "batching_queue_expired_leases": Q,
    "batching_lineage_spool_events": {"environment"},
    "batching_lineage_spool_oldest_age_seconds": {"environment"},
    "batching_lineage_spool_failing_events": {"environment"},
    "batching_reconcile_findings": E | {"class", "severity"},
    "batching_exporter_up": {"environment"},
    "batching_api_items_total": Q | {"outcome"},
}
HISTOGRAMS = {
    "batching_batch_size_items",
    "batching_batch_cost",
    "batching_batch_fill_ratio",
    "batching_padding_efficiency_ratio",
    "batching_forward_seconds",
    "batching_commit_seconds",
    "batching_item_latency_seconds",
}


def test_the_catalog_is_the_contract() -> None:
    assert {m.name: set(m.labels) for m in catalog.ALL} == CONTRACT
    assert {m.name for m in catalog.ALL if m.kind == "histogram"} == HISTOGRAMS
    for m in catalog.ALL:
        assert m.name.endswith("_total") == (m.kind == "counter"), m.name
        assert len(m.labels) == len(set(m.labels)), m.name


def cfg(top_tenants: int = 20, slo_s: float = 1.0) -> config.PipelineConfig:
    return config.PipelineConfig(
        model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
        queue=config.QueueConfig(name="q"),
        batching=config.BatchingPolicy(max_batch_size=4, max_wait_s=0.01),
        latency_slo_s=slo_s,
        metrics=config.MetricsConfig(environment="test", top_tenants=top_tenants),
    )


def recorder(**kw: Any) -> Recorder:
    return Recorder(cfg(**kw), ProcessMetrics(CollectorRegistry()))


def samples(rec: Recorder, name: str) -> dict[tuple[tuple[str, str], ...], float]:
    """``name``'s samples (a counter's ``_total``, a histogram's ``_count``) by label set."""
    out = {}
    for family in rec.metrics.registry.collect():
        for s in family.samples:
            if s.name == name:
                out[tuple(sorted(s.labels.items()))] = s.value
    return out


def by_tenant(rec: Recorder, name: str) -> dict[str, float]:
    return {dict(k)["tenant"]: v for k, v in samples(rec, name).items()}


def item(
    i: int,
    *,
    tenant: str = "t",
    enqueued_at: float = 100.0,
    deadline_at: float | None = None,
    attempts: int = 1,
    max_attempts: int = 3,
) -> models.WorkItem:
    return models.WorkItem(
        i,
        f"k{i}",
        models.Payload(b"{}"),
        enqueued_at,
        tenant=tenant,
        deadline_at=deadline_at,
        attempts=attempts,
        max_attempts=max_attempts,
    )


# ----------------------------------------------------------------------------- tenants


def test_the_first_n_tenants_keep_their_label_and_later_ones_fold_into_other() -> None:
    folder = TenantFolder(2)
    assert [folder.label(t) for t in ["a", "b", "c", "a", "c"]] == ["a", "b", "other", "a", "c"]
    # c passed b's volume (2 > 1) on its second item: c is labelled now, b folds into other
    assert folder.labelled() == {"a", "c"}
    assert folder.label("b") == "other"


def test_a_tenant_named_other_is_never_labelled_apart() -> None:
    folder = TenantFolder(3)
    assert folder.label("other", 100) == "other"
    assert folder.labelled() == frozenset()


def test_a_process_hands_out_a_bounded_number_of_tenant_labels_in_its_life() -> None:
    """Each tenant that rose to the top kept its series for the process's life (a soak
    review: 200 such tenants, 4,500 lines). Past 4 x N labels ever given, only a tenant
    labelled before is promoted again; the rest count under ``other``."""
    folder = TenantFolder(1)
    for day in range(10):  # a new, busier tenant each day
        folder.label(f"t{day}", 100 * (day + 1))
    assert folder.labelled() == {"t3"}  # the fifth new tenant stays folded
    assert folder.label("t9", 10_000) == "other"
    assert folder.label("t0", 10_000) == "t0"  # labelled before: its series exist already


@pytest.mark.parametrize(
    ("volumes", "top_n", "kept"),
    [
        ({"a": 5, "b": 9, "c": 1}, 2, {"a", "b"}),
        ({"a": 5, "b": 5, "c": 5}, 2, {"a", "b"}),  # ties by name
        ({"a": 1}, 20, {"a"}),
        ({"other": 50, "a": 1}, 1, {"a"}),
    ],
)
def test_a_snapshot_keeps_the_top_n_by_volume(
    volumes: dict[str, int], top_n: int, kept: set[str]
) -> None:
    keep = top_tenants(volumes, top_n)
    assert keep == kept
    assert {fold(t, keep) for t in volumes} == kept | ({"other"} if set(volumes) - kept else set())


def test_the_recorder_folds_tenants_beyond_top_n() -> None:
    rec = recorder(top_tenants=1)
    rec.committed([item(1, tenant="a"), item(2, tenant="a"), item(3, tenant="b")], 100.5)
    assert by_tenant(rec, "batching_items_committed_total") == {"a": 2, "other": 1}
    assert sum(by_tenant(rec, "batching_item_latency_seconds_count").values()) == 3


# ----------------------------------------------------------------------------- SLA misses


@pytest.mark.parametrize(
    ("enqueued_at", "deadline_at", "done_at", "missed"),
    [
        (100.0, None, 100.9, 0),  # within latency_slo_s (1 s)
        (100.0, None, 101.0, 0),  # exactly at the objective: not late
        (100.0, None, 101.1, 1),  # later than latency_slo_s
        (100.0, 100.5, 100.6, 1),  # after its deadline, though within the SLO
        (100.0, 100.5, 100.5, 0),  # at its deadline
        (100.0, 200.0, 101.5, 1),  # a far deadline does not excuse the SLO
    ],
)
def test_an_sla_miss_is_a_commit_after_the_deadline_or_the_latency_slo(
    enqueued_at: float, deadline_at: float | None, done_at: float, missed: int
) -> None:
    rec = recorder()
    rec.committed([item(1, enqueued_at=enqueued_at, deadline_at=deadline_at)], done_at)
    assert by_tenant(rec, "batching_sla_misses_total") == {"t": missed}  # 0 is a series too
    assert by_tenant(rec, "batching_items_committed_total") == {"t": 1}


# ----------------------------------------------------------------------------- the recorder


def test_failures_count_retried_and_dead_apart_and_retries_by_attempt() -> None:
    rec = recorder()
    rec.failed([item(1, attempts=1), item(2, attempts=3), item(3, attempts=2)], retry=True)
    rec.failed([item(4, attempts=1)], retry=False)  # undecodable: dead at once
    rec.committed([item(5, attempts=2)], 100.1)
    assert by_tenant(rec, "batching_items_failed_total") == {"t": 2}
    assert by_tenant(rec, "batching_items_dead_total") == {"t": 2}
    assert by_tenant(rec, "batching_retries_total") == {"t": 3}  # items 2, 3 and 5


def test_expired_items_count_by_tenant_and_fold_beyond_top_n() -> None:
    rec = recorder(top_tenants=1)
    rec.expired([("a", 3), ("b", 2)])
    rec.expired([("a", 1), ("c", 0)])
    assert by_tenant(rec, "batching_items_expired_total") == {"a": 4, "other": 2}


def test_the_scorer_reports_what_its_claims_expired() -> None:
    r = rig(keys(3), max_batch_size=4, claim_size=8)
    claim = r.queue.claim
    told = iter([(("a", 2), ("b", 1))])

    def expiring(n: int, **kw: Any) -> models.Claim:
        got = claim(n, **kw)
        return dataclasses.replace(got, expired=next(told, ()))

    r.queue.claim = expiring  # type: ignore[method-assign]
    rec = recorder()
    r.scorer.observer = rec
    r.scorer.run()
    assert by_tenant(rec, "batching_items_expired_total") == {"a": 2, "b": 1}
    assert by_tenant(rec, "batching_items_committed_total") == {"default": 3}


def test_a_batch_reports_its_histograms_oom_splits_and_poison() -> None:
    rec = recorder()
    items = (item(1), item(2, tenant="u"), item(3))
    batch = models.Batch(items, "size", 0.0, models.BatchStats(3, 6, 0.75, 0.5, 0.1, 0.05))
    result = outcomes.ScoreResult(
        {}, {2: "poison"}, 0.02, 5, 10, n_oom_splits=2, poisoned=frozenset({2})
    )
    rec.batch_committed(batch, result)
    h = (("environment", "test"), ("model_version", "v1"), ("queue", "q"))
    assert samples(rec, "batching_batches_total") == {h: 1}
    assert samples(rec, "batching_batch_size_items_sum") == {h: 3}
    assert samples(rec, "batching_batch_cost_sum") == {h: 6}
    assert samples(rec, "batching_batch_fill_ratio_sum") == {h: 0.75}
    assert samples(rec, "batching_padding_efficiency_ratio_sum") == {h: 0.5}
    assert samples(rec, "batching_forward_seconds_sum") == {h: 0.02}
    assert samples(rec, "batching_oom_splits_total") == {h: 2}
    assert by_tenant(rec, "batching_poison_isolated_total") == {"u": 1}


def test_every_series_carries_the_label_set_the_catalog_names() -> None:
    rec = recorder()
    rec.started(10.0)
    rec.committed([item(1)], 100.2)
    rec.failed([item(2)], retry=True)
    rec.released([item(3)])
    rec.lease_lost(2)
    rec.commit_timed(0.01)
    rec.lineage_failed(1)
    rec.breaker_tripped()
    rec.forward_hung()
    rec.expired([("t", 1)])
    rec.adaptive_state({"forward_margin": 0.2, "commit_tail_s": 0.01, "slack_s": 0.05})
    wanted = {m.name: set(m.labels) for m in catalog.SCORER}
    seen = 0
    for family in rec.metrics.registry.collect():
        name = family.name + ("_total" if family.type == "counter" else "")
        for s in family.samples:
            assert set(s.labels) - {"le"} == wanted[name], s
            seen += 1
    assert seen


def test_the_run_gauges_follow_the_run() -> None:
    rec = recorder()
    e = (("environment", "test"), ("queue", "q"))
    rec.started(10.0)
    assert samples(rec, "batching_run_active") == {e: 1}
    assert samples(rec, "batching_run_started_timestamp_seconds") == {e: 10.0}
    rec.heartbeat(12.0)
    assert samples(rec, "batching_run_heartbeat_timestamp_seconds") == {e: 12.0}
    rec.finished(13.0)
    assert samples(rec, "batching_run_active") == {e: 0}


def test_the_scorer_reports_to_its_observer_what_its_stats_count() -> None:
    r = rig(keys(10), max_batch_size=4, claim_size=8)
    rec = recorder()
    r.scorer.observer = rec
    stats = r.scorer.run()
    assert by_tenant(rec, "batching_items_committed_total") == {"default": stats.committed}
    assert (
        sum(samples(rec, "batching_batch_size_items_count").values()) == stats.batch_sizes.total()
    )
    assert sum(samples(rec, "batching_commit_seconds_count").values()) >= 1
    assert list(samples(rec, "batching_run_active").values()) == [0]


def test_an_adaptive_scorer_reports_its_controllers_terms_and_a_fixed_one_none() -> None:
    e = (("environment", "test"), ("queue", "q"))
    names = (
        "batching_adaptive_forward_margin_ratio",
        "batching_adaptive_commit_tail_seconds",
        "batching_adaptive_slack_seconds",
    )
    fixed = rig(keys(10), max_batch_size=4, claim_size=8)
    fixed.scorer.observer = rec = recorder()
    fixed.scorer.run(run_stats.RunLimits(until_empty=True))
    assert all(samples(rec, name) == {} for name in names)
    tuned = rig(keys(10), max_batch_size=4, claim_size=8, adaptive=True)
    tuned.scorer.observer = rec = recorder()
    tuned.scorer.run(run_stats.RunLimits(until_empty=True))
    ctrl = tuned.scorer.controller
    assert ctrl is not None
    want = (ctrl.model.margin, ctrl.tail_s, ctrl.slack_s)
    assert [samples(rec, name) for name in names] == [{e: value} for value in want]
    summary = tuned.scorer.stats.summary()
    assert summary["adaptive"] == ctrl.terms()
    assert "adaptive" not in fixed.scorer.stats.summary()
    rows = dict(run_stats.summary_rows(summary))
    assert rows["adaptive: forward margin / commit tail / slack"].endswith(" s")


def test_the_scorer_reports_failed_and_released_items() -> None:
    r = rig(max_batch_size=8, claim_size=8, max_attempts=3)
    r.queue.add(["ok-1", "ok-2"])
    r.queue.add(["bad-json"], b"undecodable")
    r.queue.add(["poison"], b"poison")
    rec = recorder()
    r.scorer.observer = rec
    r.scorer.run()
    assert by_tenant(rec, "batching_items_committed_total") == {"default": 2}
    assert by_tenant(rec, "batching_items_dead_total") == {"default": 1}  # bad-json
    assert by_tenant(rec, "batching_items_failed_total") == {"default": 1}  # poison: retried


def test_the_default_observer_records_nothing() -> None:
    observer: ports.ScoreObserver = ports.NoObserver()
    observer.started(1.0)
    observer.committed([item(1)], 2.0)
    observer.expired([("t", 1)])
    observer.finished(3.0)
    r = rig(keys(2))
    assert isinstance(r.scorer.observer, ports.NoObserver)


# ----------------------------------------------------------------------------- config


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        ({"latency_objective": 1.0}, "latency_objective"),
        ({"latency_objective": 0}, "latency_objective"),
        ({"metrics": {"pushgateway_url": "pushgateway:9091"}}, "like http://pushgateway:9091"),
        ({"metrics": {"textfile_path": "run.txt"}}, "textfile_path must end in .prom"),
        ({"metrics": {"top_tenants": 0}}, "top_tenants"),
        ({"metrics": {"port": 70000}}, "port"),
        ({"metrics": {"prot": 9100}}, "prot"),
    ],
)
def test_bad_metrics_settings_are_refused_with_the_fix(
    changes: dict[str, Any], message: str
) -> None:
    data = {"model": {"name": "w1-mlp", "version": "v", "sha256": "0" * 64}, **changes}
    with pytest.raises(errors.ConfigError) as info:
        config.parse_config(data)
    assert message in str(info.value)
    assert len(str(info.value).splitlines()) == 1


def test_metrics_are_off_unless_served_pushed_or_written() -> None:
    assert not config.MetricsConfig().enabled
    for on in ({"port": 9100}, {"pushgateway_url": "http://pg:9091"}, {"textfile_path": "x.prom"}):
        assert config.MetricsConfig(**on).enabled


def test_a_rollouts_batches_are_labelled_by_their_version_and_charge_device_seconds() -> None:
    rec = recorder()
    costs = {1: 1, 2: 2, 3: 1}
    plain = (item(1), item(2, tenant="u"), item(3))
    items = tuple(i._replace(cost=costs[i.id]) for i in plain)
    stats = models.BatchStats(3, 4, 0.75, 1.0, 0.1, 0.05)
    outputs = {i.id: np.zeros(1, np.float32) for i in items}
    result = outcomes.ScoreResult(outputs, {}, 0.4, 4, 4)
    rec.batch_committed(models.Batch(items, "size", 0.0, stats, model_version="v2"), result)
    rec.batch_committed(models.Batch(items[:1], "size", 0.0, stats), result)
    rec.committed(items[:2], 1.0, "v2")
    rec.failed(items[2:], retry=False, model_version="v2")
    seconds = samples(rec, "batching_device_seconds_total")
    env = (("environment", "test"),)

    def key(tenant: str, version: str) -> tuple[tuple[str, str], ...]:
        return (*env, ("model_version", version), ("queue", "q"), ("tenant", tenant))

    # v2's batch: 0.4 s shared by cost, t 2 of 4 units, u 2 of 4; v1's: all t's
    assert seconds == pytest.approx({key("t", "v2"): 0.2, key("u", "v2"): 0.2, key("t", "v1"): 0.4})
    h = (*env, ("model_version", "v2"), ("queue", "q"))
    assert samples(rec, "batching_batches_total")[h] == 1
    assert samples(rec, "batching_items_committed_total") == {
        key("t", "v2"): 1,
        key("u", "v2"): 1,
    }
    assert samples(rec, "batching_items_dead_total") == {key("t", "v2"): 1}


def test_the_api_counts_known_outcomes_only() -> None:
    from batching.metrics.api_items import ApiMetrics

    metrics = ApiMetrics("test")
    metrics.observe("q", "a", "shed_depth_cap", 3)
    metrics.observe("q", "a", "enqueued", 0)  # nothing: no series
    with pytest.raises(ValueError, match="unknown API outcome 'shed'"):
        metrics.observe("q", "a", "shed", 1)
    labels = {"environment": "test", "queue": "q", "tenant": "a"}
    count = metrics.registry.get_sample_value
    assert count("batching_api_items_total", labels | {"outcome": "shed_depth_cap"}) == 3.0
    assert count("batching_api_items_total", labels | {"outcome": "enqueued"}) is None


def test_serving_on_a_port_in_use_or_an_address_not_here_names_which() -> None:
    import socket

    from batching.metrics import publish

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(errors.ConfigError, match=rf"on port {port} .*choose a free port"):
            publish.serve(port, CollectorRegistry(), addr="127.0.0.1")
    with pytest.raises(errors.ConfigError, match=r"on address '999\.1\.1\.1' .*of this host"):
        publish.serve(0, CollectorRegistry(), addr="999.1.1.1")
