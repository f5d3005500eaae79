"""``batching metrics serve`` (the table exporter), and the metrics of ``batching score``:
``/metrics`` served while it runs, pushed or written at its end (:func:`scorer_metrics`)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Annotated, Any

import typer

from batching.cli.common import (
    ConfigOption,
    DbOverride,
    app,
    err,
    handle_errors,
    load,
    out,
    parse_duration,
)

DEFAULT_EXPORTER_PORT = 9465

metrics_app = typer.Typer(
    name="metrics",
    help="Prometheus metrics: the exporter of the queue, lineage-spool and reconcile gauges.",
    no_args_is_help=True,
)
app.add_typer(metrics_app)


def with_metrics_port(cfg: Any, port: int | None) -> Any:
    """The config with ``metrics.port`` set to ``port`` (``score --metrics-port``)."""
    if port is None:
        return cfg
    return cfg.model_copy(update={"metrics": cfg.metrics.model_copy(update={"port": port})})


@contextmanager
def scorer_metrics(cfg: Any, workers: int) -> Iterator[None]:
    """While a scoring run runs: serve ``/metrics`` on ``metrics.port`` (one endpoint for all
    ``workers``); at its end, push to the Pushgateway or write the textfile as configured.
    Nothing when the config asks for no metrics."""
    if not cfg.metrics.enabled:
        yield
        return
    from batching.metrics import publish

    with publish.worker_metrics(os.environ, workers > 1) as folder:
        reg = publish.registry(folder)
        server = (
            publish.serve(cfg.metrics.port, reg, option="metrics.port or --metrics-port")
            if cfg.metrics.port
            else None
        )
        try:
            with publish.pushing(cfg, reg):
                yield
        finally:
            for problem in publish.publish_run(cfg, reg):
                err.print(f"warning: {problem}", highlight=False)
            if server is not None:
                server.close()


@metrics_app.command("serve")
@handle_errors
def serve(
    config: ConfigOption,
    port: Annotated[
        int,
        typer.Option(
            min=1,
            max=65535,
            help="Port to serve /metrics on (not the scorer's metrics.port).",
        ),
    ] = DEFAULT_EXPORTER_PORT,
    addr: Annotated[str, typer.Option(help="Address to listen on.")] = "0.0.0.0",
    db: DbOverride = None,
    done_every: Annotated[
        str,
        typer.Option(
            help="Count the done items at most this often (90s, 5m): a count reads every one "
            "of them, so it runs beside the scrapes, never in one."
        ),
    ] = "5m",
) -> None:
    """Serve the gauges, read from the tables at each scrape, over HTTP for Prometheus.

    Queue depth by state, oldest ready age, expired leases, pause and depth cap, the
    lineage spool, the last reconcile. Done items are counted in the background (--done-every);
    their series appear once the first count has finished.

    Runs until SIGTERM or Ctrl-C. A database that fails at scrape time shows as
    batching_exporter_up 0; the exporter keeps serving.
    """
    from batching.compose import build
    from batching.metrics import exporter

    every_s = parse_duration(done_every, "--done-every")
    cfg = load(config)
    queue = build.open_queue(cfg, build.resolve(cfg, db, None).db_url)
    server, _ = exporter.serve(cfg, queue, port, addr=addr, done_every_s=every_s)
    out.print(f"serving metrics on http://{addr}:{port}/metrics", highlight=False)
    stopped = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopped.set())
    try:
        while not stopped.wait(1.0):
            pass
    finally:
        server.close()
        queue.engine.dispose()
