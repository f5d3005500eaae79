"""``batching bulk --in-place``: score a Parquet dataset where it lies, shard by shard."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.progress import (
    BarColumn,
    DownloadColumn,
    MofNCompleteColumn,
    TextColumn,
    TimeElapsedColumn,
)

from batching.cli import stop_signal
from batching.cli.common import (
    ConfigOption,
    DbOverride,
    JsonOption,
    QuietOption,
    app,
    emit_json,
    err,
    flag,
    handle_errors,
    load,
    out,
    progress_bar,
)
from batching.cli.scoring import (
    _explain_what_is_left,
    _finite,
    _score_workers,
    _where,
    exit_if_nothing_succeeded,
    lineage_settings,
    score_doc,
    summary_table,
)
from batching.outcomes import nothing_succeeded


@app.command()
@handle_errors
def bulk(
    source: Annotated[
        Path,
        typer.Argument(
            help="A Parquet file, a folder of them or a local Delta table, with a payload column."
        ),
    ],
    config: ConfigOption,
    in_place: Annotated[
        bool,
        typer.Option(
            "--in-place",
            help="Required: queue the input as shards (file x row groups), not a row each.",
        ),
    ] = False,
    rows_per_shard: Annotated[
        int,
        typer.Option(min=1, help="Rows a shard holds at least (whole row groups)."),
    ] = 65_536,
    db: DbOverride = None,
    output: Annotated[
        str | None,
        typer.Option(
            "--output", help="Output folder (in place writes Parquet); overrides the config's."
        ),
    ] = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(min=0.001, callback=_finite, help="Stop claiming shards after S seconds."),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            max=128,
            help="Scorer processes side by side, each claiming a shard at a time (as score "
            "--workers).",
        ),
    ] = 1,
    quiet: QuietOption = False,
    as_json: JsonOption = False,
) -> None:
    """Score every row of a Parquet dataset in place, each shard committed exactly once.

    The dataset's files are fingerprinted (sha256) and cut into shards of whole row groups;
    each shard is one queue item (lane 'shard'), idempotent on a key naming the file, its
    fingerprint and row groups, so running the command again scores only what is left. A file
    that changes after its shards were queued is refused. Each output row carries the shard's
    key (item_key), input_file and input_row (and input_key when the input has item_key):
    its output, or the error the model gave that row alone.

    Give in-place runs a queue of their own: `batching score` refuses a queue holding shards.
    """
    if not in_place:
        raise typer.BadParameter(
            "bulk scores a dataset in place only; add --in-place (or enqueue its rows with "
            "`batching enqueue` and run `batching score`)",
            param_hint="--in-place",
        )
    stop = stop_signal.handler()
    from batching.cli.metrics import scorer_metrics
    from batching.compose import inplace
    from batching.compose import run as wiring
    from batching.loop import stats as run_stats

    cfg = load(config)
    db_url = db or cfg.database.url
    inplace.refuse_before_queueing(cfg, db, output)  # a refused run queues nothing
    planning = progress_bar(
        TextColumn("fingerprinting input"),
        BarColumn(),
        DownloadColumn(),
        TimeElapsedColumn(),
        quiet=quiet,
    )
    hashing = planning.add_task("plan", total=None)
    with planning:
        found, queued = inplace.enqueue_shards(
            cfg,
            db_url,
            source,
            rows_per_shard,
            on_bytes=lambda done, total: planning.update(hashing, completed=done, total=total),
        )
    err.print(
        f"input: {found.rows} rows in {len(found.files)} file(s), {len(found.shards)} shards "
        f"({queued.inserted} queued now, {len(queued.duplicates)} already queued); "
        f"version {found.version[:16]}",
        highlight=False,
    )
    progress = progress_bar(
        TextColumn("scoring rows"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        quiet=quiet,
    )
    task = progress.add_task("bulk", total=found.rows)

    def on_progress(stats: run_stats.RunStats) -> None:
        progress.update(task, completed=stats.committed + stats.failed)

    limits = run_stats.RunLimits(until_empty=True, max_seconds=max_seconds)
    scored = inplace.InPlace.of(found)

    def left() -> list[str]:  # after the run: the dataset's rows still without output
        early = max_seconds is not None or stop.asked.is_set()
        problem = _rows_left(cfg, db_url, found, stopped_early=early)
        return [problem] if problem else []

    if workers > 1:
        with progress, scorer_metrics(cfg, workers):
            _score_workers(
                cfg,
                workers,
                db_url=db,
                output=output,
                limits=limits,
                on_progress=lambda done, failed, _claimed: progress.update(
                    task, completed=done + failed
                ),
                lineage_config=lineage_settings(cfg),
                stop=stop.asked,
                as_json=as_json,
                in_place=scored,
                more_errors=left,
            )
        return
    with progress, scorer_metrics(cfg, 1):
        outcome = wiring.run_score(
            cfg,
            db_url=db,
            output=output,
            limits=limits,
            on_progress=on_progress,
            on_scorer=stop.attach,
            lineage_config=lineage_settings(cfg),
            in_place=scored,
        )
    failed = nothing_succeeded(outcome.summary, cfg.queue.name)
    incomplete = left()
    if as_json:
        doc = score_doc(cfg, outcome, errors=[*filter(None, [failed]), *incomplete])
        doc["input"] = {
            "rows": found.rows,
            "files": len(found.files),
            "shards": len(found.shards),
            "queued": queued.inserted,
            "version": found.version,
        }
        emit_json(doc)
    else:
        out.print(summary_table(outcome.summary, f"run {outcome.run_id} (in place)"))
        _where(cfg, outcome)
    stop.say_stopped(outcome.summary)
    _explain_what_is_left(cfg, db, outcome.summary)
    exit_if_nothing_succeeded(failed)
    for problem in incomplete:
        flag(err, "error", problem)
        raise typer.Exit(1)


def _rows_left(cfg: Any, db_url: str, found: Any, *, stopped_early: bool) -> str | None:
    """The dataset's rows without output after the run, by why, as an error (a run that
    stopped before it was done, by --max-seconds or a signal, prints it as a note and returns
    None). Before, a rerun after a SIGKILL exited 0 while a dead scorer's shard of 65,536 rows
    stayed leased, and dead shards too: nothing told a job the dataset was incomplete."""
    from batching.compose import inplace

    left = inplace.left_of(cfg, db_url, found)
    if not left.rows:
        return None
    message = left.describe(found.rows, cfg.queue.name)
    if stopped_early:
        err.print(f"note: {message}", highlight=False)
        return None
    return message
