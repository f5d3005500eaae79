"""A real Prometheus (and Pushgateway) for tests: the Debian binaries in /usr/bin, started on a
spare loopback port with their storage in a temporary folder, scraping every second.

Use the ``prometheus`` fixture (tests/conftest.py): ``prometheus(targets, rule_files)`` starts
one that scrapes ``targets`` (job name -> ``host:port`` list) and evaluates ``rule_files``;
``Prometheus.query`` runs an instant query, ``Prometheus.alerts`` lists the alerts, and
``wait_for`` (tests/conftest.py) polls either until a condition holds. A missing binary skips
the test locally and fails it in CI.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

PROMETHEUS = "/usr/bin/prometheus"
PUSHGATEWAY = "/usr/bin/prometheus-pushgateway"


def require(binary: str) -> str:
    """``binary``'s path; skip the test when it is missing (fail it in CI)."""
    if Path(binary).exists() or shutil.which(binary):
        return binary
    reason = f"{binary} is not installed (apt-get install prometheus prometheus-pushgateway)"
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI needs it")
    pytest.skip(reason)


def free_port() -> int:
    """A TCP port free on the loopback now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout_s: float = 5.0) -> Any:
    """GET ``url`` and parse its JSON body."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return json.loads(resp.read())


def get_text(url: str, timeout_s: float = 5.0) -> str:
    """GET ``url``'s body as text."""
    with urllib.request.urlopen(url, timeout=timeout_s) as resp:
        return str(resp.read().decode())


def _ready(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=1) as resp:
            return bool(resp.status == 200)
    except OSError:
        return False


@dataclass
class Prometheus:
    """A running Prometheus at ``url``."""

    url: str
    process: subprocess.Popen[bytes]
    log: Path

    def query(self, expr: str) -> list[dict[str, Any]]:
        """An instant query's result vector (``metric`` labels and ``value``)."""
        q = urllib.parse.urlencode({"query": expr})
        body = get_json(f"{self.url}/api/v1/query?{q}")
        assert body["status"] == "success", body
        return list(body["data"]["result"])

    def value(self, expr: str) -> float | None:
        """The single value of ``expr``, or None when it has no result."""
        result = self.query(expr)
        assert len(result) <= 1, f"{expr} returned {len(result)} series"
        return float(result[0]["value"][1]) if result else None

    def alerts(self) -> list[dict[str, Any]]:
        """The alerts pending or firing now (``labels``, ``state``)."""
        return list(get_json(f"{self.url}/api/v1/alerts")["data"]["alerts"])

    def targets_up(self) -> bool:
        """Whether every scrape target has been scraped and is up."""
        active = get_json(f"{self.url}/api/v1/targets")["data"]["activeTargets"]
        return bool(active) and all(t["health"] == "up" for t in active)


def write_config(
    folder: Path,
    targets: Mapping[str, Sequence[str]],
    rule_files: Sequence[Path] = (),
    interval_s: float = 1.0,
) -> Path:
    """A prometheus.yml scraping ``targets`` (job -> host:port list) every ``interval_s``."""
    config = {
        "global": {
            "scrape_interval": f"{interval_s:g}s",
            "evaluation_interval": f"{interval_s:g}s",
        },
        "rule_files": [str(p) for p in rule_files],
        "scrape_configs": [
            {"job_name": job, "static_configs": [{"targets": list(hosts)}]}
            for job, hosts in targets.items()
        ],
    }
    path = folder / "prometheus.yml"
    path.write_text(yaml.safe_dump(config))
    return path


@contextlib.contextmanager
def running_prometheus(
    folder: Path,
    targets: Mapping[str, Sequence[str]],
    rule_files: Sequence[Path] = (),
    interval_s: float = 1.0,
) -> Iterator[Prometheus]:
    """Start Prometheus scraping ``targets``; stopped (and its storage left in ``folder``) at exit."""
    binary = require(PROMETHEUS)
    folder.mkdir(parents=True, exist_ok=True)
    config = write_config(folder, targets, rule_files, interval_s)
    port = free_port()
    log = folder / "prometheus.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={config}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
                "--web.enable-lifecycle",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    prom = Prometheus(f"http://127.0.0.1:{port}", process, log)
    try:
        _wait_ready(f"{prom.url}/-/ready", process, log)
        yield prom
    finally:
        _stop(process)


@contextlib.contextmanager
def running_pushgateway(folder: Path) -> Iterator[str]:
    """Start a Pushgateway on a spare loopback port; yields its URL."""
    binary = require(PUSHGATEWAY)
    folder.mkdir(parents=True, exist_ok=True)
    port = free_port()
    log = folder / "pushgateway.log"
    with log.open("wb") as out:
        process = subprocess.Popen(
            # its own persistence file: Debian's build defaults to one shared by every
            # Pushgateway on the host (/var/lib/prometheus/pushgateway.data), so a test's
            # gateway started with the groups any other gateway there had been pushed
            [
                binary,
                f"--web.listen-address=127.0.0.1:{port}",
                f"--persistence.file={folder / 'pushgateway.data'}",
            ],
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_ready(f"{url}/-/ready", process, log)
        yield url
    finally:
        _stop(process)


def _wait_ready(url: str, process: subprocess.Popen[bytes], log: Path) -> None:
    deadline = time.monotonic() + 30
    while not _ready(url):
        if process.poll() is not None:
            raise AssertionError(f"{url} exited: {log.read_text()[-2000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{url} not ready after 30 s: {log.read_text()[-2000:]}")
        time.sleep(0.1)


def _stop(process: subprocess.Popen[bytes]) -> None:
    process.terminate()
    try:
        process.wait(timeout=10)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
