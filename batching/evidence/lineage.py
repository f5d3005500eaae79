"""OpenLineage events for scoring runs, and the transports that carry them.

The only module that imports ``openlineage``. Events are built in-process with the client's v2
API (``event_v2`` / ``facet_v2``) and handed straight to a transport built from
:class:`~batching.config.LineageConfig`; ``OpenLineageClient`` is not used, because it reads
environment variables, ``openlineage.yml`` and git metadata on its own. Edges apply the client's
conventions (``OPENLINEAGE_CONFIG``, ``openlineage.yml``, ``OPENLINEAGE_*``) with
:mod:`batching.evidence.ol_config`.

Lineage trouble never fails a run: every emit is guarded, logged as a warning and counted in
``LineageEmitter.failures``; after a failure, events are not sent for ``cooldown_s``, so a down
or silent backend costs one attempt (at most ``timeout_s * (retries + 1)``) per cooldown. An
event not sent goes to the spool in the queue's database (:mod:`batching.evidence.spool`), its
JSON serialised once, and is re-sent byte for byte by the next run or ``batching lineage
--flush`` (:class:`EventSender`); without a spool it is dropped. No credential reaches an event
or a log: URLs, settings and error texts pass through :func:`redact_url`, and http credentials
travel as session auth, never in the transport's URL.

Datasets are named by :mod:`batching.datasets` (the OpenLineage naming spec).

Why it stays one module: it is the only one that imports ``openlineage``; the facets, the
events built from them and the emitter that delivers them follow one spec version (2-0-2)
and change together.
"""

from __future__ import annotations

import http.client as http_client
import json
import logging
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol
from urllib.parse import unquote, urljoin, urlsplit, urlunsplit

import attr
import requests
from openlineage.client import constants as ol_constants
from openlineage.client.event_v2 import InputDataset, Job, OutputDataset, Run, RunEvent, RunState
from openlineage.client.facet_v2 import (
    DatasetFacet,
    InputDatasetFacet,
    JobFacet,
    OutputDatasetFacet,
    RunFacet,
    column_lineage_dataset,
    data_quality_assertions_dataset,
    dataset_version_dataset,
    error_message_run,
    input_statistics_input_dataset,
    job_type_job,
    output_statistics_output_dataset,
    parent_run,
    processing_engine_run,
    schema_dataset,
)
from openlineage.client.serde import Serde
from openlineage.client.transport import Transport
from openlineage.client.transport.console import ConsoleConfig, ConsoleTransport
from openlineage.client.transport.file import FileConfig, FileTransport
from openlineage.client.transport.http import (
    ApiKeyTokenProvider,
    HttpConfig,
    HttpTransport,
    TokenProvider,
)
from openlineage.client.transport.http_common import DEFAULT_RETRY_CONFIG
from openlineage.client.transport.noop import NoopConfig, NoopTransport
from openlineage.client.uuid import generate_new_uuid

import batching
from batching import config, errors, ports
from batching.redaction import redact_mapping, redact_url

logger = logging.getLogger(__name__)

PROJECT_URL = "https://github.com/batching/batching"
"""The project's home: the producer URI of its events, and where its facet schemas live."""
FACET_SCHEMA_VERSION = "1-0-0"
"""Version of this project's custom facet schemas (``spec/facets/<version>/`` in the repo)."""
FACET_SCHEMA_BASE = (
    f"{PROJECT_URL}/blob/v{batching.__version__}/spec/facets/{FACET_SCHEMA_VERSION}/"
)
"""Where the custom facet schemas are published: the files under ``spec/facets/`` at the
release tag of this version (``v<package version>``); :func:`custom_facet_schemas` are their
contents."""

_OL_CORE = "https://openlineage.io/spec/2-0-2/OpenLineage.json"
_MAX_TRACE_CHARS = 8000


def events_path(
    cfg: config.LineageConfig, *, base_dir: Path, output_dir: str | Path = "outputs"
) -> Path:
    """Return the JSONL file of the file transport.

    ``cfg.path``, else ``<output_dir>/lineage/events.jsonl``; a relative path is resolved against
    ``base_dir`` (the config file's folder).
    """
    path = Path(cfg.path) if cfg.path else Path(output_dir) / "lineage" / "events.jsonl"
    path = path.expanduser()
    return path if path.is_absolute() else Path(base_dir) / path


# ----------------------------------------------------------------------------- value types


@dataclass(frozen=True, slots=True)
class InputColumn:
    """A column of an input dataset another column (or the whole output) is derived from, and
    how: an OpenLineage transformation ``kind`` (``DIRECT`` | ``INDIRECT``) and ``subtype``
    (``IDENTITY``, ``TRANSFORMATION``, ``FILTER``, ...)."""

    namespace: str
    name: str
    field: str
    kind: str = "DIRECT"
    subtype: str = "IDENTITY"
    description: str | None = None


@dataclass(frozen=True, slots=True)
class ColumnSource:
    """Where the output column ``field`` comes from (the ``columnLineage`` facet)."""

    field: str
    inputs: tuple[InputColumn, ...]


@dataclass(frozen=True, slots=True)
class Assertion:
    """One data-quality check a run made of a dataset it read (``dataQualityAssertions``):
    ``success`` False when it found issues; ``actual`` / ``expected`` as strings."""

    assertion: str
    success: bool
    severity: str | None = None
    actual: str | None = None
    expected: str | None = None
    description: str | None = None


@dataclass(frozen=True, slots=True)
class DatasetRef:
    """A dataset a run reads or writes; ``fields``: ``(column, type)`` pairs for the schema facet.

    ``row_count`` / ``size_bytes`` (bytes) become ``inputStatistics`` or ``outputStatistics``;
    ``version`` the ``version`` facet; ``columns`` (each output column's inputs) and
    ``row_inputs`` (input columns that decide which rows, e.g. a filter) the ``columnLineage``
    facet; ``assertions`` (what a run checked of a dataset it read) ``dataQualityAssertions``.
    """

    namespace: str
    name: str
    fields: tuple[tuple[str, str], ...] = ()
    row_count: int | None = None
    size_bytes: int | None = None
    version: str | None = None
    columns: tuple[ColumnSource, ...] = ()
    row_inputs: tuple[InputColumn, ...] = ()
    assertions: tuple[Assertion, ...] = ()

    def with_stats(self, row_count: int | None, size_bytes: int | None = None) -> DatasetRef:
        """Return a copy carrying statistics (rows, bytes) for the COMPLETE event."""
        return replace(self, row_count=row_count, size_bytes=size_bytes)

    def with_version(self, version: str | None) -> DatasetRef:
        """Return a copy carrying the dataset's version after the run (COMPLETE / FAIL)."""
        return replace(self, version=version)

    def with_assertions(self, assertions: Sequence[Assertion]) -> DatasetRef:
        """Return a copy carrying the checks a run made of it (as it read it)."""
        return replace(self, assertions=tuple(assertions))


@dataclass(frozen=True, slots=True)
class ModelRef:
    """The pinned model a run scores with."""

    name: str
    version: str
    sha256: str | None = None
    versions: Mapping[str, int] | None = None  # a routed run: items committed by each version


@dataclass(frozen=True, slots=True)
class RunContext:
    """What every event of one run says about it.

    ``run_id`` is a UUID string: the Prefect flow-run (or task-run) id when there is one, else
    :func:`new_run_id`. ``job_name`` is the flow name, or ``flow.task`` for a task, which also sets
    ``parent_run_id`` / ``parent_job_name`` (namespace defaults to the job's). ``job_namespace``
    ``None`` means the emitter's ``LineageConfig.namespace``. ``config``: the settings the run
    used, after every override (its database, outputs and lineage as resolved), redacted before
    it is emitted; ``effective_config_hash`` is their sha256; ``config_hash`` the sha256 of the
    settings as loaded (the file and a flow's overrides), as the run ledger keeps it.
    """

    run_id: str
    job_name: str
    job_namespace: str | None = None
    job_type: str = "JOB"
    parent_run_id: str | None = None
    parent_job_name: str | None = None
    parent_job_namespace: str | None = None
    inputs: tuple[DatasetRef, ...] = ()
    outputs: tuple[DatasetRef, ...] = ()
    model: ModelRef | None = None
    config: Mapping[str, Any] | None = None
    config_hash: str | None = None
    effective_config_hash: str | None = None
    rollout: Mapping[str, Any] | None = None  # a route change (``batching_rollout``)
    replay: Mapping[str, Any] | None = None  # a replay of a past run (``batching_replay``)
    cost: Mapping[str, Any] | None = None  # device seconds, at the end (``batching_cost``)

    def __post_init__(self) -> None:
        _check_uuid("run_id", self.run_id)
        if (self.parent_run_id is None) != (self.parent_job_name is None):
            raise ValueError("parent_run_id and parent_job_name must be given together")
        if self.parent_run_id is not None:
            _check_uuid("parent_run_id", self.parent_run_id)
            if self.parent_run_id == self.run_id:  # Marquez would make the two one run
                raise ValueError(f"run {self.run_id} cannot be its own parent")


def _check_uuid(what: str, value: str) -> None:
    try:
        uuid.UUID(value)
    except (ValueError, TypeError, AttributeError):
        raise ValueError(
            f"{what} must be a UUID string (a Prefect run id), got {value!r}"
        ) from None


def new_run_id() -> str:
    """Return a fresh time-ordered run id (UUIDv7), for runs outside Prefect."""
    return str(generate_new_uuid())


# ----------------------------------------------------------------------------- custom facets


@attr.define
class BatchingModelRunFacet(RunFacet):
    """Custom run facet ``batching_model``: the model name, version and checkpoint sha256;
    in a rollout, the items each version committed (``versions``)."""

    name: str
    version: str
    sha256: str | None = attr.field(default=None)
    versions: dict[str, int] | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return f"{FACET_SCHEMA_BASE}BatchingModelRunFacet.json#/$defs/BatchingModelRunFacet"


@attr.define
class BatchingConfigRunFacet(RunFacet):
    """Custom run facet ``batching_config``: the settings the run used (after every override,
    redacted) and their sha256 (``effectiveConfigHash``), and the sha256 of the settings as
    loaded (``configHash``, the run ledger's ``config_hash``)."""

    # OpenLineage spells facet fields in camelCase
    configHash: str | None = attr.field(default=None)
    effectiveConfigHash: str | None = attr.field(default=None)
    config: dict[str, Any] | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return f"{FACET_SCHEMA_BASE}BatchingConfigRunFacet.json#/$defs/BatchingConfigRunFacet"


@attr.define
class BatchingRolloutRunFacet(RunFacet):
    """Custom run facet ``batching_rollout``: a change of a queue's model route (start,
    promote, rollback, auto-rollback): who, why, the route before and after."""

    action: str
    queue: str
    actor: str
    reason: str
    to: dict[str, Any]
    before: dict[str, Any] | None = attr.field(default=None)  # None: the queue had no route

    @staticmethod
    def _get_schema() -> str:
        return f"{FACET_SCHEMA_BASE}BatchingRolloutRunFacet.json#/$defs/BatchingRolloutRunFacet"


@attr.define
class BatchingReplayRunFacet(RunFacet):
    """Custom run facet ``batching_replay``: the run a replay scored again, and what it found
    (items identical to what that run committed, differing, skipped as purged since)."""

    originalRunId: str
    items: int = attr.field(default=0)
    identical: int = attr.field(default=0)
    differing: int = attr.field(default=0)
    skipped: int = attr.field(default=0)
    modelVersions: dict[str, int] | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return f"{FACET_SCHEMA_BASE}BatchingReplayRunFacet.json#/$defs/BatchingReplayRunFacet"


@attr.define
class BatchingCostRunFacet(RunFacet):
    """Custom run facet ``batching_cost``: the device seconds a scoring run used (forward time
    on its device, summed over its workers), by tenant (apportioned by their items' cost)
    and by model version."""

    deviceSeconds: float
    byTenant: dict[str, float] | None = attr.field(default=None)
    byModelVersion: dict[str, float] | None = attr.field(default=None)

    @staticmethod
    def _get_schema() -> str:
        return f"{FACET_SCHEMA_BASE}BatchingCostRunFacet.json#/$defs/BatchingCostRunFacet"


CUSTOM_FACETS: dict[str, type[RunFacet]] = {
    "batching_model": BatchingModelRunFacet,
    "batching_config": BatchingConfigRunFacet,
    "batching_rollout": BatchingRolloutRunFacet,
    "batching_replay": BatchingReplayRunFacet,
    "batching_cost": BatchingCostRunFacet,
}
"""Every custom facet, by the key it is emitted under."""


def _facet_schema(
    name: str, key: str, props: dict[str, Any], required: list[str], description: str
) -> dict[str, Any]:
    body = {
        "type": "object",
        "properties": props,
        "required": required,
        "additionalProperties": True,
    }
    return {
        "$schema": "https://json-schema.org/draft/2020-12/schema",
        "$id": f"{FACET_SCHEMA_BASE}{name}.json",
        "$defs": {
            name: {
                "description": description,
                "allOf": [{"$ref": f"{_OL_CORE}#/$defs/RunFacet"}, body],
                "type": "object",
            }
        },
        "type": "object",
        "properties": {key: {"$ref": f"#/$defs/{name}"}},
    }


def custom_facet_schemas() -> list[dict[str, Any]]:
    """JSON Schemas (draft 2020-12) of the custom facets, ``$id`` matching their ``_schemaURL``.

    The repository ships them as ``spec/facets/<FACET_SCHEMA_VERSION>/<Facet>.json``
    (:func:`write_custom_facet_schemas`); a test holds the files equal to these.
    """
    text = {"type": "string", "minLength": 1}
    sha = {"type": "string", "pattern": "^[0-9a-f]{64}$"}
    share = {"type": "number", "minimum": 0, "maximum": 100}
    count = {"type": "integer", "minimum": 0}
    seconds = {"type": "number", "minimum": 0}
    route = {
        "type": "object",
        "properties": {
            "stable": text,
            "candidate": {"type": ["string", "null"]},
            "percent": share,
            "shadow": share,
            "tenants": {"type": "array", "items": {"type": "string"}},
            "epoch": {"type": "integer", "minimum": 0},
            "since": {"type": "number"},
        },
        "required": ["stable"],
    }
    return [
        _facet_schema(
            "BatchingModelRunFacet",
            "batching_model",
            {
                "name": text | {"description": "the model's name (model.name)"},
                "version": text | {"description": "the model's version (model.version)"},
                "sha256": sha | {"description": "sha256 of the checkpoint the run loaded"},
                "versions": {
                    "type": "object",
                    "additionalProperties": {"type": "integer", "minimum": 0},
                    "description": (
                        "in a rollout (the queue's route split the items): the items each "
                        "model version committed in this run"
                    ),
                },
            },
            ["name", "version"],
            "The model a batching scoring run scored with.",
        ),
        _facet_schema(
            "BatchingConfigRunFacet",
            "batching_config",
            {
                "configHash": sha
                | {"description": "sha256 of the settings as loaded (file and flow overrides)"},
                "effectiveConfigHash": sha
                | {"description": "sha256 of `config` as emitted (canonical JSON, keys sorted)"},
                "config": {
                    "type": "object",
                    "description": (
                        "the settings the run used, after every override: database.url, "
                        "output and lineage as the run resolved them; credentials masked"
                    ),
                },
            },
            [],
            "The settings of a batching run, as it used them.",
        ),
        _facet_schema(
            "BatchingRolloutRunFacet",
            "batching_rollout",
            {
                "action": {"enum": ["rollout-start", "promote", "rollback", "auto-rollback"]},
                "queue": text | {"description": "the queue whose route changed"},
                "actor": text | {"description": "who changed it (a user, guard:...)"},
                "reason": text | {"description": "why, as recorded in the queue's audit"},
                "to": route | {"description": "the route after the change"},
                "before": {
                    "oneOf": [route, {"type": "null"}],
                    "description": "the route before it (null: the queue had none)",
                },
            },
            ["action", "queue", "actor", "reason", "to"],
            "A change of which model version scores a batching queue's items.",
        ),
        _facet_schema(
            "BatchingReplayRunFacet",
            "batching_replay",
            {
                "originalRunId": {"type": "string", "format": "uuid"}
                | {"description": "the scoring run replayed"},
                "items": count | {"description": "items scored again"},
                "identical": count | {"description": "of those, bit for bit as committed"},
                "differing": count | {"description": "of those, not (or failed now)"},
                "skipped": count | {"description": "committed by the run, purged since"},
                "modelVersions": {
                    "type": "object",
                    "additionalProperties": count,
                    "description": "items replayed by each model version",
                },
            },
            ["originalRunId"],
            "A replay of a batching scoring run: the same items, the same forward passes.",
        ),
        _facet_schema(
            "BatchingCostRunFacet",
            "batching_cost",
            {
                "deviceSeconds": seconds
                | {"description": "forward seconds on the run's devices, summed"},
                "byTenant": {
                    "type": "object",
                    "additionalProperties": seconds,
                    "description": "of those, each tenant's, shared by its items' cost",
                },
                "byModelVersion": {
                    "type": "object",
                    "additionalProperties": seconds,
                    "description": "of those, each model version's",
                },
            },
            ["deviceSeconds"],
            "What a batching scoring run used of its devices, and for whom.",
        ),
    ]


def as_emitted(settings: Mapping[str, Any]) -> dict[str, Any]:
    """``settings`` as an event carries them: credentials masked (:func:`redact_mapping`),
    ``None`` values left out (as the client's serializer does)."""
    shown: dict[str, Any] = Serde.remove_nulls_and_enums(redact_mapping(settings))
    return shown


def write_custom_facet_schemas(folder: Path) -> list[Path]:
    """Write :func:`custom_facet_schemas` to ``folder`` (``spec/facets/<version>/`` in the
    repository), one ``<Facet>.json`` each; returns the files written."""
    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for schema in custom_facet_schemas():
        path = folder / schema["$id"].rsplit("/", 1)[-1]
        path.write_text(json.dumps(schema, indent=2) + "\n", encoding="utf-8")
        written.append(path)
    return written


# ----------------------------------------------------------------------------- events


def build_event(
    state: RunState,
    run: RunContext,
    *,
    producer: str,
    namespace: str,
    event_time: str,
    outputs: Sequence[DatasetRef] | None = None,
    error: BaseException | None = None,
) -> RunEvent:
    """Build one v2 ``RunEvent`` (pure; no I/O). ``outputs`` replaces ``run.outputs`` if given."""
    job_namespace = run.job_namespace or namespace
    return RunEvent(
        eventType=state,
        eventTime=event_time,
        producer=producer,
        run=Run(runId=run.run_id, facets=_run_facets(run, producer, job_namespace, error)),
        job=Job(namespace=job_namespace, name=run.job_name, facets=_job_facets(run, producer)),
        inputs=[_input(ref, producer) for ref in run.inputs],
        outputs=[_output(ref, producer) for ref in (run.outputs if outputs is None else outputs)],
    )


def _run_facets(
    run: RunContext, producer: str, job_namespace: str, error: BaseException | None
) -> dict[str, RunFacet]:
    facets: dict[str, RunFacet] = {
        "processing_engine": processing_engine_run.ProcessingEngineRunFacet(
            version=batching.__version__,
            name="batching",
            openlineageAdapterVersion=ol_constants.__version__,
            producer=producer,
        )
    }
    if run.parent_run_id is not None and run.parent_job_name is not None:
        facets["parent"] = parent_run.ParentRunFacet(
            run=parent_run.Run(runId=run.parent_run_id),
            job=parent_run.Job(
                namespace=run.parent_job_namespace or job_namespace, name=run.parent_job_name
            ),
            producer=producer,
        )
    if run.model is not None:
        m = run.model
        facets["batching_model"] = BatchingModelRunFacet(
            name=m.name,
            version=m.version,
            sha256=m.sha256,
            versions=None if m.versions is None else dict(m.versions),
            producer=producer,
        )
    if run.config is not None or run.config_hash is not None:
        cfg = redact_mapping(run.config) if run.config is not None else None
        facets["batching_config"] = BatchingConfigRunFacet(
            configHash=run.config_hash,
            effectiveConfigHash=run.effective_config_hash,
            config=cfg,
            producer=producer,
        )
    if run.rollout is not None:
        facets["batching_rollout"] = BatchingRolloutRunFacet(producer=producer, **run.rollout)
    if run.replay is not None:
        facets["batching_replay"] = BatchingReplayRunFacet(producer=producer, **run.replay)
    if run.cost is not None:
        facets["batching_cost"] = BatchingCostRunFacet(producer=producer, **run.cost)
    if error is not None:
        facets["errorMessage"] = _error_facet(error, producer)
    return facets


def _error_facet(error: BaseException, producer: str) -> error_message_run.ErrorMessageRunFacet:
    trace = "".join(traceback.format_exception(error))[-_MAX_TRACE_CHARS:]
    return error_message_run.ErrorMessageRunFacet(
        message=redact_url(f"{type(error).__name__}: {error}"),
        programmingLanguage="python",
        stackTrace=redact_url(trace),
        producer=producer,
    )


def _job_facets(run: RunContext, producer: str) -> dict[str, JobFacet]:
    job_type = job_type_job.JobTypeJobFacet(
        processingType="BATCH", integration="BATCHING", jobType=run.job_type, producer=producer
    )
    return {"jobType": job_type}


def _dataset_facets(ref: DatasetRef, producer: str) -> dict[str, DatasetFacet]:
    facets: dict[str, DatasetFacet] = {}
    if ref.fields:
        fields = [schema_dataset.SchemaDatasetFacetFields(name=n, type=t) for n, t in ref.fields]
        facets["schema"] = schema_dataset.SchemaDatasetFacet(fields=fields, producer=producer)
    if ref.version is not None:
        facets["version"] = dataset_version_dataset.DatasetVersionDatasetFacet(
            datasetVersion=ref.version, producer=producer
        )
    if ref.columns:
        cl = column_lineage_dataset
        facets["columnLineage"] = cl.ColumnLineageDatasetFacet(
            fields={
                c.field: cl.Fields(inputFields=[_input_field(i) for i in c.inputs])
                for c in ref.columns
            },
            dataset=[_input_field(i) for i in ref.row_inputs],
            producer=producer,
        )
    return facets


def _input_field(column: InputColumn) -> column_lineage_dataset.InputField:
    how = column_lineage_dataset.Transformation(
        type=column.kind, subtype=column.subtype, description=column.description
    )
    return column_lineage_dataset.InputField(
        namespace=column.namespace, name=column.name, field=column.field, transformations=[how]
    )


def _assertions_facet(
    ref: DatasetRef, producer: str
) -> data_quality_assertions_dataset.DataQualityAssertionsDatasetFacet:
    dq = data_quality_assertions_dataset
    found = [
        dq.Assertion(
            assertion=a.assertion,
            success=a.success,
            severity=a.severity,
            actual=a.actual,
            expected=a.expected,
            description=a.description,
            params=None,
        )
        for a in ref.assertions
    ]
    return dq.DataQualityAssertionsDatasetFacet(assertions=found, producer=producer)


def _has_stats(ref: DatasetRef) -> bool:
    return ref.row_count is not None or ref.size_bytes is not None


def _input(ref: DatasetRef, producer: str) -> InputDataset:
    facets: dict[str, InputDatasetFacet] = {}
    if _has_stats(ref):
        facets["inputStatistics"] = input_statistics_input_dataset.InputStatisticsInputDatasetFacet(
            rowCount=ref.row_count, size=ref.size_bytes, producer=producer
        )
    if ref.assertions:
        facets["dataQualityAssertions"] = _assertions_facet(ref, producer)
    return InputDataset(
        namespace=ref.namespace,
        name=ref.name,
        facets=_dataset_facets(ref, producer),
        inputFacets=facets,
    )


def _output(ref: DatasetRef, producer: str) -> OutputDataset:
    facets: dict[str, OutputDatasetFacet] = {}
    if _has_stats(ref):
        facets["outputStatistics"] = (
            output_statistics_output_dataset.OutputStatisticsOutputDatasetFacet(
                rowCount=ref.row_count, size=ref.size_bytes, producer=producer
            )
        )
    return OutputDataset(
        namespace=ref.namespace,
        name=ref.name,
        facets=_dataset_facets(ref, producer),
        outputFacets=facets,
    )


# ----------------------------------------------------------------------------- transports


def make_transport(cfg: config.LineageConfig, path: Path) -> Transport:
    """Build the transport ``cfg`` names; ``path`` is the file transport's JSONL file.

    The http, file and console transports also send an event already serialised
    (``emit_json``: a spooled event, byte for byte).

    Raises:
        ConfigError: the http url is not a valid URL.
    """
    if cfg.transport == "file":
        return _RawFileTransport(FileConfig(log_file_path=str(path), append=True))
    if cfg.transport == "http":
        return _http_transport(cfg)
    if cfg.transport == "console":
        return _RawConsoleTransport(ConsoleConfig())
    return NoopTransport(NoopConfig())


class _RawHttpTransport(HttpTransport):
    """The client's http transport, sending the event's JSON as given: ``emit`` serialises
    once (``Serde.to_json``) and hands the text to ``emit_json``, which a re-send calls with
    the stored text. Same URL, endpoint, headers, auth, timeout and session as ``emit``."""

    def emit(self, event: Any) -> Any:
        return self.emit_json(Serde.to_json(event))

    def emit_json(self, body: str) -> Any:
        # As HttpTransport.emit: a debuglevel set elsewhere would print the auth header.
        before = http_client.HTTPConnection.debuglevel
        http_client.HTTPConnection.debuglevel = 0
        try:
            data, headers = self._prepare_request(body)
            response = self.session.post(
                url=urljoin(self.url, self.endpoint),
                data=data,
                headers=headers,
                timeout=self.timeout,
                verify=self.verify,
            )
            response.close()
            response.raise_for_status()
            return response
        finally:
            http_client.HTTPConnection.debuglevel = before


class _RawFileTransport(FileTransport):
    """The client's file transport (append mode), writing the event's JSON as given."""

    def emit(self, event: Any) -> None:
        self.emit_json(Serde.to_json(event))

    def emit_json(self, body: str) -> None:
        path = self.config.log_file_path
        try:
            with open(path, "a", encoding="utf-8") as f:
                f.write(body + "\n")
        except OSError as exc:  # a full disk, a folder gone read-only: spooled by the emitter
            raise RuntimeError(f"Failed to write to log file `{path}`: {exc}") from exc


class _RawConsoleTransport(ConsoleTransport):
    """The client's console transport (its logger, at INFO), writing the JSON as given."""

    def emit(self, event: Any) -> None:
        self.emit_json(Serde.to_json(event))

    def emit_json(self, body: str) -> None:
        logging.getLogger(ConsoleTransport.__module__).info(body)


_RAW = (_RawHttpTransport, _RawFileTransport, _RawConsoleTransport)


def _http_transport(cfg: config.LineageConfig) -> HttpTransport:
    url, credentials = _split_credentials(cfg.url or "")
    session = requests.Session()
    session.trust_env = False  # no proxy / netrc from the environment: the library reads none
    session.auth = credentials  # kept out of the URL, which the client logs at DEBUG
    n = cfg.retries
    retry = {"total": n, "connect": n, "read": n, "status": n, "backoff_factor": 0.1}
    # A backend's Retry-After (urllib3 honours up to 6 h) must not hold a run.
    retry["respect_retry_after_header"] = False
    key = cfg.api_key.get_secret_value() if cfg.api_key else None
    http_cfg = HttpConfig(
        url=url.rstrip("/") + "/",  # keep a base path: urljoin drops a last segment
        endpoint=cfg.endpoint.lstrip("/"),
        timeout=cfg.timeout_s,
        auth=ApiKeyTokenProvider({"apiKey": key}) if key else TokenProvider({}),
        session=session,
        retry={**DEFAULT_RETRY_CONFIG, **retry},
    )
    try:
        return _RawHttpTransport(http_cfg)
    except ValueError:
        raise errors.ConfigError(
            f"lineage url {redact_url(cfg.url or '')!r} is not a URL like http://marquez:5000"
        ) from None


def _split_credentials(url: str) -> tuple[str, tuple[str, str] | None]:
    parts = urlsplit(url)
    if parts.username is None:
        return url, None
    host = parts.netloc.rpartition("@")[2]
    plain = urlunsplit(parts._replace(netloc=host))
    return plain, (unquote(parts.username), unquote(parts.password or ""))


def _send_deadline_s(cfg: config.LineageConfig) -> float | None:
    """How long one HTTP send may take, retries included; the socket timeout alone does not
    bound a server that answers a byte at a time. ``None``: not bounded (file, console)."""
    return (cfg.timeout_s + 0.5) * (cfg.retries + 1) if cfg.transport == "http" else None


class _Bounded:
    """Runs one send at a time, given up after ``deadline_s``: the send goes on in the
    background, and until it ends every further send is refused rather than run beside it."""

    def __init__(self, deadline_s: float | None) -> None:
        self.deadline_s = deadline_s
        self._in_flight: threading.Thread | None = None

    def run(self, send: Callable[[], object]) -> None:
        """Run ``send``; raise what it raised, or ``TimeoutError`` past the deadline."""
        if self.deadline_s is None:
            send()
            return
        if self._in_flight is not None and self._in_flight.is_alive():
            raise TimeoutError("an earlier lineage event is still being sent")
        failed: list[BaseException] = []

        def guarded() -> None:
            try:
                send()
            except BaseException as exc:
                failed.append(exc)

        sender = threading.Thread(target=guarded, name="lineage-send", daemon=True)
        sender.start()
        sender.join(self.deadline_s)
        if sender.is_alive():
            self._in_flight = sender
            raise TimeoutError(f"no answer within {self.deadline_s:g}s")
        if failed:
            raise failed[0]


class EventSender:
    """Sends spooled events (their stored JSON, byte for byte) where ``cfg`` says lineage goes
    now, each send bounded like the emitter's (:attr:`deadline_s`).

    Raises:
        ConfigError: at construction, when the http url is invalid.
    """

    def __init__(
        self, cfg: config.LineageConfig, *, base_dir: Path, output_dir: str | Path = "outputs"
    ) -> None:
        self.config = cfg
        self._path = events_path(cfg, base_dir=base_dir, output_dir=output_dir)
        self._transport = make_transport(cfg, self._path)
        self._bounded = _Bounded(_send_deadline_s(cfg))

    @property
    def deadline_s(self) -> float:
        """The longest one send takes (a file write: a few seconds, say)."""
        return self._bounded.deadline_s or 5.0

    def send(self, body: str) -> None:
        """Deliver one stored event, or raise why not."""
        transport = self._transport
        if not isinstance(transport, _RAW):
            raise errors.ConfigError("lineage transport none sends nothing; spooled events wait")
        if isinstance(transport, _RawFileTransport):
            self._path.parent.mkdir(parents=True, exist_ok=True)
        self._bounded.run(lambda: transport.emit_json(body))

    def close(self) -> None:
        """Release the transport (the http session); never raises."""
        _close(self._transport)


def _close(transport: Transport) -> None:
    try:
        transport.close(0)
    except Exception:  # lineage never fails a run
        logger.warning("lineage close failed", extra={"action": "lineage_close_failed"})


class EventSpool(Protocol):
    """Where the emitter keeps the events it could not deliver (:class:`batching.evidence.spool.Spool`)."""

    def add(
        self, run_id: str, event_type: str, event_time: str, body: str, error: str | None = None
    ) -> None: ...

    def pending(self, run_id: str) -> bool: ...


class LineageEmitter:
    """Emits START / COMPLETE / FAIL events for runs; never raises into the caller.

    Args:
        cfg: transport, file path, http url/endpoint, timeout_s, retries, job namespace.
        base_dir: folder that relative paths in ``cfg`` are resolved against.
        producer: URI of the producing code, e.g. ``https://github.com/acme/batching/tree/0.1.0``.
        output_dir: the outputs folder; default file path is ``<output_dir>/lineage/events.jsonl``.
        transport: an OpenLineage transport to use instead of the one ``cfg`` names (tests).
        clock: epoch seconds, for event times and the cooldown.
        cooldown_s: after a failed emit, further events are not sent (spooled, or dropped and
            counted without a spool) this long.
        spool: where undelivered events wait for a re-send (settable later: ``emitter.spool``);
            without one they are dropped and counted. A run's event waits there too while
            earlier events of the run do, so that each run's events arrive in order.

    Attributes:
        failures: events not delivered now (failed, in a cooldown, or behind spooled ones).
        spooled: of those, the events kept in the spool for a re-send.
        emitted: events delivered to the transport.
        events_path: the JSONL file when the transport is ``file``, else ``None``.

    Raises:
        ConfigError: at construction, when the http url is invalid.
    """

    def __init__(
        self,
        cfg: config.LineageConfig,
        *,
        base_dir: Path,
        producer: str,
        output_dir: str | Path = "outputs",
        transport: Transport | None = None,
        clock: ports.Clock = time.time,
        cooldown_s: float = 30.0,
        spool: EventSpool | None = None,
    ) -> None:
        self.config = cfg
        self.producer = producer
        self.failures = 0
        self.spooled = 0
        self.emitted = 0
        self.spool = spool
        file_path = events_path(cfg, base_dir=base_dir, output_dir=output_dir)
        self.events_path = file_path if cfg.transport == "file" and transport is None else None
        self._transport = transport if transport is not None else make_transport(cfg, file_path)
        self._clock = clock
        self._cooldown_s = cooldown_s
        self._resume_at = float("-inf")
        self._lock = threading.Lock()
        self._bounded = _Bounded(_send_deadline_s(cfg) if transport is None else None)

    @property
    def lost(self) -> int:
        """Events neither delivered nor spooled."""
        return self.failures - self.spooled

    def start(self, run: RunContext) -> bool:
        """Emit START; returns whether the event was delivered."""
        return self._emit(RunState.START, run, None, None)

    def running(self, run: RunContext, error: BaseException | None = None) -> bool:
        """Emit RUNNING: a retry resumes the run, or (with ``error``, as an ``errorMessage``
        facet) an attempt failed and the run will be retried."""
        return self._emit(RunState.RUNNING, run, None, error)

    def complete(self, run: RunContext, outputs: Sequence[DatasetRef] | None = None) -> bool:
        """Emit COMPLETE; ``outputs`` (with statistics) replace ``run.outputs`` if given."""
        return self._emit(RunState.COMPLETE, run, outputs, None)

    def fail(
        self, run: RunContext, error: BaseException, outputs: Sequence[DatasetRef] | None = None
    ) -> bool:
        """Emit FAIL with an ``errorMessage`` facet (redacted message and stack trace)."""
        return self._emit(RunState.FAIL, run, outputs, error)

    def close(self) -> None:
        """Release the transport (the http session); never raises."""
        _close(self._transport)

    def _emit(
        self,
        state: RunState,
        run: RunContext,
        outputs: Sequence[DatasetRef] | None,
        error: BaseException | None,
    ) -> bool:
        if isinstance(self._transport, NoopTransport):
            return False
        with self._lock:
            now = self._clock()
            try:
                event = build_event(
                    state,
                    run,
                    producer=self.producer,
                    namespace=self.config.namespace,
                    event_time=datetime.fromtimestamp(now, tz=UTC).isoformat(),
                    outputs=outputs,
                    error=error,
                )
                body = Serde.to_json(event)  # once: a re-send from the spool is these bytes
            except Exception as exc:  # lineage never fails a run
                self._count_failure("lineage emit failed", "lineage_emit_failed", state, run, exc)
                return False
            undelivered = _Undelivered(state, run, event.eventTime, body)
            if self._behind_spooled(run):
                self._not_sent(undelivered, "lineage event dropped", "lineage_emit_skipped")
                return False
            if now < self._resume_at:
                self._not_sent(undelivered, "lineage event dropped", "lineage_emit_skipped")
                return False
            try:
                self._deliver(event, body)
            except Exception as exc:  # lineage never fails a run
                self._resume_at = self._clock() + self._cooldown_s
                self._not_sent(undelivered, "lineage emit failed", "lineage_emit_failed", exc)
                return False
            self.emitted += 1
            return True

    def _behind_spooled(self, run: RunContext) -> bool:
        """Whether earlier events of ``run`` wait in the spool (this one must wait behind)."""
        if self.spool is None:
            return False
        try:
            return self.spool.pending(run.run_id)
        except Exception as exc:  # the database's trouble (the run's to report): send it
            logger.info(
                "lineage spool not readable",
                extra={"action": "lineage_spool_failed", "error": redact_url(str(exc))[:500]},
            )
            return False

    def _deliver(self, event: RunEvent, body: str) -> None:
        """Hand the event to the transport (its JSON ``body`` where the transport takes it);
        over HTTP, given up after the deadline (see :class:`_Bounded`)."""
        transport = self._transport
        if self.events_path is not None:
            self.events_path.parent.mkdir(parents=True, exist_ok=True)
        if isinstance(transport, _RAW):
            self._bounded.run(lambda: transport.emit_json(body))
        else:
            self._bounded.run(lambda: transport.emit(event))

    def _not_sent(
        self, what: _Undelivered, message: str, action: str, exc: Exception | None = None
    ) -> None:
        """Spool an event that was not sent; without a spool (or when it fails) count it lost."""
        if self.spool is None:
            self._count_failure(message, action, what.state, what.run, exc)
            return
        error = None if exc is None else f"{type(exc).__name__}: {redact_url(str(exc))}"
        try:
            self.spool.add(what.run.run_id, what.state.value, what.event_time, what.body, error)
        except Exception as spool_exc:  # lineage never fails a run: this one is lost
            logger.warning(
                "lineage spool not writable",
                extra={"action": "lineage_spool_failed", "error": redact_url(str(spool_exc))},
            )
            self._count_failure(message, action, what.state, what.run, exc)
            return
        self.spooled += 1
        self._count_failure(
            "lineage event spooled", "lineage_event_spooled", what.state, what.run, exc
        )

    def _count_failure(
        self,
        message: str,
        action: str,
        state: RunState,
        run: RunContext,
        exc: Exception | None = None,
    ) -> None:
        self.failures += 1
        extra: dict[str, Any] = {
            "action": action,
            "event_type": state.value,
            "run_id": run.run_id,
            "lineage_transport": self.config.transport,
            "failures": self.failures,
        }
        if exc is not None:
            extra |= {"error_type": type(exc).__name__, "error": redact_url(str(exc))[:500]}
        logger.warning(message, extra=extra)


@dataclass(frozen=True, slots=True)
class _Undelivered:
    """An event the emitter did not send: what the spool keeps of it."""

    state: RunState
    run: RunContext
    event_time: str
    body: str


# ----------------------------------------------------------------------------- environment


def config_from_env(env: Mapping[str, str], base: config.LineageConfig) -> config.LineageConfig:
    """Return ``base`` overridden by OpenLineage's environment variables alone (no
    ``openlineage.yml``); the edges use :func:`batching.evidence.ol_config.lineage_config`,
    which reads the client's config file too.

    Raises:
        ConfigError: a value is invalid (message names the setting; URLs are redacted).
    """
    from batching.evidence import ol_config

    return ol_config.resolve(base, env, files=False).config


__all__ = [
    "CUSTOM_FACETS",
    "FACET_SCHEMA_BASE",
    "FACET_SCHEMA_VERSION",
    "PROJECT_URL",
    "Assertion",
    "BatchingConfigRunFacet",
    "BatchingModelRunFacet",
    "ColumnSource",
    "DatasetRef",
    "EventSender",
    "EventSpool",
    "InputColumn",
    "LineageEmitter",
    "ModelRef",
    "RunContext",
    "RunState",
    "as_emitted",
    "build_event",
    "config_from_env",
    "custom_facet_schemas",
    "events_path",
    "make_transport",
    "new_run_id",
    "redact_mapping",
    "redact_url",
    "write_custom_facet_schemas",
]
