"""Rollout commands, composed: check a change against the config's registry, make it in the
database (:mod:`batching.ingress.rollout`), and record it in lineage as a run of the job
``<config name>.rollout`` with a ``batching_rollout`` facet (who, why, the route before and
after) and the queue's outputs dataset as its input (it governs that dataset and writes none
of it: an output would make Marquez count a dataset version no row is in). The scoring runs
that write the dataset name the versions that committed their rows (``batching_model``
``versions``), so Marquez shows which version produced which dataset version.

Also the guard: judge the candidate against the config's ``rollout`` bounds and roll it back
when it breaches them (``auto-rollback``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from batching import config as cfg
from batching import errors
from batching.compose import build, shadow
from batching.evidence import lineage
from batching.ingress import queue as q
from batching.ingress import rollout, version_pins
from batching.routing import Route

GUARD_ACTOR = "guard"


@dataclass(frozen=True)
class Status:
    """A queue's rollout: its route, what each version did since it began, the guard's
    verdict, the latest changes."""

    queue: str
    route: Route | None
    stats: list[rollout.VersionStats]
    truncated: bool
    breach: str | None
    history: list[Any]
    drift: dict[str, Any] | None = None  # the shadowed items' (``shadow.drift``)

    def as_dict(self) -> dict[str, Any]:
        return {
            "queue": self.queue,
            "route": None if self.route is None else self.route.as_dict(),
            "versions": [s.as_dict() for s in self.stats],
            "truncated": self.truncated,
            "guard": {"breach": self.breach},
            "shadow": self.drift,
            "history": [
                {"at": h.at, "action": h.action, "actor": h.actor, "reason": h.reason} | h.detail
                for h in self.history
            ],
        }


def start(
    config: cfg.PipelineConfig,
    db_url: str | None,
    *,
    candidate: str,
    percent: float,
    actor: str,
    reason: str,
    tenants: Sequence[str] = (),
    shadow: float = 0.0,
) -> rollout.Change:
    """Start ``candidate`` on a share of the queue.

    Raises:
        InputError: ``candidate`` is not in the config's registry, or the change is refused.
    """
    registry = config.registry()
    if candidate not in registry:
        raise errors.InputError(
            f"model version {candidate!r} is not in the registry of this config (it lists "
            f"{', '.join(sorted(registry))}); add it under model_versions, with its "
            "checkpoint and sha256, and run `batching check`"
        )
    _verify(config, candidate)

    def begin(queue: q.SqlQueue) -> rollout.Change:
        with queue.engine.connect() as conn:  # the candidate's name, if it labelled outputs
            relabelled = version_pins.conflicts(conn, queue.queue, {candidate: registry[candidate]})
        if relabelled:
            raise errors.InputError(f"{relabelled[0]}; nothing changed")
        return rollout.start(
            queue.engine,
            queue.queue,
            stable=config.model.version,
            candidate=candidate,
            percent=percent,
            tenants=tenants,
            shadow=shadow,
            actor=actor,
            reason=reason,
            now=queue.clock(),
        )

    return _changed(config, db_url, begin)


def _verify(config: cfg.PipelineConfig, version: str) -> None:
    """The candidate's pinned checkpoint, read and deserialized as a scorer will (its file, its
    sha256, its format, never unpickling code), and fitted to its model (whose factory must
    import), before any item is routed to it: a candidate that cannot load is refused here,
    not found by the scorers at the first batch routed to it."""
    from batching.model import zoo

    spec = config.registry()[version]
    try:
        path = zoo.checkpoint_path(spec.name, spec.checkpoint, Path(config.base_dir))
        zoo.check_fits(spec.name, zoo.load_checkpoint(path, spec.sha256), path)
    except (errors.ConfigError, errors.CheckpointError) as exc:
        raise errors.InputError(f"model_versions {version!r}: {exc}; nothing changed") from None


def promote(
    config: cfg.PipelineConfig, db_url: str | None, *, actor: str, reason: str
) -> rollout.Change:
    """Make the candidate stable (``rollout.promote``), if this config lists it."""
    listed = tuple(config.registry())
    return _changed(
        config,
        db_url,
        lambda queue: rollout.promote(
            queue.engine, queue.queue, actor=actor, reason=reason, now=queue.clock(), listed=listed
        ),
    )


def rollback(
    config: cfg.PipelineConfig, db_url: str | None, *, actor: str, reason: str
) -> rollout.Change:
    """Stop the candidate (``rollout.rollback``)."""
    return _changed(
        config,
        db_url,
        lambda queue: rollout.rollback(
            queue.engine, queue.queue, actor=actor, reason=reason, now=queue.clock()
        ),
    )


def status(
    config: cfg.PipelineConfig, db_url: str | None, history: int = 10, output: str | None = None
) -> Status:
    """The queue's rollout as ``batching rollout status`` shows it; ``output``: the scorers'
    ``--output``, beside which their shadow dataset is (``shadow.folder``)."""
    queue = _queue(config, db_url)
    try:
        route = rollout.current(queue.engine, queue.queue)
        stats: list[rollout.VersionStats] = []
        truncated, breach = False, None
        if route is not None:
            stats, truncated = rollout.version_stats(
                queue.engine, queue.queue, route, config.latency_slo_s
            )
            breach = rollout.judge(stats, config.rollout)
        changes = rollout.history(queue.engine, queue.queue, history)
    finally:
        queue.engine.dispose()
    drift = None
    if route is not None and route.candidate is not None:
        where = shadow.folder(config, build.resolve(config, db_url, output))
        drift = shadow.drift(where, queue.queue, route.candidate, route.since)
    return Status(queue.queue, route, stats, truncated, breach, changes, drift)


def guard(
    config: cfg.PipelineConfig,
    db_url: str | None,
    *,
    dry_run: bool = False,
    output: str | None = None,
) -> tuple[Status, rollout.Change | None]:
    """Judge the candidate (``rollout.judge``); roll it back when it breaches the config's
    ``rollout`` bounds (unless ``dry_run``), refused if the route changed meanwhile."""
    seen = status(config, db_url, history=0, output=output)
    if seen.breach is None or dry_run or seen.route is None:
        return seen, None
    epoch = seen.route.epoch
    change = _changed(
        config,
        db_url,
        lambda queue: rollout.rollback(
            queue.engine,
            queue.queue,
            actor=GUARD_ACTOR,
            reason=f"guard: {seen.breach}",
            now=queue.clock(),
            action="auto-rollback",
            expect_epoch=epoch,
        ),
    )
    return seen, change


def _queue(config: cfg.PipelineConfig, db_url: str | None) -> q.SqlQueue:
    res = build.resolve(config, db_url, None)
    queue = build.open_queue(config, res.db_url)
    queue.check_schema()
    return queue


def _changed(
    config: cfg.PipelineConfig,
    db_url: str | None,
    make: Callable[[q.SqlQueue], rollout.Change],
) -> rollout.Change:
    """Make a change on the config's queue, then record it in lineage (never failing the
    change: it is on record in the queue's audit either way)."""
    res = build.resolve(config, db_url, None)
    queue = _queue(config, db_url)
    try:
        change = make(queue)
        emit(config, res, queue, change)
    finally:
        queue.engine.dispose()
    return change


def emit(
    config: cfg.PipelineConfig, res: build.Resolved, queue: q.SqlQueue, change: rollout.Change
) -> lineage.LineageEmitter:
    """START and COMPLETE of the change's lineage run (the config's lineage settings)."""
    emitter = build.make_emitter(config, res, engine=queue.engine)
    try:
        _, out_ds = build.datasets(config, res)
        spec = config.registry().get(change.after.stable)
        model = None
        if spec is not None:
            model = lineage.ModelRef(spec.name, change.after.stable, spec.sha256)
        run = lineage.RunContext(
            run_id=lineage.new_run_id(),
            job_name=f"{config.name}.rollout",
            inputs=(out_ds,),
            model=model,
            rollout={
                "action": change.action,
                "queue": queue.queue,
                "actor": change.actor,
                "reason": change.reason,
                "to": change.after.as_dict(),
                "before": None if change.before is None else change.before.as_dict(),
            },
        )
        emitter.start(run)
        emitter.complete(run)
    finally:
        emitter.close()
    return emitter
