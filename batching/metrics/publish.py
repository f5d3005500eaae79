"""Where a scorer's metrics go: served on ``/metrics`` (:func:`serve`), pushed to a
Pushgateway or written for node_exporter's textfile collector at a run's end
(:func:`publish_run`). With worker processes (``score --workers``), each worker writes its
values to a shared folder (:func:`worker_metrics`) and the parent's registry sums them
(``prometheus_client`` multiprocess mode).
"""

from __future__ import annotations

import logging
import shutil
import socket
import tempfile
import threading
import urllib.parse
from collections.abc import Iterator, MutableMapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    push_to_gateway,
    start_http_server,
    write_to_textfile,
)
from prometheus_client.exposition import basic_auth_handler, default_handler
from prometheus_client.multiprocess import MultiProcessCollector

from batching import errors
from batching.config import PipelineConfig
from batching.metrics.recorder import process_metrics
from batching.redaction import redact_url

logger = logging.getLogger(__name__)

MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"
PUSH_JOB = "batching-score"
"""The Pushgateway grouping key's job; with :func:`grouping_key`, a run replaces the last
one's series."""


@contextmanager
def worker_metrics(env: MutableMapping[str, str], enabled: bool = True) -> Iterator[Path | None]:
    """While open, processes started from here record into one fresh folder: sets
    :data:`MULTIPROC_ENV` in ``env`` (the edge passes its environment; ``prometheus_client``
    reads it when a spawned worker imports it). Yields the folder, or None when not
    ``enabled``; at the end ``env`` is put back and the folder removed."""
    if not enabled:
        yield None
        return
    folder = Path(tempfile.mkdtemp(prefix="batching-metrics-"))
    before = env.get(MULTIPROC_ENV)
    env[MULTIPROC_ENV] = str(folder)
    try:
        yield folder
    finally:
        if before is None:
            env.pop(MULTIPROC_ENV, None)
        else:
            env[MULTIPROC_ENV] = before
        shutil.rmtree(folder, ignore_errors=True)


def registry(multiprocess_dir: Path | None = None) -> CollectorRegistry:
    """The registry to expose: this process's scorer series, or with ``multiprocess_dir``,
    the sum of what every worker wrote there."""
    if multiprocess_dir is None:
        return process_metrics().registry
    reg = CollectorRegistry()
    MultiProcessCollector(reg, path=str(multiprocess_dir))  # type: ignore[no-untyped-call]
    return reg


@dataclass
class Server:
    """A running ``/metrics`` endpoint; ``close()`` stops it."""

    port: int
    _server: Any
    _thread: Any

    def close(self) -> None:
        """Stop serving."""
        self._server.shutdown()
        self._server.server_close()


def serve(
    port: int, reg: CollectorRegistry, addr: str = "0.0.0.0", option: str = "--metrics-port"
) -> Server:
    """Serve ``reg`` on ``http://addr:port/metrics`` from a daemon thread.

    Raises:
        ConfigError: the port cannot be bound (in use, or privileged); the message names
            ``option``, the setting to change.
    """
    try:
        server, thread = start_http_server(port, addr=addr, registry=reg)
    except OSError as exc:
        if isinstance(exc, socket.gaierror):  # the address, not the port
            raise errors.ConfigError(
                f"cannot serve metrics on address {addr!r} ({exc.strerror or exc}); give an "
                "address of this host (0.0.0.0: all of them)"
            ) from None
        raise errors.ConfigError(
            f"cannot serve metrics on port {port} ({exc.strerror or exc}); "
            f"choose a free port ({option})"
        ) from None
    logger.info("serving metrics", extra={"action": "metrics_serve", "port": port})
    return Server(port, server, thread)


def _gateway(url: str) -> tuple[str, Any]:
    """The Pushgateway URL without its credentials, and the handler that sends them (HTTP
    basic auth; the client's default handler when the URL has none). Given to the client in
    the URL, ``user:password@host`` was taken for a host name: no push ever reached a
    gateway behind basic auth."""
    parts = urllib.parse.urlsplit(url)
    if parts.username is None:
        return url, default_handler
    user = urllib.parse.unquote(parts.username)
    password = urllib.parse.unquote(parts.password or "")
    host = parts.hostname or ""
    netloc = f"[{host}]" if ":" in host else host
    if parts.port is not None:
        netloc += f":{parts.port}"
    bare = urllib.parse.urlunsplit(parts._replace(netloc=netloc))

    def handler(
        url: str, method: str, timeout: float | None, headers: list[tuple[str, str]], data: bytes
    ) -> Any:
        return basic_auth_handler(url, method, timeout, headers, data, user, password)

    return bare, handler


PUSH_EVERY_S = 30.0
"""While a run runs, its series are pushed this often (``metrics.pushgateway_url``)."""
_START_CHECK_S = 0.1
"""How often the first push looks for the run's start."""


@contextmanager
def pushing(
    config: PipelineConfig, reg: CollectorRegistry, every_s: float = PUSH_EVERY_S
) -> Iterator[None]:
    """Push ``reg`` to the Pushgateway every ``every_s`` while the block runs (the caller
    publishes the run's end with :func:`publish_run`). Pushed only at its end, a run was
    never seen active: ``BatchingRunNoHeartbeat`` could not fire for a hung short run, nor
    for one that died (its last push was the previous run's, inactive). A failed push is
    logged once until one succeeds again, and tried at the next beat.

    The first push is as soon as the run says it started (``batching_run_active`` 1, within
    ``every_s`` at most): a process starts its counters at zero, and a run whose counters
    replaced the last run's only when they were already higher was read by Prometheus as a
    continuation (``rate`` undercounted it) rather than a reset. Pushed at once, before the
    run had made its series, the group was empty: a run that hung or died in its first
    ``every_s`` was never seen active, and its counters read as new series (found by a
    review)."""
    stop = threading.Event()
    beat: threading.Thread | None = None
    if config.metrics.pushgateway_url:
        labels = {"environment": config.metrics.environment, "queue": config.queue.name}

        def started() -> bool:
            return reg.get_sample_value("batching_run_active", labels) == 1

        def run() -> None:
            failing = False
            waited = 0.0
            while not started() and waited < every_s and not stop.wait(_START_CHECK_S):
                waited += _START_CHECK_S
            while True:  # then every every_s
                problem = _push(config, reg)
                if problem is not None and not failing:
                    logger.warning(problem, extra={"action": "metrics_publish_failed"})
                failing = problem is not None
                if stop.wait(every_s):
                    return

        beat = threading.Thread(target=run, name="metrics-push", daemon=True)
        beat.start()
    try:
        yield
    finally:
        stop.set()
        if beat is not None:
            beat.join(timeout=every_s + 15)


def grouping_key(config: PipelineConfig) -> dict[str, str]:
    """The Pushgateway group of this scorer's runs (with the job, :data:`PUSH_JOB`): a run
    replaces its group's series. Keyed by the queue alone, two environments sharing a gateway,
    or two scorers of one queue, replaced each other's (found by a review)."""
    return {
        "queue": config.queue.name,
        "environment": config.metrics.environment,
        "instance": config.metrics.instance or socket.gethostname(),
    }


def _push(config: PipelineConfig, reg: CollectorRegistry) -> str | None:
    """Push ``reg`` to ``metrics.pushgateway_url``; the failure as one line (the password
    masked), None when it went."""
    url = config.metrics.pushgateway_url
    assert url is not None
    gateway, handler = _gateway(url)
    try:
        push_to_gateway(
            gateway,
            job=PUSH_JOB,
            grouping_key=grouping_key(config),
            registry=reg,
            timeout=10,
            handler=handler,
        )
    except OSError as exc:
        return redact_url(f"metrics not pushed to {url}: {exc}")
    return None


def publish_run(config: PipelineConfig, reg: CollectorRegistry | None = None) -> list[str]:
    """Push the run's series to the Pushgateway and/or write the textfile, as configured
    (``metrics.pushgateway_url``, ``metrics.textfile_path``); a failure is returned as a
    one-line message for the caller to report (the CLI prints it, a flow logs it), never
    raised: metrics never fail a run. (Logged here too, every failure showed twice.)"""
    reg = reg if reg is not None else registry()
    problems: list[str] = []
    m = config.metrics
    if m.pushgateway_url and (problem := _push(config, reg)) is not None:
        problems.append(problem)
    if m.textfile_path:
        path = config.resolve(m.textfile_path)
        try:
            write_to_textfile(str(path), reg)  # a temporary file renamed over it: atomic
        except OSError as exc:
            problems.append(f"metrics not written to {path}: {exc}")
    return problems
