"""OpenLineage dataset naming (https://openlineage.io/docs/spec/naming): the namespace and
name of a database table, a local path or an object-store URI; standard library only.

Tables: ``postgres://{host}:{port}`` / ``{database}.{schema}.{table}``, and ``sqlite`` /
``{absolute file path}.{table}``. Files and folders: ``file`` / ``{absolute path}``;
``s3://{bucket}`` / ``{key}`` (likewise ``gs://``, ``abfss://``...). Credentials never appear in
either part. The scoring run's input (the queue table) and every sink's output are named here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from urllib.parse import unquote

from batching import errors
from batching.redaction import redact_url

_DB_URL = re.compile(
    r"^(?P<scheme>[\w+]+)://(?:(?P<user>[^:/]*)(?::(?P<password>.*))?@)?"
    r"(?:\[(?P<ipv6>[^\]/?]+)\]|(?P<host>[^/:?]*))?(?::(?P<port>[^/?]*))?"
    r"(?:/(?P<database>[^?]*))?(?:\?(?P<query>.*))?$",
    re.DOTALL,
)


def sql_dataset_id(
    url: str, table: str, *, schema: str | None = None, base_dir: Path | None = None
) -> tuple[str, str]:
    """Return the OpenLineage ``(namespace, name)`` of ``table`` in the database at ``url``.

    PostgreSQL: ``("postgres://host:port", "database.schema.table")``, schema default ``public``,
    port default 5432. SQLite: ``("sqlite", "/abs/path/file.db.table")``, a relative file resolved
    against ``base_dir`` (default: the working directory). Credentials never appear in either part.

    Raises:
        ConfigError: ``url`` is not a database URL, or its dialect is neither sqlite nor postgresql.
    """
    match = _DB_URL.match(url)
    if match is None:
        raise errors.ConfigError(
            f"database url {redact_url(url)!r} is not a URL like "
            "postgresql://host:5432/db or sqlite:///batching.db"
        )
    dialect = match["scheme"].split("+", 1)[0].lower()
    if dialect == "sqlite":
        return "sqlite", f"{_sqlite_path(match['database'] or '', base_dir)}.{table}"
    if dialect in ("postgresql", "postgres"):
        return _postgres_namespace(match), f"{_postgres_db(match)}.{schema or 'public'}.{table}"
    raise errors.ConfigError(
        f"database url dialect {dialect!r} is not supported; use sqlite or postgresql"
    )


def _sqlite_path(database: str, base_dir: Path | None) -> str:
    database = unquote(database).removeprefix("file:")
    if database in ("", ":memory:"):
        return "memory"
    path = Path(database).expanduser()
    if not path.is_absolute():
        path = (base_dir if base_dir is not None else Path.cwd()) / path
    return os.path.normpath(path)


def _postgres_namespace(match: re.Match[str]) -> str:
    query = dict(p.partition("=")[::2] for p in (match["query"] or "").split("&") if p)
    if match["ipv6"]:
        host = f"[{match['ipv6'].lower()}]"
    else:
        host = (match["host"] or unquote(query.get("host", "")) or "localhost").lower()
    return f"postgres://{host}:{match['port'] or query.get('port') or '5432'}"


def _postgres_db(match: re.Match[str]) -> str:
    database = unquote(match["database"] or "") or unquote(match["user"] or "")
    if not database:
        raise errors.ConfigError("postgresql url names no database; add /DBNAME after the host")
    return database


def uri_problem(uri: str) -> str | None:
    """What is wrong with an object-store URI as a setting, or None: credentials before the
    bucket (``user:secret@``) or a query string (a SAS token, a signature) would be logged,
    recorded in the ledger and sent to lineage with it."""
    scheme, sep, rest = uri.partition("://")
    if not sep or scheme.lower() == "file":
        return None
    if "@" in rest.partition("/")[0] or "?" in rest:
        shown = redact_url(uri.partition("?")[0]) + ("?..." if "?" in uri else "")
        return (
            f"{shown!r} carries credentials or a query string; give "
            f"{scheme}://bucket/path and set credentials in the scorer's environment"
        )
    return None


def file_dataset_id(path: str | Path, *, base_dir: Path | None = None) -> tuple[str, str]:
    """Return ``(namespace, name)`` of a file or a Parquet dataset directory.

    Local paths give ``("file", "/absolute/path")``; ``s3://bucket/key`` and ``gs://bucket/key``
    give ``("s3://bucket", "key")``, without credentials or a query string.
    """
    text = str(path)
    scheme, sep, rest = text.partition("://")
    if sep and scheme.lower() != "file":
        bucket, _, key = rest.partition("?")[0].partition("/")
        return f"{scheme.lower()}://{bucket.rpartition('@')[2]}", key.lstrip("/")
    local = Path(rest if sep else text).expanduser()
    if not local.is_absolute():
        local = (base_dir if base_dir is not None else Path.cwd()) / local
    return "file", os.path.normpath(local)
