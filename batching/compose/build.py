"""The composition root's builders: from a config (and the CLI's or a flow's overrides) to
the adapters it names: where a run reads and writes (:func:`resolve`), its queue, its sink,
its service profile, its lineage emitter and lineage run, and the plan-time check.

The one place that knows every concrete class; the loop, the outputs and reconcile are given
what is built here. A scoring run's life (checks, recovery, ledger, lineage) is
:mod:`batching.compose.run`.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from batching import config as cfg
from batching import errors, naming
from batching.evidence import lineage, spool
from batching.ingress import queue as q
from batching.outputs import contract as sinks
from batching.outputs import registry
from batching.plan.profile import ServiceProfile
from batching.store import database

if TYPE_CHECKING:
    from sqlalchemy.engine import Engine

logger = logging.getLogger(__name__)

PRODUCER = lineage.PROJECT_URL
"""The producer URI of every event: the project's home, the base of its facet schemas too."""


@dataclass(frozen=True)
class Resolved:
    """Where a run reads and writes, after CLI/flow overrides: the queue's database, the
    outputs (``target``; ``output`` is its location) and the local lineage log."""

    db_url: str
    target: registry.Target
    events_path: Path | None

    @property
    def output(self) -> str:
        """The dataset root, the results table or the Delta table URI."""
        return self.target.where


def resolve(config: cfg.PipelineConfig, db_url: str | None, output: str | None) -> Resolved:
    """Apply ``--db`` / ``--output`` overrides to the config's database and output location.

    The local lineage log sits beside a local output folder: ``<its parent>/lineage/events.jsonl``
    (``outputs/lineage/events.jsonl`` beside the config file for a table or an object-store
    URI; before, under the current folder, where ``batching lineage`` run elsewhere did not
    find it), unless the config names a path.

    Raises:
        ConfigError: an override is empty, or names no SQL table for a SQL sink.
    """
    for flag, value in (("--db", db_url), ("--output", output)):
        if value is not None and not value.strip():
            raise errors.ConfigError(f"{flag} is empty; give a value or leave the option out")
    target = output_target(config, output)
    folder = registry.kind_of(target).local_folder(target)
    events_dir = folder.parent if folder is not None else _sql_events_dir(config)
    events = lineage.events_path(
        config.lineage, base_dir=Path(config.base_dir), output_dir=events_dir
    )
    return Resolved(
        db_url or config.database.url,
        target,
        events if config.lineage.transport == "file" else None,
    )


def overlaps(folder: Path, other: Path) -> bool:
    """Whether ``folder`` is ``other``, lies in it or holds it (resolved paths)."""
    a, b = folder.expanduser().resolve(), other.expanduser().resolve()
    return a == b or b in a.parents or a in b.parents


def output_target(config: cfg.PipelineConfig, output: str | None) -> registry.Target:
    """The config's outputs, ``output`` (``--output``) overriding its location."""
    out = config.output
    if out.kind == "sql":
        table = output or out.table
        cfg.check_identifier(table, "--output (SQL table)")
        problem = cfg.reserved_table(table)
        if problem is not None:
            raise errors.ConfigError(f"--output {problem}")
        return registry.Target("sql", table, url=out.url)
    where = output or out.path
    if "://" not in where:  # a local folder: relative to the config's (--output: the cwd's)
        local = Path(where) if output else config.resolve(where) or Path(where)
        where = str(local.expanduser().resolve())
    return registry.Target(out.kind, where, storage_options=dict(out.storage_options))


def _sql_events_dir(config: cfg.PipelineConfig) -> Path:
    """Where the local lineage log of outputs without a local folder goes (a table, an
    object-store URI): beside the config file."""
    return (Path(config.base_dir) / "outputs").resolve()


def require_writable_folder(path: Path, what: str) -> None:
    """Create ``path`` (and its parents) if missing, and refuse it if that fails or it is not a
    folder: a bad ``--output`` is bad input, told before a run is on record.

    Raises:
        ConfigError: naming ``what``, the path and why.
    """
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise errors.ConfigError(
            f"{what} {path} cannot be created ({reason}); name a folder you can write to"
        ) from None


def checked(config: cfg.PipelineConfig, db_url: str | None, output: str | None) -> Resolved:
    """Where a run reads and writes (:func:`resolve`), refused as bad input before anything is
    on record: a SQLite file that does not exist, an output folder that cannot be created.

    Raises:
        ConfigError: naming the input and the fix.
    """
    res = resolve(config, db_url, output)
    database.require_database(res.db_url)
    folder = registry.kind_of(res.target).local_folder(res.target)
    if folder is not None:
        require_writable_folder(folder, "the output folder (output.path / --output)")
    return res


def open_queue(
    config: cfg.PipelineConfig,
    db_url: str,
    *,
    clock: Callable[[], float] = time.time,
    create: bool = False,
) -> q.SqlQueue:
    """The config's queue on ``db_url``, with its retry settings. A SQLite file must exist
    unless ``create`` (``queue.migrate()`` comes next): opening one would leave an empty file.

    Raises:
        ConfigError: the URL is malformed, or names a SQLite file that does not exist.
    """
    if not create:
        database.require_database(db_url)
    return q.SqlQueue(
        database.create_engine(db_url),
        config.queue.name,
        clock=clock,
        max_attempts=config.queue.max_attempts,
        backoff_base_s=config.queue.backoff_base_s,
        backoff_max_s=config.queue.backoff_max_s,
        fair_share=config.queue.fair_share,
        tenant_weights=config.queue.tenant_weights,
        max_tenant_wait_s=config.queue.max_tenant_wait_s,
    )


def open_sink(
    queue: q.SqlQueue, res: Resolved, *, scorer: bool = False, read_only: bool = False
) -> sinks.Sink:
    """The run's sink (``registry``), committing through ``queue``; ``scorer``: a scoring
    run's (the Parquet sink defers its ledger marks to the next commit); ``read_only``:
    reconcile's (it creates no folder or table until a repair writes)."""
    return registry.open_sink(queue, replace(res.target, scorer=scorer, read_only=read_only))


def load_profile(config: cfg.PipelineConfig) -> ServiceProfile | None:
    """The measured service profile named by the config, or None when it has none yet."""
    path = config.resolve(config.service_profile)
    if path is not None and path.is_dir():
        raise errors.ConfigError(
            f"service_profile {path} is a folder; name the profile's JSON file (written by "
            "`batching profile`)"
        )
    if path is None or not path.is_file():
        return None
    return ServiceProfile.load(path)


QUEUE_FIELDS: tuple[tuple[str, str], ...] = (
    ("item_key", "string"),
    ("queue", "string"),
    ("tenant", "string"),
    ("payload", "binary"),
    ("payload_format", "string"),
    ("cost", "integer"),
    ("state", "integer"),
)
"""The queue dataset's columns in lineage: its items, with their payloads (kept beside them,
in ``batching_payloads``)."""

_SAME = ("item_key", "queue", "tenant")  # output columns copied from the queue's


def datasets(
    config: cfg.PipelineConfig, res: Resolved, sink: sinks.Sink | None = None
) -> tuple[lineage.DatasetRef, lineage.DatasetRef]:
    """Lineage datasets: the queue table (input) and the run's outputs, named by their sink
    (with its schema and column lineage when the ``sink`` is open)."""
    ns, name = naming.sql_dataset_id(res.db_url, "batching_items")
    queue_ds = lineage.DatasetRef(ns, name, QUEUE_FIELDS)
    if sink is None:
        ns, name = registry.dataset_id(res.target, res.db_url)
        return queue_ds, lineage.DatasetRef(ns, name, ())
    described = sink.describe()
    fields = tuple((str(n), str(t)) for n, t in described["fields"])
    out = lineage.DatasetRef(described["namespace"], described["name"], fields)
    return queue_ds, column_lineage(queue_ds, out)


def column_lineage(queue_ds: lineage.DatasetRef, out: lineage.DatasetRef) -> lineage.DatasetRef:
    """``out`` with its column lineage from the queue: ``item_key``, ``queue``, ``tenant``
    copied (IDENTITY), ``output`` the model's forward pass over ``payload``; which items a run
    scores is decided by their ``state`` (a FILTER). The other columns (``scored_at``,
    ``run_id``, ``batch_id``, ``model_version``, ...) come from the run, not the queue."""

    def of(column: str, kind: str, subtype: str, text: str | None = None) -> lineage.InputColumn:
        return lineage.InputColumn(queue_ds.namespace, queue_ds.name, column, kind, subtype, text)

    names = {n for n, _ in out.fields}
    columns = [lineage.ColumnSource(c, (of(c, "DIRECT", "IDENTITY"),)) for c in _SAME if c in names]
    if "output" in names:
        model = of("payload", "DIRECT", "TRANSFORMATION", "the model's forward pass")
        columns.append(lineage.ColumnSource("output", (model,)))
    claimed = of("state", "INDIRECT", "FILTER", "items claimed ready, acked when committed")
    return replace(out, columns=tuple(columns), row_inputs=(claimed,))


def effective_config(
    config: cfg.PipelineConfig,
    res: Resolved,
    lineage_config: cfg.LineageConfig | None = None,
) -> cfg.PipelineConfig:
    """The settings a run uses, after every override: ``--db`` / ``$BATCHING_DB_URL`` as
    ``database.url``, ``--output`` as the resolved ``output.path`` (an absolute folder or a
    URI) or ``output.table``, and the lineage settings after the ``OPENLINEAGE_*``
    environment (``lineage_config``), with the file transport's resolved ``path``."""
    out = config.output
    out = out.model_copy(
        update={"table": res.output} if out.kind == "sql" else {"path": res.output}
    )
    lc = lineage_config or config.lineage
    if lc.transport == "file":
        lc = lc.model_copy(update={"path": str(_events_file(config, res, lc))})
    db_url = _absolute_sqlite(res.db_url)
    return config.model_copy(
        update={
            "database": config.database.model_copy(update={"url": db_url}),
            "output": out,
            "lineage": lc,
        }
    )


_RELATIVE_SQLITE = re.compile(r"^(sqlite(?:\+\w+)?:///)(?!/|file:|:memory:|\?|$)([^?]*)(.*)$", re.S)


def _absolute_sqlite(url: str) -> str:
    """A SQLite URL naming a relative file, made absolute against the working directory (as
    the run opens it, and as its lineage dataset is named); any other URL as it is."""
    match = _RELATIVE_SQLITE.match(url)
    if match is None:
        return url
    scheme, path, rest = match.groups()
    return f"{scheme}{os.path.abspath(path)}{rest}"


def _events_file(config: cfg.PipelineConfig, res: Resolved, lc: cfg.LineageConfig) -> Path:
    """The file transport's JSONL, as :func:`make_emitter`'s emitter resolves it."""
    out_dir = res.events_path.parent.parent if res.events_path else _sql_events_dir(config)
    return lineage.events_path(lc, base_dir=Path(config.base_dir), output_dir=out_dir).resolve()


def config_facet(
    config: cfg.PipelineConfig, res: Resolved, lineage_config: cfg.LineageConfig | None
) -> tuple[dict[str, Any], str]:
    """The effective settings (:func:`effective_config`) as the ``batching_config`` facet
    shows them (credentials masked, unset values left out), and the sha256 of exactly that
    (canonical JSON, keys sorted): anyone can check it against the facet."""
    shown = lineage.as_emitted(
        effective_config(config, res, lineage_config).model_dump(mode="json")
    )
    canonical = json.dumps(shown, sort_keys=True)
    return shown, hashlib.sha256(canonical.encode()).hexdigest()


def scoring_context(
    config: cfg.PipelineConfig,
    res: Resolved,
    run_id: str,
    *,
    sink: sinks.Sink | None = None,
    checksum: str | None = None,
    parent: tuple[str, str] | None = None,
    job_name: str | None = None,
    lineage_config: cfg.LineageConfig | None = None,
) -> lineage.RunContext:
    """The lineage run of a scoring run: queue in, outputs out, model, its effective settings
    (``lineage_config``: the lineage settings after the environment, as for
    :func:`make_emitter`) and their hashes.

    ``checksum`` is the loaded checkpoint's sha256; before it is loaded, the pinned one.
    ``job_name`` defaults to the config's name.
    """
    queue_ds, out_ds = datasets(config, res, sink)
    shown, shown_hash = config_facet(config, res, lineage_config)
    return lineage.RunContext(
        run_id=run_id,
        job_name=job_name or config.name,
        parent_run_id=parent[0] if parent else None,
        parent_job_name=parent[1] if parent else None,
        inputs=(queue_ds,),
        outputs=(out_ds,),
        model=lineage.ModelRef(
            config.model.name, config.model.version, checksum or config.model.sha256
        ),
        config=shown,
        config_hash=config.config_hash(),
        effective_config_hash=shown_hash,
    )


def make_emitter(
    config: cfg.PipelineConfig,
    res: Resolved,
    lineage_config: cfg.LineageConfig | None = None,
    *,
    engine: Engine | None = None,
) -> lineage.LineageEmitter:
    """The run's lineage emitter (``lineage_config`` overrides the config's); with the queue's
    ``engine``, events it cannot deliver wait in that database's spool (:func:`make_spool`),
    else they are dropped and counted.

    Raises:
        ConfigError: the lineage settings are invalid.
    """
    settings = lineage_config or config.lineage
    return lineage.LineageEmitter(
        settings,
        base_dir=Path(config.base_dir),
        producer=PRODUCER,
        output_dir=lineage_dir(config, res),
        spool=make_spool(engine, settings) if engine is not None else None,
    )


def lineage_dir(config: cfg.PipelineConfig, res: Resolved) -> Path:
    """The folder a file transport's events go under (``<output>/lineage/...``)."""
    return res.events_path.parent.parent if res.events_path else _sql_events_dir(config)


RESENT_OVER = ("http", "file")  # a re-send to the console or nowhere would lose the event


def make_spool(engine: Engine, settings: cfg.LineageConfig) -> spool.Spool | None:
    """The lineage spool in the queue's database, for an http or file transport (a console
    or ``none`` has nothing to re-send to); None also with ``spool_max_events: 0``."""
    if settings.transport not in RESENT_OVER or settings.spool_max_events == 0:
        return None
    return spool.Spool(
        engine, max_events=settings.spool_max_events, max_age_s=settings.spool_max_age_s
    )
