"""``python -m flows.alerts``: its argument is checked before anything is saved, and the
alert it sets up reaches a webhook as text a person reads."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
import yaml
from prefect.client.orchestration import get_client

from flows import alerts
from flows.reconcile import MAX_FINDING_LINES, findings_text, reconcile
from flows.score import score
from tests.conftest import wait_for
from tests.flows.support import make_pipeline, run_id_of


@pytest.mark.parametrize(
    "url", ["not-a-url", "hooks.example.com/x", "ftp://h/x", "https://", "http://h:port/x"]
)
def test_a_webhook_url_that_is_not_http_is_refused_with_exit_2(
    url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """Before, ``not-a-url`` was saved as the alert target: alerting silently broken."""
    with pytest.raises(SystemExit) as exited:
        alerts.main(["--webhook-url", url])
    assert exited.value.code == 2
    assert "is not an http(s) URL like https://hooks.example.com/alerts" in capsys.readouterr().err


def test_a_refused_webhook_url_keeps_its_secret_out_of_the_message(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        alerts.main(["--webhook-url", "ftp://u:s3cret@h/x"])
    assert "s3cret" not in capsys.readouterr().err


@pytest.mark.parametrize("url", ["https://hooks.example.com/alerts", "http://127.0.0.1:9/x"])
def test_http_webhook_urls_are_accepted(url: str) -> None:
    assert alerts.webhook_url(url) == url


class _Hook(BaseHTTPRequestHandler):
    """A webhook receiver: keeps each POSTed JSON body."""

    received: ClassVar[list[dict[str, Any]]] = []

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.received.append(json.loads(body))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def webhook() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Hook)
    _Hook.received = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}/alerts"
    server.shutdown()
    server.server_close()
    with get_client(sync_client=True) as client:
        for path in alerts.AUTOMATIONS.glob("*.yaml"):
            name = yaml.safe_load(path.read_text(encoding="utf-8"))["name"]
            for automation in client.read_automations_by_name(name):
                client.delete_automation(automation.id)


def test_a_reconcile_alert_reaches_the_webhook_in_words_with_the_flow_run_url(
    tmp_path: Path, webhook: str
) -> None:
    """Through the real automation: Prefect renders the template and POSTs it. Before, the body
    was ``Critical findings ['lost_write', ...] ... (counts {'lost_write': 2, ...})``."""
    alerts.create(webhook)
    # A file a batch (nothing waits to be committed with another): one is deleted, three stay.
    one_file_a_batch = {"max_batch_size": 25, "claim_size": 50, "max_inflight_batches": 1}
    pipeline = make_pipeline(tmp_path, 100, batching=one_file_a_batch)
    upstream = run_id_of(score(**pipeline.params(), return_state=True))
    sorted(pipeline.output.rglob("*.parquet"))[0].unlink()
    failed = reconcile(**pipeline.params(upstream_flow_run_id=upstream), return_state=True)
    assert failed.is_failed()

    # The score run's items waited past the 0.5 s SLO too: its sla-missed alert may come.
    (alert,) = wait_for(
        lambda: [a for a in _Hook.received if "reconcile" in a["title"]],
        timeout_s=60,
        what="the webhook POST",
    )
    assert alert["title"] == "batching: reconcile found critical faults in score-tabular"
    text = alert["text"]
    lines = text.splitlines()
    assert any(line.startswith("- critical: missing file (") for line in lines), text
    assert f"Scoring run checked: {upstream}" in lines
    url = f"/runs/flow-run/{run_id_of(failed)}"
    assert any(line.startswith("Reconcile flow run: http") and line.endswith(url) for line in lines)
    assert "{'" not in text, "no Python repr"
    assert "['" not in text, "no Python repr"


def test_the_findings_text_is_one_line_per_finding_critical_first() -> None:
    from batching.evidence import findings as f

    report = f.Report(
        output_kind="parquet",
        location="/data/scores",
        now=0.0,
        since=None,
        run_id=None,
        findings=tuple(
            [f.Finding(f.Kind.ORPHAN_FILE, f.Severity.WARNING, "a file\nno batch names", count=1)]
            + [
                f.Finding(f.Kind.LOST_WRITE, f.Severity.CRITICAL, f"lost {i}", count=i)
                for i in range(25)
            ]
            + [f.Finding(f.Kind.DEAD, f.Severity.INFO, "dead item", count=3)]
        ),
    )
    lines = findings_text(report).splitlines()
    assert lines[0] == "- critical: lost write (0 affected): lost 0"
    assert len(lines) == MAX_FINDING_LINES + 1
    assert lines[-1] == "- and 6 more (see the findings artifact)"
    assert not any("info" in line for line in lines)
