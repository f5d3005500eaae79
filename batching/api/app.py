"""The FastAPI application of ``batching api`` (the only module that imports fastapi and
uvicorn): enqueue over HTTP, read an item's state and committed result, with a long poll.

Every error is one line of JSON, ``{"error": {"kind", "message"}}``: 401 no or unknown
token, 403 an item of another tenant, 404 no such item (or another tenant's), 409 a key
another tenant holds, 413 a body past the limit, 422 bad input, 429 the queue at its depth
cap (with ``Retry-After``), 503 the database (or an output) cannot be reached.

The queue and the outputs are synchronous SQLAlchemy: their calls run in the thread pool, and
POSTs are enqueued by one writer thread in groups, one transaction each (``writer``); a long
poll waits on the event loop between reads, holding no thread.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable
from dataclasses import dataclass, field
from typing import Annotated, Any

from fastapi import Depends, FastAPI, Header, Path, Query, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException

from batching import errors, models
from batching.api import requests, tokens, wakeup, writer
from batching.api.results import ItemView, Results
from batching.ingress import ingest
from batching.ingress.watch import CommitWatch

logger = logging.getLogger(__name__)

MAX_WAIT_S = 30.0
"""The longest long poll (``wait_s``)."""
DEFAULT_MAX_BODY_BYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class Settings:
    """What the application is given (the CLI builds it from the config and environment).

    ``watch``: long polls wake on commit (``wakeup``), reading the item again at least every
    ``backstop_s``; without it, every ``poll_s``. POSTs are written in groups (``writer``):
    up to ``group_max_records`` records a transaction, lingering ``group_linger_s`` for more.
    """

    results: Results
    tokens: tokens.Tokens
    limits: ingest.ItemLimits = field(default_factory=ingest.ItemLimits)
    max_attempts: int = 5
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    retry_after_s: int = 1
    poll_s: float = 0.025
    watch: bool = True
    backstop_s: float = 0.5
    group_max_records: int = writer.DEFAULT_MAX_RECORDS
    group_linger_s: float = 0.0


class ApiError(Exception):
    """An answer other than success: its HTTP status, kind and one-line message."""

    def __init__(
        self, status: int, kind: str, message: str, headers: dict[str, str] | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.kind, self.message, self.headers = status, kind, message, headers


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
        signal = None
        if settings.watch:
            watch = CommitWatch(settings.results.engine)
            signal = wakeup.CommitSignal(watch, backstop_s=settings.backstop_s)
            signal.start(asyncio.get_running_loop())
        app.state.signal = signal
        if app.state.writer.closed:  # served again after a shutdown
            app.state.writer = _writer(settings)
        try:
            yield
        finally:
            await run_in_threadpool(app.state.writer.close)
            if signal is not None:
                await run_in_threadpool(signal.close)

    app = FastAPI(
        lifespan=lifespan,
        title="batching",
        summary="Durable dynamic batching: enqueue items, read their committed results.",
        version="1",
    )
    app.state.settings = settings
    app.state.writer = _writer(settings)
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


def serve(app: FastAPI, host: str, port: int) -> None:
    """Serve ``app`` with uvicorn (one process) until SIGINT or SIGTERM."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level="warning", access_log=False)


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
        return error_response(status, type(exc).__name__, str(exc), headers)

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


def _tenant(request: Request, authorization: Annotated[str | None, Header()] = None) -> str:
    """The tenant of the request's bearer token; 401 without a known one."""
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
ItemKey = Annotated[str, Path(min_length=1, max_length=500, pattern=r"^[^\x00]+$")]


# -- routes -------------------------------------------------------------------------------------


def _routes(app: FastAPI, settings: Settings) -> None:
    @app.get("/healthz", summary="The process is up.")
    def healthz() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/readyz", summary="The database is reachable and its schema current (else 503).")
    def readyz() -> dict[str, bool]:
        settings.results.queue("default").check_schema()
        return {"ok": True}

    @app.post(
        "/v1/queues/{queue}/items",
        status_code=201,
        summary="Enqueue one item, or {items: [...]}; idempotent on item_key.",
        openapi_extra={
            "requestBody": {
                "required": True,
                "content": {"application/json": {"schema": BODY_SCHEMA}},
            }
        },
        responses={200: {"description": "every item was already present"}, **_ERRORS},
    )
    async def post_items(request: Request, queue: QueueName, tenant: Tenant) -> JSONResponse:
        body = await _read_json(request, settings.max_body_bytes)
        records = await run_in_threadpool(_records, settings, tenant, body)
        post = request.app.state.writer.submit(queue, tenant, records)
        doc, created = await asyncio.wrap_future(post.answer)
        return JSONResponse(doc, 201 if created else 200)

    @app.get(
        "/v1/queues/{queue}",
        summary="The queue's depth by state for the token's tenant, as `batching status --json`.",
        responses=_ERRORS,
    )
    def get_queue(queue: QueueName, tenant: Tenant) -> dict[str, Any]:
        return settings.results.stats(queue, tenant)

    @app.get(
        "/v1/queues/{queue}/items/{item_key}",
        summary="An item's state and committed result; wait_s long-polls until it is final.",
        responses={404: {"description": "no such item"}, **_ERRORS},
    )
    async def get_item(
        request: Request,
        queue: QueueName,
        item_key: ItemKey,
        tenant: Tenant,
        wait_s: Annotated[float, Query(ge=0, le=MAX_WAIT_S)] = 0.0,
    ) -> JSONResponse:
        signal = getattr(request.app.state, "signal", None)
        view = await _wait(settings, signal, queue, item_key, tenant, wait_s)
        return JSONResponse(view.doc())


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
_ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["item_key", "payload"],
    "properties": {
        "item_key": {"type": "string", "maxLength": 500},
        "payload": {
            "description": 'a JSON object or array, or {"tensor": {"dtype", "shape", "data_b64"}}',
            "oneOf": [{"type": "object"}, {"type": "array"}],
        },
        "tenant": {"type": "string", "description": "the token's tenant (the default)"},
        "priority": {"type": "integer"},
        "deadline": {"oneOf": [{"type": "number"}, {"type": "string", "format": "date-time"}]},
        "cost": {"type": "integer", "minimum": 1},
        "lane": {"type": "string"},
    },
    "additionalProperties": False,
}
BODY_SCHEMA: dict[str, Any] = {
    "oneOf": [
        _ITEM_SCHEMA,
        {
            "type": "object",
            "required": ["items"],
            "properties": {"items": {"type": "array", "items": _ITEM_SCHEMA, "minItems": 1}},
            "additionalProperties": False,
        },
    ]
}


async def _read_json(request: Request, max_bytes: int) -> Any:
    """The body as JSON, refused with 413 past ``max_bytes`` (before it is read whole)."""
    too_big = ApiError(
        413, "PayloadTooLarge", f"the body is over {max_bytes} bytes; split it into requests"
    )
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and int(declared) > max_bytes:
        raise too_big
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > max_bytes:
            raise too_big
        chunks.append(chunk)
    try:
        return json.loads(b"".join(chunks))
    except (ValueError, RecursionError) as exc:  # JSONDecodeError and UnicodeDecodeError too
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ApiError(
            400, "InputError", f"body: not valid JSON ({reason}); send one JSON document"
        ) from None


def _records(settings: Settings, tenant: str, body: Any) -> list[models.EnqueueRecord]:
    """A body's records, validated (before the request joins a group: its errors are its own);
    the writer (``writer.Writer``) enqueues them."""
    try:
        return requests.records(body, tenant, settings.limits)
    except RecursionError:
        raise errors.InputError("body: nested too deeply; flatten the payload") from None


async def _wait(
    settings: Settings,
    signal: wakeup.CommitSignal | None,
    queue: str,
    key: str,
    tenant: str,
    wait_s: float,
) -> ItemView:
    """The item, once final or after ``wait_s``; 404 when unknown or another tenant's. Woken
    by a commit (``signal``; its ticket is taken before each read), else reads every
    ``poll_s``."""

    def read() -> Awaitable[ItemView | None]:
        return run_in_threadpool(settings.results.item, queue, key)

    ends = time.monotonic() + wait_s
    while True:
        ticket = signal.ticket() if signal is not None else None
        view = await read()
        if view is None or view.tenant != tenant:
            raise ApiError(404, "NotFound", f"no item {key!r} in queue {queue!r} for this token")
        left = ends - time.monotonic()
        if view.terminal or left <= 0:
            return view
        if signal is not None and ticket is not None:
            await signal.wait(ticket, left)
        else:
            await asyncio.sleep(min(settings.poll_s, left))
