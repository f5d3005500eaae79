"""The sinks a config can name (``output.kind``), and how each is opened: the one place that
knows them all. A new sink is a module that satisfies ``sinks.Sink``, one entry in
:data:`SINKS`, the config value, tests and docs.

A sink's heavy library loads when the sink is opened, not when this module is imported.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from batching import errors, naming, ports
from batching.outputs import contract as sinks


@dataclass(frozen=True)
class Target:
    """Where a run's outputs go, after the CLI's and the flow's overrides.

    ``where``: the Parquet dataset root, the results table, or the Delta table URI. ``url``:
    the database of a results table outside the queue's (None: the queue's). ``scorer``: the
    sink is a scoring run's (the Parquet sink then defers its ledger marks). ``read_only``:
    opened to be read (reconcile), it creates nothing until it writes.
    """

    kind: str
    where: str
    url: str | None = None
    storage_options: Mapping[str, str] = field(default_factory=dict)
    scorer: bool = False
    read_only: bool = False


@dataclass(frozen=True)
class SinkKind:
    """One ``output.kind``: how to open its sink, name its dataset without opening it, and
    whether ``where`` is a local folder the run creates (``None``: it is not)."""

    open: Callable[[ports.Fence, Target], sinks.Sink]
    dataset: Callable[[Target, str], tuple[str, str]]
    local_folder: Callable[[Target], Path | None]


def _parquet(fence: ports.Fence, target: Target) -> sinks.Sink:
    from batching.outputs.parquet import ParquetSink

    return ParquetSink(
        fence, Path(target.where), defer_marks=target.scorer, create=not target.read_only
    )


def _sql(fence: ports.Fence, target: Target) -> sinks.Sink:
    from batching.outputs import sql as sql_sink

    create = not target.read_only
    if target.url is None:
        return sql_sink.SqlSink(fence, target.where, create=create)
    return sql_sink.WarehouseSqlSink(fence, target.url, target.where, create=create)


def _delta(fence: ports.Fence, target: Target) -> sinks.Sink:
    try:
        from batching.outputs.delta import DeltaSink
    except ImportError as exc:
        raise errors.ConfigError(
            f"output.kind delta needs the deltalake package ({exc}); install it: "
            "pip install 'batching[delta]'"
        ) from None
    return DeltaSink(fence, target.where, storage_options=target.storage_options)


def _sql_dataset(target: Target, queue_url: str) -> tuple[str, str]:
    return naming.sql_dataset_id(target.url or queue_url, target.where)


def _path_dataset(target: Target, _queue_url: str) -> tuple[str, str]:
    return naming.file_dataset_id(target.where)


def _local(target: Target) -> Path | None:
    return None if "://" in target.where else Path(target.where)


SINKS: dict[str, SinkKind] = {
    "parquet": SinkKind(_parquet, _path_dataset, _local),
    "sql": SinkKind(_sql, _sql_dataset, lambda _target: None),
    "delta": SinkKind(_delta, _path_dataset, _local),
}


def kind_of(target: Target) -> SinkKind:
    """The registered sink of ``target.kind``.

    Raises:
        ConfigError: no sink of that kind.
    """
    found = SINKS.get(target.kind)
    if found is None:
        raise errors.ConfigError(
            f"output.kind {target.kind!r} is not a sink; use one of {', '.join(SINKS)}"
        )
    return found


def open_sink(fence: ports.Fence, target: Target) -> sinks.Sink:
    """The sink ``target`` names, committing through ``fence``.

    Raises:
        ConfigError: no sink of that kind, or its settings are invalid.
        SinkError: its output cannot be reached or created.
    """
    return kind_of(target).open(fence, target)


def dataset_id(target: Target, queue_url: str) -> tuple[str, str]:
    """The OpenLineage ``(namespace, name)`` of ``target``'s dataset, without opening it."""
    return kind_of(target).dataset(target, queue_url)
