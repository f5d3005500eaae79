"""``batching queue pause | resume | cancel | cap | audit``: queue controls for incidents.

Each change is recorded in ``batching_queue_audit`` with who (``--actor``, default: the OS
user), when and why (``--reason``, required to pause and to cancel); ``batching queue audit``
lists the record. ``batching status`` shows a pause and a cap (:func:`control_lines`).
"""

from __future__ import annotations

import datetime as dt
import json
import time
from dataclasses import asdict
from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from batching import errors
from batching.cli.common import (
    DbOverride,
    JsonOption,
    app,
    emit_json,
    handle_errors,
    load,
    open_queue,
    out,
    plain,
    warn_unknown_queue,
    warn_unknown_tenant,
)

queue_app = typer.Typer(
    name="queue",
    help="Queue controls for incidents: pause, resume, cancel items, cap the depth, audit.",
    no_args_is_help=True,
)
app.add_typer(queue_app, name="queue")

QueueArgument = Annotated[
    str | None,
    typer.Argument(help="Queue name (default: the --config's queue.name).", show_default=False),
]
ConfigOpt = Annotated[
    Path | None,
    typer.Option(
        "--config", "-c", help="Pipeline YAML: its database and queue name, unless given."
    ),
]
ActorOption = Annotated[
    str | None,
    typer.Option("--actor", help="Who is acting, as recorded in the audit (default: the OS user)."),
]
ReasonRequired = Annotated[
    str,
    typer.Option("--reason", help="Why, as recorded in the audit (required).", show_default=False),
]
ReasonOption = Annotated[
    str | None, typer.Option("--reason", help="Why, as recorded in the audit.")
]


def acting(actor: str | None) -> str:
    """``--actor``, or the OS user running the command."""
    if actor is not None:
        return actor
    import getpass
    import os

    try:
        return getpass.getuser()
    except Exception:  # no user name for this uid (a container): the uid
        return f"uid:{os.getuid()}"


NewOption = Annotated[
    bool,
    typer.Option(
        "--new", help="The queue has no item yet: control it anyway (else refused as a typo)."
    ),
]


def _open(
    queue: str | None, db: str | None, config: Path | None, *, new: bool | None = None
) -> Any:
    """The ``SqlQueue`` the command acts on, its schema checked: ``--db`` or the config's
    database (or the default file), QUEUE or the config's queue name. ``new`` (a pause, a
    cap): False refuses a queue with no items and no control, True allows it; None warns."""
    from batching.cli.common import DEFAULT_DB

    cfg = load(config) if config is not None else None
    name = queue or (cfg.queue.name if cfg is not None else None)
    if not name:
        raise errors.InputError(
            "which queue? give its name (`batching queue pause NAME ...`) or --config FILE"
        )
    if not 1 <= len(name) <= 200:
        raise errors.InputError(f"a queue name is 1 to 200 characters, got {len(name)}")
    url = db or (cfg.database.url if cfg is not None else DEFAULT_DB)
    q = open_queue(url, name)
    q.check_schema()
    if not new:  # --new: the user said it has no item yet
        warn_unknown_queue(q, controls_too=True, refuse="--new" if new is False else None)
    return q


def when(at: float | None) -> str:
    """An epoch time as ``2026-12-02 01:50:57 UTC``."""
    if at is None:
        return "-"
    return dt.datetime.fromtimestamp(at, dt.UTC).strftime("%Y-%m-%d %H:%M:%S UTC")


@queue_app.command()
@handle_errors
def pause(
    queue: QueueArgument = None,
    reason: ReasonRequired = "",
    actor: ActorOption = None,
    db: DbOverride = None,
    config: ConfigOpt = None,
    new: NewOption = False,
    as_json: JsonOption = False,
) -> None:
    """Pause a queue: scorers stop claiming from it; batches in flight finish.

    Every scorer sees the pause at its next claim; what it holds is scored and committed as
    usual. Recorded with --actor and --reason; undo with `batching queue resume`.

    --json: ok, action, queue, changed (false: it was paused already), control."""
    from batching.ingress import controls

    q = _open(queue, db, config, new=new)
    before = controls.state(q.engine, q.queue)
    after = controls.pause(q.engine, q.queue, actor=acting(actor), reason=reason, now=time.time())
    changed = not before.paused
    if as_json:
        emit_json(_doc("pause", q.queue, changed, after))
        return
    verb = "paused" if changed else "was already paused"
    out.print(
        f"queue {q.queue!r} {verb} by {after.paused_by} since {when(after.paused_at)}: "
        f"{after.reason}"
    )
    out.print(
        "scorers claim nothing from it from their next claim; batches in flight finish. "
        f"Resume: `batching queue resume {q.queue}`"
    )


@queue_app.command()
@handle_errors
def resume(
    queue: QueueArgument = None,
    reason: ReasonOption = None,
    actor: ActorOption = None,
    db: DbOverride = None,
    config: ConfigOpt = None,
    as_json: JsonOption = False,
) -> None:
    """Resume a paused queue: scorers claim from it again at their next poll.

    --json: ok, action, queue, changed (false: it was not paused), control."""
    from batching.ingress import controls

    q = _open(queue, db, config)
    before = controls.state(q.engine, q.queue)
    after = controls.resume(q.engine, q.queue, actor=acting(actor), reason=reason, now=time.time())
    if as_json:
        emit_json(_doc("resume", q.queue, before.paused, after))
        return
    if before.paused:
        out.print(
            f"queue {q.queue!r} resumed (paused by {before.paused_by} since "
            f"{when(before.paused_at)}); scorers claim from it again at their next poll"
        )
    else:
        out.print(f"queue {q.queue!r} was not paused; nothing to resume (recorded)")


@queue_app.command()
@handle_errors
def cap(
    queue: QueueArgument = None,
    max_depth: Annotated[
        int | None,
        typer.Option(
            "--max-depth", min=0, help="Most items ready or leased; an enqueue past it is refused."
        ),
    ] = None,
    no_cap: Annotated[bool, typer.Option("--no-cap", help="Remove the cap.")] = False,
    reason: ReasonOption = None,
    actor: ActorOption = None,
    db: DbOverride = None,
    config: ConfigOpt = None,
    new: NewOption = False,
    as_json: JsonOption = False,
) -> None:
    """Cap a queue's depth: enqueues past --max-depth items are refused (backpressure).

    An enqueue that would leave more than --max-depth items ready or leased is refused whole
    (exit 2, nothing enqueued); keys already present do not count. --no-cap removes the cap.

    --json: ok, action, queue, changed, control, depth (items ready or leased now)."""
    from batching.ingress import admission, controls

    if (max_depth is None) == (not no_cap):
        raise errors.InputError("give one of --max-depth N or --no-cap")
    q = _open(queue, db, config, new=new)
    before = controls.state(q.engine, q.queue)
    after = controls.set_max_depth(
        q.engine, q.queue, max_depth, actor=acting(actor), reason=reason, now=time.time()
    )
    with q.read() as conn:
        depth = admission.depth(conn, q.queue)
    if as_json:
        emit_json(_doc("cap", q.queue, before.max_depth != after.max_depth, after, depth=depth))
        return
    if max_depth is None:
        out.print(f"queue {q.queue!r}: depth cap removed ({depth} items ready or leased)")
        return
    over = "; enqueues are refused until it is back under" if depth >= max_depth else ""
    out.print(f"queue {q.queue!r} capped at {max_depth} items ready or leased (now {depth}){over}")


@queue_app.command()
@handle_errors
def cancel(
    queue: QueueArgument = None,
    key: Annotated[
        list[str] | None, typer.Option("--key", help="An item key to cancel (repeatable).")
    ] = None,
    keys_file: Annotated[
        Path | None,
        typer.Option("--keys-file", help="A file of item keys to cancel, one per line."),
    ] = None,
    tenant: Annotated[
        str | None, typer.Option("--tenant", help="Cancel this tenant's items.")
    ] = None,
    enqueue_run: Annotated[
        str | None,
        typer.Option(
            "--enqueue-run",
            help="Cancel what one `batching enqueue` brought in (it prints its id).",
        ),
    ] = None,
    reason: ReasonRequired = "",
    actor: ActorOption = None,
    db: DbOverride = None,
    config: ConfigOpt = None,
    as_json: JsonOption = False,
) -> None:
    """Cancel ready items by key, tenant and/or enqueue run; in-flight ones finish.

    The ready items matching every filter given are not scored and stay as `cancelled`
    (`batching redrive --only cancelled` brings them back, `batching purge` removes them).
    Leased items are in flight: they are left to finish, and counted.

    --json: ok, action, queue, cancelled, in_flight."""
    from batching.ingress import controls

    keys = _keys(key, keys_file)
    q = _open(queue, db, config)
    result = controls.cancel_items(
        q.engine,
        q.queue,
        keys=keys,
        tenant=tenant,
        enqueue_run=enqueue_run,
        actor=acting(actor),
        reason=reason,
        now=time.time(),
    )
    if as_json:
        emit_json(
            {
                "ok": True,
                "action": "cancel",
                "queue": q.queue,
                "cancelled": result.cancelled,
                "in_flight": result.in_flight,
            }
        )
        return
    out.print(f"cancelled {result.cancelled} ready item(s) of queue {q.queue!r}")
    if not (result.cancelled or result.in_flight):
        warn_unknown_tenant(q, tenant, ("ready", "leased"))
    if result.in_flight:
        out.print(
            f"{result.in_flight} matching item(s) are in flight (leased): left to finish; "
            "pause the queue first to stop new claims"
        )


def _keys(key: list[str] | None, keys_file: Path | None) -> list[str] | None:
    """``--key`` values and the lines of ``--keys-file`` (blank lines skipped); None: neither."""
    if not key and keys_file is None:
        return None
    keys = list(key or ())
    if keys_file is not None:
        try:
            text = keys_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise errors.InputError(f"--keys-file {keys_file}: cannot read it ({exc})") from None
        keys += [line.strip() for line in text.splitlines() if line.strip()]
        if not keys:
            raise errors.InputError(f"--keys-file {keys_file} holds no keys; one key a line")
    return keys


@queue_app.command()
@handle_errors
def audit(
    queue: Annotated[
        str | None,
        typer.Argument(
            help="Queue name (default: the --config's queue.name, else every queue).",
            show_default=False,
        ),
    ] = None,
    limit: Annotated[int, typer.Option("--limit", min=1, help="The latest N actions.")] = 50,
    db: DbOverride = None,
    config: ConfigOpt = None,
    as_json: JsonOption = False,
) -> None:
    """Recorded control actions (pause to purge, rollouts): when, who, why, what.

    Pause, resume, cap, cancel, redrive, purge, and a rollout's start, promote, rollback.

    --json: ok, rows (id, queue, action, actor, at, reason, detail), oldest first."""
    from batching.cli.common import DEFAULT_DB
    from batching.ingress import controls

    cfg = load(config) if config is not None else None
    q = open_queue(db or (cfg.database.url if cfg is not None else DEFAULT_DB))
    q.check_schema()
    queue = queue or (cfg.queue.name if cfg is not None else None)  # as every control reads -c
    rows = controls.audit(q.engine, queue, limit)
    if as_json:
        emit_json({"ok": True, "rows": [asdict(r) for r in rows]})
        return
    table = Table(
        title=f"queue audit {'(all)' if queue is None else repr(queue)}",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        pad_edge=False,
    )
    for col in ("at", "queue", "action", "actor", "reason", "detail"):
        table.add_column(col, overflow="fold")
    for r in rows:
        detail = json.dumps({k: v for k, v in r.detail.items() if v is not None})
        table.add_row(
            when(r.at), *(plain(v) for v in (r.queue, r.action, r.actor, r.reason or "-", detail))
        )
    out.print(table)
    if not rows:
        out.print("no control actions recorded")


def _doc(action: str, queue: str, changed: bool, control: Any, **extra: Any) -> dict[str, Any]:
    return {
        "ok": True,
        "action": action,
        "queue": queue,
        "changed": changed,
        "control": asdict(control),
        **extra,
    }


def control_lines(controls_by_queue: dict[str, Any], depths: dict[str, int]) -> list[str]:
    """``batching status``'s lines for paused and capped queues, and for those whose ledger
    retention purged (none for the others)."""
    lines = []
    for name, c in sorted(controls_by_queue.items()):
        if c.paused:
            lines.append(
                f"queue {name!r} PAUSED by {c.paused_by} since {when(c.paused_at)}: {c.reason} "
                f"(`batching queue resume {name}`)"
            )
        if c.max_depth is not None:
            lines.append(
                f"queue {name!r} depth cap {c.max_depth} items ready or leased "
                f"(now {depths.get(name, 0)})"
            )
        if c.ledger_horizon is not None:
            lines.append(
                f"queue {name!r} ledger kept from {when(c.ledger_horizon)} "
                "(`batching purge --ledger`): older outputs are not judged for orphans"
            )
    return lines
