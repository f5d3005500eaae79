"""The shipped alert rules, evaluated live by a real Prometheus scraping a real scorer
(``batching score --metrics-port``) and the table exporter (``batching metrics serve``):

1. an SLA miss: every item committed late (held back by a paused queue past a tiny SLO), so the miss-ratio and fast-burn alerts fire;
2. a growing backlog with no scorer: the oldest-ready-age alert goes pending, then firing;
3. a clean run: items committed in time, no backlog: nothing is pending or firing, while the
   same targets are up and the committed counter and miss ratio are there (not vacuous);
4. POSTs to ``batching api`` past the queue's depth cap: the API's own /metrics counts the
   429s, and the shedding alert fires.

The rules are a temporary copy of deployments/monitoring/alerts.yml with every ``for:``
shortened to 2 s (each ``expr`` exactly as shipped), so pending -> firing takes seconds; the
shipped durations are covered by promtool (tests/integration/test_alert_rules.py). A ``for:``
alert's pending phase is read back from Prometheus' own ``ALERTS`` series, so it is seen even
when it lasted one evaluation. The Prefect side (the SLA-missed and backlog automations
posting to a webhook) is tests/e2e/test_prefect_server.py.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from datetime import datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml

from batching.ingress import controls, ingest
from batching.model import workloads
from tests import prometheus as prom
from tests.conftest import REPO, wait_for
from tests.e2e.test_cli import write_config
from tests.e2e.test_prometheus import queue
from tests.e2e.test_prometheus import spawn as spawn  # a fixture
from tests.e2e.test_prometheus import ws as ws  # a fixture

pytestmark = pytest.mark.slow

ALERTS = REPO / "deployments" / "monitoring" / "alerts.yml"
FOR = "2s"


def fast_rules(folder: Path) -> Path:
    """The shipped rules with every ``for:`` set to :data:`FOR`; the expressions unchanged."""
    rules = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            if "for" in rule:
                rule["for"] = FOR
    path = folder / "alerts-fast.yml"
    path.write_text(yaml.safe_dump(rules, sort_keys=False))
    return path


def config(ws: Path, **top: Any) -> Path:
    """The e2e W1 config with ``top`` (latency_slo_s, backlog_alert_age_s) set."""
    return write_config(ws, metrics={"environment": "e2e"}, **top)


def enqueue(ws: Path, n: int, prefix: str, late_s: float | None = None) -> None:
    """``n`` W1 items of tenant a; with ``late_s``, held back (the queue paused) until the
    oldest has waited over ``late_s``, so each of them is committed past a smaller SLO."""
    records = [
        ingest.record_from_mapping({**json.loads(line), "tenant": "a"}, "test")
        for line in workloads.w1_json_lines(n, prefix=prefix)
    ]
    q = queue(ws)
    try:
        if late_s is not None:
            controls.pause(q.engine, "tabular", actor="test", reason="hold", now=time.time())
        assert q.enqueue(records).inserted == n
        if late_s is not None:
            wait_for(lambda: (q.stats().oldest_ready_age_s or 0) > late_s, 30, "items to age")
            controls.resume(q.engine, "tabular", actor="test", reason=None, now=time.time())
    finally:
        q.engine.dispose()


def start(
    ws: Path,
    prometheus: Callable[..., prom.Prometheus],
    spawn: Callable[..., Any],
    cfg: Path,
    scorer: bool = True,
) -> prom.Prometheus:
    """The exporter (and a long-lived scorer) on ``cfg``, scraped with the fast rules."""
    targets: dict[str, list[str]] = {}
    if scorer:
        port = prom.free_port()
        spawn(
            "score", "-c", str(cfg), "--max-seconds", "300", "--metrics-port", str(port),
            cwd=ws,
        )  # fmt: skip
        targets["scorer"] = [f"127.0.0.1:{port}"]
    port = prom.free_port()
    spawn("metrics", "serve", "-c", str(cfg), "--port", str(port), cwd=ws)
    targets["batching-exporter"] = [f"127.0.0.1:{port}"]
    server = prometheus(targets, [fast_rules(ws)])
    wait_for(server.targets_up, 90, "the scorer and the exporter to be scraped")
    return server


def committed(server: prom.Prometheus, n: int) -> Callable[[], bool]:
    """Whether Prometheus has scraped ``n`` items committed."""
    return lambda: server.value("sum(batching_items_committed_total)") == n


def score_in_two_rounds(
    ws: Path, server: prom.Prometheus, n: int, late_s: float | None = None
) -> None:
    """Commit ``n`` items, then ``n`` more once Prometheus has seen the first: a counter
    series is born at its first commit, and ``rate()`` needs it to grow while scraped."""
    for round_ in (1, 2):
        enqueue(ws, n, f"r{round_}-", late_s)
        wait_for(committed(server, round_ * n), 120, f"round {round_}'s commits to be scraped")


def state(server: prom.Prometheus, alert: str) -> str | None:
    """``alert``'s state now (pending, firing), or None."""
    found = [a["state"] for a in server.alerts() if a["labels"]["alertname"] == alert]
    return found[0] if found else None


def was_pending(server: prom.Prometheus, alert: str) -> bool:
    expr = f'max_over_time(ALERTS{{alertname="{alert}",alertstate="pending"}}[10m])'
    return server.value(expr) == 1.0


def pending_then_firing(server: prom.Prometheus, alert: str, labels: dict[str, str]) -> None:
    """``alert`` fires with ``labels``, having been pending first (its ``for:``)."""
    wait_for(lambda: state(server, alert) == "firing", 60, f"{alert} to fire")
    assert was_pending(server, alert), f"{alert} fired without being pending first"
    (firing,) = [a for a in server.alerts() if a["labels"]["alertname"] == alert]
    assert labels.items() <= firing["labels"].items(), firing


def _epoch_s(rfc3339: str) -> float:
    """Prometheus' nanosecond RFC 3339 time (``...05.123456789Z``) as epoch seconds."""
    micro = re.sub(r"(\.\d{6})\d+", r"\1", rfc3339).replace("Z", "+00:00")
    return datetime.fromisoformat(micro).timestamp()


def evaluated_since(server: prom.Prometheus, since: float) -> bool:
    """Whether every rule group has been evaluated after ``since`` (epoch seconds)."""
    groups = prom.get_json(f"{server.url}/api/v1/rules")["data"]["groups"]
    return bool(groups) and all(_epoch_s(g["lastEvaluation"]) > since for g in groups)


def batching_alerts(server: prom.Prometheus) -> list[dict[str, Any]]:
    return [a for a in server.alerts() if a["labels"]["alertname"].startswith("Batching")]


def test_an_sla_miss_fires_the_miss_ratio_and_fast_burn_alerts(
    ws: Path, prometheus: Callable[..., prom.Prometheus], spawn: Callable[..., Any]
) -> None:
    # A tiny SLO, and items held back longer than it before the scorer may claim them:
    # every commit is a miss, however fast the scorer is.
    cfg = config(ws, latency_slo_s=0.05)
    server = start(ws, prometheus, spawn, cfg)
    score_in_two_rounds(ws, server, 40, late_s=0.2)
    labels = {"environment": "e2e", "queue": "tabular"}
    wait_for(
        lambda: server.value('batching:sla_miss_ratio:rate5m{queue="tabular"}') == 1.0,
        30,
        "the 5 min miss ratio to be 1",
    )
    assert server.value('batching:latency_error_budget:ratio{queue="tabular"}') == pytest.approx(
        0.01
    )
    pending_then_firing(server, "BatchingSlaMissRatioHigh", {**labels, "severity": "ticket"})
    # No `for:` on the fast burn (it pages at once): firing at its first true evaluation.
    wait_for(
        lambda: state(server, "BatchingLatencyBudgetFastBurn") == "firing",
        30,
        "BatchingLatencyBudgetFastBurn to fire",
    )
    (burn,) = [
        a for a in server.alerts() if a["labels"]["alertname"] == "BatchingLatencyBudgetFastBurn"
    ]
    assert labels.items() <= burn["labels"].items()
    assert burn["labels"]["severity"] == "page"
    assert "tabular" in burn["annotations"]["summary"]
    assert not was_pending(server, "BatchingQueueOldestReadyAgeOverBound")


def test_a_growing_backlog_fires_the_oldest_ready_age_alert(
    ws: Path, prometheus: Callable[..., prom.Prometheus], spawn: Callable[..., Any]
) -> None:
    cfg = config(ws, backlog_alert_age_s=2)
    enqueue(ws, 20, "waiting-")  # and no scorer
    server = start(ws, prometheus, spawn, cfg, scorer=False)
    assert server.value('batching_queue_age_bound_seconds{queue="tabular"}') == 2.0
    pending_then_firing(
        server,
        "BatchingQueueOldestReadyAgeOverBound",
        {"environment": "e2e", "queue": "tabular", "tenant": "a", "severity": "page"},
    )
    age = server.value('max(batching_queue_oldest_ready_age_seconds{queue="tabular"})')
    assert age is not None
    assert age > 2.0


def test_a_clean_run_fires_nothing(
    ws: Path, prometheus: Callable[..., prom.Prometheus], spawn: Callable[..., Any]
) -> None:
    cfg = config(ws, latency_slo_s=60, backlog_alert_age_s=60)
    server = start(ws, prometheus, spawn, cfg)
    score_in_two_rounds(ws, server, 40)
    # Not vacuous: the series the alerts read are there, and say "all well".
    assert server.value('sum(rate(batching_items_committed_total{queue="tabular"}[5m])) > 0')
    wait_for(
        lambda: server.value('batching:sla_miss_ratio:rate5m{queue="tabular"}') == 0.0,
        30,
        "the 5 min miss ratio to be recorded as 0",
    )
    assert server.value('batching:latency_error_budget:ratio{queue="tabular"}') == pytest.approx(
        0.01
    )
    assert server.value('batching_queue_age_bound_seconds{queue="tabular"}') == 60.0
    # Waited for: a scrape past the 1 s timeout of these fast rules (a loaded CI machine)
    # marks every series of the exporter stale at once, until the next scrape.
    wait_for(
        lambda: server.value('sum(batching_queue_items{queue="tabular",state="ready"})') == 0.0,
        30,
        "the drained queue's ready series at 0",
    )
    assert server.value("batching_exporter_up") == 1.0
    settled = time.time()
    wait_for(lambda: evaluated_since(server, settled + 3), 30, "3 more rule evaluations")
    assert server.targets_up()
    assert batching_alerts(server) == []
    window_s = max(1, int(time.time() - settled))
    assert server.query(f'ALERTS{{alertname=~"Batching.*"}}[{window_s}s]') == []


def _is(server: prom.Prometheus, expr: str, value: float) -> bool:
    return server.value(expr) == value


def test_posts_past_the_depth_cap_fire_the_api_shedding_alert(
    ws: Path,
    prometheus: Callable[..., prom.Prometheus],
    spawn: Callable[..., Any],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cfg = config(ws)
    token = "t" * 24
    monkeypatch.setenv("BATCHING_API_TOKENS", f"{token}=a")
    q = queue(ws)
    controls.set_max_depth(q.engine, "tabular", 5, actor="test", reason=None, now=time.time())
    q.engine.dispose()
    port = prom.free_port()
    spawn("api", "-c", str(cfg), "--port", str(port), cwd=ws)  # no scorer: nothing drains
    base = f"http://127.0.0.1:{port}"
    items = f"{base}/v1/queues/tabular/items"
    auth = {"Authorization": f"Bearer {token}"}

    def up() -> bool:
        try:
            return httpx.get(f"{base}/healthz", timeout=2).status_code == 200
        except httpx.HTTPError:
            return False

    wait_for(up, 60, "batching api to answer")
    server = prometheus({"batching-api": [f"127.0.0.1:{port}"]}, [fast_rules(ws)])
    wait_for(server.targets_up, 90, "the API to be scraped")
    answers = []
    shed = 'sum(batching_api_items_total{outcome="shed_depth_cap"})'
    for round_ in (1, 2):  # rate() needs the counter to grow while scraped
        for k in range(10):
            body = {"item_key": f"r{round_}-{k}", "payload": {"x": [0.5] * 64}}
            answers.append(httpx.post(items, json=body, headers=auth, timeout=10).status_code)
        expected = {1: 5.0, 2: 15.0}[round_]  # the first 5 fill the cap of 5
        wait_for(functools.partial(_is, server, shed, expected), 30, f"round {round_}'s 429s")
    assert answers.count(201) == 5
    assert answers.count(429) == 15
    pending_then_firing(
        server,
        "BatchingApiShedding",
        {"environment": "e2e", "queue": "tabular", "severity": "page"},
    )
