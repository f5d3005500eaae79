"""Pydantic models of every setting, composed into one ``PipelineConfig`` loaded from YAML.

Validation errors name the field and the fix. The library never reads environment variables:
the CLI and ``flows/`` turn env and flags into overrides passed to :func:`load_config`.

Why it stays one module: the sections are one pydantic model composed of the others, and the
loader's messages (an unknown setting's nearest known name, a key given twice, an empty
section) walk that composition; split by section, each would import the loader back.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import math
import re
import typing
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    SecretStr,
    ValidationError,
    field_validator,
    model_validator,
)

from batching import errors, naming
from batching.redaction import redact_mapping, redact_url

_IDENTIFIER = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")
QUEUE_TABLES = frozenset(
    {
        "batching_batches",
        "batching_items",
        "batching_items_archive",
        "batching_lineage_spool",
        "batching_meta",
        "batching_model_versions",
        "batching_outbox",
        "batching_payloads",
        "batching_queue_audit",
        "batching_queue_controls",
        "batching_ranges",
        "batching_runs",
        "batching_schema_version",
        "batching_sweeps",
    }
)
"""The queue's own tables (``store.schema``, less the results table): never an output."""
_SHA256 = re.compile(r"^[0-9a-f]{64}$")
_FACTORY = re.compile(r"^[A-Za-z_][\w.]*:[A-Za-z_]\w*$")
_DB_URL = re.compile(r"^(sqlite|postgres|postgresql)(\+\w+)?://")
_NAMESPACE = re.compile(r"^[a-zA-Z:;=/0-9_\-.@+]{1,1024}$")  # Marquez's NamespaceName

DEFAULT_DB_URL = "sqlite:///batching.db"
MAX_ITEM_BYTES = 64 * 2**20
"""The ceiling of ``model.max_item_bytes``: no item's payload is larger, whatever the config."""


def reserved_table(name: str) -> str | None:
    """Why ``name`` cannot be a results table (the queue's own tables; ``pg_`` and
    ``sqlite_`` names, the databases' own catalogs: ``pg_class`` passed every check and the
    run failed as a bug), or None."""
    if name.lower() in QUEUE_TABLES:
        return f"{name} is one of the queue's own tables; name another"
    if name.lower().startswith(("pg_", "sqlite_")):
        return f"{name}: names starting with pg_ or sqlite_ are the database's own; name another"
    return None


def check_identifier(value: str, what: str) -> str:
    """Return ``value`` if it is a safe SQL identifier, else raise ``ConfigError`` naming ``what``."""
    if not _IDENTIFIER.match(value):
        raise errors.ConfigError(
            f"{what} must be a SQL identifier (letters, digits, _; max 63 chars), got {value!r}"
        )
    return value


def _numeric(annotation: Any) -> bool:
    """Whether a field holds a number (``int``, ``float``, optionally None)."""
    args = typing.get_args(annotation) or (annotation,)
    return any(a in (int, float) for a in args) and bool not in args


class _Model(BaseModel):
    # Infinity and NaN are no setting's value (`.inf` would pass every "at most" check).
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _no_booleans_for_numbers(cls, data: Any) -> Any:
        """YAML's ``true`` would otherwise pass as 1 for a number."""
        if isinstance(data, dict):
            for name, value in data.items():
                field = cls.model_fields.get(name)
                if isinstance(value, bool) and field is not None and _numeric(field.annotation):
                    raise ValueError(f"{name} must be a number, got {str(value).lower()}")
        return data


class DatabaseConfig(_Model):
    """Where the queue table lives."""

    url: str = Field(
        DEFAULT_DB_URL,
        description="the queue's database: `sqlite:///FILE` or `postgresql://USER@HOST:PORT/DB` (`--db` and `$BATCHING_DB_URL` override it); a password is never printed",
    )

    @field_validator("url")
    @classmethod
    def _supported(cls, value: str) -> str:
        if not _DB_URL.match(value):
            raise ValueError(
                f"must be sqlite:///FILE or postgresql://USER@HOST:PORT/DB, got {redact_url(value)!r}"
            )
        return value


class QueueConfig(_Model):
    """Which items a scorer claims and how long it holds them."""

    name: str = Field(
        "default",
        min_length=1,
        max_length=200,
        description="the queue to claim from (one table holds many queues)",
    )
    lane: str | None = Field(
        None,
        description="claim only items of this lane (model routing); none: every lane",
    )
    lease_s: float = Field(
        60.0,
        gt=0,
        le=604_800,  # a week
        description="how long a claim holds its items; heartbeats extend it while the scorer lives",
    )
    heartbeat_s: float | None = Field(
        None,
        gt=0,
        le=604_800,
        description="how often leases are extended; at most `lease_s / 3` (none: `lease_s / 3`)",
    )
    forward_timeout_s: float = Field(
        300.0,
        gt=0,
        le=604_800,
        description="the longest one forward pass may run (checked each heartbeat): past it the scorer stops extending the batch's lease, asks the model to score its own probe input, and stops the run; a model that passes the probe hung on the batch's inputs (several items: the crash rule finds which; one item scored alone: it fails, charged); one that fails it is at fault (its items go back unused and, with `breaker.pause_queue`, the queue is paused; a rollout candidate's fail, charged to it). Restart the scorer: a pass hung in native code runs on until its process ends",
    )
    max_attempts: int = Field(
        5,
        ge=1,
        le=1000,
        description="attempts before an item is dead; set on each item when it is enqueued (`batching enqueue --max-attempts`)",
    )
    backoff_base_s: float = Field(
        1.0,
        ge=0,
        le=86_400,
        description="retry delay after a failure: `min(backoff_max_s, backoff_base_s * 2^(n-1))`, times a jitter in [0.5, 1]",
    )
    backoff_max_s: float = Field(
        600.0,
        ge=0,
        le=604_800,
        description="the cap on every retry delay",
    )
    poll_s: float = Field(
        0.05,
        gt=0,
        le=3600,
        description="how often an idle scorer looks for work when nothing wakes it (a NOTIFY on "
        "PostgreSQL, a data_version change on SQLite)",
    )
    idle_poll_max_s: float = Field(
        1.0,
        gt=0,
        le=3600,
        description="an idle scorer polls less often the longer it finds nothing, up to this: new items still wake it at once; what only time makes ready (a retry's backoff, an expired lease, a resumed queue) waits up to this long",
    )
    late_policy: Literal["score", "expire"] = Field(
        "score",
        description="a claimed item predicted to miss its `deadline_at` when its batch is cut: `score` it anyway (late), or `expire` it unscored with a reason naming its deadline and the prediction (counted)",
    )
    default_deadline_s: float | None = Field(
        None,
        gt=0,
        description="with `late_policy: expire`, an item enqueued without a `deadline_at` is due this many seconds after its enqueue (as Triton's default queue timeout): on an online queue set it to `latency_slo_s`, and under overload an item that would commit past the objective is expired unscored with its reason, not scored late; none: only items with a deadline of their own can be late",
    )
    fair_share: bool = Field(
        True,
        description="each claim, and then each batch cut from what was claimed, splits across the tenants by weight (`tenant_weights`), priority and deadline order kept within a tenant, so one tenant's flood cannot starve another; with `batching.adaptive`, a tenant sending a quarter or less of the heaviest tenant's rate (items over weight) goes first, its items riding in the next pass, while such tenants together send at most a third of the items; false: one order across tenants (priority, deadline, age)",
    )
    tenant_weights: dict[str, float] = Field(
        default_factory=dict,
        description="a tenant's share of each claim and batch relative to the others' (1.0 when unlisted), e.g. `{gold: 4, bulk: 0.5}`; with `fair_share`",
    )
    max_tenant_wait_s: float = Field(
        30.0,
        gt=0,
        description="aging: a tenant with ready items that a scorer has not served for this long gets its next item claimed (and batched) ahead of every share, so a low weight delays a tenant but never starves it",
    )

    @field_validator("tenant_weights", mode="before")
    @classmethod
    def _no_boolean_weights(cls, value: Any) -> Any:
        if isinstance(value, dict):
            for tenant, weight in value.items():
                if isinstance(weight, bool):
                    raise ValueError(
                        f"tenant_weights[{tenant!r}] must be a number (its share relative to "
                        f"the others'), got {str(weight).lower()}"
                    )
        return value

    @field_validator("tenant_weights")
    @classmethod
    def _positive_weights(cls, value: dict[str, float]) -> dict[str, float]:
        for tenant, weight in value.items():
            if not 1 <= len(tenant) <= 200:
                raise ValueError(
                    f"tenant_weights: a tenant name has 1 to 200 characters, got {tenant!r}"
                )
            if not (math.isfinite(weight) and 0 < weight <= 1e6):
                raise ValueError(
                    f"tenant_weights[{tenant!r}] must be > 0 and <= 1e6 (its share relative to "
                    f"the others'; leave it out for 1.0), got {weight!r}"
                )
        return value

    @model_validator(mode="after")
    def _heartbeat_below_lease(self) -> QueueConfig:
        if self.heartbeat_s is not None and self.heartbeat_s * 3 > self.lease_s:
            raise ValueError(
                f"heartbeat_s must be <= lease_s / 3 ({self.lease_s / 3:g}) so a live lease "
                f"never expires between heartbeats, got {self.heartbeat_s:g}"
            )
        if self.default_deadline_s is not None and self.late_policy != "expire":
            raise ValueError(
                "default_deadline_s takes effect only with late_policy: expire (an item "
                "scored anyway when late has no use for it); set late_policy: expire or "
                "remove default_deadline_s"
            )
        if self.backoff_base_s > self.backoff_max_s:
            raise ValueError(
                f"backoff_base_s ({self.backoff_base_s:g}) must be <= backoff_max_s "
                f"({self.backoff_max_s:g}), the cap on every retry delay"
            )
        return self

    @property
    def effective_heartbeat_s(self) -> float:
        """Heartbeat interval: the configured one, else a third of the lease."""
        return self.heartbeat_s if self.heartbeat_s is not None else self.lease_s / 3


class BreakerConfig(_Model):
    """The retry-storm breaker: when batch after batch fails in the model with no single poison
    item found, the run stops, gives its items back without using an attempt, pauses the queue
    and fails with ``RetryStorm`` (resume: `batching queue resume QUEUE --reason ...`)."""

    enabled: bool = Field(
        True,
        description="off: every failed batch uses its items' attempts, as before the breaker",
    )
    max_failed_batches: int = Field(
        3,
        ge=1,
        le=100,
        description="consecutive batches of two or more items in which every item failed in the forward pass that stop the run; their failures are held (items still leased) until a batch scores",
    )
    pause_queue: bool = Field(
        True,
        description="on a trip, pause the queue, so every scorer of it stops claiming",
    )


class ModelSpec(_Model):
    """A pinned model: built-in name or factory, checkpoint file and its mandatory sha256."""

    name: str = Field(
        ...,
        min_length=1,
        description="`w1-mlp`, `w2-text` (built in) or `package.module:factory` returning a `torch.nn.Module`",
    )
    version: str = Field(
        ...,
        min_length=1,
        max_length=100,
        description="recorded with every output (its key, its partition, its lineage)",
    )
    checkpoint: str | None = Field(
        None,
        min_length=1,
        description="`.safetensors` or a state dict read with `weights_only=True` (none: the built-in model's own)",
    )
    sha256: str = Field(
        description="the checkpoint's digest (`sha256sum FILE`, quoted in YAML); another file is refused",
    )
    dtype: Literal["float32", "float16", "bfloat16"] = Field(
        "float32",
        description="the model's parameter dtype",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        "auto",
        description="`auto`: cuda when there is one, else cpu",
    )
    autocast: Literal["none", "bf16", "fp16"] = Field(
        "none",
        description="mixed precision on CUDA (ignored on cpu)",
    )
    # Bounds on one request. Without them a 60k-token item asked the GPU for 57.6 GB and a
    # 50 MB line held 9 GB of host memory, each retried max_attempts times. Enqueue refuses a
    # file holding an item past them (`batching enqueue --config`; without it, these
    # defaults); the runner fails such an item dead at decode, whatever enqueued it.
    max_item_tokens: int = Field(
        16384,
        ge=1,
        le=2**24,
        description="the most token ids in one item (a `tokens` list, an integer tensor); `batching enqueue` refuses a file with a longer item and the scorer fails one dead at once; `batching check` says how long an item the device can take, and fails a limit that lets in items missing `latency_slo_s` alone",
    )
    max_item_elements: int = Field(
        1_048_576,
        ge=1,
        le=2**28,
        description="the most numbers in one item's payload (`x`, `tokens`, a tensor's elements); checked like `max_item_tokens`",
    )
    max_item_bytes: int = Field(
        16 * 2**20,
        ge=1,
        le=MAX_ITEM_BYTES,
        description=f"the most bytes of one item's stored payload (compact JSON or tensor bytes), at most {MAX_ITEM_BYTES // 2**20} MiB; checked like `max_item_tokens`",
    )
    memory_budget_bytes: int | None = Field(
        None,
        ge=1,
        description="device memory one forward pass may use: a batch over it is split, an item over it alone is dead at once with its estimate (none: 90% of the GPU's memory left after the weights; unchecked on cpu)",
    )
    service_profile: str | None = Field(
        None,
        description="this version's measured service profile (`batching profile`); none: the config's `service_profile`",
    )

    @field_validator("sha256", mode="before")
    @classmethod
    def _quoted(cls, value: Any) -> Any:
        if isinstance(value, int | float):  # all digits: YAML read a number (and lost zeros)
            raise ValueError('sha256 must be a quoted string in YAML: sha256: "<64 hex digits>"')
        return value

    @field_validator("sha256")
    @classmethod
    def _sha(cls, value: str) -> str:
        value = value.lower()
        if not _SHA256.match(value):
            raise ValueError("sha256 must be 64 hex digits (run `sha256sum CHECKPOINT`)")
        return value

    @field_validator("name")
    @classmethod
    def _name(cls, value: str) -> str:
        if ":" in value and not _FACTORY.match(value):
            raise ValueError(f"factory must look like package.module:function, got {value!r}")
        return value


class RolloutConfig(_Model):
    """Rollouts (`batching rollout`): when the guard (`batching rollout guard`, the
    `rollout-guard` deployment) rolls a candidate back, judged on the items scored or failed
    since the rollout began; and where shadow outputs go."""

    shadow_path: str | None = Field(
        None,
        min_length=1,
        description="a folder (relative to this file's) for the shadow outputs of `rollout start --shadow`: a Parquet dataset of each shadowed item's stable and candidate output, never published, so outside the output dataset (`batching check` fails one in it; none: `shadow/` beside a local output folder, else `outputs/shadow` beside this file)",
    )

    min_items: int = Field(
        50,
        ge=1,
        description="judge nothing before the candidate has scored or failed this many items",
    )
    max_error_rate: float = Field(
        0.05,
        ge=0,
        le=1,
        description="roll back when more than this fraction of the candidate's items failed in its forward pass",
    )
    max_p99_ratio: float = Field(
        1.5,
        gt=0,
        description="roll back when the candidate's p99 latency (enqueue to commit) exceeds the stable version's by this factor",
    )
    max_p99_s: float | None = Field(
        None,
        gt=0,
        description="... or exceeds this many seconds (none: no bound of its own; a backlog scored late makes every version's p99 long)",
    )


class BatchingPolicy(_Model):
    """When a micro-batch is released, and how items are grouped."""

    max_batch_size: int = Field(
        64,
        ge=1,
        le=65536,
        description="release a micro-batch at this many items",
    )
    max_batch_cost: int | None = Field(
        None,
        ge=1,
        le=2**31 - 1,
        description="release at this total cost (e.g. tokens; an item's `cost`); none: no cost cap",
    )
    max_wait_s: float = Field(
        0.01,
        ge=0,
        description="release when the oldest item has waited this long since it was enqueued; must be below `latency_slo_s`; not used with `adaptive` (it goes at once at a free model)",
    )
    length_buckets: tuple[int, ...] = Field(
        (),
        description="strictly increasing cost edges; a batch never mixes buckets (less padding), except with `adaptive` where the model predicts one padded pass sooner for all",
    )
    claim_size: int | None = Field(
        None,
        ge=1,
        le=1_048_576,
        description="items per claim statement (none: `4 * max_batch_size`); a multiple of `max_batch_size` lets uniform tensor claims go whole batches at a time",
    )
    max_inflight_batches: int = Field(
        2,
        ge=1,
        le=64,
        description="scored batches that may wait for the commit stage (what one group commit can take)",
    )
    adaptive: bool = Field(
        False,
        description="SLO-adaptive release: go when the model frees up, never past the oldest item's `latency_slo_s` budget (predicted from forward times measured online, seeded by `service_profile`); `max_batch_size` stays an upper bound; other buckets' items join a batch where one padded pass is predicted sooner for all",
    )

    @field_validator("length_buckets")
    @classmethod
    def _sorted(cls, value: tuple[int, ...]) -> tuple[int, ...]:
        if list(value) != sorted(set(value)) or any(v <= 0 for v in value):
            raise ValueError("length_buckets must be strictly increasing positive bucket edges")
        return value

    @property
    def effective_claim_size(self) -> int:
        """Rows claimed per claim statement: configured, else 4 batches' worth."""
        return self.claim_size or self.max_batch_size * 4


_CREDENTIAL = re.compile(
    r"(?i)(secret|password|token|credential|sas|access_key|account_key|master_key|private_key"
    r"|client_certificate|connection_string)"
)


class OutputConfig(_Model):
    """Where committed outputs go: a Parquet dataset, a SQL results table or a Delta table."""

    kind: Literal["parquet", "sql", "delta"] = Field(
        "parquet",
        description="`parquet`: a dataset of files; `sql`: a results table; `delta`: a Delta Lake table (`pip install 'batching[delta]'`)",
    )
    # The Parquet dataset root, or the Delta table: a folder or an object-store URI
    # (s3://bucket/path); relative paths start from the config file's folder.
    path: str = Field(
        "outputs",
        min_length=1,
        description="the Parquet dataset root or the Delta table: a folder, or an object-store URI (`s3://bucket/path`) for Delta",
    )
    table: str = Field(
        "batching_results",
        description="kind sql: the results table (created if missing), keyed by queue, model version and item key",
    )
    # kind sql: the database of the results table when it is not the queue's (a warehouse);
    # outputs then roll forward from the queue's outbox. Credentials: PGPASSWORD / ~/.pgpass.
    url: str | None = Field(
        None,
        description="kind sql: the table's database when it is not the queue's (a warehouse); outputs then roll forward from the queue's outbox",
    )
    # kind delta: delta-rs's object-store settings (AWS_REGION, AWS_ENDPOINT_URL, ...).
    # Credentials stay in the scorer's environment, where delta-rs reads them.
    storage_options: dict[str, str] = Field(
        default_factory=dict,
        description="kind delta: delta-rs's object-store settings (`AWS_REGION`, `AWS_ENDPOINT_URL`, ...); credentials stay in the environment",
    )
    max_rows_per_commit: int = Field(
        8192,
        ge=1,
        description="group commit: scored batches waiting for the commit stage commit together, up to this many rows",
    )
    # How long the commit stage may gather scored batches into one commit (one file): 0 =
    # commit whatever is waiting as soon as the stage is free. A bulk run whose model is the
    # bottleneck otherwise writes one small file per batch. Adds up to this to latency (the
    # policy check counts it).
    commit_interval_s: float = Field(
        0.0,
        ge=0,
        le=60,
        description="how long the commit stage may gather scored batches into one commit (0-60); adds to latency (`batching check` counts it); an item with a deadline commits at once",
    )

    @field_validator("table")
    @classmethod
    def _table(cls, value: str) -> str:
        if not _IDENTIFIER.match(value):
            raise ValueError(
                "table must be a SQL identifier (a letter or _, then letters, digits, _; "
                "at most 63)"
            )
        problem = reserved_table(value)
        if problem is not None:
            raise ValueError(f"table {problem}")
        return value

    @field_validator("url")
    @classmethod
    def _url(cls, value: str | None) -> str | None:
        if value is not None and not _DB_URL.match(value):
            raise ValueError(
                "url must be sqlite:///FILE or postgresql://USER@HOST:PORT/DB, got "
                f"{redact_url(value)!r}"
            )
        return value

    @field_validator("storage_options")
    @classmethod
    def _no_credentials(cls, value: dict[str, str]) -> dict[str, str]:
        # by key, or in a value (a password in an endpoint URL, a presigned signature)
        secret = sorted(k for k, v in value.items() if _CREDENTIAL.search(k) or redact_url(v) != v)
        if secret:
            raise ValueError(
                f"{', '.join(secret)}: a credential does not belong in a config file; remove "
                "it and set it in the scorer's environment, where delta-rs reads it (e.g. "
                "AWS_SECRET_ACCESS_KEY)"
            )
        return value

    @model_validator(mode="after")
    def _settings_of_its_kind(self) -> OutputConfig:
        if self.url is not None and self.kind != "sql":
            raise ValueError(
                f"url is a setting of kind sql (a table in another database), not {self.kind}"
            )
        if self.storage_options and self.kind != "delta":
            raise ValueError(f"storage_options is a setting of kind delta, not {self.kind}")
        problem = naming.uri_problem(self.path)
        if problem:
            raise ValueError(f"path {problem}")
        return self


class LineageConfig(_Model):
    """Where OpenLineage events go; an outage never fails a run: its events wait in a spool.

    The spool is in the queue's database (``batching lineage flush``, or the next run, re-sends).

    OpenLineage's own sources (`OPENLINEAGE_CONFIG`, `openlineage.yml`, `OPENLINEAGE_*`) override
    these settings: see :mod:`batching.evidence.ol_config`.
    """

    transport: Literal["file", "http", "console", "none"] = Field(
        "file",
        description="where OpenLineage events go (`$OPENLINEAGE_URL` switches to http)",
    )
    path: str | None = Field(
        None,
        min_length=1,
        description="the file transport's JSONL (none: `lineage/events.jsonl` beside the output folder, or `outputs/` beside the config)",
    )
    url: str | None = Field(
        None,
        description="the http transport's backend (Marquez: `http://host:5000`)",
    )
    endpoint: str = Field(
        "api/v1/lineage",
        description="the http transport's path",
    )
    namespace: str = Field(
        "batching",
        description="the OpenLineage job namespace (letters, digits, `:;=/_-.@+`)",
    )
    timeout_s: float = Field(
        2.0,
        gt=0,
        le=60,
        description="one delivery attempt's timeout; a lineage outage never fails a run",
    )
    retries: int = Field(
        1,
        ge=0,
        le=5,
        description="delivery retries before an event is counted as not delivered",
    )
    spool_max_events: int = Field(
        10_000,
        ge=0,
        le=10_000_000,
        description="undelivered events kept in the queue database for a re-send (beyond: the oldest are dropped, warned and counted; 0: no spool)",
    )
    spool_max_age_s: float = Field(
        7 * 86400.0,
        gt=0,
        description="how long an undelivered event is kept for a re-send before it is dropped (warned and counted)",
    )
    # Sent as ``Authorization: Bearer <key>`` by the http transport. Set only from the
    # OpenLineage sources (OPENLINEAGE_API_KEY, openlineage.yml: see evidence.ol_config), never
    # from a pipeline config: left out of every dump, so of the config hash, the lineage config
    # facet and the logs.
    api_key: SecretStr | None = Field(None, exclude=True, repr=False)

    @field_validator("namespace")
    @classmethod
    def _marquez_namespace(cls, value: str) -> str:
        if not _NAMESPACE.match(value):
            raise ValueError(
                f"namespace {value!r} is not one Marquez accepts: letters, digits and "
                ":;=/_-.@+ only, no spaces (e.g. batching-prod)"
            )
        return value

    @model_validator(mode="after")
    def _url_for_http(self) -> LineageConfig:
        if self.transport != "http":
            return self
        if not self.url:
            raise ValueError("transport http needs url (e.g. http://localhost:5000)")
        if not _is_http_url(self.url):
            raise ValueError(
                f"lineage url {redact_url(self.url)!r} is not a URL like http://marquez:5000"
                " (http or https, a host, a numeric port if any)"
            )
        if self.api_key is not None and urlsplit(self.url).username is not None:
            raise ValueError(
                f"lineage url {redact_url(self.url)!r} has credentials and an API key is set "
                "too (OPENLINEAGE_API_KEY); use one: the URL's Basic auth would replace the key"
            )
        return self


def _is_http_url(url: str) -> bool:
    """Whether ``url`` is ``http(s)://host[:port][/path]``, as the lineage transport needs
    (no white space: ``http://h:1/ extra`` passed, and the push failed as a bug)."""
    if any(c.isspace() for c in url):
        return False
    try:
        parts = urlsplit(url)
        _ = parts.port  # raises on a port that is not a number in range
    except ValueError:  # e.g. an unclosed IPv6 bracket
        return False
    return parts.scheme in ("http", "https") and bool(parts.hostname)


class MetricsConfig(_Model):
    """Prometheus metrics: where a scorer serves or sends them (see docs/operations.md#metrics).

    A long-running scorer serves ``/metrics`` on ``port``; a short run (a Prefect flow run)
    pushes its metrics to ``pushgateway_url`` or writes ``textfile_path`` at its end.
    """

    environment: str = Field(
        "default",
        min_length=1,
        max_length=100,
        description="the `environment` label of every series (e.g. prod, staging)",
    )
    port: int | None = Field(
        None,
        ge=1,
        le=65535,
        description="a scorer serves `/metrics` on this port (`score --metrics-port` overrides it); none: not served",
    )
    pushgateway_url: str | None = Field(
        None,
        description="a run pushes its metrics here as it starts, every 30 s and at its end (`http://host:9091`; `http://user:password@host:9091` sends basic auth, the password masked in every message; grouping key job `batching-score`, queue, environment, instance)",
    )
    instance: str | None = Field(
        None,
        min_length=1,
        max_length=200,
        description="the `instance` of this scorer's Pushgateway group: each run replaces its group's series, so scorers that run at once need their own (e.g. `gpu-0`); none: the host's name",
    )
    textfile_path: str | None = Field(
        None,
        min_length=1,
        description="a run writes its metrics to this file at its end (node_exporter's textfile collector: a `*.prom` file)",
    )
    top_tenants: int = Field(
        20,
        ge=1,
        le=10_000,
        description='tenants with their own label (the top N by items seen); the rest fold into `tenant="other"`',
    )

    @field_validator("pushgateway_url")
    @classmethod
    def _pushgateway_is_http(cls, value: str | None) -> str | None:
        if value is not None and not _is_http_url(value):
            raise ValueError(
                f"pushgateway_url {redact_url(value)!r} is not a URL like http://pushgateway:9091"
                " (http or https, a host, a numeric port if any)"
            )
        return value

    @field_validator("textfile_path")
    @classmethod
    def _prom_file(cls, value: str | None) -> str | None:
        if value is not None and not value.endswith(".prom"):
            raise ValueError(
                f"textfile_path must end in .prom (node_exporter reads only those), got {value!r}"
            )
        return value

    @property
    def enabled(self) -> bool:
        """Whether a run records metrics: served, pushed or written somewhere."""
        return bool(self.port or self.pushgateway_url or self.textfile_path)


class PipelineConfig(_Model):
    """One environment's whole pipeline, as in ``deployments/*.yaml``."""

    name: str = Field(
        "score",
        min_length=1,
        description="the job's name: lineage, the run ledger, Prefect artifacts",
    )
    profile: Literal["online", "bulk"] = Field(
        "online",
        description="`online` (latency: batches by the window) or `bulk` (throughput: full, length-sorted batches)",
    )
    database: DatabaseConfig = DatabaseConfig()
    queue: QueueConfig = QueueConfig()
    breaker: BreakerConfig = BreakerConfig()
    model: ModelSpec
    model_versions: list[ModelSpec] = Field(
        default_factory=list,
        description="the registry: every other version that may run, each pinned like `model`; which one does run is the queue's route, changed only by `batching rollout` (`model`: the version a queue without a route runs)",
    )
    rollout: RolloutConfig = RolloutConfig()
    batching: BatchingPolicy = BatchingPolicy()
    output: OutputConfig = OutputConfig()
    lineage: LineageConfig = LineageConfig()
    latency_slo_s: float = Field(
        1.0,
        gt=0,
        description="the objective `batching check` holds the worst case to: `max_wait_s` (none with `adaptive`) + a full batch's service time + `commit_interval_s`",
    )
    service_profile: str | None = Field(
        None,
        description="forward times per batch size and length measured by `batching profile` (for `batching check` and deadline releases)",
    )
    backlog_alert_depth: int | None = Field(
        None,
        ge=1,
        description="a score run emits `batching.queue.backlog` when this many items are ready after it",
    )
    backlog_alert_age_s: float | None = Field(
        None,
        gt=0,
        description="... or when the oldest ready item is this old",
    )
    latency_objective: float = Field(
        0.99,
        gt=0,
        lt=1,
        description="the fraction of items to commit within `latency_slo_s` (the SLO the burn-rate alerts hold; 0.99: 1% error budget)",
    )
    metrics: MetricsConfig = MetricsConfig()
    base_dir: str = Field(".", exclude=True)

    @model_validator(mode="after")
    def _versions_unique(self) -> PipelineConfig:
        seen = [self.model.version, *(v.version for v in self.model_versions)]
        twice = sorted({v for v in seen if seen.count(v) > 1})
        if twice:
            raise ValueError(
                f"model version(s) {', '.join(map(repr, twice))} listed twice in model and "
                "model_versions; give each checkpoint its own version"
            )
        return self

    def registry(self) -> dict[str, ModelSpec]:
        """Every version that may run, by name: ``model`` first, then ``model_versions``."""
        return {self.model.version: self.model} | {v.version: v for v in self.model_versions}

    @model_validator(mode="after")
    def _window_below_slo(self) -> PipelineConfig:
        if self.batching.max_wait_s >= self.latency_slo_s:
            raise ValueError(
                f"batching.max_wait_s must be < latency_slo_s ({self.latency_slo_s:g}), "
                f"got {self.batching.max_wait_s:g}"
            )
        return self

    def resolve(self, path: str | None) -> Path | None:
        """Resolve a config-relative path against the config file's folder."""
        if path is None:
            return None
        p = Path(path).expanduser()
        return p if p.is_absolute() else Path(self.base_dir) / p

    def config_hash(self) -> str:
        """sha256 of the canonical JSON of the settings (stable across key order), their
        credentials masked as lineage shows them: the hash goes out beside the masked
        settings, and a hash of the unmasked ones let anyone holding an event test guesses
        of a password offline (a security review recovered four)."""
        canonical = json.dumps(redact_mapping(self.model_dump(mode="json")), sort_keys=True)
        return hashlib.sha256(canonical.encode()).hexdigest()


def _format_validation(source: str, exc: ValidationError) -> str:
    parts = []
    unknown: dict[tuple[int | str, ...], list[str]] = {}  # by section, in order
    for err in exc.errors():
        if err["type"] == "extra_forbidden":
            unknown.setdefault(tuple(err["loc"][:-1]), []).append(str(err["loc"][-1]))
            continue
        loc = ".".join(str(p) for p in err["loc"]) or "(top level)"
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "model_type" and err.get("input") is None:  # "queue:" and nothing
            msg = "an empty section; give its settings or remove it"
        elif err["type"] == "model_type":  # "model: w2-text": not a class name, the fix
            msg = f"a section of settings, not {err.get('input')!r}; indent its settings under it"
        parts.append(f"{loc}: {msg}")
    parts += [_unknown_settings(section, names) for section, names in unknown.items()]
    return f"{source}: " + "; ".join(parts)


def _unknown_settings(section: tuple[int | str, ...], names: list[str]) -> str:
    """Unknown settings of one section, each with the nearest known name (a typo's fix), and
    the section's known names once when one of them has none."""
    known = _known_settings(section)
    prefix = "".join(f"{part}." for part in section)
    near = {name: difflib.get_close_matches(name, known, n=1) for name in names}
    if len(names) == 1 and near[names[0]]:  # one typo: its fix is enough
        return f"{prefix}{names[0]}: unknown setting; did you mean {near[names[0]][0]}?"
    labels = [f"{prefix}{n}" + (f" (did you mean {m[0]}?)" if m else "") for n, m in near.items()]
    what = "unknown setting" if len(names) == 1 else "unknown settings"
    tail = f"; known here: {', '.join(known)}" if known and not all(near.values()) else ""
    return f"{', '.join(labels)}: {what}{tail}"


def _known_settings(section: tuple[int | str, ...]) -> list[str]:
    """The setting names of a config section (none when it is not a section of settings)."""
    model: type[BaseModel] = PipelineConfig
    for part in section:
        field = model.model_fields.get(str(part))
        kinds = (field.annotation, *typing.get_args(field.annotation)) if field else ()
        nested = [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]
        if not nested:
            return []
        model = nested[0]
    return [name for name in model.model_fields if name != "base_dir"]


def _deep_merge(base: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def parse_config(data: Any, *, source: str = "config", base_dir: str = ".") -> PipelineConfig:
    """Validate a mapping into a ``PipelineConfig``; raises ``ConfigError`` naming each bad field."""
    if not isinstance(data, dict):
        raise errors.ConfigError(f"{source}: expected a mapping of settings at the top level")
    if "deployments" in data and "model" not in data:
        raise errors.ConfigError(
            f"{source}: a Prefect deployment file (it lists deployments), not a scoring "
            "config; give a scoring config such as deployments/tabular.yaml (prefect deploy "
            "reads this file)"
        )
    lineage = data.get("lineage")
    if isinstance(lineage, dict) and "api_key" in lineage:
        raise errors.ConfigError(
            f"{source}: lineage.api_key: a secret does not belong in a config file; remove it "
            "and set OPENLINEAGE_API_KEY in the scorer's environment"
        )
    try:
        return PipelineConfig.model_validate({**data, "base_dir": base_dir})
    except ValidationError as exc:
        raise errors.ConfigError(_format_validation(source, exc)) from None


class _DuplicateKey(yaml.YAMLError):
    def __init__(self, key: Any, line: int) -> None:
        super().__init__(f"{key!r} given twice")
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """SafeLoader that refuses a key given twice in one mapping (YAML keeps the last, so a
    pasted-in second ``batching:`` would silently replace the first)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                raise _DuplicateKey(key, key_node.start_mark.line + 1)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_config(path: str | Path, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """Load and validate a YAML pipeline config; ``overrides`` (nested dicts) win over the file.

    Raises:
        ConfigError: the file is missing, is not YAML, or a field is invalid (message names it).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise errors.ConfigError(
            f"{p}: cannot read config ({exc.strerror}); check the path"
        ) from None
    except UnicodeDecodeError:
        raise errors.ConfigError(f"{p}: not UTF-8 text; save the config as UTF-8") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except _DuplicateKey as exc:
        raise errors.ConfigError(
            f"{p}: line {exc.line}: {exc.key!r} is given twice in one section; keep one"
        ) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise errors.ConfigError(f"{p}:{where} is not valid YAML; fix the syntax") from None
    except RecursionError:
        raise errors.ConfigError(f"{p}: nested too deeply to be a config; fix it") from None
    except TypeError:  # a key that is a list or a mapping (YAML's "? [1, 2]")
        raise errors.ConfigError(
            f"{p}: a key that is a list or a mapping; a config's keys are names"
        ) from None
    if data is None:
        if not overrides:
            raise errors.ConfigError(
                f"{p}: the file is empty; a config names at least its model (start from one of "
                "deployments/*.yaml)"
            )
        data = {}
    source = str(p)
    if overrides and isinstance(data, dict):
        data = _deep_merge(data, overrides)
        source += " with its overrides"  # a bad key may be the overrides' (a flow parameter)
    return parse_config(data, source=source, base_dir=str(p.parent.resolve()))
