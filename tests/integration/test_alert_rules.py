"""promtool checks the shipped monitoring: the alert rules load (``check rules``), their unit
tests pass (``test rules``: hours of series evaluated at once, both burn-rate windows
included), the example Prometheus config loads with them (``check config``), and every
dashboard query parses as PromQL. Without promtool (Debian's ``prometheus`` package) these
skip locally and fail in CI."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from tests.conftest import IN_CI
from tests.unit.test_monitoring import MONITORING, RULES, dashboard_exprs

GRAFANA_VARIABLES = {
    "$__rate_interval": "1m",
    "$__range": "1h",
    "$environment": ".*",
    "$queue": ".*",
    "$tenant": ".*",
}


@pytest.fixture(scope="module")
def promtool() -> str:
    path = shutil.which("promtool")
    if path is None:
        reason = "promtool not installed (apt-get install prometheus)"
        if IN_CI:
            pytest.fail(f"{reason}: CI needs it")
        pytest.skip(reason)
    return path


def run(*argv: str, cwd: Path = MONITORING) -> str:
    done = subprocess.run(argv, cwd=cwd, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    return done.stdout + done.stderr


def test_the_rules_load(promtool: str) -> None:
    out = run(promtool, "check", "rules", str(RULES))
    assert "SUCCESS" in out


def test_the_rule_unit_tests_pass(promtool: str) -> None:
    tests = sorted(str(p.relative_to(MONITORING)) for p in (MONITORING / "tests").glob("*.yml"))
    assert "tests/slo.yml" in tests
    out = run(promtool, "test", "rules", *tests)
    assert out.count("SUCCESS") == len(tests), out


def test_the_example_prometheus_config_loads_the_rules(promtool: str) -> None:
    out = run(promtool, "check", "config", "prometheus.yml")
    assert "1 rule files found" in out


def test_every_dashboard_query_parses(promtool: str, tmp_path: Path) -> None:
    """Each query, its Grafana variables filled in, as a recording rule promtool parses."""
    records = []
    for i, expr in enumerate(e for e in dashboard_exprs() if "label_values(" not in e):
        for variable, value in GRAFANA_VARIABLES.items():
            expr = expr.replace(variable, value)
        assert not re.search(r"\$\w", expr), f"a Grafana variable left in {expr}"
        records.append({"record": f"dashboard:query_{i}", "expr": expr})
    path = tmp_path / "dashboard-queries.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": records}]}))
    run(promtool, "check", "rules", str(path), cwd=tmp_path)
