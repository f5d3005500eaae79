"""A real Prometheus scrapes a real scorer and the table exporter during a known workload, and
what it stores agrees with the database: the committed counter with the items committed, the
batch-size histogram's count with the run's batches, the queue gauges with ``status --json``.
Then the ``--workers`` endpoint (one for the group) and the Pushgateway of a short run.
"""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from batching.ingress import ingest
from batching.ingress.queue import SqlQueue
from batching.model import workloads
from batching.store import database
from tests import prometheus as prom
from tests.conftest import wait_for
from tests.e2e.test_cli import BATCHING, DB, batching, write_config

N_A, N_B = 150, 50  # tenant a, tenant b: with top_tenants 1, b folds into "other"


def queue(ws: Path) -> SqlQueue:
    return SqlQueue(database.create_engine(f"sqlite:///{ws / 'queue.db'}"), "tabular")


def enqueue(ws: Path, n_a: int = N_A, n_b: int = N_B, prefix: str = "") -> None:
    """W1 items of tenants a and b (in-process: the CLI's enqueue is tested elsewhere)."""
    records = [
        ingest.record_from_mapping({**json.loads(line), "tenant": tenant}, "test")
        for tenant, n in (("a", n_a), ("b", n_b))
        for line in workloads.w1_json_lines(n, prefix=f"{prefix}{tenant}-")
    ]
    q = queue(ws)
    assert q.enqueue(records).inserted == n_a + n_b
    q.engine.dispose()


@pytest.fixture
def ws(tmp_path: Path) -> Path:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    return tmp_path


def config(ws: Path, **metrics: Any) -> Path:
    return write_config(ws, metrics={"environment": "e2e", "top_tenants": 1, **metrics})


@pytest.fixture
def spawn() -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``batching ARGS`` in the background; each is stopped (SIGTERM) at the end."""
    started: list[subprocess.Popen[str]] = []

    def run(*args: str, cwd: Path) -> subprocess.Popen[str]:
        p = subprocess.Popen(
            [BATCHING, *args], cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        started.append(p)
        return p

    yield run
    for p in started:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                p.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                p.kill()
                p.communicate()


def stop(p: subprocess.Popen[str]) -> tuple[str, str]:
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 0, err
    assert "Traceback" not in err, err
    return out, err


def done(ws: Path) -> int:
    q = queue(ws)
    try:
        return q.stats().by_state["done"]
    finally:
        q.engine.dispose()


def scrape(port: int) -> dict[str, float]:
    """``name{labels}`` -> value of every sample an endpoint shows."""
    text = prom.get_text(f"http://127.0.0.1:{port}/metrics")
    return {
        f"{s.name}{dict(sorted(s.labels.items()))}": s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def total(samples: dict[str, float], name: str) -> float:
    return sum(v for k, v in samples.items() if k.startswith(name + "{"))


def test_prometheus_scrapes_the_scorer_and_the_exporter_and_agrees_with_the_database(
    ws: Path, prometheus: Callable[..., prom.Prometheus], spawn: Callable[..., Any]
) -> None:
    enqueue(ws)
    cfg = str(config(ws))
    scorer_port, exporter_port = prom.free_port(), prom.free_port()
    # --max-seconds: the scorer drains the queue, then stays up waiting for work.
    scorer = spawn(
        "score", "-c", cfg, "--max-seconds", "300", "--metrics-port", str(scorer_port),
        "--json", cwd=ws,
    )  # fmt: skip
    # --done-every 1s: a done count taken while the scorer drains is not served for 5 minutes
    exporter = spawn(
        "metrics", "serve", "-c", cfg, "--port", str(exporter_port), "--done-every", "1s", cwd=ws
    )
    server = prometheus(
        {"scorer": [f"127.0.0.1:{scorer_port}"], "exporter": [f"127.0.0.1:{exporter_port}"]}
    )
    wait_for(lambda: done(ws) == N_A + N_B, 120, "the scorer to drain the queue")
    committed = float(N_A + N_B)

    def settled() -> bool:
        seen = server.value('sum(batching_items_committed_total{environment="e2e"})')
        ready = server.value('sum(batching_queue_items{state="ready"})')
        n_done = server.value('sum(batching_queue_items{state="done"})')
        return seen == committed and ready == 0.0 and n_done == committed

    wait_for(settled, 60, "Prometheus to scrape the drained queue")
    by_tenant = {
        r["metric"]["tenant"]: float(r["value"][1])
        for r in server.query("batching_items_committed_total")
    }
    assert by_tenant == {"a": N_A, "other": N_B}  # top_tenants 1: b folds into other
    batches = server.value("sum(batching_batch_size_items_count)")
    gauges = {
        r["metric"]["state"]: float(r["value"][1])
        for r in server.query('sum by (state) (batching_queue_items{queue="tabular"})')
    }
    assert server.value('batching_run_active{queue="tabular"}') == 1.0
    assert server.value("batching_exporter_up") == 1.0
    assert server.value('batching_latency_slo_seconds{queue="tabular"}') == 0.5

    status = batching("status", "--db", DB, "--all", "--json", cwd=ws).json()
    assert {s: gauges[s] for s in status["by_state"]} == {
        s: float(n) for s, n in status["by_state"].items()
    }
    out, _ = stop(scorer)
    summary = json.loads(out)["summary"]
    assert summary["items_committed"] == committed
    assert batches == summary["batches"]
    stop(exporter)


def test_workers_serve_one_endpoint_whose_counter_is_the_groups_total(
    ws: Path, spawn: Callable[..., Any]
) -> None:
    enqueue(ws, 60, 40)
    port = prom.free_port()
    scorer = spawn(
        "score", "-c", str(config(ws)), "--workers", "2", "--max-seconds", "300",
        "--metrics-port", str(port), "--json", cwd=ws,
    )  # fmt: skip
    wait_for(lambda: done(ws) == 100, 120, "the workers to drain the queue")

    def counted() -> dict[str, float] | None:
        samples = scrape(port)
        return samples if total(samples, "batching_items_committed_total") == 100 else None

    samples = wait_for(counted, 30, "the endpoint to show every worker's commits")
    out, _ = stop(scorer)
    summary = json.loads(out)["summary"]
    assert total(samples, "batching_batch_size_items_count") == summary["batches"]


def test_a_short_run_pushes_its_metrics_and_the_next_run_replaces_them(
    ws: Path, tmp_path: Path
) -> None:
    with prom.running_pushgateway(tmp_path / "pgw") as url:
        cfg = str(config(ws, pushgateway_url=url, textfile_path="run.prom"))
        enqueue(ws, 30, 0)
        assert batching("score", "-c", cfg, cwd=ws).rc == 0
        pushed = prom.get_text(f"{url}/metrics")
        first = {
            f"{s.name}{dict(sorted(s.labels.items()))}": s.value
            for f in text_string_to_metric_families(pushed)
            for s in f.samples
            if s.name == "batching_items_committed_total"
        }
        assert list(first.values()) == [30.0]
        (labels,) = first
        assert "'job': 'batching-score'" in labels
        assert "'queue': 'tabular'" in labels
        written = (ws / "run.prom").read_text()
        assert 'batching_items_committed_total{environment="e2e"' in written

        enqueue(ws, 0, 5, prefix="again-")
        assert batching("score", "-c", cfg, cwd=ws).rc == 0
        again = [
            (s.labels["tenant"], s.value)
            for f in text_string_to_metric_families(prom.get_text(f"{url}/metrics"))
            for s in f.samples
            if s.name == "batching_items_committed_total"
        ]
        assert again == [("b", 5.0)]  # the second run's group replaced the first's


def test_metrics_serve_help_and_a_missing_database_are_one_line(ws: Path) -> None:
    r = batching("metrics", "serve", "--help", cwd=ws)
    assert (r.rc, "Usage: batching metrics serve" in r.out) == (0, True)
    bad = batching("metrics", "serve", "-c", str(config(ws)), "--db", "sqlite:///typo.db", cwd=ws)
    assert bad.rc == 2
    lines = bad.err.strip().splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: ")
    assert "batching init" in lines[0]
