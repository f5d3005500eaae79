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
    OutputOverride,
    QuietOption,
    app,
    emit_json,
    err,
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
    nothing_succeeded,
    score_doc,
    summary_table,
)


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
    output: OutputOverride = None,
    max_seconds: Annotated[
        float | None,
        typer.Option(min=0.001, callback=_finite, help="Stop claiming shards after S seconds."),
    ] = None,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
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
            "only in-place bulk runs are offered here; add --in-place (or enqueue rows with "
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
    failed = nothing_succeeded(outcome.summary)
    if as_json:
        doc = score_doc(cfg, outcome, errors=[failed] if failed else [])
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
    _explain_what_is_left(cfg, db, outcome.summary)
    _say_dead_shards(cfg, db)
    exit_if_nothing_succeeded(failed)


def _say_dead_shards(cfg: Any, db: str | None) -> None:
    """A note when the queue holds dead input shards: their rows have no output (the input
    changed or went missing after planning, a corrupt page), and only the run's log and its
    failed count said so."""
    from batching.compose import build

    queue = build.open_queue(cfg, build.resolve(cfg, db, None).db_url)
    try:
        dead = queue.stats(done=False).by_state.get("dead", 0)
    finally:
        queue.engine.dispose()
    if dead:
        err.print(
            f"note: {dead} input shard(s) of queue {queue.queue!r} are dead: their rows have no "
            f"output; `batching status -q {queue.queue}` and the run's log say why; once the "
            "input is as planned, `batching redrive -c CONFIG --reason ...` and this command "
            "again score them",
            highlight=False,
        )
