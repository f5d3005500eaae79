"""OpenLineage runs the flows record themselves; ``batching.compose.run.run_score`` records scoring.

The OpenLineage run id is always the Prefect flow-run id, so a run in Marquez and a run in the
Prefect UI cross-reference one to one. Two cases need the flow's help:

* a score run whose preconditions fail never reaches ``run_score``: :func:`record_failure`
  emits its START and FAIL (with the ``errorMessage`` facet) under the scoring job's name;
* a reconcile run is its own job, ``<config name>-reconcile``: :func:`reconcile_run`. Given
  the score run it checks (``upstream_flow_run_id``), its ``parent`` facet names that run;
  its findings are a ``dataQualityAssertions`` facet on the outputs it read.

Lineage trouble never fails a run: the emitter counts and logs delivery failures, and a run
context that cannot be built is logged and skipped.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

from batching import config, errors
from batching.compose import build
from batching.compose import record as run_record
from batching.evidence import lineage
from batching.evidence.findings import Kind, Report, Severity
from batching.redaction import redact_url
from batching.store import database
from flows import settings

logger = logging.getLogger(__name__)

_ASSERTION_SEVERITY = {Severity.CRITICAL: "error", Severity.WARNING: "warn", Severity.INFO: "info"}
_WORST_OF_KIND = {
    Kind.LOST_WRITE: Severity.CRITICAL,
    Kind.MISSING_FILE: Severity.CRITICAL,
    Kind.TRUNCATED_OR_CORRUPT: Severity.CRITICAL,
    Kind.ORPHAN_FILE: Severity.CRITICAL,
    Kind.DUPLICATE: Severity.CRITICAL,
    Kind.UNPUBLISHED: Severity.CRITICAL,
    Kind.UNSAFE_PATH: Severity.CRITICAL,
    Kind.STALE_LEASE: Severity.WARNING,
    Kind.SLA_MISS: Severity.WARNING,
    Kind.OTHER_DATASET: Severity.WARNING,
    Kind.DEAD: Severity.INFO,
    Kind.EXPIRED: Severity.INFO,
}
"""The worst severity a finding class can have (:mod:`batching.evidence.findings`)."""


def emitter(cfg: config.PipelineConfig, res: build.Resolved) -> lineage.LineageEmitter:
    """A lineage emitter for ``cfg``, with the environment's transport, like ``run_score``'s.

    Raises:
        ConfigError: the lineage settings are invalid (e.g. a malformed ``OPENLINEAGE_URL``).
    """
    return build.make_emitter(cfg, res, settings.lineage_config(cfg))


def reconcile_context(
    cfg: config.PipelineConfig,
    res: build.Resolved,
    run_id: str,
    *,
    repair: bool,
    upstream: str | None = None,
) -> lineage.RunContext:
    """The run context of a reconcile run: it reads the queue and the outputs (writes on repair).

    ``upstream``: the score run it checks (its flow-run id, so its lineage run id), named by
    the ``parent`` facet as a run of the config's job; left out when it is not a run id, or
    is this run's own.

    Raises:
        ConfigError: the lineage settings are invalid.
    """
    queue, out = build.datasets(cfg, res)
    lineage_config = settings.lineage_config(cfg)
    shown, shown_hash = build.config_facet(cfg, res, lineage_config)
    parent = upstream if upstream != run_id and _is_uuid(upstream) else None
    return lineage.RunContext(
        run_id=run_id,
        job_name=f"{cfg.name}-reconcile",
        parent_run_id=parent,
        parent_job_name=cfg.name if parent else None,
        inputs=(queue, out),
        outputs=(queue, out) if repair else (),
        config=shown,
        config_hash=cfg.config_hash(),
        effective_config_hash=shown_hash,
    )


def _is_uuid(value: str | None) -> bool:
    try:
        uuid.UUID(str(value))
    except ValueError:
        return False
    return value is not None


def assertions(report: Report) -> tuple[lineage.Assertion, ...]:
    """One data-quality assertion per finding class: ``success`` when the report has no
    critical or warning finding of it; ``actual`` the items (or files) concerned, ``expected``
    0; ``severity`` the worst found (``error`` for critical, ``warn``, ``info``), else the
    worst the class can have. The run fails exactly when an ``error`` assertion fails."""
    found = []
    for kind, worst in _WORST_OF_KIND.items():
        of_kind = report.by_kind(kind)
        ranked = [f.severity for f in of_kind]
        severity = next((s for s in Severity if s in ranked), worst)  # CRITICAL first
        found.append(
            lineage.Assertion(
                assertion=str(kind),
                success=not any(s is not Severity.INFO for s in ranked),
                severity=_ASSERTION_SEVERITY[severity],
                actual=str(sum(f.count for f in of_kind)),
                expected="0",
                description=redact_url(of_kind[0].message)[:500] if of_kind else None,
            )
        )
    return tuple(found)


@dataclass
class ReconcileRun:
    """A reconcile run's lineage while it runs: :meth:`checked` hands it the final report,
    whose findings its COMPLETE or FAIL carries."""

    context: lineage.RunContext
    report: Report | None = None

    def checked(self, report: Report) -> None:
        """The report the run's verdict is made of (after a repair, the second pass)."""
        self.report = report

    def final(self) -> lineage.RunContext:
        """The context for the run's end: the outputs as read, with the findings on them."""
        if self.report is None:
            return self.context
        queue, out, *rest = self.context.inputs
        found = out.with_assertions(assertions(self.report))
        return replace(self.context, inputs=(queue, found, *rest))


def record_failure(
    cfg: config.PipelineConfig,
    db_url: str | None,
    output: str | None,
    run_id: str,
    error: BaseException,
) -> None:
    """Emit START then FAIL for a scoring run that failed before it started scoring."""
    try:
        res = settings.locations(cfg, db_url, output)
        lineage_config = settings.lineage_config(cfg)
        ctx = build.scoring_context(cfg, res, run_id, lineage_config=lineage_config)
        emit = emitter(cfg, res)
    except (errors.ConfigError, ValueError):
        logger.warning("lineage for the failed run skipped", exc_info=True)
        return
    run_record.record_failed_start(emit, ctx, error)


@contextmanager
def reconcile_run(
    cfg: config.PipelineConfig,
    res: build.Resolved,
    run_id: str,
    *,
    repair: bool,
    upstream: str | None = None,
) -> Iterator[ReconcileRun]:
    """START on entry; COMPLETE on a clean exit, FAIL with the error when the block raises;
    either with the findings the block handed to :meth:`ReconcileRun.checked`."""
    run = ReconcileRun(reconcile_context(cfg, res, run_id, repair=repair, upstream=upstream))
    engine = database.create_engine(res.db_url)  # its spool: events the backend did not take
    emit = build.make_emitter(cfg, res, settings.lineage_config(cfg), engine=engine)
    emit.start(run.context)
    try:
        yield run
    except BaseException as exc:
        emit.fail(run.final(), exc)
        raise
    else:
        emit.complete(run.final())
    finally:
        emit.close()
        engine.dispose()
