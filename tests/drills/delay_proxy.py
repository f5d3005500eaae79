"""A TCP proxy that adds latency: every chunk is delivered ``delay_s`` after it arrived, in
order, in both directions (a slow network or an overloaded dependency, not a slow bandwidth).

In a test: ``with DelayProxy(upstream_port, delay_s=0.01) as proxy:`` then connect to
``proxy.port``; ``proxy.delay_s`` may change while it runs. As a command, in front of any
server (the drills in docs/operations.md use it this way)::

    python -m tests.drills.delay_proxy --upstream 127.0.0.1:5432 --port 6432 --delay-ms 20
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import threading
import time
from types import TracebackType

_CHUNK_BYTES = 65536


class DelayProxy:
    """The proxy, serving on a loopback port from its own thread (an asyncio loop)."""

    def __init__(
        self, upstream_port: int, *, delay_s: float, upstream_host: str = "127.0.0.1"
    ) -> None:
        self.upstream = (upstream_host, upstream_port)
        self.delay_s = delay_s
        self.port = 0
        self.connections = 0
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True, name="delay-proxy")
        self._server: asyncio.Server | None = None

    def __enter__(self) -> DelayProxy:
        self._thread.start()
        if not self._ready.wait(10):
            raise RuntimeError("the delay proxy did not start")
        return self

    def __exit__(
        self,
        kind: type[BaseException] | None,
        value: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(10)

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._server = self._loop.run_until_complete(
            asyncio.start_server(self._connection, "127.0.0.1", self.port)
        )
        self.port = int(self._server.sockets[0].getsockname()[1])
        self._ready.set()
        try:
            self._loop.run_forever()
        finally:
            self._server.close()
            for task in asyncio.all_tasks(self._loop):
                task.cancel()
            with contextlib.suppress(Exception):
                self._loop.run_until_complete(asyncio.sleep(0))
            self._loop.close()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        except OSError:
            writer.close()
            return
        await asyncio.gather(
            self._pipe(reader, up_writer), self._pipe(up_reader, writer), return_exceptions=True
        )

    async def _pipe(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Read chunks as they come; deliver each ``delay_s`` after it came, in order."""
        chunks: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

        async def deliver() -> None:
            while True:
                due, data = await chunks.get()
                if not data:
                    break
                wait_s = due - time.monotonic()
                if wait_s > 0:
                    await asyncio.sleep(wait_s)
                writer.write(data)
                await writer.drain()

        sender = asyncio.ensure_future(deliver())
        try:
            while data := await reader.read(_CHUNK_BYTES):
                chunks.put_nowait((time.monotonic() + self.delay_s, data))
        finally:
            chunks.put_nowait((0.0, b""))
            with contextlib.suppress(Exception):
                await sender
            writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--upstream", required=True, help="HOST:PORT of the real server")
    parser.add_argument("--port", type=int, default=0, help="loopback port to serve on")
    parser.add_argument("--delay-ms", type=float, required=True, help="one-way latency added")
    args = parser.parse_args()
    host, _, port = args.upstream.rpartition(":")
    proxy = DelayProxy(int(port), delay_s=args.delay_ms / 1000, upstream_host=host)
    proxy.port = args.port
    with proxy:
        print(f"127.0.0.1:{proxy.port} -> {args.upstream} (+{args.delay_ms:g} ms each way)")
        with contextlib.suppress(KeyboardInterrupt):
            threading.Event().wait()


if __name__ == "__main__":
    main()
