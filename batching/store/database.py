"""Database URLs and engines: normalize, redact, create, require, and translate errors.

The one place a database URL is parsed and its errors become ``QueueError`` (with the URL's
password masked). SQLite engines get their set-up (WAL, ``BEGIN IMMEDIATE``, the writer lock)
from :mod:`batching.sqlite`; PostgreSQL runs on psycopg 3.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sqlite3
import time
import urllib.parse
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, ParamSpec, TypeVar

import sqlalchemy as sa
from sqlalchemy import exc
from sqlalchemy import util as sa_util
from sqlalchemy.engine import Engine

from batching import errors
from batching.redaction import redact_url
from batching.store import sqlite

logger = logging.getLogger(__name__)
P = ParamSpec("P")
R = TypeVar("R")

_DRIVERS = {"sqlite": ("pysqlite",), "postgresql": ("psycopg",)}  # synchronous DBAPIs we test


def normalize_url(url: str) -> str:
    """Map ``postgres://``/``postgresql://`` to the psycopg 3 driver; other URLs pass through."""
    for prefix in ("postgres://", "postgresql://"):
        if url.startswith(prefix):
            return "postgresql+psycopg://" + url[len(prefix) :]
    return url


def redact(url: str) -> str:
    """The URL with its password replaced by ``***`` (safe to log or print), also when it
    does not parse (a missing ``:``, a port that is not a number); ``postgresql://`` as the
    user wrote it, not the driver form :func:`normalize_url` made of it."""
    try:  # SQLAlchemy masks the user-info password; redact_url also a password= in the query
        shown = redact_url(sa.make_url(url).render_as_string(hide_password=True))
    except (exc.ArgumentError, ValueError):
        shown = redact_url(url)
    driver_form = normalize_url("postgresql://")
    if shown.startswith(driver_form):  # the driver normalize_url adds, not the user's URL
        return "postgresql://" + shown.removeprefix(driver_form)
    return shown


def create_engine(url: str, *, sqlite_busy_timeout_ms: int = 30_000) -> Engine:
    """An engine tuned for the queue (SQLite: WAL + BEGIN IMMEDIATE; PostgreSQL: psycopg 3).

    Raises:
        ConfigError: the URL is malformed or names an unsupported database.
    """
    parsed = _parse_url(url)
    backend = parsed.get_backend_name()
    file = _sqlite_file(parsed) if backend == "sqlite" else None
    if backend == "sqlite" and file is None:
        raise errors.ConfigError(
            f"database URL {redact_url(url)!r} names no file; the queue must outlive the process "
            "and be shared by its connections: use sqlite:///FILE"
        )
    if file is not None and not file.parent.is_dir():
        raise errors.ConfigError(
            f"no folder {file.parent.absolute()} for the database file {file.name}; create the "
            "folder first, or fix the path (relative paths start from the current folder)"
        )
    if backend == "postgresql" and not parsed.database:
        fix = (  # a service file may name one, but lineage names the queue's table by the URL
            "name it in the URL beside the service: postgresql:///DB?service=NAME"
            if "service" in parsed.query
            else "use postgresql://USER@HOST:PORT/DB"
        )
        raise errors.ConfigError(
            f"database URL {redact(url)!r} names no database (it would use the server's "
            f"default); {fix}"
        )
    if backend not in ("sqlite", "postgresql"):
        raise errors.ConfigError(
            f"database {redact(url)} is not supported; use sqlite:///FILE or postgresql://HOST/DB"
        )
    if parsed.get_driver_name() not in _DRIVERS[backend]:
        raise errors.ConfigError(
            f"database driver {parsed.get_driver_name()!r} in {redact(url)} is not supported "
            f"(the queue runs on {' or '.join(_DRIVERS[backend])}); write the URL as "
            f"{'postgresql://' if backend == 'postgresql' else 'sqlite:///'}..."
        )
    ignored = _ignored_sqlite_options(parsed) if backend == "sqlite" else []
    if ignored:
        raise errors.ConfigError(
            f"database URL {redact(url)!r}: {', '.join(ignored)} would be ignored without "
            "uri=true; add &uri=true to pass them to SQLite (e.g. "
            "sqlite:///file:queue.db?mode=ro&uri=true), or remove them"
        )
    try:
        if backend == "sqlite":
            engine = sa.create_engine(parsed, pool_size=4, max_overflow=8)
            sqlite.configure(engine, sqlite_busy_timeout_ms, file)
            return engine
        return sa.create_engine(parsed, pool_pre_ping=True, pool_size=2, max_overflow=4)
    except (ImportError, exc.ArgumentError, TypeError, ValueError) as e:  # no driver, bad options
        raise errors.ConfigError(
            f"database URL {redact(url)!r} cannot be used ({type(e).__name__}: "
            f"{redact_url(str(e))}); use sqlite:///FILE or postgresql://USER@HOST:PORT/DB"
        ) from None


def _parse_url(url: str) -> sa.URL:
    """``url`` parsed (``postgres://`` mapped to psycopg 3), or ``ConfigError`` naming it redacted."""
    _, sep, rest = url.partition("://")
    if sep and rest.split("/", 1)[0].count("@") > 1:
        # The driver would take what follows the first "@" for the host, and name it (part of
        # the password) in its error.
        raise errors.ConfigError(
            f"database URL {redact(url)!r} has an '@' in its user name or password; "
            "percent-encode it as %40"
        )
    try:
        parsed = sa.make_url(normalize_url(url))
        if parsed.port is not None and not 0 < parsed.port < 65536:
            raise ValueError("port out of range")
        return parsed
    except (exc.ArgumentError, ValueError):  # ValueError: a port that is not a number
        raise errors.ConfigError(
            f"database URL {redact(url)!r} is malformed; use sqlite:///FILE or "
            "postgresql://USER@HOST:PORT/DB"
        ) from None


IDLE_IN_TRANSACTION_S = 60
"""PostgreSQL ends a scorer's session that sits this long inside a transaction
(:func:`bound_idle_transactions`): a scorer frozen mid-transaction (stopped, swapped out, cut
off) otherwise holds its row and advisory locks, and every scorer of the queue waits behind
them, until it resumes or TCP gives up (hours). A scorer's transactions wait on nothing but
the database; an enqueue's does (it reads its file inside it, minutes for a large one), so
only scorers set it. A server or role setting of its own is kept."""


def bound_idle_transactions(engine: sa.Engine) -> None:
    """Every new PostgreSQL connection of ``engine`` (a scorer's) sets
    ``IDLE_IN_TRANSACTION_S`` unless the server or role set a timeout; call it before the
    engine first connects. Nothing on SQLite (one writer lock, no session to end)."""
    if engine.dialect.name == "postgresql":
        sa.event.listen(engine, "connect", _bound_idle_transactions)


def _bound_idle_transactions(dbapi_connection: Any, _record: Any) -> None:
    with dbapi_connection.cursor() as cur:
        cur.execute("SHOW idle_in_transaction_session_timeout")
        row = cur.fetchone()
        if row is not None and str(row[0]) in ("0", "0ms"):
            cur.execute(f"SET idle_in_transaction_session_timeout = '{IDLE_IN_TRANSACTION_S}s'")
    dbapi_connection.commit()


# Query options the pysqlite driver takes itself; without uri=true it drops any other (with a
# warning), so "?mode=ro" alone would quietly open the file read-write.
_PYSQLITE_OPTIONS = frozenset(
    ("uri", "timeout", "isolation_level", "detect_types", "check_same_thread", "cached_statements")
)


def _ignored_sqlite_options(parsed: sa.URL) -> list[str]:
    """The query options of a SQLite URL that the driver would ignore (SQLite URI options
    given without ``uri=true``)."""
    return [] if _uri_on(parsed) else sorted(set(parsed.query) - _PYSQLITE_OPTIONS)


def _uri_on(parsed: sa.URL) -> bool:
    """Whether a SQLite URL sets ``uri=true`` (as the driver reads it; unreadable: off)."""
    try:
        return bool(sa_util.asbool(parsed.query.get("uri", False)))
    except ValueError:
        return False


def _sqlite_file(parsed: sa.URL) -> Path | None:
    """The file a SQLite URL names (``file:`` URIs included), or None for a memory database."""
    database = parsed.database or ""
    mode = parsed.query.get("mode")
    modes = {mode} if isinstance(mode, str) else set(mode or ())
    if _uri_on(parsed) and database.startswith("file:"):
        location = urllib.parse.urlsplit(database)  # file:x.db, file:///abs, file://localhost/abs
        database = urllib.parse.unquote(location.path)
        modes |= set(urllib.parse.parse_qs(location.query).get("mode", ()))
    if database in ("", ":memory:") or "memory" in modes:
        return None
    return Path(database)


def require_database(url: str) -> None:
    """Refuse a SQLite URL whose file is not there: opening it would create an empty database
    (and leave it behind) only to fail its schema check. ``batching init`` creates it.

    Raises:
        ConfigError: the URL is malformed, or its SQLite file does not exist.
    """
    parsed = _parse_url(url)
    if parsed.get_backend_name() != "sqlite":
        return
    path = _sqlite_file(parsed)
    if path is None or path.exists():
        return
    raise errors.ConfigError(
        f"no database at {path.resolve()}: create it with `batching init "
        f"--db {redact(url)}`, or fix the path (relative paths start from the current folder)"
    )


def require_file_still_there(engine: Engine) -> None:
    """A SQLite engine's file is where it was opened. An open connection still reads a file
    moved or deleted under it, so a long-lived reader (the API, the metrics exporter) would
    answer from a database nobody writes any more, and a writer would write where nobody reads.

    Raises:
        QueueError: the file is gone from its path.
    """
    if engine.dialect.name != "sqlite":
        return
    path = _sqlite_file(engine.url)
    if path is not None and not path.exists():
        raise errors.QueueError(  # no path: /readyz answers anyone
            "the SQLite database file is gone from its path; restore it (remove its old -wal "
            "and -shm first: SQLite would apply them to the copy) or run `batching init`"
        )


def check_intact(engine: Engine) -> None:
    """SQLite: ``PRAGMA quick_check`` (``batching init``), so an upgrade never runs on, nor
    passes, a damaged file. Other databases: nothing (their servers check their pages).

    Raises:
        QueueError: the file is damaged (the message says what to do).
    """
    if engine.dialect.name != "sqlite":
        return
    url = engine.url.render_as_string()
    with translate_errors(url), engine.connect() as conn:
        found = [str(row[0]) for row in conn.exec_driver_sql("PRAGMA quick_check").all()]
    if found != ["ok"]:
        reason = "database disk image is malformed"
        raise errors.QueueError(
            f"database {redact(url)}: {reason} ({found[0][:120]}){_hint(reason)}"
        )


@contextlib.contextmanager
def translate_errors(url: str) -> Iterator[None]:
    """Turn SQLAlchemy errors into ``QueueError`` with the URL redacted (the one place it happens)."""
    try:
        yield
    except sqlite3.Error as e:  # a raw connection's (the SQLite bulk paths)
        reason = (str(e).strip().splitlines() or [type(e).__name__])[0]
        _refuse_not_a_database(url, reason, e)
        raise errors.QueueError(f"database {redact(url)}: {reason}{_hint(reason)}") from e
    except exc.DBAPIError as e:
        reason = str(e.orig).strip().splitlines()[0] if e.orig else str(e)
        _refuse_not_a_database(url, reason, e)
        if e.connection_invalidated:  # the pool drops the connection; a new one may work
            raise errors.Disconnected(f"database {redact(url)} connection lost: {reason}") from e
        if isinstance(e, exc.OperationalError):
            message = f"database {redact(url)} failed: {reason}{_hint(reason)}"
            if any(text in reason for text in _RESTARTING):  # a verb's retry may get through
                raise errors.Disconnected(message) from e
            raise errors.QueueError(message) from e
        raise errors.QueueError(f"database {redact(url)}: {reason}{_hint(reason)}") from e


def _refuse_not_a_database(url: str, reason: str, e: Exception) -> None:
    for texts, fix in _NOT_A_DATABASE:  # bad input (exit 2), not a database failure
        if all(t in reason for t in texts):
            raise errors.ConfigError(f"database {redact(url)}: {reason}; {fix}") from e


# A server restarting or failing over refuses new connections for a moment (``pg_ctl restart``:
# refused, then "starting up"): a reconnecting verb tries again (``reconnecting``) rather than
# failing the run. A refused login or a missing database is not among them: it fails at once.
_RESTARTING = (
    "Connection refused",
    "the database system is starting up",
    "the database system is shutting down",
    "the database system is in recovery mode",
    "the database system is not yet accepting connections",  # after a crash (restart -m immediate)
    "server closed the connection unexpectedly",
    # a session ended by the server (pg_terminate_backend: SQLSTATE 57P01, a shutdown:
    # 57P02, a crash: 57P03), reported as a plain failure when the pool had not yet marked the
    # connection invalid: the run failed where a retry on a new connection gets through
    "terminating connection due to administrator command",
    "terminating connection due to unexpected postmaster exit",
    "terminating connection because of crash of another server process",
)
_NOT_A_DATABASE = (  # a URL that names something else: what to give instead
    (("file is not a database",), "the path names a file that is not SQLite; check it"),
    (
        ("unable to open database file",),
        "the path must name a file (not a folder) in a folder this user can write",
    ),
    (("invalid sslmode value",), "use sslmode=disable, prefer, require, verify-ca or verify-full"),
)
_HINTS = (  # what to do about the connection failures users meet first
    (
        ("database disk image is malformed",),
        "the SQLite file is damaged: stop what uses it, restore it from a backup (or "
        "`sqlite3 FILE .recover`), then run `batching reconcile`",
    ),
    (('database "', "does not exist"), "create it (createdb), then `batching init --db URL`"),
    (('role "', "does not exist"), "check the user name in the URL (or create that role)"),
    (("Connection refused",), "is the server running? check the host and port"),
    (
        ("is not permitted to log in",),
        "the role's login was revoked: an administrator restores it (ALTER ROLE NAME LOGIN), "
        "or use another role; see Credentials in docs/operations.md",
    ),
    (
        ("password authentication failed",),
        "check the user and the password (the URL's, or libpq's: PGPASSWORD, ~/.pgpass, a "
        "service file)",
    ),
    (
        ("definition of service", "not found"),
        "check the service name and the service file (PGSERVICEFILE, ~/.pg_service.conf)",
    ),
    (
        ("no password supplied",),
        "give the password as libpq takes it: PGPASSWORD, ~/.pgpass (PGPASSFILE), a service "
        "file (PGSERVICEFILE, ?service=NAME) or the URL; see Credentials in docs/operations.md",
    ),
)


def _hint(reason: str) -> str:
    return next((f"; {fix}" for texts, fix in _HINTS if all(t in reason for t in texts)), "")


_RECONNECT_TRIES = 6  # 0.1 + 0.2 + ... + 3.2 s: a server restart or a failover, not an outage


def reconnecting(verb: Callable[P, R]) -> Callable[P, R]:
    """Run a queue verb again, on a new connection, when its connection was lost.

    Only verbs whose second run is safe: each is a compare-and-set under its lease (a
    heartbeat, a release or a fail that did commit finds nothing left to change), and a claim
    whose commit answer was lost leaves its items under a lease nobody holds, which expires
    and charges nobody (``batching.crashes``). A commit is not retried here: its outcome is
    the ledger's to decide (``loop.scorer.Scorer._commit``).
    """

    @functools.wraps(verb)
    def run(*args: P.args, **kwargs: P.kwargs) -> R:
        for attempt in range(_RECONNECT_TRIES):
            try:
                return verb(*args, **kwargs)
            except errors.Disconnected as exc:
                if attempt == _RECONNECT_TRIES - 1:
                    raise
                delay = 0.1 * 2**attempt
                logger.warning(
                    "database connection lost; reconnecting in %.1f s",
                    delay,
                    extra={"action": "reconnect", "verb": verb.__name__, "error": str(exc)},
                )
                time.sleep(delay)
        raise AssertionError("unreachable")

    return run
