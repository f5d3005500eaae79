"""Serve every deployment from this process, no work pool needed: ``python -m flows.serve``.

Run it from the repository root against a Prefect server (``PREFECT_API_URL``). It registers
the score, reconcile and bulk deployments with their schedules and triggers, then polls for
their runs and executes each in a subprocess (at most ``--limit`` at a time) until Ctrl-C,
which pauses the schedules. Triggers stay registered (they are automations): delete them with
``prefect automation delete`` when the deployments go.
"""

from __future__ import annotations

import argparse
import os

from flows import logs


def main(argv: list[str] | None = None) -> None:
    """Parse ``--limit`` and serve the deployments until interrupted."""
    parser = argparse.ArgumentParser(prog="python -m flows.serve", description=__doc__)
    parser.add_argument("--limit", type=int, default=2, help="flow runs at a time (default 2)")
    args = parser.parse_args(argv)
    # Each run is a subprocess that inherits this: its `batching` records reach the UI.
    os.environ.setdefault(logs.EXTRA_LOGGERS_ENV, logs.LIBRARY)

    from prefect import serve

    from flows.deployments import all_deployments

    serve(*all_deployments(), limit=args.limit)


if __name__ == "__main__":
    main()
