"""What every command of the CLI shares: the Typer app, the consoles, the options, one-line
errors (``handle_errors``), ``--json`` documents (``emit_json``), progress bars, durations.

Light on purpose: ``batching --help`` imports this and the command modules, so anything
heavier than typer and rich (SQLAlchemy, torch, pyarrow) is imported by the command that
needs it, when it runs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import unicodedata
from collections.abc import Callable
from pathlib import Path
from typing import Annotated, Any, NoReturn, ParamSpec, TypeVar

import typer
import typer.exceptions as typer_exceptions
from rich.console import Console
from rich.progress import Progress, ProgressColumn
from rich.text import Text

from batching import errors
from batching.cli import argv
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


def shown(value: object, *, keep_newlines: bool = False) -> str:
    """``value`` as text a terminal prints and does nothing else with: each control character
    (an escape sequence's ESC, a NUL, a line break in a tenant) as its escape, ``\\x1b``,
    ``\\n``; everything else (brackets, backslashes, ``:emoji:`` codes, any script) as is."""
    text = str(value)
    if text.isprintable() or not any(_control(c, keep_newlines) for c in text):
        return text
    return "".join(
        c.encode("unicode_escape").decode("ascii") if _control(c, keep_newlines) else c
        for c in text
    )


def _control(char: str, keep_newlines: bool) -> bool:
    if keep_newlines and char == "\n":
        return False
    return unicodedata.category(char) in ("Cc", "Zl", "Zp")


def plain(value: object) -> Text:
    """``value`` as a Rich ``Text`` shown as it is on any console: a table cell, a title, a
    progress or spinner text never parsed as markup or emoji codes, one line (see ``shown``)."""
    return Text(shown(value))


class DataConsole(Console):
    """A console for data: what it prints is names, keys, paths and messages made of them
    (a tenant ``[/]``, a key ``:smile:``, a path ``.[delta]``), never markup or emoji codes,
    which Rich would read, drop or fail on after the work was done; control characters in them
    are printed as escapes, not acted on by the terminal. ``flag`` styles the one word that
    should be red (its message a plain Text)."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(markup=False, emoji=False, **kwargs)

    def render_str(self, text: str, **kwargs: Any) -> Text:
        """Every string Rich prints passes here (``print``, table cells, titles)."""
        return super().render_str(shown(text, keep_newlines=True), **kwargs)


out = DataConsole(soft_wrap=True, width=_PIPE_WIDTH)
err = DataConsole(stderr=True, soft_wrap=True)


def flag(console: Console, label: str, message: str) -> None:
    """``label: message`` with the label in red and the message printed as it is."""
    # A Text, never markup: rich's escape() leaves "\\[" with no closing bracket as it is, and
    # its markup then printed "[" (a backslash lost from a file name, found by hypothesis)
    text = Text.assemble((f"{label}:", "red"), " ", shown(message, keep_newlines=True))
    console.print(text, highlight=False)


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
        help="Database URL: sqlite:///FILE or postgresql://USER@HOST:PORT/DB (its password "
        "from PGPASSWORD, ~/.pgpass or a ?service= file, as libpq takes it).",
        show_default=True,
    ),
]


def queue_name(value: str | None) -> str | None:
    # The same bounds as a config's queue.name: a queue no config can name is a typo.
    if value is not None and not 1 <= len(value) <= 200:
        raise typer.BadParameter(f"must be 1 to 200 characters, got {len(value)}")
    return value


QueueOption = Annotated[str, typer.Option("--queue", "-q", help="Queue name.", callback=queue_name)]
ConfigQueueOption = Annotated[
    str | None,
    typer.Option(
        "--queue",
        "-q",
        help="Queue name. Default: the --config's queue.name, else default.",
        callback=queue_name,
    ),
]
AttemptsOption = Annotated[
    int | None,
    typer.Option(
        min=1,
        max=1000,
        help="Attempts before an item is dead (1-1000). Default: the --config's "
        "queue.max_attempts, else 5.",
    ),
]


ConfigOption = Annotated[
    Path, typer.Option("--config", "-c", help="Pipeline YAML (see deployments/).")
]
DbOverride = Annotated[
    str | None,
    typer.Option("--db", envvar="BATCHING_DB_URL", help="Database URL; overrides the config's."),
]
OutputOverride = Annotated[
    str | None,
    typer.Option(
        "--output", help="Output folder (parquet) or table (sql); overrides the config's."
    ),
]


def load(config: Path) -> Any:
    from batching.config import load_config

    return load_config(config)


ConfigDbOption = Annotated[
    str | None,
    typer.Option(
        "--db",
        envvar="BATCHING_DB_URL",
        help="Database URL: sqlite:///FILE or postgresql://USER@HOST:PORT/DB. Default: the "
        f"--config's database.url, else {DEFAULT_DB}.",
        show_default=False,
    ),
]
TargetOption = Annotated[
    Path | None,
    typer.Option(
        "--config",
        "-c",
        help="Pipeline YAML: its database.url and queue.name are the defaults of --db and -q.",
    ),
]


def target(db: str | None, queue: str | None, config: Path | None) -> tuple[str, str]:
    """The database URL and queue a command acts on: ``--db`` and ``-q`` as given, else the
    config's ``database.url`` and ``queue.name`` (as ``score -c`` reads them), else the
    defaults. A bad config fails here, before anything is opened."""
    from batching import config as cfg

    pipeline = load(config) if config is not None else None
    url = db if db is not None else pipeline.database.url if pipeline else DEFAULT_DB
    name = queue if queue is not None else (pipeline.queue if pipeline else cfg.QueueConfig()).name
    return url, name


JsonOption = Annotated[
    bool,
    typer.Option(
        "--json",
        help="Machine-readable output: one JSON document on stdout (progress and notes on "
        'stderr); a failure is {"ok": false, "error": {"kind", "message", '
        '"exit_code"}}, with the same exit code.',
    ),
]


def emit_json(doc: object) -> None:
    """Write ``doc`` to stdout as the one JSON document of a ``--json`` command."""
    sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    sys.stdout.flush()


def error_doc(kind: str, message: str, exit_code: int) -> dict[str, Any]:
    """The document a ``--json`` command prints on stdout when it fails (``kind``: the
    ``batching.errors`` class, or ``unexpected`` for a bug)."""
    return {"ok": False, "error": {"kind": kind, "message": message, "exit_code": exit_code}}


def handle_errors(fn: Callable[P, R]) -> Callable[P, R]:
    """Print a ``BatchingError`` as one line and exit 2 (bad input) or 1 (failure).

    A command called with ``--json`` (its ``as_json`` parameter) also prints the error as its
    JSON document on stdout (``error_doc``), so a script reading stdout always gets one.
    """

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        as_json = bool(kwargs.get("as_json"))
        try:
            return fn(*args, **kwargs)
        except errors.USAGE_ERRORS as exc:
            _fail(type(exc).__name__, str(exc), 2, as_json)
        except errors.BatchingError as exc:
            _fail(type(exc).__name__, str(exc), 1, as_json)
        except (typer.Exit, typer.Abort, typer_exceptions.TyperException):
            raise  # typer's own ways out (exit codes, usage errors)
        except Exception as exc:  # a bug: still one line; the traceback when asked for
            if os.environ.get("BATCHING_DEBUG"):
                raise
            _fail(
                "unexpected",
                f"unexpected {type(exc).__name__}: {redact_url(str(exc))} "
                "(a bug: run again with BATCHING_DEBUG=1 for the traceback, and report it)",
                1,
                as_json,
            )

    return wrapper


def run(command_line: typer.Typer, *, as_json: bool) -> NoReturn:
    """Run ``command_line`` as ``command_line()`` does, except that a usage error, which the
    command line raises before any command runs (an unknown option, a missing argument, a
    value of the wrong type), is ONE line on stderr naming the fix, not Click's usage box;
    with ``as_json`` (``--json``) also a JSON error document (``kind`` ``UsageError``)."""
    refused = argv.not_text(sys.argv[1:])
    if refused is not None:  # before any command runs: nothing half-applied
        flag(err, "error", refused)
        if as_json:
            emit_json(error_doc("UsageError", refused, 2))
        sys.exit(2)
    try:
        code = command_line(standalone_mode=False)
    except typer_exceptions.TyperException as exc:
        if type(exc).__name__ == "NoArgsIsHelpError":  # a bare group: its help is the answer
            exc.show()  # type: ignore[attr-defined]
            sys.exit(2)
        # Typer's vendored Click exceptions; TyperException is the one public name for them
        message = " ".join(exc.format_message().split())
        code = getattr(exc, "exit_code", 2)
        ctx = getattr(exc, "ctx", None)
        hint = f" (see `{ctx.command_path if ctx is not None else 'batching'} --help`)"
        flag(err, "error", f"{message}{hint}")
        if as_json:
            emit_json(error_doc("UsageError", message, code))
        sys.exit(code)
    except typer_exceptions.Abort:
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


def _fail(kind: str, message: str, code: int, as_json: bool) -> NoReturn:
    flag(err, "error", message)
    if as_json:
        emit_json(error_doc(kind, message, code))
    raise typer.Exit(code) from None


def open_queue(db: str, queue: str = "default", *, create: bool = False, **kwargs: Any) -> Any:
    """An ``SqlQueue`` for ``db`` (imports SQLAlchemy only when a command needs it); the
    SQLite file must exist unless ``create`` (``batching init``)."""
    from batching.ingress import queue as q
    from batching.store import database

    if not create:
        database.require_database(db)
    return q.SqlQueue(database.create_engine(db), queue, **kwargs)


def warn_unknown_tenant(q: Any, tenant: str | None, states: tuple[str, ...]) -> None:
    """After a control matched nothing: warn when ``tenant`` has no item of ``states`` in
    ``q``'s queue, naming the tenants that have (a mistyped --tenant matched nothing, and
    said only "0 item(s)", exit 0; found by a review)."""
    if tenant is None:
        return
    groups = q.stats(done=False).groups
    having = sorted({g.tenant for g in groups if any(getattr(g, s, 0) for s in states)})
    if tenant not in having:
        err.print(
            f"warning: queue {q.queue!r} has no {' or '.join(states)} item of tenant "
            f"{tenant!r}; tenants that have: {', '.join(having[:10]) or 'none'}"
            + (", ..." if len(having) > 10 else "")
            + " (a typo?)",
            highlight=False,
        )


def warn_unknown_queue(
    q: Any, *, controls_too: bool = False, refuse: str | None = None
) -> str | None:
    """Warn (and return the warning) that ``q``'s queue has no items, naming the queues there:
    a typo looked like an idle queue. A queue with a control or an audit row (purged) is known;
    ``controls_too`` (pause, cap): by items or control only (a typo's audit row: not paused)."""
    from batching.ingress import controls

    names = set(q.queue_names()) | set(controls.states(q.engine))
    names |= set() if controls_too else set(controls.last_at(q.engine))  # audited
    has = "no items and no control yet" if controls_too else "no items"
    if q.queue not in names:
        said = (
            f"queue {q.queue!r} has {has}; queues in this database: "
            f"{', '.join(sorted(names)) or 'none'}" + (" (a typo?)" if controls_too else "")
        )
        if refuse is not None:
            raise errors.InputError(
                f"{said}; nothing changed: to control a queue before its first item, add {refuse}"
            )
        err.print(f"warning: {said}", highlight=False)
        return said
    return None


def parse_duration(text: str, name: str) -> float:
    """``90s``/``30m``/``12h``/``7d`` to seconds; ``ConfigError`` otherwise. The unit is
    required: a bare ``7`` was taken as seconds, and ``purge --older-than 7`` from an operator
    who meant days deleted nearly every done item (found by a review)."""
    units = {"s": 1, "m": 60, "h": 3600, "d": 86400}
    text = text.strip()
    body, unit = (text[:-1], text[-1]) if text and text[-1] in units else (text, "")
    try:
        value = float(body)
    except ValueError:
        value = math.nan
    if not unit and math.isfinite(value):
        raise errors.ConfigError(
            f"{name} {text} needs a unit: write {text}s, {text}m, {text}h or {text}d"
        )
    if not math.isfinite(value):  # nan and inf parse as floats; nan compared as "older"
        raise errors.ConfigError(
            f"{name} must be a duration like 90s, 30m, 12h or 7d, got {text!r}"
        ) from None
    if value < 0:
        raise errors.ConfigError(f"{name} must not be negative, got {text!r}")
    if value * units[unit] > 36500 * 86400:  # store.retention.MAX_AGE_S (a test binds them)
        raise errors.ConfigError(f"{name} must be at most 36500d, got {text!r}")
    return value * units[unit]
