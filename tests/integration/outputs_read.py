"""Reading outputs back as a downstream reader would: a results table with SQLAlchemy."""

from __future__ import annotations

from typing import Any

import numpy as np
import sqlalchemy as sa


def sql_rows(url: str, table: str = "batching_results") -> list[dict[str, Any]]:
    """Every row of a results table, its output decoded."""
    from batching import database

    engine = database.create_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(sa.text(f"SELECT * FROM {table}")).mappings().all()
    finally:
        engine.dispose()
    return [{**r, "output": np.frombuffer(r["output"], "<f4").tolist()} for r in rows]
