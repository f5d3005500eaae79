"""``batching score | demo``: the scoring commands of the CLI."""

from __future__ import annotations

import math
import os
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import BarColumn, MofNCompleteColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from batching.cli import stop_signal
from batching.cli.common import (
    ConfigOption,
    DbOverride,
    JsonOption,
    OutputOverride,
    QuietOption,
    app,
    emit_json,
    err,
    flag,
    handle_errors,
    load,
    out,
    plain,
    progress_bar,
    warn_unknown_queue,
)
from batching.outcomes import nothing_succeeded


def lineage_settings(cfg: Any) -> Any:
    """The config's lineage settings under the OpenLineage client's sources (``openlineage.yml``,
    the ``OPENLINEAGE*`` environment), as the flows do (``OPENLINEAGE_URL`` sends the events
    to Marquez)."""
    from batching.evidence import ol_config

    return ol_config.lineage_config(cfg.lineage, os.environ)


def summary_table(summary: Mapping[str, object], title: str = "run summary") -> Table:
    """The closing table of a scoring run."""
    from batching.loop.stats import summary_rows

    table = Table(title=plain(title), show_header=False)
    table.add_column("metric")
    table.add_column("value", justify="right")
    for name, value in summary_rows(summary):
        table.add_row(plain(name), plain(value))
    return table


def _finite(value: float | None) -> float | None:
    if value is not None and not math.isfinite(value):
        raise typer.BadParameter(f"must be a number of seconds, got {value}")
    return value


@app.command()
@handle_errors
def score(
    config: ConfigOption,
    db: DbOverride = None,
    output: OutputOverride = None,
    until_empty: Annotated[
        bool,
        typer.Option(
            "--until-empty",
            help="Stop when the queue is empty (the default unless --max-seconds is given).",
        ),
    ] = False,
    max_items: Annotated[
        int | None, typer.Option(min=1, help="Stop after claiming N items.")
    ] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(
            min=0.001,
            callback=_finite,
            help="Stop claiming after S seconds; waits for new work until then.",
        ),
    ] = None,
    quiet: QuietOption = False,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            max=128,
            help="Scorer processes to run side by side: one lineage run, each worker its "
            "child job <name>.worker-<i>; torch threads are split between them. --max-items "
            "is shared out between them.",
        ),
    ] = 1,
    metrics_port: Annotated[
        int | None,
        typer.Option(
            "--metrics-port",
            min=1,
            max=65535,
            help="Serve Prometheus /metrics on this port while scoring (overrides "
            "metrics.port; with --workers, one endpoint for all of them).",
        ),
    ] = None,
    model_version: Annotated[
        str | None,
        typer.Option(
            "--model-version",
            help="Serve this version of a rollout alone (listed in model_versions): claim only "
            "the items the queue's route sends to it. For a device that cannot hold two "
            "versions: run one such scorer per version.",
        ),
    ] = None,
    as_json: JsonOption = False,
) -> None:
    """Claim, batch, score and commit items from the config's queue.

    SIGTERM or Ctrl-C stops claiming, finishes the batches in flight and releases the rest.
    Lineage goes where the config says, or where $OPENLINEAGE_URL (OPENLINEAGE_*) points.

    --json prints one document when the run ends: ok, run_id, queue, database (password
    masked), output, events_path (null unless lineage goes to a file), lineage_failures,
    summary (the closing table's numbers: items_committed, items_failed, batches,
    latency_p99_s, ...), workers (with --workers: index, run_id, failed, error of each) and
    errors (one-line messages). The exit code is the same as without --json.
    """
    stop = stop_signal.handler()  # first: a signal while the model loads must not kill the run
    from batching.cli.metrics import scorer_metrics, with_metrics_port
    from batching.compose import run as wiring
    from batching.loop import stats as run_stats

    cfg = with_metrics_port(load(config), metrics_port)
    lineage_config = lineage_settings(cfg)
    limits = run_stats.RunLimits(
        until_empty=until_empty or max_seconds is None,
        max_items=max_items,
        max_seconds=max_seconds,
    )
    progress = progress_bar(
        TextColumn("scoring"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("{task.fields[rate]}"),
        TimeElapsedColumn(),
        quiet=quiet,
    )
    task = progress.add_task("score", total=None, rate="")

    def show(committed: int, failed: int, claimed: int) -> None:
        progress.update(
            task,
            completed=committed + failed,
            total=max_items or claimed or None,
            rate=f"{committed} committed",
        )

    if workers > 1:
        with progress, scorer_metrics(cfg, workers):
            _score_workers(
                cfg,
                workers,
                db_url=db,
                output=output,
                limits=limits,
                on_progress=show,
                lineage_config=lineage_config,
                stop=stop.asked,
                as_json=as_json,
                model_version=model_version,
            )
        return

    def on_progress(stats: run_stats.RunStats) -> None:
        show(stats.committed, stats.failed, stats.claimed)

    with progress, scorer_metrics(cfg, 1):
        outcome = wiring.run_score(
            cfg,
            db_url=db,
            output=output,
            limits=limits,
            on_progress=on_progress,
            on_scorer=stop.attach,
            lineage_config=lineage_config,
            model_version=model_version,
        )
    failed = nothing_succeeded(outcome.summary, cfg.queue.name)
    if as_json:
        emit_json(score_doc(cfg, outcome, errors=[failed] if failed else []))
    else:
        out.print(summary_table(outcome.summary, f"run {outcome.run_id}"))
        _where(cfg, outcome)
    stop.say_stopped(outcome.summary)
    _explain_what_is_left(cfg, db, outcome.summary)
    exit_if_nothing_succeeded(failed)


def exit_if_nothing_succeeded(message: str | None) -> None:
    if message is not None:
        flag(err, "error", message)
        raise typer.Exit(1)


def score_doc(
    cfg: Any,
    outcome: Any,
    reports: Sequence[Any] = (),
    errors: Sequence[str] = (),
) -> dict[str, Any]:
    """``batching score --json``'s document (its keys are listed in ``score``'s help)."""
    from batching.store.database import redact

    events_path = outcome.events_path
    return {
        "ok": not errors,
        "run_id": outcome.run_id,
        "queue": cfg.queue.name,
        "database": redact(outcome.db_url),
        "output": str(outcome.output),
        "events_path": None if events_path is None else str(events_path),
        "lineage_failures": outcome.lineage_failures,
        "summary": dict(outcome.summary),
        "workers": [
            {"index": r.index, "run_id": r.run_id, "failed": r.error is not None, "error": r.error}
            for r in reports
        ],
        "errors": list(errors),
    }


def _explain_what_is_left(cfg: Any, db: str | None, summary: Mapping[str, object]) -> None:
    """A run that stops while the queue still holds items says why, when the queue shows it:
    items waiting out a retry backoff (an until-empty run does not wait for them); and when
    it scored nothing, a queue name without items (a typo), or items leased by other scorers
    (a dead one's come back when their leases expire); a paused queue."""
    from batching.compose import build
    from batching.ingress import controls

    queue = build.open_queue(cfg, build.resolve(cfg, db, None).db_url)
    try:
        held = controls.state(queue.engine, queue.queue)
        if held.paused:
            err.print(
                f"note: queue {queue.queue!r} is paused (by {held.paused_by}: {held.reason}); "
                f"scorers claim nothing from it until `batching queue resume {queue.queue}`",
                highlight=False,
            )
        stats = queue.stats(done=False)
        if stats.backoff:
            err.print(
                f"note: {stats.backoff} item(s) of queue {queue.queue!r} are waiting out a "
                "retry backoff (a failed attempt); run again later to score them",
                highlight=False,
            )
        if summary.get("items_committed") or summary.get("items_failed"):
            return
        leased = stats.by_state.get("leased", 0)
        if not stats.groups:
            warn_unknown_queue(queue)
        elif leased and not stats.by_state.get("ready"):
            err.print(
                f"note: nothing was ready; {leased} item(s) of queue {queue.queue!r} are leased "
                "by other scorers (a dead scorer's come back when their leases expire, "
                f"queue.lease_s {cfg.queue.lease_s:g} s)",
                highlight=False,
            )
    finally:
        queue.engine.dispose()


def _where(cfg: Any, outcome: Any) -> None:
    """The closing lines: which queue was read (``--db`` or $BATCHING_DB_URL override the
    config's database: say which one), where outputs and lineage went, lineage not delivered."""
    from batching.store.database import redact

    out.print(f"queue: {cfg.queue.name} in {redact(outcome.db_url)}", highlight=False)
    out.print(f"outputs: {outcome.output}")
    events_path, lineage_failures = outcome.events_path, outcome.lineage_failures
    if events_path:
        out.print(f"lineage: {events_path}")
    if lineage_failures:
        err.print(
            f"warning: {lineage_failures} lineage event(s) not delivered (scoring not affected);"
            " those spooled in the queue's database are re-sent by the next run or"
            " `batching lineage flush -c CONFIG` (`batching status` shows how many wait)",
            highlight=False,
        )


def _score_workers(
    cfg: Any,
    n: int,
    *,
    stop: threading.Event,
    as_json: bool,
    more_errors: Callable[[], list[str]] | None = None,
    **kwargs: Any,
) -> None:
    """Run ``n`` workers and report them; ``more_errors``: the caller's own findings after
    the run (``bulk``: rows without output), errors of the run's like the workers'."""
    from batching.compose import run as wiring

    result = wiring.run_score_workers(cfg, n, stop=stop, **kwargs)
    outcome = result.workers
    more = more_errors() if more_errors is not None else []
    if stop.is_set() and not outcome.reports:
        err.print("note: stopped by a signal before the workers started; nothing was claimed")
    elif len(outcome.reports) < n:
        err.print(
            f"note: --max-items is shared out between the workers: {len(outcome.reports)} "
            f"of {n} had items to claim, so only they ran",
            highlight=False,
        )
    if as_json:
        failed = [] if outcome.exit_code else [nothing_succeeded(result.summary, cfg.queue.name)]
        emit_json(
            score_doc(
                cfg, result, outcome.reports, [*outcome.errors(), *filter(None, failed), *more]
            )
        )
    else:
        _show_workers(cfg, result)
    if not outcome.exit_code:
        _explain_what_is_left(cfg, kwargs.get("db_url"), result.summary)
    for message in outcome.errors():
        flag(err, "error", message)
    if outcome.exit_code:
        raise typer.Exit(outcome.exit_code)
    exit_if_nothing_succeeded(nothing_succeeded(result.summary, cfg.queue.name))
    for message in more:
        flag(err, "error", message)
        raise typer.Exit(1)


def _show_workers(cfg: Any, result: Any) -> None:
    outcome = result.workers
    done = [r for r in outcome.reports if r.error is None]
    if done:
        title = f"run {result.run_id}: {len(done)} of {len(outcome.reports)} workers"
        out.print(summary_table(result.summary, title))
    if outcome.reports:
        runs = (f"{r.run_id}{' (failed)' if r.error else ''}" for r in outcome.reports)
        out.print(f"worker runs: {', '.join(runs)}")
    _where(cfg, result)


@app.command()
@handle_errors
def demo(
    workdir: Annotated[
        Path, typer.Option("--dir", help="Folder for the demo database and outputs.")
    ] = Path("batching-demo"),
    n_text: Annotated[int, typer.Option(min=1, help="W2 text requests to enqueue.")] = 300,
    n_tabular: Annotated[int, typer.Option(min=1, help="W1 tabular requests to enqueue.")] = 5000,
    sink: Annotated[
        str,
        typer.Option(
            help="Where outputs go: parquet (a dataset per queue), delta (a Delta table per "
            "queue; needs the delta extra, `pip install -e '.\\[delta]'`) or sql (a table in the database)."
        ),
    ] = "parquet",
) -> None:
    """One command on SQLite: init, enqueue W2 and W1 samples, score both, show outputs."""
    from batching.compose import demo as d

    d.run_demo(
        workdir,
        n_text=n_text,
        n_tabular=n_tabular,
        out=out,
        summary_table=summary_table,
        sink=sink,
    )
