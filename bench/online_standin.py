"""A stand-in for `batching api` + scorer, for `bench/online_bench.py --dry-run`. Not a test.

It speaks the ingress contract the open-loop generator codes against, with a simulated scorer
(no model, no database) so the generator, its statistics and its table can be checked in a few
seconds on any machine:

    POST /v1/queues/{queue}/items?wait_s=N   {"item_key", "payload"}, Authorization: Bearer
        <token>; {"items": [{... as GET}]}, long-polls until terminal
        201 new, 200 existing, 401 unknown token, 429 + Retry-After at the depth cap
    GET  /v1/queues/{queue}/items/{item_key}?wait_s=N
        {"item_key", "state", "result", "error", "model_version"}, long-polls until terminal
    POST /predict                   {"tokens": [...]} -> {"y": ...} when scored (a peer's shape)
    GET  /health

The simulated scorer forms a batch when the oldest item has waited ``--window-s`` or
``--max-batch`` items are ready, "scores" it for ``--fixed-s + --per-item-s * size`` seconds,
and with ``--late-policy expire`` expires items already older than ``--slo-s`` instead.

    python bench/online_standin.py --port 8765 [--max-depth 200] [--late-policy expire]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time
from collections import deque
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager, suppress
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from fastapi import FastAPI, Header, HTTPException, Request
from fastapi.responses import JSONResponse

TERMINAL = {"done", "dead", "expired", "cancelled"}


@dataclass
class Item:
    key: str
    tenant: str
    enqueued: float
    state: str = "ready"
    result: Any = None
    event: asyncio.Event = field(default_factory=asyncio.Event)

    def doc(self) -> dict[str, Any]:
        return {
            "item_key": self.key,
            "state": self.state,
            "result": self.result,
            "error": "past its deadline" if self.state == "expired" else None,
            "model_version": "standin-v1",
        }


def build_app(args: argparse.Namespace) -> FastAPI:
    tokens = dict(
        pair.split("=", 1) for pair in os.environ.get("BATCHING_API_TOKENS", "").split(",") if pair
    )
    items: dict[str, Item] = {}
    ready: deque[Item] = deque()
    wake = asyncio.Event()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        task = asyncio.create_task(scorer())
        yield
        task.cancel()

    app = FastAPI(title="online-bench stand-in", lifespan=lifespan)

    def tenant_of(authorization: str | None) -> str:
        token = (authorization or "").removeprefix("Bearer ").strip()
        if token not in tokens:
            raise HTTPException(401, "unknown token")
        return tokens[token]

    def admit(key: str, tenant: str) -> tuple[Item, bool]:
        if key in items:
            return items[key], False
        if args.max_depth is not None and len(ready) >= args.max_depth:
            raise HTTPException(429, "queue full", headers={"Retry-After": "1"})
        item = Item(key, tenant, time.monotonic())
        items[key] = item
        ready.append(item)
        wake.set()
        return item, True

    async def scorer() -> None:
        while True:
            if not ready:
                wake.clear()
                await wake.wait()
            due = ready[0].enqueued + args.window_s
            while len(ready) < args.max_batch and time.monotonic() < due:
                await asyncio.sleep(min(0.002, max(0.0, due - time.monotonic())))
            batch = [ready.popleft() for _ in range(min(args.max_batch, len(ready)))]
            now = time.monotonic()
            if args.late_policy == "expire":
                late = [i for i in batch if now - i.enqueued > args.slo_s]
                batch = [i for i in batch if now - i.enqueued <= args.slo_s]
                for item in late:
                    item.state = "expired"
                    item.event.set()
            if batch:
                await asyncio.sleep(args.fixed_s + args.per_item_s * len(batch))
            for item in batch:
                item.state, item.result = "done", {"score": 0.5}
                item.event.set()

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/queues/{queue}/items")
    async def post_item(
        queue: str,
        request: Request,
        wait_s: float = 0.0,
        authorization: str | None = Header(None),
    ) -> JSONResponse:
        tenant = tenant_of(authorization)
        body = await request.json()
        item, new = admit(f"{queue}/{body['item_key']}", tenant)
        if item.state not in TERMINAL and wait_s > 0:
            with suppress(TimeoutError):
                await asyncio.wait_for(item.event.wait(), wait_s)
        doc = item.doc() | {"item_key": body["item_key"], "created": new}
        return JSONResponse({"items": [doc]}, 201 if new else 200)

    @app.get("/v1/queues/{queue}/items/{item_key}")
    async def get_item(
        queue: str, item_key: str, wait_s: float = 0.0, authorization: str | None = Header(None)
    ) -> dict[str, Any]:
        tenant_of(authorization)
        item = items.get(f"{queue}/{item_key}")
        if item is None:
            raise HTTPException(404, "no such item")
        if item.state not in TERMINAL and wait_s > 0:
            with suppress(TimeoutError):
                await asyncio.wait_for(item.event.wait(), wait_s)
        return item.doc() | {"item_key": item_key}

    counter = iter(range(1 << 62))

    @app.post("/predict")
    async def predict(request: Request) -> dict[str, Any]:
        await request.json()
        item, _ = admit(f"predict/{next(counter)}", "peer")
        await item.event.wait()
        return {"y": item.result}

    return app


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--max-batch", type=int, default=32)
    parser.add_argument("--window-s", type=float, default=0.01)
    parser.add_argument("--fixed-s", type=float, default=0.004)
    parser.add_argument("--per-item-s", type=float, default=0.0015)
    parser.add_argument("--max-depth", type=int, default=None)
    parser.add_argument("--late-policy", choices=["score", "expire"], default="score")
    parser.add_argument("--slo-s", type=float, default=1.0)
    args = parser.parse_args()
    uvicorn.run(build_app(args), host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
