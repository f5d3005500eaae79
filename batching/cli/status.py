"""``batching status``: a queue's depth by state, lane and tenant, its controls, the
lineage spool's backlog and, with ``--costs``, the device seconds its runs used."""

from __future__ import annotations

import json
import sys
import time
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich import box
from rich.table import Table

from batching import errors
from batching.cli.common import (
    ConfigDbOption,
    ConfigQueueOption,
    TargetOption,
    app,
    handle_errors,
    open_queue,
    out,
    parse_duration,
    plain,
    target,
    warn_unknown_queue,
)

if TYPE_CHECKING:
    from batching.models import QueueStats


@app.command()
@handle_errors
def status(
    db: ConfigDbOption = None,
    queue: ConfigQueueOption = None,
    config: TargetOption = None,
    all_queues: Annotated[bool, typer.Option("--all", help="Every queue in the table.")] = False,
    costs: Annotated[
        bool,
        typer.Option(
            "--costs",
            help="Also the device seconds the queue's runs used, by tenant and model version.",
        ),
    ] = False,
    since: Annotated[
        str | None,
        typer.Option("--since", help="With --costs: runs that ended this long ago (24h)."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Machine-readable output.")] = False,
) -> None:
    """Queue depth by state, lane and tenant, oldest ready age, controls; --costs: device time.

    Per queue, lane and tenant: items by state, the oldest ready item's age, expired leases;
    a pause (who, since when, why) and a depth cap. With --costs, the device seconds (forward
    time on the scorers' devices) the queue's runs used since --since, by tenant (shared by
    their items' cost) and by model version, from the run ledger.

    --json: by_state, oldest_ready_age_s, expired_leases, groups, backoff, and controls (by
    queue: paused, paused_at, paused_by, reason, max_depth, ledger_horizon); with --costs,
    costs (runs, device_s, by_tenant, by_model_version)."""
    from dataclasses import asdict

    from batching.cli.controls import control_lines
    from batching.ingress import controls

    if all_queues and queue is not None:
        raise errors.InputError("--all and --queue together: give one (--all: every queue)")
    if costs and all_queues:
        raise errors.InputError("--costs is per queue: give --queue NAME rather than --all")
    if since is not None and not costs:
        raise errors.InputError("--since applies to --costs: add --costs, or leave --since out")
    since = since or "24h"
    window_s = parse_duration(since, "--since") if costs else 0.0
    url, queue = target(db, queue, config)
    q = open_queue(url, queue)
    q.check_schema()
    stats = q.stats(all_queues=all_queues)
    if not all_queues and not stats.groups:
        warn_unknown_queue(q)
    held = controls.states(q.engine)
    if not all_queues:
        held = {queue: held.get(queue, controls.QueueControl(queue))}
    spent = None
    if costs:
        from batching.ingress.run_ledger import RunLedger

        spent = RunLedger(q).costs(time.time() - window_s)
    if as_json:
        doc = asdict(stats) | {"controls": {k: asdict(c) for k, c in held.items()}}
        doc |= {"costs": spent} if spent is not None else {}
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    out.print(status_table(stats, None if all_queues else queue))
    # cancelled only when some are, as in the table: the line stays within 80 columns
    totals = ", ".join(f"{k} {v}" for k, v in stats.by_state.items() if v or k != "cancelled")
    backoff = f"; {stats.backoff} ready waiting out a retry backoff" if stats.backoff else ""
    out.print(f"total: {totals}; expired leases {stats.expired_leases}{backoff}")
    depths: dict[str, int] = {}
    for g in stats.groups:
        depths[g.queue] = depths.get(g.queue, 0) + g.ready + g.leased
    for line in control_lines(held, depths):
        out.print(line, highlight=False)
    out.print(_lineage_backlog(q.engine), highlight=False)
    if spent is not None:
        out.print(cost_table(spent, queue, since))


def cost_table(spent: dict[str, Any], queue: str, since: str) -> Table:
    """``--costs``: device seconds by tenant and by model version, the largest first."""
    table = Table(
        title=f"device seconds of queue {queue!r}, last {since} ({spent['runs']} run(s), "
        f"{spent['device_s']:.3g} s)",
        box=box.SIMPLE_HEAD,
    )
    for column in ("by", "name", "device s", "share"):
        table.add_column(column)
    total = spent["device_s"] or 1.0
    for by, key in (("tenant", "by_tenant"), ("model version", "by_model_version")):
        for name, seconds in sorted(spent[key].items(), key=lambda kv: -kv[1]):
            table.add_row(by, plain(name), f"{seconds:.3g}", f"{seconds / total:.1%}")
    return table


def _lineage_backlog(engine: Any) -> str:
    """The status line of the lineage spool: what waits for a re-send, and for how long."""
    from batching.evidence import spool

    left = spool.backlog(engine)
    age = left.oldest_age_s(time.time())
    if age is None:
        return "lineage spool: empty"
    return (
        f"lineage spool: {left.events} event(s) of {left.runs} run(s) waiting for a re-send, "
        f"oldest {age:.0f}s (`batching lineage flush -c CONFIG` sends them)"
    )


def status_table(stats: QueueStats, queue: str | None) -> Table:
    """``batching status``'s table: one row per (lane, tenant) of ``queue``, or per (queue,
    lane, tenant) of every queue when ``queue`` is None (``--all``); names shown as they are."""
    # No vertical rules: with --all, ten columns still fit 80 characters without folding names.
    table = Table(
        title=f"queue {'(all)' if queue is None else repr(queue)}",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
        collapse_padding=True,
    )
    keys = ("lane", "tenant") if queue is not None else ("queue", "lane", "tenant")
    for col in keys:
        table.add_column(col, no_wrap=True, overflow="ellipsis")
    # "stale": leases past their expiry that the reaper has not released yet. "cancelled"
    # only when some are (``batching queue cancel``): the table stays within 80 columns.
    counts = ["ready", "leased", "done", "dead", "expired", "expired_leases"]
    if any(g.cancelled for g in stats.groups):
        counts.insert(5, "cancelled")
    for col in [*counts, "oldest"]:
        title = "stale" if col == "expired_leases" else col
        table.add_column(title, justify="right", min_width=len(title))
    for g in stats.groups:
        age = f"{g.oldest_ready_age_s:.1f}s" if g.oldest_ready_age_s is not None else "-"
        names = {"queue": g.queue, "lane": g.lane or "-", "tenant": g.tenant}
        cells = (str(getattr(g, c)) for c in counts)
        table.add_row(*(plain(names[k]) for k in keys), *cells, age)
    return table
