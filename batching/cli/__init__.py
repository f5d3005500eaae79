"""The ``batching`` command line. Exit codes: 0 ok, 1 failed, 2 bad usage or bad input.

One module per group of commands, each registering on the one Typer app of
:mod:`batching.cli.common`: :mod:`~batching.cli.queue` (init, enqueue, redrive, purge),
:mod:`~batching.cli.status` (status), :mod:`~batching.cli.controls` (queue pause, resume, cancel, cap, audit),
:mod:`~batching.cli.scoring` (score, demo), :mod:`~batching.cli.bulk` (bulk --in-place), :mod:`~batching.cli.plan` (check,
profile), :mod:`~batching.cli.evidence` (lineage, reconcile, maintain),
:mod:`~batching.cli.metrics` (metrics serve), :mod:`~batching.cli.api` (api),
:mod:`~batching.cli.rollout` (rollout start, status, promote, rollback, guard). The CLI is an edge: it alone
(with ``flows/``) reads environment variables (``BATCHING_DB_URL``, ``OPENLINEAGE_*``) and
turns them into arguments for the library.
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import typer

_STOPPABLE = ("score", "bulk")  # commands that stop gracefully on SIGTERM and SIGINT


def register() -> typer.Typer:
    """The one Typer app with every command registered on it."""
    from batching.cli import (  # noqa: F401  (register commands)
        api,
        bulk,
        controls,
        evidence,
        metrics,
        plan,
        queue,
        rollout,
        scoring,
        status,
    )
    from batching.cli.common import app

    _unwrap_help(app)
    return app


def _unwrap_help(command_line: typer.Typer) -> None:
    """Join each help paragraph's hard-wrapped lines: Typer keeps a docstring's single line
    breaks, so on a terminal narrower than the source each line wrapped again, ragged, in
    mid-sentence (found by a review)."""
    import inspect
    import re

    def unwrap(text: str | None) -> str | None:
        if not text:
            return text
        paragraphs = inspect.cleandoc(text).split("\n\n")
        listed = re.compile(r"^\s|^([-*]|\d+\.) ", re.MULTILINE)  # lists, indented blocks
        return "\n\n".join(p if listed.search(p) else " ".join(p.split("\n")) for p in paragraphs)

    for info in command_line.registered_commands:
        info.help = unwrap(info.help or (info.callback.__doc__ if info.callback else None))
    for group in command_line.registered_groups:
        group.help = unwrap(group.help) if isinstance(group.help, str) else group.help
        if group.typer_instance is not None:
            _unwrap_help(group.typer_instance)


def main() -> None:
    """Console-script entry point."""
    if sys.argv[1:2] and sys.argv[1] in _STOPPABLE:  # before the imports: they take ~1 s
        from batching.cli import stop_signal

        stop_signal.install_early()
    from batching.cli.common import run

    app = register()
    from batching.logs import configure_logging

    configure_logging(logging.DEBUG if os.environ.get("BATCHING_DEBUG") else logging.WARNING)
    run(app, as_json="--json" in sys.argv[1:])
