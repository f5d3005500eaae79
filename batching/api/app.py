"""The FastAPI application of ``batching api`` (the only module that imports fastapi and
uvicorn): enqueue over HTTP, read an item's state and committed result, with a long poll.

Every error is one line of JSON, ``{"error": {"kind", "message"}}``: 401 no or unknown
token, 403 an item of another tenant, 404 no such item (or another tenant's), 409 a key
another tenant holds, 413 a body past the limit, 422 bad input, 429 the queue at its depth
cap (with ``Retry-After``), 503 the database (or an output) cannot be reached.

The queue and the outputs are synchronous SQLAlchemy: their calls run in the thread pool, and
POSTs are enqueued by one writer thread in groups, one transaction each (``writer``); a long
poll waits on the event loop between reads, holding no thread.

Why it stays one module: it is the one that imports fastapi, and its routes, their error
answers and the settings they read are one surface, the OpenAPI schema; what is not HTTP
lives beside it (``writer``, ``wakeup``, ``results``, ``tokens``, ``requests``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import functools
import gc
import json
import logging
import socket
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Annotated, Any

import orjson
from fastapi import Depends, FastAPI, Path, Query, Request, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from batching import errors, models
from batching.api import door, requests, tokens, wakeup, writer
from batching.api.results import TERMINAL, ItemView, Results
from batching.ingress import ingest
from batching.ingress.watch import CommitWatch
from batching.store import database

logger = logging.getLogger(__name__)

BODY_STALL_S = 30.0
"""The longest a request's body may pause between bytes before it is refused with 408."""
MAX_WAIT_S = 30.0
"""The longest long poll (``wait_s``)."""
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024
INLINE_BYTES = 64 * 1024
"""A POST body up to this size is parsed on the event loop, a larger one in a thread."""
LARGE_BYTES = 1024 * 1024
"""Bodies past this are read one at a time (``post_items``); those between INLINE_BYTES and
this side by side, so a tenant's 70 KiB request never waits behind another's 16 MiB ones."""


Observe = Callable[[str, str, str, int], None]
"""Told what each POST did with its items: (queue, tenant, outcome, n), the outcome one of
``enqueued``, ``duplicate`` (its key already queued), ``shed_depth_cap`` and
``shed_tenant_share`` (a 429); the CLI counts them (``batching_api_items_total``)."""


@dataclass(frozen=True)
class Settings:
    """What the application is given (the CLI builds it from the config and environment).

    ``watch``: long polls are answered after the commit that finishes their item
    (``wakeup``), or after ``backstop_s`` at most; without it, every ``poll_s``. POSTs are
    written in groups (``writer``): up to ``group_max_records`` records a transaction,
    lingering ``group_linger_s`` for more. ``observe`` hears each POST's outcome;
    ``metrics`` (the exposition and its content type) is served on ``GET /metrics``.
    ``fits``: a payload the model cannot take is refused with 422 (``requests.records``).
    """

    results: Results
    tokens: tokens.Tokens
    limits: ingest.ItemLimits = field(default_factory=ingest.ItemLimits)
    fits: requests.Fits | None = None
    max_attempts: int = 5
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1
    poll_s: float = 0.025
    watch: bool = True
    backstop_s: float = 0.5
    group_max_records: int = writer.DEFAULT_MAX_RECORDS
    group_linger_s: float = 0.0
    observe: Observe | None = None
    metrics: Callable[[], tuple[bytes, str]] | None = None
    queue: str | None = None  # the one queue served (the config's); None: any (tests)


class ApiError(Exception):
    """An answer other than success: its HTTP status, kind and one-line message."""

    def __init__(
        self, status: int, kind: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers


class ItemsResponse(JSONResponse):
    """An items document, encoded by orjson: a W2 result (256 floats) took json.dumps ~8% of
    the event loop's time at 92 requests a second. Its floats are finite (the runner fails a
    row with a non-finite output, so none is committed); a SQL output's column names are a
    ``str`` subclass, which orjson takes as keys only with ``OPT_NON_STR_KEYS``."""

    def render(self, content: Any) -> bytes:
        return orjson.dumps(content, option=orjson.OPT_NON_STR_KEYS)


def error_response(
    status: int, kind: str, message: str, headers: dict[str, str] | None = None
) -> JSONResponse:
    """``{"error": {"kind", "message"}}``, the message on one line."""
    line = " ".join(message.split())
    return JSONResponse({"error": {"kind": kind, "message": line}}, status, headers=headers)


def create_app(settings: Settings) -> FastAPI:
    """The application serving ``settings``' queue database and outputs."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        watch = CommitWatch(settings.results.engine) if settings.watch else None
        backstop_s = settings.backstop_s if watch is not None else settings.poll_s
        waiters = wakeup.Waiters(
            settings.results.finished,
            watch,
            acked=settings.results.acked,
            backstop_s=backstop_s,
        )
        app.state.waiters = waiters
        app.state.door = door.Door(functools.partial(_commit_mark, settings.results, watch))
        app.state.large_bodies = asyncio.Semaphore(1)  # see post_items
        if app.state.writer.closed:  # served again after a shutdown
            app.state.writer = _writer(settings)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.writer.close)
            await run_in_threadpool(waiters.close)

    app = FastAPI(
        lifespan=lifespan,
        title="batching",
        summary="Durable dynamic batching: enqueue items, read their committed results.",
        version="1",
    )
    app.state.settings = settings
    app.state.writer = _writer(settings)
    app.state.door = door.Door(None)  # the lifespan's sees commits
    _handlers(app)
    _routes(app, settings)
    return app


def _writer(settings: Settings) -> writer.Writer:
    return writer.Writer(
        settings.results,
        settings.max_attempts,
        max_records=settings.group_max_records,
        linger_s=settings.group_linger_s,
    )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket on ``host:port``, bound before the server says it serves.

    Raises:
        ConfigError: the address cannot be bound (in use, privileged, an unknown host).
    """
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
        sock = socket.socket(family, kind, proto)
    except (OSError, UnicodeError) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else exc
        raise errors.ConfigError(
            f"cannot serve on host {host!r} ({reason}); check --host"
        ) from None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(address)
    except OSError as exc:
        sock.close()
        raise errors.ConfigError(
            f"cannot serve on {host}:{port} ({exc.strerror or exc}); choose a free port (--port)"
        ) from None
    sock.set_inheritable(True)
    return sock


def serve(app: FastAPI, sock: socket.socket) -> None:
    """Serve ``app`` with uvicorn (one process) on ``sock`` (:func:`bind`) until SIGINT or
    SIGTERM."""
    import uvicorn

    server = uvicorn.Server(
        uvicorn.Config(
            app,
            log_level="warning",
            access_log=False,
            # Past the longest long poll, the requests still in flight are cut: a client
            # that stopped sending its body held a SIGTERM'd API open until it hung up.
            timeout_graceful_shutdown=int(MAX_WAIT_S) + 5,
        )
    )
    # What is alive now (FastAPI, pydantic, SQLAlchemy; torch, where payloads are checked) is
    # frozen out of the cyclic GC for the server's life, as the scorer does for a run: each
    # collection of the oldest generation walked it all again, with the GIL held (40 ms of
    # 89k objects, 150 ms of 344k with torch, measured), stalling every request meanwhile.
    gc.collect()
    gc.freeze()
    try:
        server.run(sockets=[sock])
    finally:
        gc.unfreeze()


# -- errors -------------------------------------------------------------------------------------

_STATUS: tuple[tuple[type[Exception], int], ...] = (
    (requests.TenantMismatch, 403),
    (writer.Conflict, 409),
    (errors.QueueFull, 429),
    (errors.InputError, 422),
    (errors.ConfigError, 422),
    (errors.SchemaError, 503),
    (errors.QueueError, 503),
    (errors.SinkError, 503),
)


def _hidden(exc: Exception) -> str | None:
    """What a client is told instead of ``exc``'s message, when that names the server's side
    (its files; its database's host, port and name, on /readyz to anyone: a security
    review); None to send the message (a refusal at the depth cap says what to do)."""
    if isinstance(exc, errors.SinkError):
        return "the item's output cannot be read now"
    if isinstance(exc, errors.SchemaError):
        return "the queue database's schema is not this API's version"
    if isinstance(exc, errors.QueueError) and not isinstance(exc, errors.QueueFull):
        return "the queue database is unavailable now"
    return None


def _handlers(app: FastAPI) -> None:
    async def api_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, ApiError)
        return error_response(exc.status, exc.kind, exc.message, exc.headers)

    async def batching_error(request: Request, exc: Exception) -> JSONResponse:
        status = next((code for kind, code in _STATUS if isinstance(exc, kind)), 500)
        headers = None
        if status == 429:
            retry = request.app.state.settings.retry_after_s
            headers = {"Retry-After": str(retry)}
        message = str(exc)
        hidden = _hidden(exc)
        if hidden is not None:  # names the server's files or database: logged, not sent
            logger.warning(hidden, extra={"action": "api_unavailable", "error": message})
            message = f"{hidden} (the API's log says why)"
        return error_response(status, type(exc).__name__, message, headers)

    async def invalid(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, RequestValidationError)
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()))
        return error_response(422, "InputError", f"{where}: {first.get('msg', 'invalid')}")

    async def http_error(_request: Request, exc: Exception) -> JSONResponse:
        assert isinstance(exc, HTTPException)
        headers = dict(exc.headers) if exc.headers else None
        return error_response(exc.status_code, "HTTPError", str(exc.detail), headers)

    async def unexpected(_request: Request, exc: Exception) -> JSONResponse:
        logger.error("request failed", exc_info=exc, extra={"action": "api_unexpected"})
        return error_response(500, "unexpected", f"unexpected {type(exc).__name__} (a bug)")

    app.add_exception_handler(ApiError, api_error)
    app.add_exception_handler(errors.BatchingError, batching_error)
    app.add_exception_handler(RequestValidationError, invalid)
    app.add_exception_handler(HTTPException, http_error)
    app.add_exception_handler(Exception, unexpected)


# -- auth ---------------------------------------------------------------------------------------


_BEARER = HTTPBearer(auto_error=False, description="a token of `BATCHING_API_TOKENS`")


async def _tenant(
    request: Request, _shown: Annotated[HTTPAuthorizationCredentials | None, Security(_BEARER)]
) -> str:
    """The tenant of the request's bearer token; 401 without a known one. (``_BEARER`` puts
    the scheme in the OpenAPI schema, so a generated client sends the token; the header is
    read here, for this API's own 401 messages.) ``async`` because it never blocks: FastAPI
    runs a plain ``def`` dependency in its thread pool, a thread hop per request each."""
    authorization = request.headers.get("authorization")
    scheme, _, token = (authorization or "").partition(" ")
    challenge = {"WWW-Authenticate": "Bearer"}
    if scheme.lower() != "bearer" or not token.strip():
        raise ApiError(401, "Unauthorized", "give Authorization: Bearer TOKEN", challenge)
    tenant = request.app.state.settings.tokens.tenant_of(token.strip())
    if tenant is None:
        raise ApiError(
            401, "Unauthorized", "unknown token; use one the server was given", challenge
        )
    return str(tenant)


Tenant = Annotated[str, Depends(_tenant)]
QueueName = Annotated[str, Path(min_length=1, max_length=200, pattern=r"^[^\x00/]+$")]


async def _served(request: Request, queue: QueueName, _tenant: Tenant) -> str:
    """The path's queue, when it is the one this API serves (its config's ``queue.name``:
    its item limits, its output read back); else 404, after the token is checked. Any other
    queue's items were enqueued and never read back (the wrong output), or never scored."""
    served = request.app.state.settings.queue
    if served is not None and queue != served:
        raise ApiError(
            404,
            "NotFound",
            f"queue {queue!r} is not served here: this API serves {served!r} (its config's "
            "queue.name); use the API started with that queue's config",
        )
    return queue


Served = Annotated[str, Depends(_served)]
ItemKey = Annotated[str, Path(min_length=1, max_length=500, pattern=r"^[^\x00]+$")]
WaitS = Annotated[
    float,
    Query(
        ge=0,
        le=MAX_WAIT_S,
        allow_inf_nan=False,
        description="long poll: answer once final, or after this long",
    ),
]


# -- routes -------------------------------------------------------------------------------------


def _routes(app: FastAPI, settings: Settings) -> None:
    @app.get("/healthz", summary="The process is up.")
    async def healthz() -> dict[str, bool]:
        return {"ok": True}

    if settings.metrics is not None:
        exposition = settings.metrics

        @app.get("/metrics", include_in_schema=False)
        def metrics() -> Response:
            body, content_type = exposition()
            return Response(body, media_type=content_type)

    @app.get("/readyz", summary="The database is reachable and its schema current (else 503).")
    def readyz() -> dict[str, bool]:
        # New items would otherwise be written to an unlinked file and lost with the process.
        database.require_file_still_there(settings.results.engine)
        settings.results.queue("default").check_schema()
        return {"ok": True}

    @app.post(
        "/v1/queues/{queue}/items",
        status_code=201,
        summary="Enqueue one item, or {items: [...]}; idempotent on item_key.",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": requests.BODY_SCHEMA}},
            }
        },
        responses={
            200: {"description": "every item was already present"},
            404: {"description": _NOT_SERVED},
            **_ERRORS,
        },
    )
    async def post_items(
        request: Request, queue: Served, tenant: Tenant, wait_s: WaitS = 0.0
    ) -> JSONResponse:
        ends = time.monotonic() + wait_s
        raw = await _read_body(request, settings.max_body_bytes)
        entry: door.Door = request.app.state.door
        if (shut := entry.refusal(queue, tenant)) is not None:  # full: the body is not parsed
            _observe(settings, queue, tenant, f"shed_{shut.reason}", door.items_in(raw))
            raise shut
        if len(raw) <= INLINE_BYTES:  # cheaper here than the hop to a thread
            records = _records(settings, tenant, _json_of(raw))
        elif len(raw) <= LARGE_BYTES:
            records = await run_in_threadpool(lambda: _records(settings, tenant, _json_of(raw)))
        else:  # one at a time: a 16 MiB body of tiny JSON values peaks at ~1 GB as objects,
            # and six at once took 2.5 GB and held every other tenant's request for seconds
            # (a security review); the largest bodies now wait for each other, not the API
            async with request.app.state.large_bodies:
                records = await run_in_threadpool(lambda: _records(settings, tenant, _json_of(raw)))
        waiters: wakeup.Waiters = request.app.state.waiters
        keys = dict.fromkeys(r.item_key for r in records) if wait_s > 0 else {}
        futures = {k: waiters.register(queue, k) for k in keys}  # before the writer reads
        try:
            mark = entry.mark()  # before the writer looks: a commit meanwhile opens the door
            post = request.app.state.writer.submit(queue, tenant, records)
            try:
                doc, created = await asyncio.wrap_future(post.answer)
            except errors.QueueFull as full:
                _observe(settings, queue, tenant, f"shed_{full.reason}", len(records))
                entry.close(queue, tenant, full, mark)
                raise
            new = sum(1 for item in doc["items"] if item["created"])
            _observe(settings, queue, tenant, "enqueued", new)
            _observe(settings, queue, tenant, "duplicate", len(doc["items"]) - new)
            if futures:
                final = await _finals(settings, queue, doc["items"], futures, ends)
                doc = {"items": [_with_result(i, final.get(i["item_key"])) for i in doc["items"]]}
        finally:
            for key, future in futures.items():
                waiters.cancel(queue, key, future)
        return ItemsResponse(doc, 201 if created else 200)

    @app.get(
        "/v1/queues/{queue}",
        summary="The queue's depth by state for the token's tenant, as `batching status --json`.",
        description="The live states are read at each request; `done` is the last count of "
        "the queue's done items, made in the background when a read finds it 10 s old "
        "(`done_counted_at`: epoch seconds when it started; a client polling every few "
        "seconds sees one about 10 s old at most). Reads in the API's first 30 s wait for the "
        "first count; after that `done` is absent until one has landed.",
        responses={404: {"description": _NOT_SERVED}, **_ERRORS},
    )
    def get_queue(queue: Served, tenant: Tenant) -> dict[str, Any]:
        database.require_file_still_there(settings.results.engine)  # as an item's GET
        return settings.results.stats(queue, tenant)

    @app.get(
        "/v1/queues/{queue}/items/{item_key:path}",
        summary="An item's state and committed result; wait_s long-polls until it is final.",
        responses={404: {"description": f"no such item, or {_NOT_SERVED}"}, **_ERRORS},
    )
    async def get_item(
        request: Request, queue: Served, item_key: ItemKey, tenant: Tenant, wait_s: WaitS = 0.0
    ) -> JSONResponse:
        # A file gone from its path: no answer from the unlinked one a pooled connection reads.
        database.require_file_still_there(settings.results.engine)
        view = await _wait(settings, request.app.state.waiters, queue, item_key, tenant, wait_s)
        return ItemsResponse(view.doc())


_NOT_SERVED = "a queue this API does not serve (only its config's queue.name)"
_ERRORS: dict[int | str, dict[str, Any]] = {
    code: {"description": what}
    for code, what in (
        (401, "no or unknown bearer token"),
        (403, "an item names another tenant"),
        (409, "an item_key another tenant holds"),
        (413, "the body is past the size limit"),
        (422, "bad input: {error: {kind, message}}"),
        (429, "the queue is at its depth cap; retry after Retry-After seconds"),
        (503, "the database or the output cannot be reached"),
    )
}


def _commit_mark(results: Results, watch: CommitWatch | None) -> object:
    """What moves when a batch commits, for the door (``door.Door``): the ledger's last row
    on SQLite, the commit watch's generation on PostgreSQL (it wakes on acks); None: unknown."""
    if results.engine.dialect.name == "sqlite":
        return results.acked()  # None until the first batch: a mark too
    return watch.mark() if watch is not None else None


def _observe(settings: Settings, queue: str, tenant: str, outcome: str, n: int) -> None:
    if settings.observe is not None and n > 0:
        settings.observe(queue, tenant, outcome, n)


async def _read_body(request: Request, max_bytes: int) -> bytes:
    """The body, refused with 413 past ``max_bytes`` (before it is read whole)."""
    too_big = ApiError(
        413, "PayloadTooLarge", f"the body is over {max_bytes} bytes; split it into requests"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    loop = asyncio.get_running_loop()
    try:
        # A client that stops sending its body is cut after BODY_STALL_S without a byte:
        # before, it held its connection (and a SIGTERM'd API) open for as long as it liked.
        async with asyncio.timeout(BODY_STALL_S) as stall:
            async for chunk in request.stream():
                size += len(chunk)
                if size > max_bytes:
                    raise too_big
                chunks.append(chunk)
                stall.reschedule(loop.time() + BODY_STALL_S)
    except TimeoutError:
        raise ApiError(
            408, "RequestTimeout", f"no byte of the body for {BODY_STALL_S:g} s; send it whole"
        ) from None
    except ClientDisconnect:  # the client's doing, not a bug: nobody reads the answer
        raise ApiError(
            400, "ClientDisconnect", "the client left before its body was sent"
        ) from None
    return b"".join(chunks)


def _json_of(raw: bytes) -> Any:
    """The body as JSON; 400 when it is not."""
    try:
        return json.loads(raw)
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ApiError(
            400, "InputError", f"body: not valid JSON ({reason}); send one JSON document"
        ) from None


def _records(settings: Settings, tenant: str, body: Any) -> list[models.EnqueueRecord]:
    """A body's records, validated (before the request joins a group: its errors are its own);
    the writer (``writer.Writer``) enqueues them."""
    try:
        return requests.records(body, tenant, settings.limits, settings.fits)
    except RecursionError:
        raise errors.InputError("body: nested too deeply; flatten the payload") from None


async def _wait(
    settings: Settings,
    waiters: wakeup.Waiters,
    queue: str,
    key: str,
    tenant: str,
    wait_s: float,
) -> ItemView:
    """The item, once final or after ``wait_s``; 404 when unknown or another tenant's. It
    waits registered with ``waiters`` (before its first read: see ``wakeup``)."""
    ends = time.monotonic() + wait_s
    future = waiters.register(queue, key) if wait_s > 0 else None
    try:
        view = await run_in_threadpool(settings.results.item, queue, key)
        if view is None or view.tenant != tenant:
            raise ApiError(404, "NotFound", f"no item {key!r} in queue {queue!r} for this token")
        if view.terminal or future is None:
            return view
        with contextlib.suppress(TimeoutError):
            return await asyncio.wait_for(
                asyncio.wrap_future(future), max(0.0, ends - time.monotonic())
            )
        latest = await run_in_threadpool(settings.results.item, queue, key)
        return latest if latest is not None else view
    finally:
        if future is not None:
            waiters.cancel(queue, key, future)


async def _finals(
    settings: Settings,
    queue: str,
    items: list[dict[str, Any]],
    futures: dict[str, concurrent.futures.Future[ItemView]],
    ends: float,
) -> dict[str, ItemView]:
    """A waiting POST's items once final (or as they are at ``ends``), by key: those final
    when written (present before) read now, the others as their futures resolve."""
    terminal = {s.name.lower() for s in TERMINAL}
    already = [i["item_key"] for i in items if i["state"] in terminal]
    final: dict[str, ItemView] = {}
    if already:
        final.update(await run_in_threadpool(settings.results.finished, queue, already))
    pending = [
        asyncio.wrap_future(futures[i["item_key"]]) for i in items if i["item_key"] not in final
    ]
    for wrapped in pending:  # its error is read below from the future it wraps, not from it
        wrapped.add_done_callback(_retrieved)
    if pending:
        await asyncio.wait(pending, timeout=max(0.0, ends - time.monotonic()))
    for item in items:
        future = futures[item["item_key"]]
        if item["item_key"] not in final and future.done() and not future.cancelled():
            final[item["item_key"]] = future.result()
    return final


def _retrieved(wrapped: asyncio.Future[Any]) -> None:
    """Mark a wrapper's exception retrieved: else asyncio logs "Future exception was never
    retrieved" with a traceback for every item whose result could not be read."""
    if not wrapped.cancelled():
        wrapped.exception()


def _with_result(item: dict[str, Any], view: ItemView | None) -> dict[str, Any]:
    """A POSTed item with its state, result, error and model version once final."""
    if view is None:
        return item | {"result": None, "error": None, "model_version": None}
    doc = view.doc()
    return item | {k: doc[k] for k in ("state", "result", "error", "model_version")}
