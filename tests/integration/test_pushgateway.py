"""Pushes to a Pushgateway, against a local HTTP server standing in for one (it records each
PUT): the URL's credentials go as basic auth and never into a message; a run is pushed while
it runs, not only at its end."""

from __future__ import annotations

import base64
import http.server
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import pytest
from prometheus_client import CollectorRegistry, Gauge

from batching import config
from batching.metrics import publish

MODEL = {"model": {"name": "w1-mlp", "version": "v", "sha256": "0" * 64}}


@dataclass
class Gateway:
    port: int
    puts: list[tuple[str, str | None, bytes]] = field(default_factory=list)  # path, auth, body

    def config(self, userinfo: str = "") -> config.PipelineConfig:
        url = f"http://{userinfo}127.0.0.1:{self.port}"
        return config.parse_config(MODEL | {"metrics": {"pushgateway_url": url}})


@pytest.fixture
def gateway() -> Iterator[Gateway]:
    found = Gateway(0)

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_PUT(self) -> None:
            body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
            found.puts.append((self.path, self.headers.get("Authorization"), body))
            self.send_response(200)
            self.end_headers()

        def log_message(self, *args: object) -> None:
            pass

    server = http.server.HTTPServer(("127.0.0.1", 0), Handler)
    found.port = server.server_address[1]
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield found
    finally:
        server.shutdown()
        server.server_close()


def test_a_pushgateway_behind_basic_auth_gets_the_push_and_no_message_shows_the_password(
    gateway: Gateway,
) -> None:
    """The client read ``user:secret@host`` as a host and never reached the gateway, and a
    failed push printed the password."""
    assert publish.publish_run(gateway.config("pgw:s3cret@")) == []
    ((path, auth, _),) = gateway.puts
    assert path.startswith("/metrics/job/batching-score/environment/default/instance/")
    assert auth == "Basic " + base64.b64encode(b"pgw:s3cret").decode()

    gone = config.parse_config(
        MODEL | {"metrics": {"pushgateway_url": "http://pgw:s3cret@127.0.0.1:9"}}
    )  # nothing listens on port 9
    (problem,) = publish.publish_run(gone)
    assert problem.startswith("metrics not pushed to http://pgw:***@127.0.0.1:9: ")
    assert "s3cret" not in problem


def test_a_run_is_pushed_while_it_runs_not_only_at_its_end(gateway: Gateway) -> None:
    """Pushed only at its end, a hung or dead short run never showed as active on the
    Pushgateway, and BatchingRunNoHeartbeat could not fire for it."""
    reg = CollectorRegistry()
    active = Gauge("batching_run_active", "a run is active", registry=reg)
    with publish.pushing(gateway.config(), reg, every_s=0.05):
        active.set(1)
        deadline = time.monotonic() + 10
        while len(gateway.puts) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
    assert len(gateway.puts) >= 2
    assert b"batching_run_active 1.0" in gateway.puts[-1][2]


def test_environments_and_scorers_sharing_a_gateway_keep_their_own_groups(
    gateway: Gateway,
) -> None:
    """Keyed by job and queue alone, staging's run replaced prod's series on a shared
    gateway, and two scorers of one queue replaced each other's (found by a review)."""
    url = f"http://127.0.0.1:{gateway.port}"
    for environment, instance in (("prod", None), ("staging", None), ("prod", "gpu-1")):
        metrics: dict[str, object] = {"pushgateway_url": url, "environment": environment}
        if instance is not None:
            metrics["instance"] = instance
        assert publish.publish_run(config.parse_config(MODEL | {"metrics": metrics})) == []
    host = socket.gethostname()
    assert [path for path, _, _ in gateway.puts] == [
        f"/metrics/job/batching-score/environment/prod/instance/{host}/queue/default",
        f"/metrics/job/batching-score/environment/staging/instance/{host}/queue/default",
        "/metrics/job/batching-score/environment/prod/instance/gpu-1/queue/default",
    ]


def test_a_run_is_pushed_as_soon_as_it_starts(gateway: Gateway) -> None:
    """Its counters start at zero: pushed early, Prometheus sees the reset from the last
    run's values (pushed first when already past them, it read a continuation and rate()
    undercounted the run). Pushed at once, before the run made its labelled series, the
    group was empty (found by a review): a run that hung or died in its first 30 s was never
    seen active. So the first push waits for the run's ``batching_run_active`` 1."""
    cfg = gateway.config()
    reg = CollectorRegistry()
    active = Gauge("batching_run_active", "a run is active", ("environment", "queue"), registry=reg)
    with publish.pushing(cfg, reg, every_s=3600):
        time.sleep(0.3)
        assert gateway.puts == []  # nothing of the run yet: no empty group
        active.labels(cfg.metrics.environment, cfg.queue.name).set(1)
        deadline = time.monotonic() + 10
        while not gateway.puts and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(gateway.puts) == 1
    assert b"batching_run_active{" in gateway.puts[0][2]
    assert b"} 1.0" in gateway.puts[0][2]
