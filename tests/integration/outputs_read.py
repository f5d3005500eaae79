"""Reading outputs back as a downstream reader would: a Delta table with ``deltalake`` and
with DuckDB's delta reader, a results table with SQLAlchemy (shared by the tests and bench)."""

from __future__ import annotations

import glob
import os
from typing import Any

import numpy as np
import sqlalchemy as sa


def delta_rows(uri: str, storage_options: dict[str, str] | None = None) -> list[dict[str, Any]]:
    """Every row of the table's latest version (``deltalake``, through DataFusion)."""
    import pyarrow as pa
    from deltalake import DeltaTable, QueryBuilder

    table = DeltaTable(uri, storage_options=storage_options)
    sql = "SELECT item_key, batch_id, output, model_version, date FROM t"
    return list(pa.table(QueryBuilder().register("t", table).execute(sql).read_all()).to_pylist())


def duckdb_delta_rows(uri: str) -> list[tuple[str, str]]:
    """``(item_key, batch_id)`` of every row, read by DuckDB's delta extension (the binary the
    ``duckdb-extension-delta`` package ships: nothing is downloaded)."""
    import duckdb
    import duckdb_extension_delta

    folder = os.path.dirname(duckdb_extension_delta.__file__)
    (extension,) = glob.glob(f"{folder}/extensions/*/delta.duckdb_extension")
    con = duckdb.connect()
    try:
        con.load_extension(extension)
        found = con.execute("SELECT item_key, batch_id FROM delta_scan(?)", [uri]).fetchall()
    finally:
        con.close()
    return [(str(k), str(b)) for k, b in found]


def sql_rows(url: str, table: str = "batching_results") -> list[dict[str, Any]]:
    """Every row of a results table, its output decoded."""
    from batching.store import database

    engine = database.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT * FROM {table}")).mappings().all()
    finally:
        engine.dispose()
    return [{**r, "output": np.frombuffer(r["output"], "<f4").tolist()} for r in rows]
