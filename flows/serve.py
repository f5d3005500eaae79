"""Serve every deployment from this process, no work pool needed: ``python -m flows.serve``.

Run it from the repository root against a Prefect server (``PREFECT_API_URL``). It registers
the score, score-nightly, reconcile, bulk, maintain and rollout-guard deployments with their
schedules and triggers,
then polls for their runs and executes each in a subprocess (at most ``--limit`` at a time)
until Ctrl-C or SIGTERM, which pauses the schedules. Triggers stay registered (they are automations): delete
them with ``prefect automation delete`` when the deployments go.

Prefect's runner pauses the schedules through the API when it stops; with the server gone, its
client retries for minutes. So the runner works in a child process group, and this process,
on Ctrl-C or SIGTERM, passes the signal on and waits ``--shutdown-grace-s`` seconds; then it
kills the group (flow runs in it included: their leases expire and their items are claimed
again) and says how to pause the schedules by hand.
"""

from __future__ import annotations

import argparse
import multiprocessing as mp
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from types import FrameType

from flows import logs


def main(argv: list[str] | None = None) -> None:
    """Parse the options and serve the deployments until interrupted."""
    parser = argparse.ArgumentParser(
        prog="python -m flows.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--limit", type=int, default=2, help="flow runs at a time (default 2)")
    parser.add_argument(
        "--shutdown-grace-s",
        type=float,
        default=30.0,
        help="after Ctrl-C or SIGTERM, seconds to let the runner stop before killing it (30)",
    )
    args = parser.parse_args(argv)
    if args.limit < 1 or args.shutdown_grace_s <= 0:
        parser.error("--limit must be >= 1 and --shutdown-grace-s > 0")
    sys.exit(supervise(args.limit, args.shutdown_grace_s))


def supervise(
    limit: int, grace_s: float, target: Callable[[int, int, float], None] | None = None
) -> int:
    """Run ``target`` (the runner) in a child process group until it ends or this process gets
    Ctrl-C or SIGTERM; returns the exit code for this process. ``target(limit, supervisor pid,
    grace_s)`` must be importable by name (the child is spawned)."""
    stop = threading.Event()

    def on_signal(_signum: int, _frame: FrameType | None) -> None:
        stop.set()

    previous = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        return _run_child(target or _serve, limit, grace_s, stop)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)


def _run_child(
    target: Callable[[int, int, float], None], limit: int, grace_s: float, stop: threading.Event
) -> int:
    child = mp.get_context("spawn").Process(
        target=target, args=(limit, os.getpid(), grace_s), name="serve"
    )
    child.start()
    while child.is_alive() and not stop.wait(0.5):
        pass
    if not child.is_alive():
        if child.exitcode:  # it failed on its own (e.g. the server went away): nothing paused
            sys.stderr.write(
                f"flows.serve: the runner stopped with exit code {child.exitcode} (is the "
                f"Prefect server reachable?). {_PAUSE_HINT}\n"
            )
        return child.exitcode or 0
    _signal_group(child, signal.SIGINT)  # the runner pauses schedules and stops its runs
    child.join(grace_s)
    if child.is_alive():
        sys.stderr.write(
            f"flows.serve: the runner did not stop within {grace_s:g}s (is the Prefect server "
            f"reachable?); killing it. {_PAUSE_HINT}\n"
        )
        _signal_group(child, signal.SIGKILL)
        child.join()
        return 1
    return 0


_PAUSE_HINT = (
    "Its schedules may still be active: pause them with "
    "`prefect deployment schedule pause --all` once the server is back"
)


def _signal_group(child: mp.process.BaseProcess, sig: signal.Signals) -> None:
    assert child.pid is not None
    try:
        os.killpg(child.pid, sig)
    except ProcessLookupError:  # not yet its own group (signalled during start-up)
        os.kill(child.pid, sig)


def _serve(limit: int, supervisor: int, grace_s: float) -> None:
    os.setsid()  # its own process group: the supervisor can stop it and its flow runs at once
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threading.Thread(target=_stop_if_orphaned, args=(supervisor, grace_s), daemon=True).start()
    # Each run is a subprocess that inherits this: its `batching` records reach the UI.
    os.environ.setdefault(logs.EXTRA_LOGGERS_ENV, logs.LIBRARY)
    # A heartbeat a minute, as prefect.yaml's: the zombie-runs automation's 600 s window.
    os.environ.setdefault("PREFECT_FLOWS_HEARTBEAT_FREQUENCY", "60")

    from prefect import serve

    from flows.deployments import all_deployments

    try:
        serve(*all_deployments(), limit=limit)
    except KeyboardInterrupt:
        raise
    except Exception as exc:  # one line, not Prefect's traceback; the supervisor says the rest
        sys.stderr.write(f"flows.serve: the runner failed: {type(exc).__name__}: {exc}\n")
        sys.exit(1)


def _stop_if_orphaned(supervisor: int, grace_s: float) -> None:
    """The supervisor was killed (e.g. SIGKILL): stop as if interrupted, and for good after the
    grace period, rather than serve on with nobody to stop it."""
    while os.getppid() == supervisor:
        time.sleep(1.0)
    os.killpg(0, signal.SIGINT)
    time.sleep(grace_s)
    os.killpg(0, signal.SIGKILL)


if __name__ == "__main__":
    main()
