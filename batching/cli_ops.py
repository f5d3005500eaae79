"""``batching lineage | reconcile``: the evidence commands of the CLI."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from batching import errors
from batching.cli import app, handle_errors, out


@app.command()
@handle_errors
def lineage(
    run: Annotated[
        str | None, typer.Option("--run", help="Run id; default: the latest run.")
    ] = None,
    events: Annotated[Path | None, typer.Option("--events", help="Event log (JSONL).")] = None,
    config: Annotated[
        Path | None, typer.Option("--config", "-c", help="Pipeline YAML whose event log to read.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Show a run's job, inputs, outputs and facets from the local OpenLineage event log."""
    from batching import lineage as ol

    path = events or _events_from_config(config)
    if not path.is_file():
        raise errors.InputError(
            f"{path}: no lineage event log; run `batching score` first or pass --events"
        )
    summary = ol.summarize_run(ol.read_events(path), run)
    if summary is None:
        raise errors.InputError(f"{path}: no events for run {run!r}; omit --run for the latest run")
    if as_json:
        sys.stdout.write(json.dumps(summary, indent=2, default=str) + "\n")
        return
    _print_summary(summary)


def _events_from_config(config: Path | None) -> Path:
    if config is None:
        return Path("outputs/lineage/events.jsonl")
    from batching import app as wiring
    from batching.config import load_config

    res = wiring.resolve(load_config(config), None, None)
    if res.events_path is None:
        raise errors.ConfigError(f"{config}: lineage transport is not file; nothing local to read")
    return res.events_path


def _print_summary(s: dict[str, Any]) -> None:
    job = s["job"]
    out.print(
        f"run {s['run_id']}  job {job['namespace']}/{job['name']}  state {s['state']}",
        highlight=False,
    )
    out.print(
        f"events: {' -> '.join(s['event_types'])}  started {s['started_at']}  duration {s['duration_s']}s",
        highlight=False,
    )
    if s.get("parent"):
        out.print(f"parent: {s['parent']['job']} run {s['parent']['run_id']}", highlight=False)
    if s.get("model"):
        out.print(f"model: {s['model']}", highlight=False)
    if s.get("error"):
        out.print(f"[red]error:[/red] {s['error']}", highlight=False)
    table = Table("direction", "namespace", "name", "rows", "bytes", "facets")
    for direction in ("inputs", "outputs"):
        for d in s[direction]:
            table.add_row(
                direction[:-1],
                d["namespace"],
                d["name"],
                str(d.get("row_count", "-")),
                str(d.get("size_bytes", "-")),
                ", ".join(d["facets"]),
            )
    out.print(table)
    out.print(
        f"run facets: {', '.join(s['run_facets'])}; config hash {s.get('config_hash')}",
        highlight=False,
    )
