"""``batching reconcile --full``: the options of a sweep, its progress on stderr, and where it
stands (the command itself is :func:`batching.cli.evidence.reconcile`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from batching import errors
from batching.cli.common import out, progress_bar

if TYPE_CHECKING:
    from batching.evidence.findings import Report


def check_options(
    full: bool, *, since: str | None, run: str | None, restart: bool, max_time: str | None
) -> None:
    """Refuse options that do not go together with (or without) ``--full``."""
    if full:
        for name, value in (("--since", since), ("--run", run)):
            if value is not None:
                raise errors.InputError(
                    f"--full sweeps everything; it takes no {name} (drop one of the two)"
                )
        return
    for name, given in (("--restart", restart), ("--max-time", max_time is not None)):
        if given:
            raise errors.InputError(f"{name} is an option of a sweep: add --full")


def run(
    queue: Any,
    sink: Any,
    now: float,
    *,
    repair: bool,
    dataset_lost: bool,
    restart: bool,
    limit_s: float | None,
    quiet: bool,
) -> Report:
    """The full sweep, its progress on stderr (a line a page; none on a pipe or with --quiet)."""
    from rich.progress import TextColumn, TimeElapsedColumn

    from batching.evidence import sweep as sw

    progress = progress_bar(
        TextColumn("{task.description}", markup=False), TimeElapsedColumn(), quiet=quiet
    )
    with progress:
        task = progress.add_task("sweep: starting", total=None)

        def on_page(p: sw.Progress) -> None:
            progress.update(
                task,
                description=f"sweep {p.phase}: page {p.pages}, {p.batches} batch(es), "
                f"{p.items} item(s), {p.files} file(s), {p.findings} finding(s)",
            )

        return sw.sweep(
            queue,
            sink,
            now=now,
            restart=restart,
            max_seconds=limit_s,
            repair=repair,
            dataset_lost=dataset_lost,
            on_page=on_page,
        )


def print_progress(sweep: Mapping[str, Any]) -> None:
    """Where the sweep stands (a report's ``sweep``), and how to resume it."""
    state = "finished" if sweep["finished"] else f"stopped in its {sweep['phase']} phase"
    out.print(
        f"full sweep {state}: {sweep['pages']} page(s), {sweep['batches']} batch(es), "
        f"{sweep['items']} item(s), {sweep['files']} file(s) since it started",
        highlight=False,
    )
    if not sweep["finished"]:
        out.print("`batching reconcile --full` again resumes it", highlight=False)
