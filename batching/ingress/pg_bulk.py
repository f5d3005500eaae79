"""PostgreSQL enqueue at speed: item rows by binary ``COPY`` into a session's staging table,
then one ``INSERT ... SELECT ... ON CONFLICT DO NOTHING``; bodies by binary ``COPY``.

SQLAlchemy's many-row INSERT (``insertmanyvalues``) sends each chunk as a VALUES list of
bound rows; on psycopg 3 that enqueued W1 items at ~5,400 a second on the development VM.
``COPY`` cannot skip a key already queued, so the rows are copied to a temporary table
(``ON COMMIT DELETE ROWS``: the pooled connection keeps it, empty) and moved from there in one
statement that returns the new ids; measured per row, 1.8 us to copy and 9.3 to insert,
where one ``unnest`` of column arrays took 20.5 (psycopg sends arrays as text the server
parses). Bodies, most of the bytes and with no conflict to skip, go straight to
``batching_payloads`` by ``COPY``. All of it runs in the caller's transaction: nothing is
visible before the enqueue commits. A chunk of a few rows (one API request) skips the staging
table and the bodies' ``COPY``: one ``unnest`` statement writes its items and bodies, cheaper
there than the round trips of a ``COPY``.
"""

from __future__ import annotations

import itertools
from collections.abc import Mapping, Sequence
from typing import Any

import orjson
import sqlalchemy as sa
from sqlalchemy.engine import Connection

# (column, PostgreSQL array type) of a queued item row, in the order of the unnest.
COLUMNS: tuple[tuple[str, str], ...] = (
    ("queue", "text"),
    ("lane", "text"),
    ("item_key", "text"),
    ("tenant", "text"),
    ("priority", "int4"),
    ("payload_format", "text"),
    ("dtype", "text"),
    ("shape", "text"),
    ("cost", "int4"),
    ("state", "int2"),
    ("attempts", "int4"),
    ("max_attempts", "int4"),
    ("crash_count", "int4"),
    ("enqueued_at", "float8"),
    ("run_after", "float8"),
    ("deadline_at", "float8"),
    ("sort_deadline", "float8"),
    ("enqueue_run", "text"),
    ("route_bucket", "int4"),
)
_NAMES = ", ".join(c for c, _ in COLUMNS)
_UNNEST = (
    f"INSERT INTO batching_items ({_NAMES})"
    f" SELECT * FROM unnest({', '.join(f'CAST(:{c} AS {t}[])' for c, t in COLUMNS)})"
    " ON CONFLICT (queue, item_key) DO NOTHING RETURNING item_key, id"
)
# A few rows (an API request) and their bodies in ONE statement: one round trip, where the
# unnest and then a COPY of the bodies took three or four (a COPY is a start, its data and
# its end), and each request of an API group paid them all.
_UNNEST_WITH_BODIES = sa.text(
    f"WITH new AS ({_UNNEST}), bodies AS (INSERT INTO batching_payloads (id, payload)"
    " SELECT new.id, b.payload FROM new JOIN unnest(CAST(:b_keys AS text[]),"
    " CAST(:b_bodies AS bytea[])) AS b(item_key, payload) USING (item_key))"
    " SELECT item_key, id FROM new"
)
_STAGE = "batching_enqueue_stage"
# No constraints or defaults (LIKE ... INCLUDING DEFAULTS would draw ids from the items'
# sequence for the staged rows): the columns alone.
_CREATE_STAGE = sa.text(
    f"CREATE TEMP TABLE IF NOT EXISTS {_STAGE} ON COMMIT DELETE ROWS"
    f" AS SELECT {_NAMES} FROM batching_items WITH NO DATA"
)
_COPY_STAGE = f"COPY {_STAGE} ({_NAMES}) FROM STDIN (FORMAT BINARY)"
# Empties the stage as it moves the rows, so the next chunk of the same enqueue starts clean.
_FROM_STAGE = sa.text(
    f"WITH staged AS (DELETE FROM {_STAGE} RETURNING {_NAMES})"
    f" INSERT INTO batching_items ({_NAMES}) SELECT {_NAMES} FROM staged"
    " ON CONFLICT (queue, item_key) DO NOTHING RETURNING item_key, id"
)
_COPY_BODIES = "COPY batching_payloads (id, payload) FROM STDIN (FORMAT BINARY)"
STAGE_MIN = 64  # rows in a chunk from which the staging table pays for its COPY
CHUNK = 5000  # rows an enqueue writes a statement (1000: 16.5 us a row to insert; 5000: 11.8)


def insert_new(
    conn: Connection, rows: Sequence[Mapping[str, Any]], bodies: Mapping[str, bytes]
) -> dict[str, int]:
    """Insert the rows whose ``(queue, item_key)`` is new, and their bodies (``bodies`` by
    key); the new ids by key. A chunk of a few rows in one statement; a larger one by
    ``COPY`` through the staging table, its bodies by ``COPY`` (:func:`copy_bodies`).

    ``rows`` are ``SqlQueue._row`` dicts with distinct keys (an enqueue drops repeats first).
    """
    names = [c for c, _ in COLUMNS]
    if len(rows) < STAGE_MIN:
        arrays: dict[str, Any] = {c: [r[c] for r in rows] for c in names}
        keys = arrays["item_key"]
        arrays |= {"b_keys": keys, "b_bodies": [bodies[k] for k in keys]}
        return {key: id_ for key, id_ in conn.execute(_UNNEST_WITH_BODIES, arrays)}
    conn.execute(_CREATE_STAGE)
    with _raw_cursor(conn) as cur, cur.copy(_COPY_STAGE) as copy:
        copy.set_types([t for _, t in COLUMNS])
        for r in rows:
            copy.write_row([r[c] for c in names])
    ids = {key: id_ for key, id_ in conn.execute(_FROM_STAGE)}
    if ids:
        copy_bodies(conn, [(i, bodies[k]) for k, i in ids.items()])
    return ids


def _raw_cursor(conn: Connection) -> Any:
    """A psycopg cursor on ``conn``'s connection, in its transaction."""
    raw = conn.connection.dbapi_connection
    assert raw is not None  # a Connection in a transaction holds its DBAPI connection
    return raw.cursor()


def copy_bodies(conn: Connection, bodies: Sequence[tuple[int, bytes]]) -> None:
    """Write ``(id, body)`` rows to ``batching_payloads`` by binary ``COPY``, in ``conn``'s
    transaction."""
    with _raw_cursor(conn) as cur, cur.copy(_COPY_BODIES) as copy:
        copy.set_types(["int8", "bytea"])
        for row in bodies:
            copy.write_row(row)


# -- claims as one row -----------------------------------------------------------------------

# A PostgreSQL claim read back as ONE row laid out as ``sqlite_claim.CLAIMED_NO_BODIES`` (the
# columns as JSON arrays, the times' min, max and deadline count) followed by
# ``sqlite_claim.CLAIMED_TIMES``'s time columns, from the claim's own UPDATE ... RETURNING, then
# its bodies concatenated in a second statement (:func:`with_bodies`): so
# ``sqlite_claim.unpack_claim`` builds its items (or one ItemBlock) a column at a time, where
# returning a row per item cost ~12 us a row of Python (fetch, item tuples, sort) in the
# scorer, the largest share of a PostgreSQL scorer's CPU. The aggregates of one query step
# through the same rows in the same order (one ORDER BY each sorted the rows once per
# aggregate: 17 sorts, twice the claim's time); ``unpack_claim`` puts the items in claim
# order. Times go as integers (whole seconds, fraction times 2^52), exact as in SQLite.
_JSON_COLUMNS = (
    "u.id",
    "u.item_key",
    "u.payload_format",
    "u.dtype",
    "u.shape",
    "u.lane",
    "u.tenant",
    "u.priority",
    "u.cost",
    "u.attempts",
    "u.max_attempts",
    "octet_length(p.payload)",
)
_WHOLE = "CAST(trunc({0}) AS bigint)"
_FRACTION = "CAST(({0} - trunc({0})) * 4503599627370496 AS bigint)"


def _agg(expr: str) -> str:
    return f"CAST(json_agg({expr}) AS text)"


_AGGREGATES = ", ".join(
    [
        *map(_agg, _JSON_COLUMNS),
        "min(u.enqueued_at)",
        "max(u.enqueued_at)",
        "count(u.deadline_at)",
        *(
            _agg(part.format(column))
            for column in ("u.enqueued_at", "u.deadline_at")
            for part in (_WHOLE, _FRACTION)
        ),
    ]
)
_TIMES_AT = len(_JSON_COLUMNS) + 3  # where the CLAIMED_TIMES columns start in the row
_SIZES = _JSON_COLUMNS.index("octet_length(p.payload)")
# The bodies of a claim's ids, concatenated in the order of the ids. PostgreSQL refuses a value
# past 1 GB: bodies adding up to more than CONCAT_MAX_BYTES are read a row each instead.
CONCAT_MAX_BYTES = 256 * 2**20
_BODIES_IN_ORDER = sa.text(
    "SELECT string_agg(p.payload, CAST('' AS bytea) ORDER BY o.n)"
    " FROM unnest(CAST(:ids AS bigint[])) WITH ORDINALITY o(id, n)"
    " JOIN batching_payloads p ON p.id = o.id"
)


_BODIES_OF_RUN = sa.text(
    "SELECT string_agg(payload, CAST('' AS bytea) ORDER BY id) FROM batching_payloads"
    " WHERE id BETWEEN :first AND :last"
)


def claim_as_one_row(claim_sql: str) -> str:
    """``claim_sql`` (a ``WITH ... UPDATE ... RETURNING`` claim) read back as one row: see
    :func:`split_row`."""
    return (
        f"WITH u AS ({claim_sql}) SELECT {_AGGREGATES}"
        " FROM u LEFT JOIN batching_payloads p ON p.id = u.id"
    )


def split_row(row: Sequence[Any]) -> tuple[Sequence[Any], Sequence[Any]] | None:
    """A :func:`claim_as_one_row` row as ``(CLAIMED_NO_BODIES row, CLAIMED_TIMES row)``; None
    when the claim took nothing."""
    if row[0] is None:
        return None
    return row[:_TIMES_AT], (row[0], *row[_TIMES_AT:])


def with_bodies(conn: Connection, claimed: Sequence[Any]) -> Sequence[Any] | None:
    """A ``CLAIMED_NO_BODIES`` row of :func:`split_row` with its bodies appended (laid out as
    ``sqlite_claim.CLAIMED``), read in ``conn``'s transaction; None when they add up to more
    than :data:`CONCAT_MAX_BYTES` (read them a row each). A missing body row is left out, as
    its null size says. Ids that are one ascending run (a range lease's, mostly) are read as
    a range of the key: 2.1 against 3.9 us a row for 16,384 W1 bodies, measured."""
    sizes = orjson.loads(claimed[_SIZES])
    if sum(size for size in sizes if size is not None) > CONCAT_MAX_BYTES:
        return None
    ids = orjson.loads(claimed[0])
    if ids[-1] - ids[0] + 1 == len(ids) and all(b - a == 1 for a, b in itertools.pairwise(ids)):
        data = conn.execute(_BODIES_OF_RUN, {"first": ids[0], "last": ids[-1]}).scalar()
    else:
        data = conn.execute(_BODIES_IN_ORDER, {"ids": ids}).scalar()
    return (*claimed, data or b"")
