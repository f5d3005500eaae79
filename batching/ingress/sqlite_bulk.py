"""SQLite enqueue at speed: item rows and bodies by the driver's ``executemany`` of one
prepared ``INSERT``, tuples in, no statement compiled or parameter set processed per row.

SQLAlchemy's many-row INSERT with ``RETURNING`` (``insertmanyvalues``) builds a parameter
dictionary per row and renders each batch of them as a VALUES list: on the development VM a
W1 item cost ~21 us to enqueue, more than its claim, ack and forward pass together, most of it
in that per-row Python. ``sqlite3``'s ``executemany`` steps one prepared statement over the
rows in C, but cannot return the new ids. They are found instead by the rowid: the caller's
transaction holds SQLite's one write lock, so every row with an id above the table's largest
before the insert is one this insert made, and a key already queued (``ON CONFLICT DO
NOTHING``) made none. All of it runs in the caller's transaction, as the rest of the enqueue.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from sqlalchemy.engine import Connection

from batching.store import schema

_ITEMS, _PAYLOADS = schema.items.name, schema.payloads.name


def _driver(conn: Connection) -> Any:
    """The ``sqlite3`` connection under ``conn``, in ``conn``'s transaction."""
    return conn.connection.driver_connection


def insert_new(conn: Connection, rows: Sequence[Mapping[str, Any]]) -> dict[str, int]:
    """Insert the rows whose ``(queue, item_key)`` is new (each row: column -> value, every row
    the same columns); returns the new ids by key."""
    if not rows:
        return {}
    columns = tuple(rows[0])
    raw = _driver(conn)
    (before,) = raw.execute(f"SELECT coalesce(max(id), 0) FROM {_ITEMS}").fetchone()
    raw.executemany(
        f"INSERT INTO {_ITEMS} ({', '.join(columns)}) VALUES ({', '.join('?' * len(columns))}) "
        "ON CONFLICT (queue, item_key) DO NOTHING",
        map(operator.itemgetter(*columns), rows),
    )
    return dict(raw.execute(f"SELECT item_key, id FROM {_ITEMS} WHERE id > ?", (before,)))


def insert_bodies(conn: Connection, bodies: Iterable[tuple[int, bytes]]) -> None:
    """Insert each ``(item id, body)``."""
    _driver(conn).executemany(f"INSERT INTO {_PAYLOADS} (id, payload) VALUES (?, ?)", bodies)
