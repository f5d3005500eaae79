"""``batching rollout start | status | promote | rollback | guard`` and ``batching replay``:
change which model version scores a queue, one command at a time, each recorded (who, when,
why, from, to) in the queue's audit and in lineage; score a past run again.

The config's registry (``model`` and ``model_versions``) says what may run; the queue's
route in the database says what does run. Scorers pick a change up at their next claim.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich import box
from rich.table import Table

from batching import errors
from batching.cli.common import (
    ConfigOption,
    DbOverride,
    JsonOption,
    app,
    emit_json,
    handle_errors,
    load,
    out,
    plain,
)
from batching.cli.controls import ActorOption, ReasonRequired, acting, when

rollout_app = typer.Typer(
    name="rollout",
    help="Roll a new model version out: canary by percent or tenant, compare, promote, roll back.",
    no_args_is_help=True,
)
app.add_typer(rollout_app, name="rollout")


ShadowBeside = Annotated[
    str | None,
    typer.Option(
        "--output",
        help="The scorers' --output, when they were given one: their shadow dataset is beside "
        "it (unless rollout.shadow_path sets it).",
    ),
]


def _fmt_s(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.0f} ms"


def _change_doc(change: Any) -> dict[str, Any]:
    return {
        "ok": True,
        "action": change.action,
        "before": None if change.before is None else change.before.as_dict(),
        "route": change.after.as_dict(),
    }


def _show(queue: str, change: Any, as_json: bool) -> None:
    """A route change: its JSON document, or the route now and before."""
    if as_json:
        emit_json(_change_doc(change))
        return
    before = change.before.describe() if change.before else "-"
    out.print(plain(f"queue {queue!r}: {change.after.describe()} (was: {before})"))


@rollout_app.command()
@handle_errors
def start(
    config: ConfigOption,
    candidate: Annotated[
        str,
        typer.Option(
            "--candidate", help="The version to try (listed in the config's model_versions)."
        ),
    ],
    reason: ReasonRequired = "",
    percent: Annotated[
        float | None,
        typer.Option(
            "--percent",
            help="Share of the keys (of --tenants, if given) the candidate scores, 0-100; "
            "sticky per item_key. Default: 100 with --tenants, else required.",
        ),
    ] = None,
    tenants: Annotated[
        str | None,
        typer.Option("--tenants", help="Comma-separated tenants the candidate serves."),
    ] = None,
    shadow: Annotated[
        float,
        typer.Option(
            "--shadow",
            help="Share (0-100) of the stable items also scored by the candidate, kept aside.",
        ),
    ] = 0.0,
    actor: ActorOption = None,
    db: DbOverride = None,
    as_json: JsonOption = False,
) -> None:
    """Start a canary: the candidate scores a sticky share of the queue's items.

    Each item is scored by exactly one version, recorded in its output row, the ledger and
    lineage. Running scorers pick the route up at their next claim. Undo: `batching rollout
    rollback`; make it everyone's: `batching rollout promote`.

    --json: ok, action, before, route."""
    from batching.compose import rollouts

    names = [t.strip() for t in (tenants or "").split(",") if t.strip()]
    if tenants is not None and not names:
        raise typer.BadParameter(
            f"{tenants!r} names no tenant; give TENANT[,TENANT...], or leave --tenants out "
            "for every tenant",
            param_hint="--tenants",
        )
    odd = next((t for t in names if len(t) > 200 or not t.isprintable()), None)
    if odd is not None:  # no item's tenant could be it: items hold names of 200 at most
        raise typer.BadParameter(
            f"{odd[:40]!r}{'...' if len(odd) > 40 else ''} is not a tenant name (at most 200 "
            "printable characters); give "
            "the tenants' names as items carry them",
            param_hint="--tenants",
        )
    if percent is None:
        if not names and not shadow:
            raise errors.InputError("give --percent (0-100), --tenants, or --shadow")
        percent = 100.0 if names else 0.0
    cfg = load(config)
    change = rollouts.start(
        cfg,
        db,
        candidate=candidate,
        percent=percent,
        tenants=names,
        shadow=shadow,
        actor=acting(actor),
        reason=reason,
    )
    if as_json:
        emit_json(_change_doc(change))
        return
    out.print(plain(f"queue {cfg.queue.name!r}: {change.after.describe()}"))
    out.print(
        "scorers pick it up at their next claim. Compare: `batching rollout status`; "
        "undo: `batching rollout rollback`"
    )


@rollout_app.command()
@handle_errors
def promote(
    config: ConfigOption,
    reason: ReasonRequired = "",
    actor: ActorOption = None,
    db: DbOverride = None,
    as_json: JsonOption = False,
) -> None:
    """Promote the candidate: it becomes the stable version and scores every item.

    One transaction with its audit row; batches already split finish with the version they
    were split to. --json: ok, action, before, route."""
    from batching.compose import rollouts

    cfg = load(config)
    change = rollouts.promote(cfg, db, actor=acting(actor), reason=reason)
    _show(cfg.queue.name, change, as_json)
    if not as_json:
        out.print(
            f"when you next edit the config, make {change.after.stable!r} its model: move that"
            " whole model_versions entry (name, checkpoint, sha256, dtype) into model, and list"
            " the old model under model_versions; a version's name must keep its weights"
        )


@rollout_app.command()
@handle_errors
def rollback(
    config: ConfigOption,
    reason: ReasonRequired = "",
    actor: ActorOption = None,
    db: DbOverride = None,
    as_json: JsonOption = False,
) -> None:
    """Roll the candidate back: the stable version scores every item again.

    --json: ok, action, before, route."""
    from batching.compose import rollouts

    cfg = load(config)
    _show(cfg.queue.name, rollouts.rollback(cfg, db, actor=acting(actor), reason=reason), as_json)


@rollout_app.command()
@handle_errors
def status(
    config: ConfigOption,
    db: DbOverride = None,
    history: Annotated[
        int, typer.Option("--history", min=0, max=10_000, help="Route changes shown.")
    ] = 10,
    output: ShadowBeside = None,
    as_json: JsonOption = False,
) -> None:
    """What each version of the rollout did since it began, and the guard's verdict.

    Per version: items, error and dead rate, latency p50/p99 (enqueue to commit), SLA
    misses; then the guard's verdict and the latest changes.

    With --shadow: the drift of the shadowed items' outputs (mean and max absolute
    difference; cosine similarity for vectors, KS and PSI for scalars).

    --json: queue, route, versions[], truncated, guard.breach, shadow, history[]."""
    from batching.compose import rollouts

    cfg = load(config)
    seen = rollouts.status(cfg, db, history, output)
    if as_json:
        emit_json({"ok": True} | seen.as_dict())
        return
    if seen.route is None:
        out.print(
            plain(
                f"queue {seen.queue!r} has no route: every scorer runs its configured "
                f"version ({cfg.model.version})"
            )
        )
    else:
        out.print(
            plain(f"queue {seen.queue!r}: {seen.route.describe()} since {when(seen.route.since)}")
        )
    if seen.stats:
        table = Table(box=box.SIMPLE)
        for column in ("version", "role", "items", "committed", "errors", "dead", "p50", "p99"):
            table.add_column(column)
        table.add_column("SLA misses")
        for s in seen.stats:
            table.add_row(
                plain(s.version),
                s.role,
                str(s.items),
                str(s.committed),
                f"{s.errors} ({s.error_rate:.1%})",
                str(s.dead),
                _fmt_s(s.p50_s),
                _fmt_s(s.p99_s),
                str(s.sla_misses),
            )
        out.print(table)
        if seen.truncated:
            out.print("(the most recent 200,000 items only)")
        if seen.drift is not None:
            shown = ", ".join(
                f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                for k, v in seen.drift.items()
            )
            out.print(plain(f"shadow drift (candidate against stable): {shown}"))
        elif seen.route is not None and seen.route.shadow:
            out.print(
                "shadow drift: nothing shadowed yet (a candidate that fails every shadow "
                "pass writes nothing either: the scorers' summaries count shadow failures)"
            )
        verdict = seen.breach or "within the bounds of the config's rollout section"
        out.print(plain(f"guard: {verdict}"))
    for h in seen.history:
        out.print(plain(f"{when(h.at)}  {h.action:<14} {h.actor}: {h.reason}"))


@rollout_app.command()
@handle_errors
def guard(
    config: ConfigOption,
    db: DbOverride = None,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Judge only; roll nothing back.")
    ] = False,
    output: ShadowBeside = None,
    as_json: JsonOption = False,
) -> None:
    """Roll the candidate back if it breaches the config's `rollout` bounds.

    The bounds: error rate, p99 latency, p99 against the stable version's. Run it on a
    schedule (the `rollout-guard` deployment does, every minute).

    Exit 0 whether or not it rolled back; --json: breach, rolled_back, route."""
    from batching.compose import rollouts

    cfg = load(config)
    seen, change = rollouts.guard(cfg, db, dry_run=dry_run, output=output)
    if as_json:
        route = change.after if change else seen.route
        emit_json(
            {
                "ok": True,
                "breach": seen.breach,
                "rolled_back": change is not None,
                "route": None if route is None else route.as_dict(),
            }
        )
        return
    if seen.route is None or seen.route.candidate is None:
        out.print(plain(f"queue {seen.queue!r} has no candidate; nothing to guard"))
    elif seen.breach is None:
        out.print(plain(f"candidate {seen.route.candidate}: within bounds"))
    elif change is None:
        out.print(plain(f"breach (dry run, nothing rolled back): {seen.breach}"))
    else:
        out.print(plain(f"rolled back: {seen.breach}; now {change.after.describe()}"))


@app.command()
@handle_errors
def replay(
    run_id: Annotated[str, typer.Argument(help="The scoring run to replay (its run id).")],
    config: ConfigOption,
    model_version: Annotated[
        str | None,
        typer.Option(
            "--model-version", help="Replay with this version (default: each item's own)."
        ),
    ] = None,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output",
            help="Side dataset folder (default: replays, in the working folder: outputs/replay "
            "was inside the default output dataset).",
        ),
    ] = None,
    dataset: Annotated[
        str | None,
        typer.Option(
            "--dataset",
            help="Where the run committed its outputs, when it was given `score --output` "
            "(default: the config's output).",
        ),
    ] = None,
    db: DbOverride = None,
    as_json: JsonOption = False,
) -> None:
    """Score a past run's items again, in the same forward passes, and diff the outputs.

    The items the run committed are scored into a side dataset and compared with what the run
    committed.

    The same checkpoint on the same device (CPU) gives every item identical; another version
    gives a drift report. Items purged since are named and skipped. Exit 1 when an item of
    a same-version replay differs (but in a pass the runner split or that failed items,
    which replays without that promise). --json: the report."""
    from batching.compose import replay as replays

    cfg = load(config)
    if dataset is not None and "://" not in dataset and not Path(dataset).expanduser().exists():
        raise errors.InputError(
            f"--dataset {dataset}: no such folder; give the folder the run was given as "
            "`score --output`, or leave --dataset out for the config's output"
        )
    folder = output if output is not None else Path("replays")
    report = replays.replay(
        cfg, db, run_id, output=folder.resolve(), model_version=model_version, dataset=dataset
    )
    if as_json:
        emit_json({"ok": True} | report.as_dict())
    else:
        versions = ", ".join(f"{v} {n}" for v, n in sorted(report.model_versions.items()))
        out.print(
            plain(
                f"run {run_id}: {report.items} items in {report.passes} passes of "
                f"{report.batches} batches replayed ({versions}) into {report.output}"
            )
        )
        out.print(
            plain(
                f"identical {report.identical}, differing {report.differing} (mean abs diff "
                f"{report.mean_abs_diff:.3g}, max {report.max_abs_diff:.3g}); skipped "
                f"{report.skipped} purged since"
                + (f": {', '.join(report.skipped_keys)}" if report.skipped_keys else "")
            )
        )
        if report.passes_unrecorded:
            out.print(
                f"{report.passes_unrecorded} batch(es) committed before passes were recorded: "
                "each replayed as one pass (their bits may differ)"
            )
    if report.inexact and not as_json:
        out.print(
            f"{report.inexact} item(s) were in passes the runner split or that failed items "
            f"(no bit-for-bit promise): {report.differing_inexact} of them differ"
        )
    if model_version is None and report.differing > report.differing_inexact:
        raise typer.Exit(1)
