"""How the CLI shows a reconcile report: the findings table, the repairs, a verdict with the
next step, or the report as JSON (``batching reconcile``, ``reconcile --full``)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING

import typer
from rich.table import Table

from batching.cli import full_sweep
from batching.cli.common import out, plain

if TYPE_CHECKING:
    from batching.evidence.findings import Report

_SHOW_FILES = 3
# Findings --repair leaves as they are: a deadline missed, a batch whole in another dataset.
_NOT_REPAIRED = frozenset({"sla_miss", "other_dataset", "unsafe_path"})
_SHOW_KEYS = 5


def show(
    report: Report, after: Report | None, *, as_json: bool, unknown_queue: str | None = None
) -> None:
    """Print a report (and what a repair left); exit 1 unless clean. The queue's items not
    done (``Report.not_done``) are said beside the verdict: a "clean" with a dead scorer's
    shard still leased read as the whole dataset scored. ``unknown_queue``: the warning that
    the queue has no items here (a typo's "clean" judged nothing), kept in the JSON too."""
    if as_json:
        doc = report.to_dict() | ({"after_repair": after.to_dict()} if after else {})
        doc |= {"unknown_queue": unknown_queue} if unknown_queue else {}
        sys.stdout.write(json.dumps(doc, indent=2, default=str) + "\n")
    elif unknown_queue:
        print_report(report)
        out.print(f"judged nothing: {unknown_queue}", highlight=False)
    else:
        print_report(report)
        if after is not None:
            out.print("after repair:", highlight=False)
            print_report(after)
        pending = (after or report).not_done
        if pending is not None and any(pending):
            out.print(
                f"not judged yet: {pending[0]} item(s) leased and {pending[1]} ready (not "
                "done; a dead scorer's leased items come back when their leases expire)",
                highlight=False,
            )
    if not (after or report).clean:
        raise typer.Exit(1)


def print_report(report: Report) -> None:
    out.print(f"reconcile {report.output_kind} {report.location}", highlight=False)
    if report.sweep is not None:
        full_sweep.print_progress(report.sweep)
    if report.findings:
        table = Table("class", "severity", "count")
        for col in ("files", "item keys", "message"):
            table.add_column(col, overflow="fold")
        for f in report.findings:
            table.add_row(
                str(f.kind),
                str(f.severity),
                str(f.count),
                plain(_shorten(tuple(_relative(p, report.location) for p in f.files), _SHOW_FILES)),
                plain(_shorten(f.item_keys, _SHOW_KEYS, total=max(f.count, len(f.item_keys)))),
                plain(f.message),
            )
        out.print(table)
    if report.repairs:
        done = Table("repair", "target", "items")
        for r in report.repairs:
            done.add_row(r.action, plain(r.target), str(r.n_items))
        out.print(done)
    critical = sum(1 for f in report.findings if str(f.severity) == "critical")
    warning = sum(1 for f in report.findings if str(f.severity) == "warning")
    if report.clean and report.sweep is not None and not report.sweep["finished"]:
        out.print("clean so far: what the sweep has checked is consistent", highlight=False)
    elif report.clean:
        out.print("clean: every done item has exactly one committed output", highlight=False)
    else:
        kinds = {str(f.kind) for f in report.findings if str(f.severity) != "info"}
        hint = ""
        if kinds - _NOT_REPAIRED and not report.repairs:
            hint = "; `--repair` fixes what can be fixed"
        elif kinds & _NOT_REPAIRED:
            hint = (
                f"; {', '.join(sorted(kinds & _NOT_REPAIRED))} not repaired: see docs/operations.md"
            )
        out.print(f"{critical} critical, {warning} warning finding(s){hint}", highlight=False)
    requeued = sum(r.n_items for r in report.repairs if r.action == "requeue")
    if requeued:
        out.print(
            f"{requeued} item(s) requeued: `batching score` scores them again (input shards"
            " of `bulk --in-place`: run that bulk command again)",
            highlight=False,
        )


def _relative(path: str, root: str) -> str:
    """``path`` relative to the dataset ``root`` when inside it (shorter to read), else as is."""
    try:
        return Path(path).relative_to(root).as_posix()
    except ValueError:
        return path


def _shorten(values: tuple[str, ...], limit: int, *, total: int | None = None) -> str:
    """At most ``limit`` values, then ``+N more`` (``total``: how many there are in all)."""
    if not values:
        return "-"
    total = max(total or len(values), len(values))
    shown = ", ".join(values[:limit])
    return shown if total <= limit else f"{shown} +{total - limit} more"
