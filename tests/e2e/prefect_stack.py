"""A real ``prefect server start`` and the processes an end-to-end test starts against it."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from tests.conftest import REPO, wait_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Stack:
    """A Prefect server and the processes a test starts against it; all stopped at the end."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.api = f"http://127.0.0.1:{_free_port()}/api"
        self.db_url = f"sqlite:///{root / 'queue.db'}"
        self.events_path = root / "lineage.jsonl"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.http = httpx.Client(base_url=self.api, timeout=10)

    def env(self) -> dict[str, str]:
        base = {
            k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "OPENLINEAGE"))
        }
        return base | {
            "PREFECT_HOME": str(self.root / "prefect-home"),
            "PREFECT_API_URL": self.api,
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "PREFECT_SERVER_SERVICES_SCHEDULER_ENABLED": "false",
            "PREFECT_RUNNER_POLL_FREQUENCY": "1",
            "DO_NOT_TRACK": "1",
            "BATCHING_DB_URL": self.db_url,
            "OPENLINEAGE__TRANSPORT__TYPE": "file",
            "OPENLINEAGE__TRANSPORT__LOG_FILE_PATH": str(self.events_path),
        }

    def start(
        self, *args: str, name: str, env: dict[str, str] | None = None
    ) -> subprocess.Popen[bytes]:
        with (self.root / f"{name}.log").open("wb") as log:  # the child keeps its own copy
            proc = subprocess.Popen(
                [sys.executable, *args],
                cwd=REPO,
                env=env or self.env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self.procs.append(proc)
        return proc

    def start_server(self) -> None:
        port = self.api.rsplit(":", 1)[1].split("/")[0]
        env = {k: v for k, v in self.env().items() if k != "PREFECT_API_URL"}
        args = ("-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port", port)
        self.start(*args, "--no-ui", name="server", env=env)
        wait_for(self._healthy, 120, "the Prefect server")

    def _healthy(self) -> bool:
        try:
            return self.http.get("/health").json() is True
        except httpx.HTTPError:
            return False

    def stop(self, *procs: subprocess.Popen[bytes]) -> None:
        """SIGINT to every one of ``procs`` still running, then each waited for within one
        20 s grace (a Prefect worker can take most of it), the rest killed: one after
        another, two workers' graces cost a test 40 s of its teardown."""
        running = [p for p in procs if p.poll() is None]
        for proc in running:
            os.killpg(proc.pid, signal.SIGINT)
        deadline = time.monotonic() + 20
        for proc in running:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)

    def close(self) -> None:
        """What ran against the server stopped together, then the server (started first)."""
        self.stop(*self.procs[1:])
        self.stop(*self.procs[:1])
        self.http.close()

    def post(self, path: str, body: Any) -> Any:
        # A busy server on a 2-core machine answers 503 now and then (its own database is
        # locked); a client retries those, as Prefect's own client does.
        for delay in (0.5, 1, 2, 4, 0):
            response = self.http.post(path, json=body)
            if response.status_code != 503 or not delay:
                break
            time.sleep(delay)
        if response.is_error:  # what the server refused, and why, in the failure
            raise AssertionError(f"POST {path}: {response.status_code} {response.text[:2000]}")
        return response.json() if response.content else None

    def deployments(self) -> dict[str, dict[str, Any]]:
        found = self.post("/deployments/filter", {})
        return {d["name"]: d for d in found}

    def flow_run(self, run_id: str) -> dict[str, Any]:
        return dict(self.http.get(f"/flow_runs/{run_id}").json())

    def finished(self, run_id: str, timeout_s: float = 120) -> dict[str, Any]:
        def done() -> dict[str, Any] | None:
            run = self.flow_run(run_id)
            return run if run["state"]["type"] in ("COMPLETED", "FAILED", "CRASHED") else None

        return wait_for(done, timeout_s, f"flow run {run_id} to finish")
