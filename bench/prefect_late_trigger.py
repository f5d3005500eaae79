"""Reproduce Prefect's late trigger on a deployment's first scheduled run. Not a test.

Prefect 3.9.1 (checked in its source, ``site-packages/prefect/server``):

1. A flow-run state change emits ``prefect.flow-run.<State>`` with ``follows`` = the previous
   state's id when the two states are less than 5 min apart (``models/events.py``:
   ``_timing_is_tight``, ``TIGHT_TIMING``).
2. The scheduler inserts scheduled runs in bulk (``models/deployments.py``:
   ``_insert_scheduled_flow_runs``), outside orchestration: no ``prefect.flow-run.Scheduled``
   event is ever emitted for them.
3. The first run of an interval deployment is due at once, so its Scheduled state is less
   than 5 min older than its Pending one: the Pending event ``follows`` an event that never
   comes. The reactive triggers service holds it (``events/ordering``:
   ``preceding_event_confirmed`` raises ``EventArrivedEarly``), and Running and Completed,
   which follow it, behind it, until the periodic evaluation lets "lost followers" go after
   ``PRECEDING_EVENT_LOOKBACK`` (15 min, a constant). Later scheduled runs were inserted more
   than 5 min ahead, so their Pending event follows nothing; runs started by hand got their
   Scheduled event from orchestration. Both trigger at once.

A custom event (``emit_event`` from the run's ``on_completion`` hook) has no ``follows``.

This script starts ``prefect server start`` on a spare port (a scratch ``PREFECT_HOME``), serves
a no-op flow on an hourly interval whose first run is due 30 s after it is registered, with two trigger deployments:
one on ``prefect.flow-run.Completed`` of that flow, one on a custom event its ``on_completion``
hook emits; waits for the first scheduled run, then starts one by hand; and reports how long
after each run ended each trigger created its run (or that it had not after ``--wait-s``).

    python bench/prefect_late_trigger.py [--wait-s 120]

``--wait-s 1000`` sees the held trigger fire, about 15 min late. Measured (2 cores, SQLite
server, ``--wait-s 1000``, 2026-12-01)::

    Prefect 3.9.1, server on port 35531, started 22:16:21
    first scheduled run: trigger on bench.run.ended created its run after 0.1 s
    first scheduled run: trigger on prefect.flow-run.Completed created its run after 900.4 s
    run started by hand: trigger on bench.run.ended created its run after 0.1 s
    run started by hand: trigger on prefect.flow-run.Completed created its run after 0.0 s
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

# The parent starts the server and the children with PREFECT_API_URL set before they import
# Prefect (its settings are read on import); the parent itself never talks to the API.
import prefect
from prefect import flow
from prefect.client.orchestration import get_client
from prefect.client.schemas.filters import DeploymentFilter, DeploymentFilterId
from prefect.deployments import run_deployment
from prefect.events import DeploymentEventTrigger, emit_event
from prefect.schedules import Interval

CUSTOM = "bench.run.ended"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_healthy(url: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.5)
    raise SystemExit(f"the Prefect server at {url} did not answer within {timeout_s:g}s")


def _ended_hook(_flow: Any, flow_run: Any, _state: Any) -> None:
    emit_event(
        event=CUSTOM,
        resource={"prefect.resource.id": f"bench.run.{flow_run.id}"},
        payload={"flow_run_id": str(flow_run.id)},
    )


@flow(name="bench-noop", on_completion=[_ended_hook])  # type: ignore[list-item]
def noop() -> None:
    """The scheduled flow: does nothing."""


@flow(name="bench-after")
def after(upstream: str = "") -> None:
    """The triggered flow: does nothing."""


def serve() -> None:
    """Child process: serve the no-op flow and the two triggered deployments."""
    on_state = DeploymentEventTrigger(
        name="bench-on-completed",
        expect={"prefect.flow-run.Completed"},
        match={"prefect.resource.id": "prefect.flow-run.*"},
        match_related={"prefect.resource.role": "flow", "prefect.resource.name": "bench-noop"},
        parameters={"upstream": "{{ event.resource.id.split('.')[-1] }}"},
    )
    on_custom = DeploymentEventTrigger(
        name="bench-on-custom",
        expect={CUSTOM},
        match={"prefect.resource.id": "bench.run.*"},
        parameters={"upstream": "{{ event.payload.flow_run_id }}"},
    )
    # One run 30 s from now (the default anchor, now, would put the first run an hour ahead).
    first_in_30s = Interval(
        timedelta(hours=1), anchor_date=datetime.now(UTC) + timedelta(seconds=30)
    )
    prefect.serve(
        noop.to_deployment(name="noop", schedules=[first_in_30s]),  # type: ignore[arg-type]
        after.to_deployment(name="on-state", triggers=[on_state]),  # type: ignore[arg-type]
        after.to_deployment(name="on-custom", triggers=[on_custom]),  # type: ignore[arg-type]
        limit=4,
    )


def _report(wait_s: float) -> list[str]:
    """Wait for the first scheduled run, start one by hand, and time the triggers."""
    with get_client(sync_client=True) as client:
        noop = _poll(lambda: _deployment(client, "bench-noop/noop"), 120, "the noop deployment")
        first = _poll(lambda: _ended(client, noop.id, scheduled=True), 180, "the first run")
    by_hand = run_deployment("bench-noop/noop", timeout=120)
    runs = {"first scheduled run": first, "run started by hand": by_hand}
    found: dict[tuple[str, str], float | None] = {}
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        with get_client(sync_client=True) as client:
            for label, run in runs.items():
                for name in ("on-state", "on-custom"):
                    if found.get((label, name)) is None:
                        found[(label, name)] = _trigger_delay(client, name, run)
        if all(v is not None for v in found.values()):
            break
        time.sleep(2)
    lines = []
    for (label, name), delay in sorted(found.items()):
        trigger = "prefect.flow-run.Completed" if name == "on-state" else CUSTOM
        when = f"after {delay:.1f} s" if delay is not None else f"not within {wait_s:g} s"
        lines.append(f"{label}: trigger on {trigger} created its run {when}")
    return lines


def _poll(fn: Any, timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if (found := fn()) is not None:
            return found
        time.sleep(1)
    raise SystemExit(f"{what} did not come within {timeout_s:g}s")


def _deployment(client: Any, name: str) -> Any:
    try:
        return client.read_deployment_by_name(name)
    except Exception:
        return None


def _ended(client: Any, deployment_id: Any, *, scheduled: bool) -> Any:
    runs = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[deployment_id]))
    )
    for run in runs:
        if ("auto-scheduled" in run.tags) == scheduled and run.state and run.state.is_final():
            return run
    return None


def _trigger_delay(client: Any, deployment: str, upstream: Any) -> float | None:
    target = client.read_deployment_by_name(f"bench-after/{deployment}")

    runs = client.read_flow_runs(
        deployment_filter=DeploymentFilter(id=DeploymentFilterId(any_=[target.id]))
    )
    ended_at = upstream.state.timestamp
    for run in runs:
        if run.parameters.get("upstream") == str(upstream.id):
            return float((run.created - ended_at).total_seconds())
    return None


def main(argv: list[str] | None = None) -> None:
    """Command line: ``--wait-s``."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--wait-s", type=float, default=120.0, help="wait for triggers (120)")
    parser.add_argument("--role", choices=["serve", "report"], help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role == "serve":
        serve()
        return
    if args.role == "report":
        print("\n".join(_report(args.wait_s)), flush=True)
        return
    home = Path(tempfile.mkdtemp(prefix="prefect-late-trigger-"))
    port = _free_port()
    api = f"http://127.0.0.1:{port}/api"
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_API_URL": api,
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_LOGGING_LEVEL": "WARNING",
    }
    me = [sys.executable, __file__]
    server = subprocess.Popen(
        [sys.executable, "-m", "prefect", "server", "start", "--host", "127.0.0.1", "--port",
         str(port)],
        env=env, stdout=(home / "server.log").open("w"), stderr=subprocess.STDOUT,
    )  # fmt: skip
    runner = None
    try:
        _wait_healthy(api, 120)
        started = datetime.now(UTC)
        runner = subprocess.Popen(
            [*me, "--role", "serve"], env=env, stdout=subprocess.DEVNULL,
            stderr=(home / "serve.log").open("w"),
        )  # fmt: skip
        report = subprocess.run(
            [*me, "--role", "report", "--wait-s", str(args.wait_s)],
            env=env, capture_output=True, text=True, check=False,
        )  # fmt: skip
        print(f"Prefect {prefect.__version__}, server on port {port}, started {started:%H:%M:%S}")
        print(report.stdout.strip() or report.stderr.strip()[-2000:])
    finally:
        for proc in (runner, server):
            if proc is not None:
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()


if __name__ == "__main__":
    main()
