"""``batching demo``: the whole product on SQLite in one command, downloading nothing."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pyarrow.dataset as ds
from rich.console import Console
from rich.text import Text

from batching import errors
from batching.compose import build
from batching.compose import run as wiring
from batching.config import load_config
from batching.ingress import ingest
from batching.model import workloads

DEPLOYMENTS = Path(__file__).resolve().parents[2] / "deployments"


SINKS = ("parquet", "delta", "sql")
"""What the demo can write: a Parquet dataset and a Delta table per queue, or one SQL table."""


def _config(name: str, sink: str, workdir: Path | None = None) -> Any:
    path = DEPLOYMENTS / name
    if not path.is_file():
        raise errors.ConfigError(
            f"{path}: shipped config not found; run the demo from a clone of the repository"
        )
    overrides: dict[str, Any] = {"output": {"kind": sink}}
    if workdir is not None:  # in --dir, never beside the shipped config (a table has no folder)
        events = (workdir / "outputs" / "lineage" / "events.jsonl").resolve()
        overrides["lineage"] = {"path": str(events)}
    return load_config(path, overrides)


def run_demo(
    workdir: Path,
    *,
    n_text: int,
    n_tabular: int,
    out: Console,
    summary_table: Callable[..., Any],
    sink: str = "parquet",
) -> None:
    """Init a SQLite queue in ``workdir``, enqueue W2 (JSONL) and W1 (Parquet tensors), score
    both into ``sink`` outputs (see :data:`SINKS`)."""
    if sink not in SINKS:
        raise errors.ConfigError(f"--sink must be one of {', '.join(SINKS)}, got {sink!r}")
    if workdir.exists() and not workdir.is_dir():
        raise errors.ConfigError(f"{workdir}: not a folder; pass --dir a new or existing folder")
    db = f"sqlite:///{(workdir / 'demo.db').resolve()}"
    if (workdir / "demo.db").exists():  # checked before a file is written: never half applied
        existing = build.open_queue(_config("online.yaml", sink), db)
        try:
            existing.migrate()
        finally:
            existing.engine.dispose()
    try:
        workdir.mkdir(parents=True, exist_ok=True)
        text_file = workloads.write_lines(
            workdir / "text-requests.jsonl", workloads.w2_json_lines(n_text)
        )
        tab_file = workloads.write_w1_parquet(workdir / "tabular-requests.parquet", n_tabular)
    except OSError as exc:
        raise errors.ConfigError(
            f"{workdir}: cannot write the demo files there ({exc.strerror or errors.one_line(exc)});"
            " pass --dir a new or writable folder"
        ) from None
    for name, file in (("online.yaml", text_file), ("tabular.yaml", tab_file)):
        cfg = _config(name, sink, workdir)
        queue = build.open_queue(cfg, db, create=True)
        queue.migrate()
        result = queue.enqueue(ingest.read_records(file))
        out.print(
            f"enqueued {result.inserted} request(s) from {file} into queue {cfg.queue.name!r} ({len(result.duplicates)} already there)"
        )
        queue.engine.dispose()
        # A Delta demo after a Parquet one in the same --dir writes beside it, not into it.
        target = workdir / "outputs" / (cfg.queue.name + ("" if sink == "parquet" else f"-{sink}"))
        where = "batching_results" if sink == "sql" else str(target)
        # Text: a spinner reads a str as markup whatever the console says
        with out.status(Text(f"scoring queue {cfg.queue.name!r} with {cfg.model.name}")):
            outcome = wiring.run_score(cfg, db_url=db, output=where)
        out.print(summary_table(outcome.summary, f"{cfg.name}: run {outcome.run_id}"))
        _show(out, sink, where, db, cfg.queue.name)
        if outcome.events_path:
            out.print(
                f"lineage events: {outcome.events_path}  (try: batching lineage --events {outcome.events_path})"
            )
    out.print(f"database: {db}\nnext: batching status --db {db} --all")


def _show(out: Console, sink: str, where: str, db: str, queue: str) -> None:
    """How many rows the outputs hold, and the first three, read as a downstream reader would."""
    rows, described = _read(sink, where, db, queue)
    out.print(f"outputs: {described}  ({len(rows)} rows)")
    for row in rows[:3]:
        values = row["output"]
        shown = ", ".join(f"{v:.4f}" for v in values[:4]) + (", ..." if len(values) > 4 else "")
        out.print(
            f"  {row['item_key']}: [{shown}] ({len(values)} float{'s' if len(values) != 1 else ''},"
            f" model {row['model_version']})"
        )


def _read(sink: str, where: str, db: str, queue: str) -> tuple[list[dict[str, Any]], str]:
    if sink == "parquet":
        table = ds.dataset(where, format="parquet", partitioning="hive").to_table()
        n_files = len(list(Path(where).rglob("*.parquet")))
        return table.to_pylist(), f"{where} (Parquet, {n_files} file(s))"
    if sink == "delta":
        from batching.outputs import delta

        table = delta.DeltaSink.read(where, "SELECT item_key, output, model_version FROM t")
        return table.to_pylist(), f"{where} (Delta table)"
    import numpy as np
    import sqlalchemy as sa

    from batching.store import database, schema

    t = schema.results
    engine = database.create_engine(db)
    with engine.connect() as conn:
        found = conn.execute(sa.select(t).where(t.c.queue == queue).order_by(t.c.item_key))
        rows = [dict(r._mapping) for r in found]
    engine.dispose()
    for row in rows:
        row["output"] = np.frombuffer(row["output"], "<f4").tolist()
    return rows, f"table {where} in {database.redact(db)} (queue {queue!r})"
