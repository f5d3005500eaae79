"""``batching lineage flush | --config-check``: where lineage goes, from which source, and
re-sending what waits in the spool to go there (the ``lineage`` command is in
:mod:`batching.cli.evidence`)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

import typer
from rich import box
from rich.table import Table

from batching import errors
from batching.cli.common import err, flag, load, out, plain, progress_bar


def run(
    flush: bool,
    config_check: bool,
    run: str | None,
    events: Path | None,
    config: Path | None,
    db: str | None,
    output: str | None,
    as_json: bool,
    quiet: bool,
) -> None:
    """``--flush`` or ``--config-check``, after refusing options they do not take."""
    if flush and config_check:
        raise errors.InputError("--flush and --config-check together: give one")
    if run is not None or events is not None:
        what = "--flush" if flush else "--config-check"
        raise errors.InputError(f"{what} reads no event log: leave out --run and --events")
    if config_check:
        _config_check(config, as_json)
    elif config is None:
        raise errors.InputError(
            "--flush needs --config: the pipeline whose queue database holds the spool and "
            "whose lineage settings say where to send"
        )
    else:
        _flush(config, db, output, as_json, quiet)


def _config_check(config: Path | None, as_json: bool) -> None:
    """Print the effective lineage settings and their sources; exit 1 on an invalid one."""
    import os

    from batching import config as cfg
    from batching.evidence import ol_config

    try:
        base = load(config).lineage if config is not None else cfg.LineageConfig()
        resolved = ol_config.resolve(base, os.environ)
    except errors.ConfigError as exc:
        flag(err, "error", str(exc))
        raise typer.Exit(1) from None
    shown = _shown_settings(resolved.config)
    if as_json:
        doc = {
            "settings": {k: {"value": v, "source": resolved.sources[k]} for k, v in shown.items()},
            "openlineage_yml": str(resolved.file) if resolved.file else None,
            "not_used": list(resolved.unused),
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return
    table = Table(
        "setting",
        "value",
        "source",
        title="effective lineage settings",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for name, value in shown.items():
        table.add_row(name, plain("-" if value is None else value), plain(resolved.sources[name]))
    out.print(table)
    looked = (
        f"${ol_config.CONFIG_ENV}, ./{ol_config.FILE_NAME}, ~/.openlineage/{ol_config.FILE_NAME}"
    )
    found = str(resolved.file) if resolved.file else f"none found ({looked})"
    out.print(f"{ol_config.FILE_NAME}: {found}", highlight=False)
    if resolved.unused:
        out.print(f"not used by batching: {', '.join(resolved.unused)}", highlight=False)


def _shown_settings(settings: Any) -> dict[str, Any]:
    """The lineage settings as printed: URLs redacted, an API key only said to be set."""
    from batching.redaction import redact_url

    shown = settings.model_dump(mode="json")
    if shown.get("url"):
        shown["url"] = redact_url(shown["url"])
    shown["api_key"] = "set (hidden)" if settings.api_key is not None else None
    return dict(shown)


def _flush(config: Path, db: str | None, output: str | None, as_json: bool, quiet: bool) -> None:
    """Re-send the spooled events of the config's database; exit 1 when some remain."""
    import os

    from rich.progress import BarColumn, MofNCompleteColumn, TextColumn

    from batching.compose import build
    from batching.compose import evidence as compose_evidence
    from batching.evidence import ol_config, spool
    from batching.store.database import redact

    cfg = load(config)
    settings = ol_config.lineage_config(cfg.lineage, os.environ)
    res = build.resolve(cfg, db, output)
    queue = build.open_queue(cfg, res.db_url)
    try:
        queue.check_schema()
        before = spool.backlog(queue.engine)
    finally:
        queue.engine.dispose()
    where = f"lineage spool of {redact(res.db_url)}"
    if before.events and settings.transport not in ("http", "file"):
        raise errors.ConfigError(
            f"{where}: {before.events} event(s) wait, and lineage goes to {settings.transport}: "
            "they are re-sent over http or file only (OPENLINEAGE_URL, or lineage.transport)"
        )
    progress = progress_bar(
        TextColumn("re-sending spooled lineage events"),
        BarColumn(),
        MofNCompleteColumn(),
        quiet=quiet or as_json,
    )
    with progress:
        task = progress.add_task("flush", total=before.events)
        done = (
            compose_evidence.flush_lineage(
                cfg, res, settings, on_sent=lambda n: progress.update(task, completed=n)
            )
            if before.events
            else None
        )
    left = done.left if done is not None else before
    if as_json:
        doc = {
            "sent": done.sent if done else 0,
            "dropped": done.dropped if done else 0,
            "left_events": left.events,
            "left_runs": left.runs,
            "error": done.error if done else None,
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    elif done is None:
        out.print(f"{where}: empty; nothing to send", highlight=False)
    else:
        dropped = f"; {done.dropped} dropped by the retention cap" if done.dropped else ""
        out.print(
            f"{where}: sent {done.sent} event(s) to {settings.transport}{dropped}; "
            f"{left.events} left of {left.runs} run(s)",
            highlight=False,
        )
    if left.events:
        why = f" (last error: {done.error})" if done and done.error else ""
        flag(
            err,
            "error",
            f"{left.events} lineage event(s) still undelivered{why}; check the backend, then "
            f"run `batching lineage flush -c {config}` again",
        )
        raise typer.Exit(1)
