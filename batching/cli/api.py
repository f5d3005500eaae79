"""``batching api``: the HTTP ingress (:mod:`batching.api`), with its tokens from the
environment: ``BATCHING_API_TOKENS`` (``TOKEN=TENANT`` pairs, comma-separated) or
``BATCHING_API_TOKENS_FILE`` (one pair a line)."""

from __future__ import annotations

import functools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

import typer

from batching import errors, models
from batching.cli.common import (
    ConfigOption,
    DbOverride,
    OutputOverride,
    app,
    err,
    flag,
    handle_errors,
    load,
)

TOKENS_ENV = "BATCHING_API_TOKENS"
TOKENS_FILE_ENV = "BATCHING_API_TOKENS_FILE"


def tokens_from_env(env: dict[str, str] | os._Environ[str] = os.environ) -> Any:
    """The tokens ``BATCHING_API_TOKENS`` or the file ``BATCHING_API_TOKENS_FILE`` holds.

    Raises:
        ConfigError: neither is set, both are, the file cannot be read, or an entry is bad.
    """
    from batching.api import tokens

    inline, file = env.get(TOKENS_ENV), env.get(TOKENS_FILE_ENV)
    if inline and file:
        raise errors.ConfigError(f"both {TOKENS_ENV} and {TOKENS_FILE_ENV} are set; set one")
    if inline:
        return tokens.parse(inline, TOKENS_ENV)
    if file:
        try:
            text = Path(file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            reason = getattr(exc, "strerror", None) or type(exc).__name__
            raise errors.ConfigError(
                f"{TOKENS_FILE_ENV}: cannot read {file} ({reason}); name a readable file"
            ) from None
        known = tokens.parse(text, file)
        if os.name == "posix" and Path(file).stat().st_mode & 0o077:
            err.print(
                f"warning: {TOKENS_FILE_ENV} {file} can be read by other users (mode "
                f"{Path(file).stat().st_mode & 0o777:o}); its tokens let them enqueue and read "
                f"as their tenants: chmod 600 {file}",
                highlight=False,
            )
        return known
    raise errors.ConfigError(
        f"no API tokens: set {TOKENS_ENV}=TOKEN=TENANT[,TOKEN=TENANT...] or {TOKENS_FILE_ENV}"
        "=FILE (one TOKEN=TENANT a line)"
    )


def application(settings: Any, environment: str) -> Any:
    """The API's application (``batching.api.app.Settings`` -> FastAPI) with its own
    ``/metrics``: the items each POST enqueued, found present or shed with 429
    (``batching_api_items_total``, labelled ``environment``)."""
    import dataclasses

    from batching.api import app as api_app
    from batching.cli import api_workers
    from batching.metrics.api_items import ApiMetrics

    metrics = ApiMetrics(environment, os.environ.get(api_workers.SUMMED_ENV))
    counted = dataclasses.replace(settings, observe=metrics.observe, metrics=metrics.exposition)
    return api_app.create_app(counted)


@dataclass(frozen=True)
class _Serving:
    """What each API process is given: the checked config and where it reads and writes
    (``build.checked``), the tokens, and the command's options. Pickled to each worker of
    ``--workers``, so every worker serves the same config and tokens, read once."""

    cfg: Any
    db_url: str
    target: Any
    known: Any
    max_body_bytes: int
    retry_after_s: int
    group_max_records: int
    group_linger_s: float
    check_payloads: bool


@app.command("api")
@handle_errors
def serve_api(
    config: ConfigOption,
    db: DbOverride = None,
    output: OutputOverride = None,
    host: Annotated[str, typer.Option(help="Address to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port to listen on.")] = 8000,
    workers: Annotated[
        int,
        typer.Option(
            min=1,
            max=64,
            help="Processes serving the port, each one core's worth of requests; a worker "
            "that dies is replaced, and /metrics sums them all.",
        ),
    ] = 1,
    max_body_bytes: Annotated[
        int, typer.Option(min=1024, help="Largest request body; larger gets 413.")
    ] = 16 * 1024 * 1024,
    retry_after_s: Annotated[
        int, typer.Option(min=1, help="Retry-After of a 429 (the queue at its depth cap).")
    ] = 1,
    group_max_records: Annotated[
        int, typer.Option(min=1, help="Most records in one enqueue transaction (group commit).")
    ] = 1000,
    group_linger_s: Annotated[
        float,
        typer.Option(min=0.0, help="Wait this long for more POSTs before writing a group."),
    ] = 0.0,
    check_payloads: Annotated[
        bool,
        typer.Option(
            help="Refuse (422) a payload no model version of the config can take; loads torch "
            "(~250 MB more memory, ~2 s more to start). --no-check-payloads: such items are "
            "admitted and fail dead at decode."
        ),
    ] = True,
) -> None:
    """Serve the HTTP ingress: POST items to a queue, GET their state and committed result.

    Tokens come from BATCHING_API_TOKENS (TOKEN=TENANT pairs, comma-separated) or
    BATCHING_API_TOKENS_FILE (one pair a line); each token enqueues and reads as its tenant
    only. Items are held to the config's model.max_item_* limits and refused (422) when the
    model cannot take their payload (input length, vocabulary); results are read from the
    config's output (or --output: the one the scorers were given). See docs/howto/http.md.
    """
    from batching.api import app as api_app
    from batching.compose import build
    from batching.store import database

    known = tokens_from_env()
    cfg = load(config)
    res = build.checked(cfg, db, output)  # the scorers' --output: results are read there
    serving = _Serving(
        cfg,
        res.db_url,
        res.target,
        known,
        max_body_bytes,
        retry_after_s,
        group_max_records,
        group_linger_s,
        check_payloads,
    )
    where = f"http://{host}:{port} (database {database.redact(res.db_url)})"
    if workers == 1:
        settings = _settings(serving)
        sock = api_app.bind(host, port)
        err.print(
            f"serving {len(known)} token(s) on {where}; docs at /docs, metrics at /metrics",
            highlight=False,
        )
        try:
            api_app.serve(application(settings, cfg.metrics.environment), sock)
        finally:
            settings.results.close()
        return
    from batching.cli import api_workers

    _settings(serving, fits=False).results.close()  # the schema checked before any worker
    sock = api_app.bind(host, port)
    err.print(
        f"serving {len(known)} token(s) on {where} with {workers} worker processes; docs at "
        "/docs, metrics at /metrics",
        highlight=False,
    )
    say = functools.partial(err.print, highlight=False)
    code = api_workers.serve(workers, _serve_worker, (serving, sock, os.getpid()), say, sock)
    if code:
        raise typer.Exit(code)


def _settings(serving: _Serving, *, fits: bool = True) -> Any:
    """The application's settings for ``serving``, its results open (close them), the
    queue's schema checked."""
    from batching.api import app as api_app
    from batching.api.results import Results
    from batching.ingress import ingest
    from batching.store import database

    cfg = serving.cfg
    results = Results(
        database.create_engine(serving.db_url), serving.target, cfg.queue.tenant_weights
    )
    try:
        results.queue(cfg.queue.name).check_schema()
    except BaseException:
        results.close()
        raise
    return api_app.Settings(
        results,
        serving.known,
        ingest.ItemLimits.of(cfg.model),
        fits=_fits(cfg) if fits and serving.check_payloads else None,
        max_attempts=cfg.queue.max_attempts,
        max_body_bytes=serving.max_body_bytes,
        retry_after_s=serving.retry_after_s,
        group_max_records=serving.group_max_records,
        group_linger_s=serving.group_linger_s,
        queue=cfg.queue.name,
    )


def _serve_worker(serving: _Serving, sock: socket.socket, parent: int) -> None:
    """One worker of ``batching api --workers N`` (a spawned process): serve on ``sock``
    until SIGTERM, or until ``parent`` (the supervisor's pid) dies. A ``BatchingError`` is one line on stderr and exit 2 or 1, as the
    command's own."""
    from batching.api import app as api_app
    from batching.cli import api_workers

    api_workers.die_with_parent(parent)
    from batching.logs import configure_logging  # a spawned process: its log, as the parent's

    configure_logging(logging.DEBUG if os.environ.get("BATCHING_DEBUG") else logging.WARNING)
    try:
        settings = _settings(serving)
    except errors.USAGE_ERRORS as exc:
        flag(err, "error", str(exc))
        raise SystemExit(2) from None
    except errors.BatchingError as exc:
        flag(err, "error", str(exc))
        raise SystemExit(1) from None
    try:
        api_app.serve(application(settings, serving.cfg.metrics.environment), sock)
    finally:
        settings.results.close()


def _fits(cfg: Any) -> Callable[[models.Payload], str | None] | None:
    """The check of a payload against the inputs of the config's model versions (a queue may
    be routed to any of them by a rollout): it fits when one of them takes it
    (``payloads.fit_any_error``). Read from each model built without weights; None, with a
    warning, when one cannot be built so (the scorer's decode still fails such an item,
    with the same reason)."""
    from batching.model import payloads, zoo

    contracts: list[payloads.Contract] = []
    for name in dict.fromkeys(spec.name for spec in cfg.registry().values()):
        try:
            info = zoo.describe_unloaded(name)
        except errors.ConfigError as exc:
            err.print(
                f"warning: payloads are checked at decode only, not at the door: {exc}",
                highlight=False,
            )
            return None
        contract = (info.input_kind, info.input_dim, info.vocab_size)
        if contract not in contracts:
            contracts.append(contract)
    return functools.partial(payloads.fit_any_error, contracts=tuple(contracts))
