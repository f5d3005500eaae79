"""Open-loop latency under load, request -> result over HTTP: us and the serving peers. Not a test.

One run, one machine, one seeded arrival schedule per point, in this order:

  batching  W2 (`deployments/online.yaml`): `batching api` + `batching score` started here;
            capacity measured first: the closed loop at --concurrency in flight (the
            reference, as the peers' harnesses measure; --capacity-method) and the queue's
            drain rate with a backlog kept ready; the depth cap set with `batching queue cap`
            (--max-depth: 429 past it); then Poisson and bursty arrivals (on/off: 1 s at
            1.75x, 1 s at 0.25x) at 50/90/110/150% of the reference
  noisy     W2, our server: three quiet tenants alone, then with a fourth offering 10x each
            of them (total 90% of capacity); the quiet tenants' p99 with and without it;
            then the same 90% spread evenly over the four (what the load alone costs)
  peers     W2, the same schedules (the same offered rates: equal load) against PyTriton,
            LitServe (their harnesses' servers, `$PEERS/bench_*.py --serve`) and Ray Serve
            through its HTTP proxy (`bench/online_ray_serve.py`), each after its own capacity
  batching  W1 (`deployments/tabular.yaml`), like W2 (no peers, no noisy run)

A request to us is one POST /v1/queues/{queue}/items?wait_s=N that answers once the item is
done, dead, expired or cancelled (then GET .../items/{key}?wait_s=N while it is not); to a
peer, one POST that returns the result. Per
request: scheduled, sent and result times, HTTP status, final state. Per point: p50/p99 of the
admitted requests from scheduled arrival to result (a request still open at the cut-off counts
at its age then, a lower bound, marked ">"), goodput (results within latency_slo_s, per second
of arrivals), shed at admission (429), expired after admission (late_policy), errors, and
the CPU each server's processes and the client used per second of the point; for ours also
where a done request's time went, joined to its item in the run's database (ingress, enqueue
to commit, delivery; p50/p99) and how many items committed past the SLO. The load goes
through a lean asyncio HTTP/1.1 client (httpx costs ~10x its CPU a request, taken from the
servers on a small machine; --client httpx to compare).

    python bench/online_bench.py --peers $PEERS [--budget-s 900] [--out DIR]
    python bench/online_bench.py --variant adaptive:batching.adaptive=true --variant fixed: ...
    python bench/online_bench.py --smoke --peers $PEERS       # each server answers one request
    python bench/online_bench.py --dry-run                    # stand-in server, ~1 minute
    python bench/online_bench.py --table DIR/summary.jsonl    # the markdown tables again
    $PEERS/venv-plot/bin/python bench/plot_online.py DIR/summary.jsonl -o docs/img/online-p99.png

The whole run keeps to --budget-s: the length of each point is planned from it, and a phase
that no longer fits is skipped (and listed). Results: DIR/summary.jsonl (one line a point,
capacity, noisy comparison or skipped phase), DIR/requests.jsonl.gz (one line a request),
DIR/logs/ (every server's output), the tables on stdout.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import contextlib
import gzip
import json
import math
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.parse
import zlib
from collections.abc import Callable, Coroutine, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx
import sqlalchemy as sa
import yaml

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = {"w2": ROOT / "deployments/online.yaml", "w1": ROOT / "deployments/tabular.yaml"}
PEERS = ("pytriton", "litserve", "ray_serve")
LOADS = (0.5, 0.9, 1.1, 1.5)
LOAD_LIMIT = 4.0  # the most --loads takes: past 4x capacity a point measures the client
PATTERNS = ("poisson", "bursty")
TERMINAL = frozenset({"done", "dead", "expired", "cancelled"})
# a fresh bearer token per tenant and run (the API takes them from BATCHING_API_TOKENS)
TOKENS = {t: secrets.token_urlsafe(24) for t in ("tenant-a", "tenant-b", "tenant-c", "noisy")}
QUIET = ("tenant-a", "tenant-b", "tenant-c")
NOISY_FACTOR = 10.0
# bursty arrivals: on at 1.75x the offered rate for BURST_PHASE_S, then off at 0.25x as long
BURST_HIGH, BURST_LOW, BURST_PHASE_S = 1.75, 0.25, 1.0
# planning estimates (seconds) of what is not a point: server start-up to the first answer
START_S = {"batching": 25.0, "pytriton": 40.0, "litserve": 25.0, "ray_serve": 50.0}
START_S |= {"standin": 3.0, "standin-peer": 3.0}
SETTLE_S = 3.0  # per point: drain and the probe that waits out a backlog


def now() -> float:
    return time.perf_counter()


# -- arrivals -------------------------------------------------------------------------------


def arrival_times(pattern: str, rate: float, duration_s: float, rng: random.Random) -> list[float]:
    """Arrival times in [0, duration_s): a Poisson process of ``rate``, or (bursty) an on/off
    modulated one: BURST_PHASE_S at BURST_HIGH x ``rate``, then BURST_PHASE_S at BURST_LOW x,
    and so on (a two-state MMPP with fixed sojourns: the mean is ``rate`` over every on/off
    pair, so a point offers the same load whatever its length)."""
    out: list[float] = []
    if rate <= 0:
        return out
    if pattern not in PATTERNS:
        raise ValueError(f"unknown arrival pattern {pattern!r}")
    phase_s = duration_s if pattern == "poisson" else BURST_PHASE_S
    t0, on = 0.0, True
    while t0 < duration_s:
        scale = 1.0 if pattern == "poisson" else (BURST_HIGH if on else BURST_LOW)
        end = min(t0 + phase_s, duration_s)
        t = t0 + rng.expovariate(rate * scale)
        while t < end:
            out.append(t)
            t += rng.expovariate(rate * scale)
        t0, on = end, not on
    return out


def schedule(
    pattern: str, rate: float, shares: dict[str, float], duration_s: float, seed_text: str
) -> list[tuple[float, str]]:
    """(time, tenant) arrivals: one process of the total rate (bursts hit every tenant at
    once), each arrival's tenant drawn by ``shares``. Seeded by ``seed_text``: every system
    gets the same schedule for the same point."""
    rng = random.Random(zlib.crc32(seed_text.encode()))
    times = arrival_times(pattern, rate, duration_s, rng)
    names, weights = list(shares), list(shares.values())
    return [(t, rng.choices(names, weights)[0]) for t in times]


# -- requests -------------------------------------------------------------------------------


@dataclass(slots=True)
class Req:
    """One request: times from perf_counter, state one of TERMINAL, shed (429), error,
    unfinished (still open at the cut-off) or pending."""

    i: int
    tenant: str
    t_sched: float
    t_sent: float = math.nan
    t_result: float = math.nan
    status: int = 0
    state: str = "pending"
    error: str = ""


@dataclass
class Target:
    """How the generator reaches one server. ``call`` fills a Req; never raises."""

    system: str
    workload: str
    variant: str
    slo_s: float
    call: Callable[[Http, Req, str], Coroutine[Any, Any, None]] = field(repr=False)


def ingress_call(
    base: str, queue: str, payloads: list[str], wait_s: float
) -> Callable[[Http, Req, str], Coroutine[Any, Any, None]]:
    """Our HTTP ingress: POST the item with a long poll, then GET until a terminal state."""
    items = f"{base}/v1/queues/{queue}/items"

    async def call(http: Http, rec: Req, key: str) -> None:
        auth = {"Authorization": f"Bearer {TOKENS[rec.tenant]}"}
        body = f'{{"item_key": "{key}", "payload": {payloads[rec.i % len(payloads)]}}}'
        rec.t_sent = now()
        try:
            r = await http.post(
                f"{items}?wait_s={wait_s}",
                content=body,
                headers=auth | {"Content-Type": "application/json"},
            )
            rec.status = r.status_code
            if r.status_code == 429:
                rec.state, rec.t_result = "shed", now()
                return
            if r.status_code not in (200, 201, 202):
                rec.state, rec.error = "error", f"POST {r.status_code}: {r.text[:160]}"
                return
            state = _item_state(r)
            while state not in TERMINAL:
                g = await http.get(f"{items}/{key}", params={"wait_s": wait_s}, headers=auth)
                if g.status_code != 200:
                    rec.state, rec.error = "error", f"GET {g.status_code}: {g.text[:160]}"
                    return
                state = _state(g)
            rec.state, rec.t_result = state, now()
        except (httpx.HTTPError, ValueError, KeyError) as exc:
            rec.state, rec.error = "error", f"{type(exc).__name__}: {str(exc)[:160]}"

    return call


def _item_state(r: Any) -> str | None:
    """The state of a POST's one item."""
    try:
        items = r.json()["items"]
    except (ValueError, KeyError, TypeError):
        return None
    return items[0].get("state") if items else None


def _state(r: Any) -> str | None:
    try:
        doc = r.json()
    except ValueError:
        return None
    return doc.get("state") if isinstance(doc, dict) else None


def post_call(
    url: str, bodies: list[bytes]
) -> Callable[[Http, Req, str], Coroutine[Any, Any, None]]:
    """A peer: one POST that answers with the result (429/503: shed)."""
    headers = {"Content-Type": "application/json"}

    async def call(http: Http, rec: Req, key: str) -> None:
        rec.t_sent = now()
        try:
            r = await http.post(url, content=bodies[rec.i % len(bodies)], headers=headers)
            rec.status = r.status_code
            if r.status_code == 200:
                rec.state, rec.t_result = "done", now()
            elif r.status_code in (429, 503):
                rec.state, rec.t_result = "shed", now()
            else:
                rec.state, rec.error = "error", f"POST {r.status_code}: {r.text[:160]}"
        except httpx.HTTPError as exc:
            rec.state, rec.error = "error", f"{type(exc).__name__}: {str(exc)[:160]}"

    return call


class Http(Protocol):
    """The two calls the generator makes: httpx.AsyncClient's, or RawHttp's."""

    async def post(self, url: str, *, content: str | bytes, headers: dict[str, str]) -> Any: ...

    async def get(
        self, url: str, *, params: dict[str, Any] | None = None, headers: dict[str, str]
    ) -> Any: ...


@dataclass
class RawResponse:
    status_code: int
    content: bytes

    @property
    def text(self) -> str:
        return self.content.decode("utf-8", "replace")

    def json(self) -> Any:
        return json.loads(self.content)

    def raise_for_status(self) -> None:
        if self.status_code >= 400:
            raise httpx.HTTPError(f"HTTP {self.status_code}: {self.text[:160]}")


class Slots:
    """A first-come connection limit whose waits cost O(1) each. ``asyncio.Semaphore`` (3.11)
    removes every woken waiter from the middle of its deque: with thousands of requests
    waiting for a connection that is O(n) a wake-up, and a client that fell behind once spent
    the whole event loop on it and never read its answers again (4,000 connections left in
    CLOSE-WAIT, the servers idle)."""

    def __init__(self, n: int) -> None:
        self.free = n
        self.waiters: collections.deque[asyncio.Future[None]] = collections.deque()

    async def __aenter__(self) -> None:
        if self.free > 0 and not self.waiters:
            self.free -= 1
            return
        fut = asyncio.get_running_loop().create_future()
        self.waiters.append(fut)
        try:
            await fut
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():  # handed a slot, then cancelled
                self.release()
            raise

    async def __aexit__(self, *_: object) -> None:
        self.release()

    def release(self) -> None:
        """Hand the slot to the first waiter still waiting, else free it."""
        while self.waiters:
            fut = self.waiters.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        self.free += 1


class RawHttp:
    """A lean HTTP/1.1 keep-alive client on asyncio streams (Content-Length or chunked
    answers). httpx spends ~2.5 ms of CPU a request here, on the same 2 cores as the servers
    it measures; this one a fraction of it (``--client httpx`` to compare). Transport
    failures raise httpx.TransportError, as httpx does."""

    IDLE_S = 2.0

    def __init__(self, max_connections: int) -> None:
        self.idle: dict[
            tuple[str, int], list[tuple[asyncio.StreamReader, asyncio.StreamWriter, float]]
        ] = {}
        self.slots = Slots(max_connections)

    async def __aenter__(self) -> RawHttp:
        return self

    async def __aexit__(self, *_: object) -> None:
        for conns in self.idle.values():
            for _reader, writer, _since in conns:
                writer.close()
        self.idle.clear()

    async def post(self, url: str, *, content: str | bytes, headers: dict[str, str]) -> Any:
        body = content.encode() if isinstance(content, str) else content
        return await self.request("POST", url, body, headers)

    async def get(
        self, url: str, *, params: dict[str, Any] | None = None, headers: dict[str, str]
    ) -> Any:
        if params:
            url += "?" + urllib.parse.urlencode(params)
        return await self.request("GET", url, b"", headers)

    async def request(
        self, method: str, url: str, body: bytes, headers: dict[str, str]
    ) -> RawResponse:
        parts = urllib.parse.urlsplit(url)
        where = (parts.hostname or "127.0.0.1", parts.port or 80)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        head = f"{method} {path} HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        head += "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        wire = (head + f"Content-Length: {len(body)}\r\n\r\n").encode("latin-1") + body
        async with self.slots:
            for attempt in (0, 1):
                reader, writer, reused = await self._checkout(where, fresh=attempt > 0)
                ok = False
                try:
                    writer.write(wire)
                    status, content, keep = await self._read(reader)
                    ok = True
                except (OSError, asyncio.IncompleteReadError, ValueError) as exc:
                    if reused and attempt == 0:  # the server closed an idle connection
                        continue
                    raise httpx.TransportError(f"{method} {url}: {exc!r}") from exc
                finally:
                    if not ok:
                        writer.close()
                if keep:
                    self.idle.setdefault(where, []).append((reader, writer, now()))
                else:
                    writer.close()
                return RawResponse(status, content)
        raise AssertionError("unreachable")

    async def _checkout(
        self, where: tuple[str, int], fresh: bool
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter, bool]:
        """An idle connection used within IDLE_S (servers close idle ones: uvicorn after
        5 s), else a new one; ``fresh``: a new one."""
        pool = self.idle.setdefault(where, [])
        while pool and not fresh:
            reader, writer, since = pool.pop()
            if now() - since < self.IDLE_S and not writer.is_closing():
                return reader, writer, True
            writer.close()
        reader, writer = await self._connect(where)
        return reader, writer, False

    async def _connect(
        self, where: tuple[str, int]
    ) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        try:
            return await asyncio.open_connection(*where, limit=1 << 24)
        except OSError as exc:
            raise httpx.ConnectError(f"{where}: {exc!r}") from exc

    @staticmethod
    async def _read(reader: asyncio.StreamReader) -> tuple[int, bytes, bool]:
        line = await reader.readline()
        if not line:
            raise ValueError("connection closed before the status line")
        status = int(line.split(None, 2)[1])
        fields: dict[str, str] = {}
        while (h := await reader.readline()) not in (b"\r\n", b"\n", b""):
            k, _, v = h.decode("latin-1").partition(":")
            fields[k.strip().lower()] = v.strip().lower()
        keep = fields.get("connection") != "close"
        if "content-length" in fields:
            return status, await reader.readexactly(int(fields["content-length"])), keep
        if fields.get("transfer-encoding") == "chunked":
            chunks = []
            while size := int((await reader.readline()).split(b";")[0], 16):
                chunks.append((await reader.readexactly(size + 2))[:-2])
            while (await reader.readline()) not in (b"\r\n", b"\n", b""):
                pass  # trailers
            return status, b"".join(chunks), keep
        return status, await reader.read(), False


# -- load -----------------------------------------------------------------------------------


async def open_loop(
    target: Target,
    http: Http,
    arrivals: list[tuple[float, str]],
    key_prefix: str,
    drain_s: float,
) -> tuple[list[Req], float, float]:
    """Send each arrival at its time whatever the answers (open loop); wait ``drain_s`` after
    the last one, then cancel what is open. Returns (requests, start, cut-off)."""
    recs: list[Req] = []
    tasks: list[asyncio.Task[None]] = []
    start = now() + 0.05
    for i, (t, tenant) in enumerate(arrivals):
        delay = start + t - now()
        if delay > 0:
            await asyncio.sleep(delay)
        rec = Req(i, tenant, start + t)
        recs.append(rec)
        tasks.append(asyncio.create_task(target.call(http, rec, f"{key_prefix}-{i}")))
    if tasks:
        _, pending = await asyncio.wait(tasks, timeout=drain_s)
        for task in pending:
            task.cancel()
        await asyncio.gather(*pending, return_exceptions=True)
    cutoff = now()
    for rec in recs:
        if rec.state == "pending":
            rec.state = "unfinished"
    return recs, start, cutoff


async def closed_loop(
    target: Target, http: Http, concurrency: int, seconds: float, key_prefix: str
) -> tuple[list[Req], float, float]:
    """``concurrency`` clients, each sending its next request when the last one answered."""
    recs: list[Req] = []
    start = now()
    end = start + seconds

    async def client(c: int) -> None:
        while now() < end:
            rec = Req(len(recs), QUIET[c % len(QUIET)], now())
            recs.append(rec)
            await target.call(http, rec, f"{key_prefix}-{rec.i}")
            if rec.state == "error":
                await asyncio.sleep(0.05)

    await asyncio.gather(*(client(c) for c in range(concurrency)))
    return recs, start, end


async def one_request(target: Target, http: Http, key: str, limit_s: float) -> tuple[Req, float]:
    rec = Req(0, QUIET[0], now())
    try:
        await asyncio.wait_for(target.call(http, rec, key), limit_s)
    except TimeoutError:
        rec.state = "unfinished"
    return rec, now() - rec.t_sched


def new_http(max_connections: int, kind: str = "raw") -> Any:
    if kind == "raw":
        return RawHttp(max_connections)
    return httpx.AsyncClient(
        limits=httpx.Limits(max_connections=max_connections, max_keepalive_connections=256),
        timeout=httpx.Timeout(10.0, read=None, pool=None),
    )


# -- statistics -----------------------------------------------------------------------------


def pct(values: list[tuple[float, bool]], q: float) -> tuple[float, bool]:
    """Nearest-rank percentile of (value, censored) pairs; censored = a lower bound."""
    if not values:
        return math.nan, False
    ordered = sorted(values)
    return ordered[max(0, math.ceil(q / 100 * len(ordered)) - 1)]


def summarize(recs: list[Req], slo_s: float, window_s: float, cutoff: float) -> dict[str, Any]:
    """p50/p99 of the admitted requests that were answered (or open at the cut-off, at their
    age then: a lower bound), goodput and every way a request did not get its result."""
    counts = {s: 0 for s in ("done", "shed", "expired", "dead", "cancelled", "error", "unfinished")}
    for r in recs:
        counts[r.state] = counts.get(r.state, 0) + 1
    lat = [(r.t_result - r.t_sched, False) for r in recs if r.state == "done"]
    lat += [(cutoff - r.t_sched, True) for r in recs if r.state == "unfinished"]
    good = sum(1 for r in recs if r.state == "done" and r.t_result - r.t_sched <= slo_s)
    lags = [(r.t_sent - r.t_sched, False) for r in recs if not math.isnan(r.t_sent)]
    p50, c50 = pct(lat, 50)
    p99, c99 = pct(lat, 99)
    errors = [r.error for r in recs if r.state == "error"]
    return {
        "sent": len(recs),
        **{("shed_429" if k == "shed" else k): v for k, v in counts.items()},
        "p50_s": _round(p50),
        "p50_censored": c50,
        "p99_s": _round(p99),
        "p99_censored": c99,
        "done_rps": _round(counts["done"] / window_s),
        "goodput_rps": _round(good / window_s),
        "within_slo": good,
        "client_lag_p99_s": _round(pct(lags, 99)[0]),
        "first_error": errors[0] if errors else None,
    }


def _round(x: float) -> float | None:
    return None if math.isnan(x) else round(x, 4)


# -- servers --------------------------------------------------------------------------------


class ServerDied(RuntimeError):
    pass


class Procs:
    """Server processes, each in its own session (their children go with them), output to
    DIR/logs/NAME.log."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir = log_dir
        self.procs: list[tuple[str, subprocess.Popen[bytes]]] = []

    def spawn(
        self, name: str, argv: list[str], env: dict[str, str] | None = None, cwd: Path | None = None
    ) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        with (self.log_dir / f"{name}.log").open("wb") as log:
            proc = subprocess.Popen(
                argv, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd, start_new_session=True
            )
        self.procs.append((name, proc))

    def check(self) -> None:
        for name, proc in self.procs:
            if proc.poll() is not None:
                tail = (self.log_dir / f"{name}.log").read_text(errors="replace")[-1500:]
                raise ServerDied(f"{name} exited rc={proc.returncode}; log tail:\n{tail}")

    def cpu_s(self) -> dict[str, float]:
        """CPU seconds (user + system) so far of each server's processes: every live process
        in its session (a server's workers too, while they run)."""
        tick = os.sysconf("SC_CLK_TCK")
        by_session = {proc.pid: name for name, proc in self.procs}
        out = dict.fromkeys(by_session.values(), 0.0)
        for stat in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = stat.read_text().rpartition(")")[2].split()
            except OSError:
                continue
            name = by_session.get(int(fields[3]))  # session id
            if name is not None:
                out[name] += (int(fields[11]) + int(fields[12])) / tick
        return out

    def stop(self) -> None:
        for _, proc in reversed(self.procs):
            _signal_group(proc, signal.SIGTERM)
        for _, proc in reversed(self.procs):
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(20)
            _signal_group(proc, signal.SIGKILL)
            proc.wait()
        self.procs.clear()


def _signal_group(proc: subprocess.Popen[bytes], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)


def free_port(span: int = 1) -> int:
    """A port p with p..p+span-1 all free on 127.0.0.1 (racy, good enough on a bench host)."""
    for _ in range(50):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = int(s.getsockname()[1])
        if base + span < 65535 and all(_free(base + k) for k in range(span)):
            return base
    raise RuntimeError("no free port")


def _free(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) != 0


def project_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    return env | (extra or {})


def peer_env(peers: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PEERS"] = str(peers)
    return env


def set_dotted(data: dict[str, Any], dotted: str, value: Any) -> None:
    node = data
    *parents, leaf = dotted.split(".")
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


@dataclass
class Ours:
    """What `start_ours` made: the config written for the run, its queue and the CLI."""

    config: Path
    db_url: str
    queue: str
    slo_s: float
    cli: list[str]
    env: dict[str, str]
    base: str
    payloads: list[str]
    backlog: int  # items kept ready during the drain burst: two of the scorer's claims


def write_config(
    workload: str, source: Path, run_dir: Path, db_url: str, overrides: dict[str, Any]
) -> tuple[Path, dict[str, Any]]:
    """A copy of ``source`` for this run: its database, an output folder in the run folder,
    no lineage, config-relative paths made absolute, then the variant's overrides."""
    data = yaml.safe_load(source.read_text())
    data.setdefault("database", {})["url"] = db_url
    data.setdefault("output", {})["path"] = str(run_dir / f"out-{workload}")
    data["lineage"] = {"transport": "none"}
    if data.get("service_profile"):
        data["service_profile"] = str((source.parent / data["service_profile"]).resolve())
    weights = (data.get("model") or {}).get("weights")
    if weights and not Path(weights).is_absolute():
        data["model"]["weights"] = str((source.parent / weights).resolve())
    for dotted, value in overrides.items():
        set_dotted(data, dotted, value)
    path = run_dir / f"{workload}-{source.name}"
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    return path, data


def start_ours(
    args: argparse.Namespace, workload: str, variant: str, run_dir: Path, procs: Procs
) -> tuple[Target, Ours]:
    tag = f"{workload}-{variant or 'shipped'}"
    db_url = scratch_db(args.pg, run_dir, tag)
    overrides = dict(args.variants[variant])
    api_cpus = overrides.pop("api_cpus", args.api_cpus)  # where the processes run, not config
    scorer_cpus = overrides.pop("scorer_cpus", args.scorer_cpus)
    api_nice = overrides.pop("api_nice", args.api_nice)
    api_workers = int(overrides.pop("api_workers", 1))
    env = project_env({"BATCHING_API_TOKENS": ",".join(f"{t}={n}" for n, t in TOKENS.items())})
    if args.sim_accel and workload == "w2":
        overrides = sim_accel_model(run_dir) | overrides
        env["PYTHONPATH"] = os.pathsep.join((str(ROOT / "bench"), env["PYTHONPATH"]))
    config, data = write_config(workload, args.configs[workload], run_dir, db_url, overrides)
    cli = [sys.executable, "-m", "batching.cli"]
    subprocess.run([*cli, "init", "--db", db_url], check=True, env=env, capture_output=True)
    port = free_port()
    api_on = ["taskset", "-c", str(api_cpus)] if api_cpus is not None else []
    api_on += ["nice", "-n", str(int(api_nice))] if api_nice else []
    procs.spawn(
        f"api-{tag}",
        [*api_on, *cli, "api", "-c", str(config), "--db", db_url, "--port", str(port)]
        + (["--workers", str(api_workers)] if api_workers > 1 else []),
        env=env,
    )
    score_on = ["taskset", "-c", str(scorer_cpus)] if scorer_cpus is not None else []
    score = [*score_on, *cli, "score", "-c", str(config), "--db", db_url]
    score += ["--max-seconds", "86400"]
    score += ["--quiet"] + (["--workers", str(args.scorers)] if args.scorers > 1 else [])
    threads = {"OMP_NUM_THREADS": str(args.scorer_threads)} if args.scorer_threads else {}
    procs.spawn(f"score-{tag}", score, env=env | threads)
    queue, slo_s = data["queue"]["name"], float(data["latency_slo_s"])
    payloads = payload_json(workload)
    base = f"http://127.0.0.1:{port}"
    b = data.get("batching") or {}
    backlog = 2 * int(b.get("claim_size") or 4 * int(b.get("max_batch_size") or 64))
    call = ingress_call(base, queue, payloads, args.wait_s)
    return Target("batching", workload, variant, slo_s, call), Ours(
        config, db_url, queue, slo_s, cli, env, base, payloads, backlog
    )


def sim_accel_model(run_dir: Path) -> dict[str, Any]:
    """The overrides that put W2's simulated accelerator (``bench/sim_accel.py``) in place of
    the model: its factory and an empty checkpoint, pinned (it has no weights)."""
    sys.path.insert(0, str(ROOT / "bench"))
    import sim_accel

    path, sha256 = sim_accel.checkpoint(run_dir)
    return {
        "model.name": "sim_accel:build_text",
        "model.version": "sim-accel-w2",
        "model.checkpoint": path,
        "model.sha256": sha256,
        "model.device": "cpu",
    }


async def drain_capacity(
    ours: Ours, http: Http, seconds: float, key_prefix: str
) -> tuple[float, int]:
    """Items/s the scorer commits with its queue never empty: POST items in chunks of 256
    (``{"items": [...]}``) to keep ``ours.backlog`` ready, read the tenant's live states
    every 0.25 s (GET /v1/queues/{queue}: its done count may be a poll old, its live states
    are read now), rate of those committed over the last ``seconds`` (the first 2 s warm the
    batcher): posted, less those still ready or leased, less those that ended dead, expired
    or cancelled. Returns (items/s, items posted)."""
    tenant = QUIET[0]
    auth = {"Authorization": f"Bearer {TOKENS[tenant]}"}
    url = f"{ours.base}/v1/queues/{ours.queue}"

    async def live() -> tuple[int, int]:
        """(ready + leased, dead + expired + cancelled) of the tenant's items."""
        r = await http.get(url, headers=auth)
        r.raise_for_status()
        by_state = r.json()["by_state"]
        failed = sum(int(by_state[s]) for s in ("dead", "expired", "cancelled"))
        return int(by_state["ready"]) + int(by_state["leased"]), failed

    open_at_start, failed_at_start = await live()
    posted, samples = 0, []
    start = now()
    while now() < start + 2.0 + seconds:
        still_open, failed = await live()  # committed since the start:
        count = open_at_start + posted - still_open - (failed - failed_at_start)
        samples.append((now(), count))
        while posted - count < ours.backlog:
            items = ",".join(
                f'{{"item_key": "{key_prefix}-{posted + k}", '
                f'"payload": {ours.payloads[(posted + k) % len(ours.payloads)]}}}'
                for k in range(256)
            )
            r = await http.post(
                f"{url}/items",
                content=f'{{"items": [{items}]}}',
                headers=auth | {"Content-Type": "application/json"},
            )
            r.raise_for_status()
            posted += 256
        await asyncio.sleep(0.25)
    t1, c1 = next((t, c) for t, c in samples if t >= start + 2.0)
    t2, c2 = samples[-1]
    return (c2 - c1) / (t2 - t1) if t2 > t1 else math.nan, posted


def set_cap(ours: Ours, max_depth: int | None) -> str:
    """`batching queue cap`: past ``max_depth`` items ready or leased, enqueues get 429."""
    opt = ["--no-cap"] if max_depth is None else ["--max-depth", str(max_depth)]
    argv = [*ours.cli, "queue", "cap", ours.queue, *opt, "-c", str(ours.config)]
    argv += ["--db", ours.db_url, "--reason", "online bench"]
    r = subprocess.run(argv, env=ours.env, capture_output=True, text=True)
    return (r.stdout + r.stderr).strip().splitlines()[-1] if (r.stdout + r.stderr).strip() else ""


def scratch_db(pg_admin: str | None, run_dir: Path, tag: str) -> str:
    """SQLite in the run folder, or with --pg a fresh PostgreSQL database batching_online."""
    if not pg_admin:
        return f"sqlite:///{run_dir / f'{tag}.db'}"
    import psycopg
    from sqlalchemy.engine import make_url

    admin = make_url(pg_admin)
    conninfo = admin.set(drivername="postgresql").render_as_string(False)
    with psycopg.connect(conninfo, autocommit=True) as conn:
        conn.execute("DROP DATABASE IF EXISTS batching_online WITH (FORCE)")
        conn.execute("CREATE DATABASE batching_online")
    return admin.set(database="batching_online").render_as_string(False)


def payload_json(workload: str) -> list[str]:
    """Our item payloads (the reference sets of batching.model.workloads), as JSON text."""
    from batching.model import workloads

    if workload == "w2":
        return [json.dumps({"tokens": s.tolist()}) for s in workloads.w2_inputs()]
    return [json.dumps({"x": row.tolist()}) for row in workloads.w1_inputs(5000)]


def peer_bodies(system: str) -> list[bytes]:
    """The same W2 requests in each peer's own request shape (as its harness sends them)."""
    from batching.model import workloads

    seqs = workloads.w2_inputs()
    if system != "pytriton":
        return [json.dumps({"tokens": s.tolist()}).encode() for s in seqs]
    bodies = []
    for s in seqs:  # fixed width 128 + length: Triton's batcher joins equal shapes only
        tokens = s.tolist() + [0] * (128 - len(s))
        inputs = [
            {"name": "tokens", "shape": [1, 128], "datatype": "INT64", "data": tokens},
            {"name": "length", "shape": [1, 1], "datatype": "INT64", "data": [len(s)]},
        ]
        bodies.append(json.dumps({"inputs": inputs}).encode())
    return bodies


def start_peer(args: argparse.Namespace, system: str, procs: Procs) -> Target:
    peers: Path = args.peers
    env = peer_env(peers)
    slo_s = float(yaml.safe_load(args.configs["w2"].read_text())["latency_slo_s"])
    if system == "pytriton":
        py = str(peers / "venv-pytriton/bin/python")
        port = free_port(3)
        # the harness's own fix: the bundled stub must find this Python's libpython
        libdir = subprocess.run(
            [py, "-c", "import sysconfig; print(sysconfig.get_config_var('LIBDIR'))"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        env["LD_LIBRARY_PATH"] = os.pathsep.join(
            p for p in (libdir, env.get("LD_LIBRARY_PATH")) if p
        )
        argv = [py, str(peers / "bench_pytriton.py"), "--serve", "--workload", "w2"]
        argv += ["--max-batch", "128", "--delay-us", "5000", "--port", str(port)]
        procs.spawn("pytriton", argv, env=env, cwd=peers)
        url = f"http://127.0.0.1:{port}/v2/models/w2/infer"
    elif system == "litserve":
        port = free_port()
        argv = [str(peers / "venv-litserve/bin/python"), str(peers / "bench_litserve.py")]
        argv += ["--serve", "--workload", "w2", "--max-batch", "128", "--timeout-s", "0.005"]
        procs.spawn("litserve", [*argv, "--port", str(port)], env=env, cwd=peers)
        url = f"http://127.0.0.1:{port}/predict"
    elif system == "ray_serve":
        port = free_port()
        env["PYTHONPATH"] = str(peers)  # the replicas import the peers' workloads.py
        argv = [str(peers / "venv-ray/bin/python"), str(ROOT / "bench/online_ray_serve.py")]
        argv += ["--peers", str(peers), "--port", str(port)]
        procs.spawn("ray_serve", argv, env=env, cwd=peers)
        url = f"http://127.0.0.1:{port}/w2"
    else:
        raise ValueError(system)
    return Target(system, "w2", "", slo_s, post_call(url, peer_bodies(system)))


def start_standin(
    args: argparse.Namespace, run_dir: Path, procs: Procs, peer: bool
) -> tuple[Target, None]:
    port = free_port()
    argv = [sys.executable, str(ROOT / "bench/online_standin.py"), "--port", str(port)]
    argv += ["--max-depth", "48", "--late-policy", "expire", "--slo-s", "1.0"]
    env = project_env({"BATCHING_API_TOKENS": ",".join(f"{t}={n}" for n, t in TOKENS.items())})
    procs.spawn("standin-peer" if peer else "standin", argv, env=env)
    base = f"http://127.0.0.1:{port}"
    if peer:
        call = post_call(f"{base}/predict", [json.dumps({"tokens": [1, 2, 3]}).encode()])
        return Target("standin-peer", "w2", "", 1.0, call), None
    call = ingress_call(base, "text", payload_json("w2")[:50], args.wait_s)
    return Target("standin", "w2", "", 1.0, call), None


async def wait_ready(target: Target, http: Http, procs: Procs, limit_s: float) -> tuple[float, Req]:
    """Until one request gets its result (model loaded, scorer claiming): seconds it took."""
    start = now()
    n = 0
    while True:
        procs.check()
        left = start + limit_s - now()
        if left <= 0:
            raise ServerDied(f"{target.system} answered no request in {limit_s:.0f} s")
        rec, _ = await one_request(target, http, f"ready-{os.getpid()}-{n}", min(left, 30.0))
        n += 1
        if rec.state == "done":
            return now() - start, rec
        await asyncio.sleep(1.0)


# -- the run --------------------------------------------------------------------------------


@dataclass
class Phase:
    system: str  # batching | pytriton | litserve | ray_serve | standin | standin-peer
    workload: str
    variant: str = ""
    noisy: bool = False


class Run:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.out: Path = args.out
        self.out.mkdir(parents=True, exist_ok=True)
        self.summary = (self.out / "summary.jsonl").open("a")
        self.requests = gzip.open(self.out / "requests.jsonl.gz", "at")  # noqa: SIM115 (closed by close())
        self.deadline = now() + float(args.budget_s)
        self.capacity: dict[str, float] = dict(args.capacity)
        self.rows: list[dict[str, Any]] = []
        self.point_s = 0.0
        self.procs = Procs(self.out / "logs")
        self.run_id = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())

    def emit(self, row: dict[str, Any]) -> None:
        row = {"run_id": self.run_id, **row}
        self.rows.append(row)
        self.summary.write(json.dumps(row) + "\n")
        self.summary.flush()
        print(_progress(row), file=sys.stderr, flush=True)

    def dump_requests(self, point: str, recs: list[Req], start: float) -> None:
        for r in recs:
            doc = asdict(r)
            for k in ("t_sched", "t_sent", "t_result"):
                doc[k] = None if math.isnan(doc[k]) else round(doc[k] - start, 5)
            self.requests.write(json.dumps({"point": point, **doc}) + "\n")

    def left(self) -> float:
        return self.deadline - now()

    def close(self) -> None:
        self.summary.close()
        self.requests.close()


def parse_loads(p: argparse.ArgumentParser, text: str) -> list[float]:
    """``--loads``: fractions (0.5) or percentages (50%) of capacity. A bare number above
    LOAD_LIMIT is refused: 50 is 50x capacity, which swamps the client, not the server."""
    loads = []
    for part in filter(None, text.split(",")):
        try:
            load = float(part[:-1]) / 100 if part.endswith("%") else float(part)
        except ValueError:
            p.error(f"--loads: {part!r} is not a number; write fractions or percentages: 0.5,90%")
        if not 0 < load <= LOAD_LIMIT:
            p.error(
                f"--loads: {part} is {load:.0%} of capacity; give fractions (0.5 for half) "
                f"or percentages (50%) up to {LOAD_LIMIT:.0%}"
            )
        loads.append(load)
    if not loads:
        p.error("--loads: give at least one load, e.g. 0.5,0.9")
    return loads


def plan(args: argparse.Namespace, phases: list[Phase]) -> float:
    """Seconds of arrivals per point so that the whole run fits --budget-s (5..40 s)."""
    if args.point_s:
        return float(args.point_s)
    fixed, per_point = 0.0, 0.0
    n_loads = len(args.loads) * len(args.patterns)
    overloaded = sum(1 for ld in args.loads if ld > 1) * len(args.patterns)
    for ph in phases:
        measures = 2 if ph.system == "batching" and args.capacity_method == "drain" else 1
        fixed += START_S.get(ph.system, 30.0) + measures * (args.capacity_s + 5)
        fixed += n_loads * SETTLE_S
        per_point += n_loads + 0.5 * overloaded + (3.0 if ph.noisy else 0.0)
    lo = 2.0 if args.dry_run else 5.0
    return max(lo, min(40.0, (float(args.budget_s) - fixed) / max(per_point, 1.0)))


def phases_of(args: argparse.Namespace) -> list[Phase]:
    if args.dry_run:
        return [Phase("standin", "w2", noisy=True), Phase("standin-peer", "w2")]
    out: list[Phase] = []
    for w in args.workloads:
        if "batching" in args.systems:
            for k, v in enumerate(args.variants):
                out.append(Phase("batching", w, v, noisy=(w == "w2" and k == 0 and args.noisy)))
        if w == "w2":
            out += [Phase(p, "w2") for p in args.systems if p in PEERS]
    return out


async def drive(run: Run, phase: Phase, target: Target, procs: Procs, ours: Ours | None) -> None:
    """Ready, capacity, the load points (and the noisy-tenant pair) of one started server."""
    args = run.args
    base = {"system": phase.system, "workload": phase.workload, "variant": phase.variant}
    tag = f"{phase.system}-{phase.workload}-{phase.variant or 'x'}-{run.run_id}"
    async with new_http(args.max_connections, args.client) as http:
        ready_s, _ = await wait_ready(target, http, procs, min(args.start_limit_s, run.left()))
        run.emit({**base, "kind": "ready", "ready_s": round(ready_s, 2)})
        if args.smoke:
            return
        await closed_loop(target, http, args.concurrency, 2.0, f"{tag}-warm")
        recs, start, end = await closed_loop(
            target, http, args.concurrency, args.capacity_s, f"{tag}-cap"
        )
        in_window = [r for r in recs if r.state == "done" and r.t_result <= end]
        capacity = len(in_window) / (end - start)
        cap_row = summarize(recs, target.slo_s, end - start, now())
        run.emit(
            {**base, "kind": "capacity", "method": f"closed loop, {args.concurrency} in flight"}
            | {"capacity_rps": round(capacity, 2), "p99_s": cap_row["p99_s"]}
            | {"errors": cap_row["error"], "first_error": cap_row["first_error"]}
        )
        if ours is not None and args.capacity_method == "drain":
            await settle(run, target, http, f"{tag}-settle-cap")
            try:
                drained, posted = await drain_capacity(ours, http, args.capacity_s, f"{tag}-drain")
            except (httpx.HTTPError, ValueError, KeyError, StopIteration) as exc:
                run.emit({**base, "kind": "note", "what": f"no drain capacity: {exc!r}"[:300]})
            else:
                capacity = drained
                run.emit(
                    {**base, "kind": "capacity", "method": f"queue drain, {ours.backlog} ready"}
                    | {"capacity_rps": round(capacity, 2), "p99_s": None, "posted": posted}
                )
        key = phase.workload
        source = "reference"
        if key not in run.capacity:
            run.capacity[key], source = capacity, "measured here"
        ref = run.capacity[key]
        if not ref > 0:
            raise ServerDied(f"{phase.system}: no capacity measured ({ref}); see its log")
        await settle(run, target, http, f"{tag}-settle0")
        if ours is not None:
            depth = depth_cap(args.max_depth, ref, ours.slo_s)
            run.emit({**base, "kind": "cap", "max_depth": depth, "said": set_cap(ours, depth)})
        for pattern in args.patterns:
            for load in args.loads:
                if run.left() < run.point_s + 5:
                    run.emit({**base, "kind": "skipped", "what": f"{pattern} {load:.0%}"})
                    continue
                shares = {t: 1.0 for t in QUIET}
                arrivals = schedule(
                    pattern, load * ref, shares, run.point_s, f"{key}-{pattern}-{load}"
                )
                row = await point(run, target, http, arrivals, f"{tag}-{pattern}-{load}", ours)
                run.emit(
                    {**base, "kind": "point", "pattern": pattern, "load": load}
                    | {"offered_rps": round(load * ref, 2), "capacity_ref_rps": round(ref, 2)}
                    | {"capacity_source": source, "slo_s": target.slo_s}
                    | {"point_s": run.point_s}
                    | row
                )
        if phase.noisy:
            await noisy(run, target, http, base, ref, f"{tag}-noisy")


async def point(
    run: Run,
    target: Target,
    http: Http,
    arrivals: list[tuple[float, str]],
    key: str,
    ours: Ours | None = None,
) -> dict[str, Any]:
    drain_s = min(max(5.0, 3 * target.slo_s, 0.5 * run.point_s), max(1.0, run.left()))
    cpu0, client0 = run.procs.cpu_s(), time.process_time()
    recs, start, cutoff = await open_loop(target, http, arrivals, key, drain_s)
    cpu1, client1 = run.procs.cpu_s(), time.process_time()
    run.dump_requests(key, recs, start)
    row = summarize(recs, target.slo_s, run.point_s, cutoff)
    # where the machine's time went (all on one host): CPU seconds per second of the point
    wall = cutoff - start
    row["cpu_busy"] = {k: round((cpu1[k] - cpu0.get(k, 0.0)) / wall, 3) for k in cpu1}
    row["cpu_busy"]["client"] = round((client1 - client0) / wall, 3)
    row["settle_s"] = await settle(run, target, http, f"{key}-settle")
    if ours is not None:
        row["split"] = time_split(ours, recs, key, target.slo_s)
    return row


def time_split(ours: Ours, recs: list[Req], key: str, slo_s: float) -> dict[str, Any]:
    """Ours: where each done request's time went, from the run's database (one host, one
    clock): ingress (sent to the item's enqueue: HTTP and the API's group commit), enqueue to
    commit (what the scorer's SLO and deadlines cover) and delivery (commit to the result at
    the client: the long poll's wake-up and read); p50/p99 of each, and how many items the
    scorer committed more than the SLO after their enqueue."""
    epoch = time.time() - now()  # perf_counter to epoch seconds
    engine = sa.create_engine(ours.db_url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text(
                    "SELECT item_key, enqueued_at, finished_at FROM batching_items"
                    " WHERE queue = :q AND state = 2 AND item_key LIKE :p"
                ),
                {"q": ours.queue, "p": f"{key}-%"},
            )
            times = {k: (e, f) for k, e, f in rows}
    finally:
        engine.dispose()
    split: dict[str, list[tuple[float, bool]]] = {"ingress": [], "queue": [], "delivery": []}
    late = 0
    for r in recs:
        found = times.get(f"{key}-{r.i}") if r.state == "done" else None
        if found is None:
            continue
        enqueued, finished = found
        split["ingress"].append((enqueued - (r.t_sent + epoch), False))
        split["queue"].append((finished - enqueued, False))
        split["delivery"].append((r.t_result + epoch - finished, False))
        late += finished - enqueued > slo_s
    out: dict[str, Any] = {"committed": len(split["queue"]), "committed_past_slo": late}
    for name, values in split.items():
        for q in (50, 99):
            out[f"{name}_p{q}_s"] = _round(pct(values, q)[0])
    return out


async def settle(run: Run, target: Target, http: Http, key: str) -> float | None:
    """One probe request: it waits out whatever backlog the last point left (a server keeps
    scoring what the client gave up on), so the next point starts on an idle server."""
    rec, took = await one_request(target, http, key, max(1.0, min(90.0, run.left())))
    return round(took, 2) if rec.state == "done" else None


async def noisy(
    run: Run, target: Target, http: Http, base: dict[str, Any], ref: float, key: str
) -> None:
    """Quiet tenants alone, then with a tenant offering NOISY_FACTOR x each (90% in all), then
    the same 90% spread evenly over the four tenants: the quiet tenants' p99 there is what
    the load alone costs them, so with_noisy / even is what the noisy tenant's share costs."""
    per_quiet = 0.9 * ref / (len(QUIET) + NOISY_FACTOR)
    seconds = 1.5 * run.point_s
    quiet = {t: 1.0 for t in QUIET}
    even = (len(QUIET) + NOISY_FACTOR) / (len(QUIET) + 1)  # each tenant's share, 90% in all
    rows = {}
    summary: dict[str, Any] | None = None
    for name, shares in (
        ("alone", quiet),
        ("with_noisy", quiet | {"noisy": NOISY_FACTOR}),
        ("even", {t: even for t in (*QUIET, "noisy")}),
    ):
        if run.left() < seconds + 5:
            run.emit({**base, "kind": "skipped", "what": f"noisy {name}"})
            break
        rate = per_quiet * sum(shares.values())
        arrivals = schedule("poisson", rate, shares, seconds, f"noisy-{name}")
        drain_s = min(max(5.0, 3 * target.slo_s), max(1.0, run.left()))
        recs, start, cutoff = await open_loop(target, http, arrivals, f"{key}-{name}", drain_s)
        run.dump_requests(f"{key}-{name}", recs, start)
        q = summarize([r for r in recs if r.tenant in QUIET], target.slo_s, seconds, cutoff)
        n = summarize([r for r in recs if r.tenant == "noisy"], target.slo_s, seconds, cutoff)
        rows[name] = q
        run.emit(
            {**base, "kind": "noisy_point", "run": name, "offered_rps": round(rate, 2)}
            | {"quiet_offered_rps": round(per_quiet * len(QUIET) * shares[QUIET[0]], 2)}
            | {"slo_s": target.slo_s}
            | {"quiet": q, "noisy": n if name != "alone" else None}
        )
        await settle(run, target, http, f"{key}-{name}-settle")
        if name == "with_noisy":
            alone, with_noisy = rows["alone"]["p99_s"], rows["with_noisy"]["p99_s"]
            ratio = with_noisy / alone if alone and with_noisy is not None else None
            summary = (
                {**base, "kind": "noisy", "quiet_p99_alone_s": alone}
                | {"quiet_p99_with_noisy_s": with_noisy, "target_ratio": 1.25}
                | {"ratio": None if ratio is None else round(ratio, 3)}
                | {"censored": rows["with_noisy"]["p99_censored"] or rows["alone"]["p99_censored"]}
            )
    if summary is None:
        return
    even_p99 = rows["even"]["p99_s"] if "even" in rows else None
    if even_p99 and summary["quiet_p99_with_noisy_s"] is not None:
        summary["quiet_p99_even_s"] = even_p99
        summary["ratio_vs_even"] = round(summary["quiet_p99_with_noisy_s"] / even_p99, 3)
    run.emit(summary)


def _depth_policy(text: str) -> str:
    """--max-depth, checked before anything starts."""
    try:
        depth_cap(text, 1.0, 1.0)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give auto, auto:F (F a fraction of capacity x SLO), none or a count"
        ) from None
    return text


def depth_cap(policy: str, capacity: float, slo_s: float) -> int | None:
    """auto: what the measured capacity scores in half the SLO (the other half is the last
    item's batch and commit); auto:F: in F x the SLO; none: no cap; or a number."""
    if policy == "none":
        return None
    if policy == "auto" or policy.startswith("auto:"):
        fraction = float(policy.partition(":")[2] or 0.5)
        return max(1, math.ceil(capacity * slo_s * fraction))
    return int(policy)


def run_phase(run: Run, phase: Phase) -> None:
    base = {"system": phase.system, "workload": phase.workload, "variant": phase.variant}
    procs = run.procs = Procs(run.out / "logs")
    ours: Ours | None = None
    try:
        if phase.system == "batching":
            target, ours = start_ours(run.args, phase.workload, phase.variant, run.out, procs)
        elif phase.system.startswith("standin"):
            target, _ = start_standin(run.args, run.out, procs, phase.system == "standin-peer")
        else:
            target = start_peer(run.args, phase.system, procs)
        asyncio.run(drive(run, phase, target, procs, ours))
    except (ServerDied, OSError, subprocess.CalledProcessError) as exc:
        run.emit({**base, "kind": "failed", "error": str(exc)[-2000:]})
    finally:
        procs.stop()


def execute(args: argparse.Namespace) -> int:
    phases = phases_of(args)
    run = Run(args)
    run.point_s = plan(args, phases)
    run.emit(
        {"kind": "run", "budget_s": args.budget_s, "point_s": run.point_s}
        | {"phases": [asdict(p) for p in phases], "loads": list(args.loads)}
        | {"patterns": list(args.patterns), "commit": _commit(), "cpus": os.cpu_count()}
        | {"variants": args.variants, "argv": sys.argv[1:]}
    )
    started = now()
    for ph in phases:
        if run.left() < (15 if args.smoke else START_S.get(ph.system, 30) + args.capacity_s):
            run.emit({**asdict(ph), "kind": "skipped", "what": "phase (budget spent)"})
            continue
        run_phase(run, ph)
    run.emit({"kind": "end", "elapsed_s": round(now() - started, 1)})
    run.close()
    print(render_tables(run.rows))
    print(f"\nresults: {args.out}/summary.jsonl (tables: --table; plot: bench/plot_online.py)")
    return 0


def _commit() -> str | None:
    r = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True
    )
    return r.stdout.decode().strip() or None


# -- tables ---------------------------------------------------------------------------------


def _label(row: dict[str, Any]) -> str:
    return str(row["system"]) + (f" ({row['variant']})" if row.get("variant") else "")


def _s(value: float | None, censored: bool = False) -> str:
    if value is None:
        return "-"
    return (">" if censored else "") + f"{value:.3f}"


def render_tables(rows: Iterable[dict[str, Any]]) -> str:
    """The markdown tables of docs/benchmarks.md's "Open loop" section, from summary rows."""
    rows = list(rows)
    out = []
    caps = [r for r in rows if r["kind"] == "capacity"]
    if caps:
        out += ["| workload | system | capacity | measured by | p99 there (s) |"]
        out += ["|---|---|---:|---|---:|"]
        for r in caps:
            out.append(
                f"| {r['workload'].upper()} | {_label(r)} | {r['capacity_rps']:.1f}/s "
                f"| {r['method']} | {_s(r['p99_s'])} |"
            )
        out.append("")
    points = [r for r in rows if r["kind"] == "point"]
    if points:
        out += [
            "| workload | arrivals | load | offered/s | system | p50 s | p99 s | done/s "
            "| goodput/s | shed 429 | expired | open at cut-off | errors |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        order = {s: k for k, s in enumerate(("batching", "standin", *PEERS, "standin-peer"))}
        points.sort(
            key=lambda r: (
                r["workload"] != "w2",
                r["pattern"],
                r["load"],
                order.get(r["system"], 9),
                r["variant"],
            )
        )
        for r in points:
            out.append(
                f"| {r['workload'].upper()} | {r['pattern']} | {r['load']:.0%} "
                f"| {r['offered_rps']:.1f} | {_label(r)} | {_s(r['p50_s'], r['p50_censored'])} "
                f"| {_s(r['p99_s'], r['p99_censored'])} | {r['done_rps']:.1f} "
                f"| {r['goodput_rps']:.1f} | {r['shed_429']} | {r['expired']} "
                f"| {r['unfinished']} | {r['error']} |"
            )
        out.append("")
    split = [r for r in points if r.get("split")]
    if split:
        out += [
            "Ours, where a done request's time went (p50 / p99, s; past SLO: items committed "
            "more than latency_slo_s after their enqueue):",
            "",
            "| workload | arrivals | load | system | ingress | enqueue to commit | delivery "
            "| past SLO |",
            "|---|---|---:|---|---:|---:|---:|---:|",
        ]
        for r in split:
            f = r["split"]
            out.append(
                f"| {r['workload'].upper()} | {r['pattern']} | {r['load']:.0%} | {_label(r)} "
                + "".join(
                    f"| {_s(f[f'{n}_p50_s'])} / {_s(f[f'{n}_p99_s'])} "
                    for n in ("ingress", "queue", "delivery")
                )
                + f"| {f['committed_past_slo']} of {f['committed']} |"
            )
        out.append("")
    noisy = [r for r in rows if r["kind"] == "noisy"]
    for r in noisy:
        pts = {p["run"]: p for p in rows if p["kind"] == "noisy_point" and _label(p) == _label(r)}
        out += [
            f"Noisy tenant, {r['workload'].upper()} {_label(r)}: quiet tenants' p99 "
            f"{_s(r['quiet_p99_alone_s'])} s alone, {_s(r['quiet_p99_with_noisy_s'])} s with "
            f"the noisy one: {r['ratio']}x (target <= {r['target_ratio']}x)"
            + (" (a p99 is a lower bound)" if r["censored"] else "")
            + (
                f"; {_s(r['quiet_p99_even_s'])} s with the same load spread evenly over four "
                f"tenants: {r['ratio_vs_even']}x the even load's"
                if r.get("ratio_vs_even") is not None
                else ""
            ),
            "",
            "| run | offered/s | quiet p50 s | quiet p99 s | quiet goodput/s | noisy p99 s "
            "| shed 429 (quiet/noisy) | expired (quiet/noisy) |",
            "|---|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name in ("alone", "with_noisy", "even"):
            if name not in pts:
                continue
            p, q, n = pts[name], pts[name]["quiet"], pts[name]["noisy"] or {}
            out.append(
                f"| {name.replace('_', ' ')} | {p['offered_rps']:.1f} "
                f"| {_s(q['p50_s'], q['p50_censored'])} | {_s(q['p99_s'], q['p99_censored'])} "
                f"| {q['goodput_rps']:.1f} | {_s(n.get('p99_s'), n.get('p99_censored', False))} "
                f"| {q['shed_429']}/{n.get('shed_429', '-')} "
                f"| {q['expired']}/{n.get('expired', '-')} |"
            )
        out.append("")
    for r in rows:
        if r["kind"] in ("failed", "skipped"):
            what = r.get("what") or _gist(r.get("error", ""))
            out.append(f"- {r['kind']}: {_label(r)} {r.get('workload', '').upper()}: {what}")
    return "\n".join(out)


def _gist(error: str) -> str:
    """The first line of a failure and the last line of its log that says something."""
    lines = [ln.strip(" \u2502\u256d\u256e\u2570\u256f\u2500") for ln in error.splitlines()]
    said = [ln for ln in lines[1:] if any(c.isalnum() for c in ln)]
    return lines[0] + (f" ... {said[-1]}" if said else "") if lines else ""


def _progress(row: dict[str, Any]) -> str:
    kind = row["kind"]
    if kind == "point":
        return (
            f"[{_label(row)} {row['workload']}] {row['pattern']} {row['load']:.0%} "
            f"({row['offered_rps']}/s): p50 {_s(row['p50_s'], row['p50_censored'])} "
            f"p99 {_s(row['p99_s'], row['p99_censored'])} goodput {row['goodput_rps']}/s "
            f"shed {row['shed_429']} expired {row['expired']} open {row['unfinished']} "
            f"errors {row['error']} settle {row['settle_s']}s cpu {row.get('cpu_busy')}"
        )
    return json.dumps(row)[:400]


# -- command line ---------------------------------------------------------------------------


def parse_variant(text: str) -> tuple[str, dict[str, Any]]:
    """NAME:key=value,key=value (values YAML: true, 0.05, expire); the keys ``api_cpus`` and
    ``scorer_cpus`` place the variant's processes (taskset -c), ``api_nice`` lowers the
    API's CPU priority (nice -n) and ``api_workers`` serves the API from that many processes
    (``batching api --workers``), instead of setting config."""
    name, _, rest = text.partition(":")
    overrides = {}
    for pair in filter(None, rest.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"--variant {text!r}: {pair!r} is not key=value")
        overrides[key.strip()] = yaml.safe_load(value)
    return name, overrides


def parse_pairs(text: str) -> dict[str, str]:
    out = {}
    for pair in filter(None, text.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise argparse.ArgumentTypeError(f"{pair!r} is not workload=value")
        out[key] = value
    return out


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--budget-s", type=float, default=900.0, help="the whole run (default 900)")
    p.add_argument("--point-s", type=float, help="arrivals per point (default: from the budget)")
    p.add_argument("--out", type=Path, help="results folder (default: a new one in /tmp)")
    p.add_argument("--peers", type=Path, default=os.environ.get("PEERS"), help="the peers' folder")
    p.add_argument("--systems", default="batching,pytriton,litserve,ray_serve")
    p.add_argument("--workloads", default="w2,w1")
    p.add_argument(
        "--loads",
        default=",".join(str(x) for x in LOADS),
        help="fractions of the measured capacity, or percentages: 0.5,0.9 or 50%%,90%%",
    )
    p.add_argument("--patterns", default=",".join(PATTERNS))
    p.add_argument(
        "--variant",
        action="append",
        type=parse_variant,
        help="NAME:key=value,... config overrides of one run of ours (repeatable; "
        "default one run of the config as shipped); api_cpus=0,scorer_cpus=1 pin its processes, "
        "api_nice=10 lowers the API's priority, api_workers=2 serves it from two processes",
    )
    p.add_argument("--config", type=parse_pairs, default={}, help="w2=PATH,w1=PATH")
    p.add_argument(
        "--capacity",
        type=parse_pairs,
        default={},
        help="w2=RPS,...: the reference capacity instead of the measured one",
    )
    p.add_argument("--capacity-s", type=float, default=8.0, help="each capacity measurement")
    p.add_argument(
        "--capacity-method",
        choices=["drain", "closed"],
        default="closed",
        help="ours: the closed loop's rate (default) or the queue's drain rate with a backlog "
        "(both are measured and listed; peers: closed loop). The drain, items posted 256 a "
        "request, overstated single-item HTTP capacity by ~30%% (docs/benchmarks.md)",
    )
    p.add_argument("--concurrency", type=int, default=64, help="in flight for the capacity burst")
    p.add_argument(
        "--max-depth",
        default="auto",
        type=_depth_policy,
        help="auto (capacity x SLO / 2), auto:F (capacity x SLO x F), none, or N",
    )
    p.add_argument("--scorers", type=int, default=1, help="scorer processes (score --workers)")
    p.add_argument(
        "--scorer-threads",
        type=int,
        help="torch threads of our scorer (OMP_NUM_THREADS; default: torch's, the cores)",
    )
    p.add_argument("--api-cpus", help="ours: run the API on these CPUs (taskset -c LIST, e.g. 0)")
    p.add_argument(
        "--api-nice",
        type=int,
        default=0,
        help="ours: run the API at this lower CPU priority (nice -n N, 1-19), the scorer first",
    )
    p.add_argument(
        "--scorer-cpus",
        help="ours: run the scorer on these CPUs (taskset -c LIST, e.g. 1; torch's threads "
        "follow the set)",
    )
    p.add_argument("--wait-s", type=float, default=5.0, help="long-poll wait of one GET")
    p.add_argument("--pg", metavar="ADMIN_URL", help="PostgreSQL (scratch database) not SQLite")
    p.add_argument("--no-noisy", dest="noisy", action="store_false")
    p.add_argument(
        "--sim-accel",
        action="store_true",
        help="ours, W2: a simulated accelerator in place of the model (bench/sim_accel.py: "
        "W2's CPU profile's pass times, asleep, no CPU), to see the scheduler and the "
        "ingress without the model on the host's cores; peers are left out",
    )
    p.add_argument("--max-connections", type=int, default=4000)
    p.add_argument(
        "--client",
        choices=["raw", "httpx"],
        default="raw",
        help="HTTP client of the load: a lean asyncio one (default) or httpx",
    )
    p.add_argument("--start-limit-s", type=float, default=240.0)
    p.add_argument("--smoke", action="store_true", help="start each server, one request, stop")
    p.add_argument("--dry-run", action="store_true", help="against a stand-in server")
    p.add_argument("--table", type=Path, help="print the tables of a summary.jsonl and exit")
    args = p.parse_args()
    if args.table:
        rows = [json.loads(line) for line in args.table.read_text().splitlines() if line]
        print(render_tables(rows))
        return 0
    args.systems = [s for s in args.systems.split(",") if s]
    args.workloads = [w for w in args.workloads.split(",") if w]
    unknown = {*args.systems} - {"batching", *PEERS} or {*args.workloads} - {*CONFIGS}
    if unknown:
        p.error(f"unknown system or workload {sorted(unknown)}")
    args.loads = parse_loads(p, args.loads)
    args.patterns = [x for x in args.patterns.split(",") if x]
    args.variants = dict(args.variant or [("", {})])
    args.configs = {**CONFIGS, **{k: Path(v) for k, v in args.config.items()}}
    args.capacity = {k: float(v) for k, v in args.capacity.items()}
    if args.sim_accel and any(s in PEERS for s in args.systems):
        print("--sim-accel: the peers run the real model; running without them", file=sys.stderr)
        args.systems = [s for s in args.systems if s not in PEERS]
    if any(s in PEERS for s in args.systems) and not args.dry_run:
        if args.peers is None or not (args.peers / "workloads.py").exists():
            print(
                "no peers folder (--peers DIR or $PEERS, with workloads.py and venv-*): "
                "running without the peers",
                file=sys.stderr,
            )
            args.systems = [s for s in args.systems if s not in PEERS]
        else:
            args.peers = args.peers.resolve()
    if args.dry_run:
        args.budget_s = min(args.budget_s, 90.0)
        args.capacity_s = min(args.capacity_s, 3.0)
    if args.out is None:
        args.out = Path(tempfile.mkdtemp(prefix="online-bench-"))
    return execute(args)


if __name__ == "__main__":
    sys.exit(main())
