"""The ``batching`` command line. Exit codes: 0 ok, 1 failed, 2 bad usage or bad input.

The CLI is an edge: it alone (with ``flows/``) reads environment variables
(``BATCHING_DB_URL``) and turns them into arguments for the library.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, ParamSpec, TypeVar

import typer
import typer.exceptions as typer_exceptions
from rich import box
from rich.console import Console
from rich.progress import Progress, ProgressColumn
from rich.table import Table

from batching import database, errors
from batching.logs import configure_logging
from batching.redaction import redact_url

P = ParamSpec("P")
R = TypeVar("R")

app = typer.Typer(
    name="batching",
    help="Durable dynamic batching for model inference: queue, score, commit exactly once.",
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            out.print(f"batching {version('batching')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            out.print("batching (not installed: run `pip install -e .`)")
        raise typer.Exit()


@app.callback()
def _options(
    show_version: Annotated[
        bool,
        typer.Option(
            "--version", help="Print the version and exit.", callback=_version, is_eager=True
        ),
    ] = False,
) -> None:
    """Durable dynamic batching for model inference: queue, score, commit exactly once."""


# Messages stay on one line (paths in them can be copied); tables still fit the terminal.
# Without one (a pipe, a CI log) rich lays tables out in 80 columns, which cut paths and
# lineage dataset names mid-word; 240 keeps them whole ($COLUMNS still wins).
_PIPE_WIDTH = None if sys.stdout.isatty() or "COLUMNS" in os.environ else 240
out = Console(soft_wrap=True, width=_PIPE_WIDTH)
err = Console(stderr=True, soft_wrap=True)

QuietOption = Annotated[
    bool,
    typer.Option("--quiet", help="No progress bar (there is none when stderr is not a terminal)."),
]


def progress_bar(*columns: str | ProgressColumn, quiet: bool) -> Progress:
    """A progress display on stderr, gone when done; off with --quiet, on a pipe or a log file
    (rich draws nothing there but a blank line at the end)."""
    return Progress(*columns, console=err, disable=quiet or not err.is_terminal, transient=True)


DEFAULT_DB = "sqlite:///batching.db"
DbOption = Annotated[
    str,
    typer.Option(
        "--db",
        envvar="BATCHING_DB_URL",
        help="Database URL: sqlite:///FILE or postgresql://USER@HOST:PORT/DB.",
        show_default=True,
    ),
]


def _queue_name(value: str | None) -> str | None:
    # The same bounds as a config's queue.name: a queue no config can name is a typo.
    if value is not None and not 1 <= len(value) <= 200:
        raise typer.BadParameter(f"must be 1 to 200 characters, got {len(value)}")
    return value


QueueOption = Annotated[
    str, typer.Option("--queue", "-q", help="Queue name.", callback=_queue_name)
]


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Print a ``BatchingError`` as one line and exit 2 (bad input) or 1 (failure)."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return fn(*args, **kwargs)
        except errors.USAGE_ERRORS as exc:
            err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except errors.BatchingError as exc:
            err.print(f"[red]error:[/red] {exc}", markup=True, highlight=False, soft_wrap=True)
            raise typer.Exit(1) from None
        except (typer.Exit, typer.Abort, typer_exceptions.TyperException):
            raise  # typer's own ways out (exit codes, usage errors)
        except Exception as exc:  # a bug: still one line; the traceback when asked for
            if os.environ.get("BATCHING_DEBUG"):
                raise
            err.print(
                f"[red]error:[/red] unexpected {type(exc).__name__}: {redact_url(str(exc))} "
                "(a bug: run again with BATCHING_DEBUG=1 for the traceback, and report it)",
                markup=True,
                highlight=False,
                soft_wrap=True,
            )
            raise typer.Exit(1) from None

    return wrapper


def open_queue(db: str, queue: str = "default", *, create: bool = False, **kwargs: Any) -> Any:
    """An ``SqlQueue`` for ``db`` (imports SQLAlchemy only when a command needs it); the
    SQLite file must exist unless ``create`` (``batching init``)."""
    from batching import queue as q

    if not create:
        database.require_database(db)
    return q.SqlQueue(database.create_engine(db), queue, **kwargs)


@app.command()
@handle_errors
def init(db: DbOption = DEFAULT_DB) -> None:
    """Create or upgrade the queue schema (a second run changes nothing)."""

    result = open_queue(db, create=True).migrate()
    where = database.redact(db)
    if result.applied:
        out.print(
            f"{where}: schema upgraded from version {result.from_version} to {result.to_version}"
        )
    else:
        out.print(f"{where}: schema already at version {result.to_version}; nothing to do")


@app.command()
@handle_errors
def enqueue(
    file: Annotated[Path, typer.Argument(help="JSONL or Parquet file of records.")],
    db: DbOption = DEFAULT_DB,
    queue: QueueOption = "default",
    max_attempts: Annotated[
        int, typer.Option(min=1, max=1000, help="Attempts before an item is dead (1-1000).")
    ] = 5,
    quiet: QuietOption = False,
) -> None:
    """Enqueue every record of FILE in one transaction (all or nothing), idempotent on item_key.

    Each record: item_key, payload, and optionally tenant, priority, deadline, cost, lane.
    """
    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn

    from batching import ingest

    q = open_queue(db, queue, max_attempts=max_attempts)
    q.check_schema()  # before reading: a large file takes a while
    progress = progress_bar(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        quiet=quiet,
    )
    try:
        with progress:
            reading = progress.add_task(f"reading {file.name}", total=None)
            records = ingest.read_records(file, lambda n: progress.update(reading, completed=n))
            progress.update(reading, total=len(records), visible=False)
            writing = progress.add_task("enqueueing (one transaction)", total=len(records))
            result = q.enqueue(records, lambda n: progress.update(writing, completed=n))
    except KeyboardInterrupt:
        err.print(f"interrupted: nothing of {file} was enqueued (one transaction)")
        raise typer.Exit(130) from None
    out.print(
        f"{file}: committed {result.inserted} new item(s) to queue {queue!r}; "
        f"{len(result.duplicates)} already present (not enqueued again)"
    )
    if not records:
        err.print(f"warning: {file} holds no records; nothing to enqueue", highlight=False)
    now = time.time()
    late = sum(1 for r in records if r.deadline_at is not None and r.deadline_at <= now)
    if late:
        err.print(
            f"warning: {late} record(s) of {file} are already past their deadline; they expire "
            "at the next claim, unscored (an SLA miss)",
            highlight=False,
        )
    if result.duplicates:
        shown = ", ".join(result.duplicates[:5])
        more = f" and {len(result.duplicates) - 5} more" if len(result.duplicates) > 5 else ""
        out.print(f"duplicates: {shown}{more}")


@app.command()
@handle_errors
def status(
    db: DbOption = DEFAULT_DB,
    queue: Annotated[
        str | None,
        typer.Option("--queue", "-q", help="Queue name [default: default].", callback=_queue_name),
    ] = None,
    all_queues: Annotated[bool, typer.Option("--all", help="Every queue in the table.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Queue depth by state, oldest ready age, expired leases, per queue, lane and tenant."""
    from dataclasses import asdict

    if all_queues and queue is not None:
        raise errors.InputError("--all and --queue together: give one (--all: every queue)")
    queue = queue or "default"
    q = open_queue(db, queue)
    q.check_schema()
    stats = q.stats(all_queues=all_queues)
    if not all_queues and not stats.groups:
        warn_unknown_queue(q)
    if as_json:
        sys.stdout.write(json.dumps(asdict(stats), indent=2) + "\n")
        return
    # No vertical rules: with --all, ten columns still fit 80 characters without folding names.
    table = Table(
        title=f"queue {'(all)' if all_queues else repr(queue)}",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    keys = ("queue", "lane", "tenant") if all_queues else ("lane", "tenant")
    for col in keys:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    # "stale": leases past their expiry that the reaper has not released yet.
    for col in ("ready", "leased", "done", "dead", "expired", "stale", "oldest"):
        table.add_column(col, justify="right", min_width=len(col))
    for g in stats.groups:
        age = f"{g.oldest_ready_age_s:.1f}s" if g.oldest_ready_age_s is not None else "-"
        names = {"queue": g.queue, "lane": g.lane or "-", "tenant": g.tenant}
        counts = (g.ready, g.leased, g.done, g.dead, g.expired, g.expired_leases)
        table.add_row(*(names[k] for k in keys), *(str(v) for v in counts), age)
    out.print(table)
    totals = ", ".join(f"{k} {v}" for k, v in stats.by_state.items())
    backoff = f"; {stats.backoff} ready waiting out a retry backoff" if stats.backoff else ""
    out.print(f"total: {totals}; expired leases {stats.expired_leases}{backoff}")


@app.command()
@handle_errors
def redrive(
    db: DbOption = DEFAULT_DB,
    queue: QueueOption = "default",
    only: Annotated[str, typer.Option(help="Which items: dead, expired or all.")] = "all",
) -> None:
    """Move dead and/or expired items back to ready with fresh attempts."""
    from batching import models

    choices = {
        "dead": (models.State.DEAD,),
        "expired": (models.State.EXPIRED,),
        "all": (models.State.DEAD, models.State.EXPIRED),
    }
    if only not in choices:
        raise errors.ConfigError(f"--only must be dead, expired or all, got {only!r}")
    q = open_queue(db, queue)
    q.check_schema()
    n = q.redrive(choices[only])
    if n == 0:
        warn_unknown_queue(q)
    out.print(f"redrove {n} item(s) in queue {queue!r} back to ready")


@app.command()
@handle_errors
def purge(
    older_than: Annotated[
        str, typer.Option(help="Age of done items to remove: 7d, 12h, 30m, 90s.")
    ] = "7d",
    db: DbOption = DEFAULT_DB,
    queue: QueueOption = "default",
    archive: Annotated[
        bool, typer.Option(help="Copy to batching_items_archive before deleting.")
    ] = False,
) -> None:
    """Remove done items older than --older-than (keep at least the reconcile window)."""
    age_s = parse_duration(older_than, "--older-than")
    q = open_queue(db, queue)
    q.check_schema()
    n = q.purge(age_s, archive=archive)
    if n == 0:
        warn_unknown_queue(q)
    verb = "archived" if archive else "deleted"
    out.print(f"{verb} {n} done item(s) older than {older_than} from queue {queue!r}")


def warn_unknown_queue(q: Any) -> None:
    """Warn that ``q``'s queue has no items, naming those that do: a mistyped ``-q`` would
    otherwise look like an idle queue (zeros, exit 0)."""
    names = sorted({g.queue for g in q.stats(all_queues=True).groups})
    if q.queue not in names:
        err.print(
            f"warning: queue {q.queue!r} has no items; queues in this database: "
            f"{', '.join(names) or 'none'}",
            highlight=False,
        )


def parse_duration(text: str, name: str) -> float:
    """``90s``/``30m``/``12h``/``7d`` (or plain seconds) to seconds; ``ConfigError`` otherwise."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    body, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "s")
    try:
        value = float(body)
    except ValueError:
        value = math.nan
    if not math.isfinite(value):  # nan and inf parse as floats; nan compared as "older"
        raise errors.ConfigError(
            f"{name} must be a duration like 90s, 30m, 12h or 7d, got {text!r}"
        ) from None
    if value < 0:
        raise errors.ConfigError(f"{name} must not be negative, got {text!r}")
    return value * units[unit]


def main() -> None:
    """Console-script entry point."""
    from batching import cli, cli_ops, cli_score  # noqa: F401  (register their commands)

    configure_logging(logging.DEBUG if os.environ.get("BATCHING_DEBUG") else logging.WARNING)
    # ``cli.app``, not ``app``: under ``python -m batching.cli`` this module is ``__main__`` and
    # the other command modules register on the imported ``batching.cli``.
    cli.app()


if __name__ == "__main__":
    main()
