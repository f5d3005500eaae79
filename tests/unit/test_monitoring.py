"""The monitoring shipped in deployments/monitoring/ stays consistent with the metrics and the
runbook: every ``batching_*`` series an alert rule or the Grafana dashboard queries is one the
metrics contract names, every recording rule queried is recorded, every alert pages or
tickets with a runbook section that exists, and every alert has promtool cases that fire and
that must not. (promtool itself runs in tests/integration/test_alert_rules.py.)"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from batching.evidence.lineage import PROJECT_URL
from batching.metrics import catalog

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "deployments" / "monitoring"
RULES = MONITORING / "alerts.yml"
DASHBOARD = MONITORING / "grafana-dashboard.json"
RUNBOOK = REPO / "docs" / "operations.md"
RUNBOOK_URL = f"{PROJECT_URL}/blob/main/docs/operations.md#"

# The series batching.metrics exports: its catalog, the one list the code registers from.
COUNTERS = frozenset(m.name for m in catalog.ALL if m.kind == "counter")
HISTOGRAMS = frozenset(m.name for m in catalog.ALL if m.kind == "histogram")
GAUGES = frozenset(m.name for m in catalog.ALL if m.kind == "gauge")
SERIES = (
    COUNTERS
    | GAUGES
    | {f"{h}{suffix}" for h in HISTOGRAMS for suffix in ("_bucket", "_sum", "_count")}
)
"""Every series name a query may use: histograms only through their ``_bucket``, ``_sum``
and ``_count`` series."""

NAME = re.compile(r"\bbatching_[a-z0-9_]+")
RECORDED = re.compile(r"\bbatching:[a-z0-9_:]+")


def rules() -> list[dict[str, Any]]:
    doc = yaml.safe_load(RULES.read_text(encoding="utf-8"))
    return [rule for group in doc["groups"] for rule in group["rules"]]


def alerts() -> list[dict[str, Any]]:
    return [rule for rule in rules() if "alert" in rule]


def dashboard_exprs(node: Any = None) -> Iterator[str]:
    """Every ``expr`` (targets) and ``query`` (template variables) of the dashboard."""
    if node is None:
        node = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    if isinstance(node, dict):
        for key, value in node.items():
            wanted = key == "expr" or (key == "query" and "label_values(" in str(value))
            if wanted and isinstance(value, str):
                yield value
            else:
                yield from dashboard_exprs(value)
    elif isinstance(node, list):
        for value in node:
            yield from dashboard_exprs(value)


def queries() -> list[tuple[str, str]]:
    """(where, PromQL) of every rule and dashboard query."""
    found = [(rule.get("alert") or rule["record"], rule["expr"]) for rule in rules()]
    return found + [("dashboard", expr) for expr in dashboard_exprs()]


def github_anchor(heading: str) -> str:
    """The anchor GitHub gives a Markdown heading."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def runbook_anchors() -> set[str]:
    text = RUNBOOK.read_text(encoding="utf-8")
    return {github_anchor(m) for m in re.findall(r"^#{1,6} (.+)$", text, flags=re.M)}


def test_the_dashboard_queries_something() -> None:
    exprs = list(dashboard_exprs())
    assert len(exprs) >= 20
    assert any("histogram_quantile" in e for e in exprs)


@pytest.mark.parametrize(("where", "expr"), queries(), ids=lambda v: v[:60])
def test_every_series_queried_is_one_the_metrics_export(where: str, expr: str) -> None:
    unknown = sorted(set(NAME.findall(expr)) - SERIES)
    assert unknown == [], f"{where} queries series no metric exports: {unknown}"


def test_every_recording_rule_queried_is_recorded() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    used = {name for _, expr in queries() for name in RECORDED.findall(expr)}
    assert used, "the alerts and dashboard use the recording rules"
    assert used - recorded == set()
    assert recorded - used == set(), "a recording rule nothing reads"


def test_the_burn_rate_windows_are_recorded() -> None:
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    for window in ("5m", "30m", "1h", "6h"):
        assert f"batching:sla_miss_ratio:rate{window}" in recorded


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_every_alert_pages_or_tickets_with_a_runbook_section(alert: dict[str, Any]) -> None:
    assert alert["labels"]["severity"] in ("page", "ticket")
    notes = alert["annotations"]
    assert notes["summary"]
    assert notes["description"]
    url = notes["runbook_url"]
    assert url.startswith(RUNBOOK_URL), url
    anchor = url.removeprefix(RUNBOOK_URL)
    assert anchor == alert["alert"].lower()
    assert anchor in runbook_anchors(), f"docs/operations.md has no heading for #{anchor}"


def test_the_runbook_is_one_block_at_the_end_of_operations_md() -> None:
    text = RUNBOOK.read_text(encoding="utf-8")
    tail = text[text.index("\n## Alerts\n") :]
    assert "\n## " not in tail[1:], "the alert runbook is the page's last section"
    for alert in alerts():
        assert f"\n### {alert['alert']}\n" in tail


def _promtool_cases() -> dict[str, set[bool]]:
    """Per alert name: whether the promtool tests expect it firing (True) and not (False)."""
    cases: dict[str, set[bool]] = {}
    for path in sorted((MONITORING / "tests").glob("*.yml")):
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
        assert doc["rule_files"] == ["../alerts.yml"], path
        for test in doc["tests"]:
            for case in test.get("alert_rule_test", []):
                cases.setdefault(case["alertname"], set()).add(bool(case.get("exp_alerts")))
    return cases


@pytest.mark.parametrize("alert", alerts(), ids=lambda a: a["alert"])
def test_every_alert_has_promtool_cases_that_fire_and_that_must_not(
    alert: dict[str, Any],
) -> None:
    assert _promtool_cases().get(alert["alert"]) == {True, False}


def test_the_dashboard_slices_by_environment_queue_and_tenant() -> None:
    board = json.loads(DASHBOARD.read_text(encoding="utf-8"))
    names = {v["name"] for v in board["templating"]["list"]}
    assert {"environment", "queue", "tenant"} <= names
    for expr in dashboard_exprs(board):
        if NAME.search(expr) and "label_values(" not in expr:
            assert "$environment" in expr, expr


def test_the_plan_checks_heartbeat_bound_is_the_alerts() -> None:
    """``batching check`` warns of a beat as slow as BatchingRunNoHeartbeat's silence: the
    two numbers must stay one."""
    from batching.compose import checks

    (rule,) = [a for a in alerts() if a["alert"] == "BatchingRunNoHeartbeat"]
    assert f"> {checks.HEARTBEAT_ALERT_S:g}" in rule["expr"]
