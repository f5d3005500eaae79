"""The deployments as a user runs them, against a real ``prefect server start`` (slow, ~1 min).

1. ``python -m flows.serve`` registers the score, reconcile, bulk and maintain deployments; a score run
   started from its deployment completes in a served subprocess, and its end triggers a
   reconcile of that run (upstream id and output passed on), which completes too; both are
   OpenLineage runs in the JSONL log.
2. ``flows.alerts`` (run before the score run) saves the webhook block and the alert
   automations: the score run, whose items waited for the server longer than the online
   config's 1 s SLO, emits ``batching.run.sla_missed`` and the SLA-missed automation POSTs to
   a local webhook (naming the queue and the miss ratio); a ``batching.reconcile.failed`` and
   a ``batching.queue.backlog`` event do the same through theirs; a batching flow run whose
   heartbeats stop is marked Crashed by the zombie-runs automation (its window shortened).
3. ``prefect deploy --all --prefect-file deployments/prefect.yaml`` registers the same
   deployments on a process work pool, with their triggers.

The server's scheduler is off, so the interval and cron schedules create no runs here.
"""

from __future__ import annotations

import json
import os
import signal
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from batching.compose import build
from batching.config import load_config
from batching.evidence import lineage_log
from batching.ingress import ingest
from batching.model import workloads
from flows import alerts
from tests.conftest import REPO, wait_for
from tests.e2e.prefect_stack import Stack

AUTOMATIONS = REPO / "deployments" / "automations"

pytestmark = pytest.mark.slow


def enqueue_text(stack: Stack, n_items: int) -> None:
    cfg = load_config(REPO / "deployments" / "online.yaml")
    queue = build.open_queue(cfg, stack.db_url, create=True)
    try:
        queue.migrate()
        file = workloads.write_lines(stack.root / "w2.jsonl", workloads.w2_json_lines(n_items))
        queue.enqueue(ingest.read_records(file))
    finally:
        queue.engine.dispose()


def test_served_deployments_score_reconcile_alert_and_deploy(stack: Stack, tmp_path: Path) -> None:
    enqueue_text(stack, 40)
    hook = Webhook()
    try:
        create_automations(stack, hook)
        score_reconcile_and_alert(stack, tmp_path, hook)
    finally:
        hook.close()
    check_deploy(stack)


def score_reconcile_and_alert(stack: Stack, tmp_path: Path, hook: Webhook) -> None:
    serve = stack.start("-m", "flows.serve", name="serve")
    deployments = wait_for(
        lambda: d if len(d := stack.deployments()) == 6 else None, 90, "6 deployments"
    )
    assert set(deployments) == {
        "score",
        "score-nightly",
        "reconcile",
        "bulk",
        "maintain",
        "rollout-guard",
    }

    out = str(tmp_path / "outputs" / "text")
    score_run = stack.post(
        f"/deployments/{deployments['score']['id']}/create_flow_run",
        {"parameters": {"output": out}},
    )
    assert stack.finished(score_run["id"])["state"]["type"] == "COMPLETED"
    reconcile_run = wait_for(
        lambda: [
            r
            for r in stack.post("/flow_runs/filter", {})
            if r["parameters"].get("upstream_flow_run_id") == score_run["id"]
        ],
        60,
        "the triggered reconcile run",
    )[0]
    assert reconcile_run["parameters"]["output"] == out
    assert stack.finished(reconcile_run["id"])["state"]["type"] == "COMPLETED"
    check_lineage(stack, score_run["id"], reconcile_run["id"])
    stack.stop(serve)
    assert serve.returncode == 0  # stopped by Ctrl-C within the grace period
    assert all(d["paused"] for d in stack.deployments().values())  # the runner paused them

    check_sla_missed(hook, score_run["id"])
    check_alert(stack, hook)
    check_backlog(stack, hook)
    check_zombie(stack, hook)


def check_lineage(stack: Stack, score_id: str, reconcile_id: str) -> None:
    events = lineage_log.read_events(stack.events_path)
    scorer = next(e["run"]["runId"] for e in events if e["job"]["name"].endswith(".worker-0"))
    runs = [(e["run"]["runId"], e["job"]["name"], e["eventType"]) for e in events]
    assert runs == [
        (score_id, "score-online", "START"),
        (scorer, "score-online.worker-0", "START"),
        (scorer, "score-online.worker-0", "COMPLETE"),
        (score_id, "score-online", "COMPLETE"),
        (reconcile_id, "score-online-reconcile", "START"),
        (reconcile_id, "score-online-reconcile", "COMPLETE"),
    ]
    # the scorer is a child of its flow run; the triggered reconcile a child of the score run
    # it checked; the flow run itself has no parent
    parents = [(e["run"]["facets"].get("parent") or {}).get("run", {}).get("runId") for e in events]
    assert parents == [None, score_id, score_id, None, score_id, score_id]


class Webhook:
    """A loopback HTTP endpoint that records the JSON bodies POSTed to it."""

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []
        received = self.bodies

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                length = int(self.headers.get("content-length", 0))
                received.append(json.loads(self.rfile.read(length)))
                self.send_response(200)
                self.end_headers()

            def log_message(self, *_: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/alerts"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def create_automations(stack: Stack, hook: Webhook) -> None:
    """``python -m flows.alerts``: the webhook block and every automation."""
    alerts = stack.start("-m", "flows.alerts", "--webhook-url", hook.url, name="alerts")
    assert alerts.wait(60) == 0, (stack.root / "alerts.log").read_text()


def posted(hook: Webhook, title: str) -> dict[str, Any]:
    """The one notification titled ``title`` the webhook received (waits for it)."""
    found = wait_for(
        lambda: [b for b in hook.bodies if b["title"] == title], 60, f"the webhook {title!r}"
    )
    assert len(found) == 1, found
    return found[0]


def check_sla_missed(hook: Webhook, score_id: str) -> None:
    """The score run missed the online SLO (its items waited for the server to start): the
    SLA-missed automation posted, naming the queue, the miss ratio and the run."""
    body = posted(hook, "batching: score-online missed its latency SLO on queue text")
    assert "40 of 40 items committed by a run of score-online (queue text)" in body["text"]
    assert "took over 1.0 s from enqueue to commit: 100.0% late" in body["text"]
    assert "objective of 99.0% on time (burn rate 100.0x" in body["text"]
    assert score_id in body["text"]


def check_alert(stack: Stack, hook: Webhook) -> None:
    """A reconcile-failed event reaches the webhook."""
    event = {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": "batching.reconcile.failed",
        "resource": {"prefect.resource.id": "batching.output.text"},
        "payload": {
            "config": "score-online",
            "queue": "text",
            "location": "/srv/outputs/text",
            "critical": ["missing_file"],
            "findings_text": "- critical: missing file (1 affected): its file is missing",
            "flow_run_url": "http://prefect.example/runs/flow-run/1",
        },
    }
    stack.post("/events", [event])
    body = posted(hook, "batching: reconcile found critical faults in score-online")
    assert "- critical: missing file (1 affected): its file is missing" in body["text"]
    assert "Reconcile flow run: http://prefect.example/runs/flow-run/1" in body["text"]


def check_backlog(stack: Stack, hook: Webhook) -> None:
    """A backlog event (as a score run emits it; without the ``batching.config`` label, so
    the score deployment's own backlog trigger leaves it alone) reaches the webhook."""
    event = {
        "id": str(uuid.uuid4()),
        "occurred": datetime.now(UTC).isoformat(),
        "event": "batching.queue.backlog",
        "resource": {"prefect.resource.id": "batching.queue.text"},
        "payload": {
            "queue": "text",
            "config": "score-online",
            "depth": 6000,
            "oldest_ready_age_s": 75.0,
            "depth_threshold": 5000,
            "age_threshold_s": 60,
            "reasons": ["depth", "age"],
        },
    }
    stack.post("/events", [event])
    body = posted(hook, "batching: queue text has a backlog (depth, age)")
    assert "6000 items ready (alert at 5000), the oldest waiting 75.0 s" in body["text"]


def check_zombie(stack: Stack, hook: Webhook) -> None:
    """The zombie-runs automation, as created by ``flows.alerts`` but its 600 s window cut to
    10 s, Prefect's least (a copy beside it): a batching flow run whose heartbeats stopped is marked Crashed,
    and the webhook is told; a batching run that completed after its heartbeat, and another
    project's silent run, are left alone."""
    (shipped,) = [
        a for a in stack.post("/automations/filter", {}) if a["name"] == "batching-zombie-runs"
    ]
    (block,) = {a["block_document_id"] for a in shipped["actions"] if "block_document_id" in a}
    fast = alerts.load_automation(AUTOMATIONS / "zombie-runs.yaml", uuid.UUID(block))
    fast.name, fast.trigger.within = "batching-zombie-runs-fast", timedelta(seconds=10)  # type: ignore[union-attr]
    fast_id = stack.post("/automations/", fast.model_dump(mode="json"))["id"]
    (ours,) = stack.post("/flows/filter", {"flows": {"name": {"any_": ["batching-score"]}}})
    theirs = stack.post("/flows/", {"name": "another-project"})

    def running(flow: dict[str, Any]) -> dict[str, Any]:
        run = stack.post("/flow_runs/", {"flow_id": flow["id"], "state": {"type": "RUNNING"}})
        stack.post(
            "/events",
            [
                {
                    "id": str(uuid.uuid4()),
                    "occurred": datetime.now(UTC).isoformat(),
                    "event": "prefect.flow-run.heartbeat",
                    "resource": {
                        "prefect.resource.id": f"prefect.flow-run.{run['id']}",
                        "prefect.resource.name": run["name"],
                    },
                    "related": [
                        {
                            "prefect.resource.id": f"prefect.flow.{flow['id']}",
                            "prefect.resource.role": "flow",
                            "prefect.resource.name": flow["name"],
                        }
                    ],
                }
            ],
        )
        return dict(run)

    zombie, finished, other = running(ours), running(ours), running(theirs)
    stack.post(
        f"/flow_runs/{finished['id']}/set_state", {"state": {"type": "COMPLETED"}, "force": True}
    )
    crashed = wait_for(
        lambda: r if (r := stack.flow_run(zombie["id"]))["state"]["type"] == "CRASHED" else None,
        90,
        "the silent run to be marked Crashed",
    )
    assert "No heartbeat for 600 s" in crashed["state"]["message"]
    title = f"batching: flow run {zombie['name']} went silent; marking it Crashed"
    assert "frees its deployment to run again" in posted(hook, title)["text"]
    time.sleep(15)  # past another window: the others had longer to fire than the zombie
    assert stack.flow_run(finished["id"])["state"]["type"] == "COMPLETED"
    assert stack.flow_run(other["id"])["state"]["type"] == "RUNNING"
    assert not [
        b for b in hook.bodies if {finished["name"], other["name"]} & set(b["title"].split())
    ]
    stack.http.delete(f"/automations/{fast_id}").raise_for_status()


def check_deploy(stack: Stack) -> None:
    """``prefect deploy`` registers deployments/prefect.yaml on a process work pool."""
    stack.post("/work_pools/", {"name": "batching", "type": "process"})
    args = (
        "-m",
        "prefect",
        "--no-prompt",
        "deploy",
        "--all",
        "--prefect-file",
        "deployments/prefect.yaml",
    )
    assert stack.start(*args, name="deploy").wait(120) == 0, (stack.root / "deploy.log").read_text()
    deployments = stack.deployments()
    assert {d["work_pool_name"] for d in deployments.values()} == {"batching"}
    automations = {a["name"] for a in stack.post("/automations/filter", {})}
    assert automations == {
        "reconcile-after-scoring",
        "score-on-backlog",
        *(yaml.safe_load(p.read_text())["name"] for p in AUTOMATIONS.glob("*.yaml")),
    }


def test_serve_exits_within_its_grace_period_when_the_server_is_gone(stack: Stack) -> None:
    """With its server gone, Prefect's runner sometimes stops at once and sometimes retries
    pausing the schedules for minutes; either way `flows.serve` ends within the grace period
    (tests/flows/test_serve.py covers the kill path deterministically)."""
    serve = stack.start("-m", "flows.serve", "--shutdown-grace-s", "3", name="serve")
    wait_for(lambda: len(stack.deployments()) == 6, 90, "6 deployments")
    server = stack.procs[0]
    os.killpg(server.pid, signal.SIGKILL)
    server.wait(10)
    time.sleep(2)  # the runner notices (its event websocket drops)
    started = time.monotonic()
    os.killpg(serve.pid, signal.SIGINT)
    code = serve.wait(30)
    assert time.monotonic() - started < 20
    log = (stack.root / "serve.log").read_text()
    if code != 0:
        assert code == 1
        assert "prefect deployment schedule pause --all" in log
