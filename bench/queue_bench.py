"""Benchmark: claim+ack rows per second at claim sizes 1, 64 and 512, on SQLite and PostgreSQL.

Not a test. One scorer process, the database on the same machine; every claim is one
statement and every ack one fenced UPDATE, each in its own transaction (as the scorer does).

    python bench/queue_bench.py [--pg postgresql://postgres@127.0.0.1:5432/postgres] [--items N]
        [--tenants N]

With ``--tenants N`` the items are spread over N tenants, so every claim is split by the
fair share (``queue.fair_share``); one tenant (the default) is the single-tenant claim.

``--w1 N``: instead, N W1 tensor items claimed as the scorer claims them (``columns=True``,
claims of ``--claim`` items: range leases where a claim is one run of ids) and acked in
batches of 2,048, with the claims and the acks timed apart: microseconds a row each.

``--enqueue N``: instead, N W1 tensor items enqueued in one call into an empty queue, then
the first quarter of them again (every key present), microseconds a row each.

``--trickle N``: instead, the CPU a claim costs a scorer below capacity, as it claims after
every batch and whenever the database changes: N rounds of two items enqueued, a claim of up
to 64 that takes them (``columns=True``), a claim that finds nothing, the ack. Milliseconds
of this thread's CPU (``time.thread_time``) a claim of each kind, and an ack.

``--stats N``: instead, how long ``batching status`` and a metrics scrape take to count a
queue table of N done items and 750 live ones (1,000 enqueued: 500 ready, 250 leased, 250
done; then the done rows copied up to N): milliseconds, the median of three, for the live states alone
(``stats(done=False)``: what a scrape, a score flow's precondition and a run's closing note
read) and for every state (``stats()``, which reads each done item).

``--unprepared``: PostgreSQL's connections prepare no statement. By default psycopg 3 prepares
a statement on the server on its sixth execution on a connection, and the queue's verbs
render the same SQL every time, so they run prepared; this measures what that saves.
"""

from __future__ import annotations

import argparse
import gc
import math
import platform
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import sqlalchemy as sa

from batching import models
from batching.ingress import ingest
from batching.ingress import queue as q
from batching.model import workloads
from batching.store import database, schema


def _records(n: int, tenants: int = 1) -> list[models.EnqueueRecord]:
    return [
        models.EnqueueRecord(f"k{i}", models.Payload(b'{"x":[0.5]}'), tenant=f"t{i % tenants}")
        for i in range(n)
    ]


UNPREPARED = False
"""``--trickle N``: instead, the CPU a claim costs a scorer below capacity, as it claims after
every batch and whenever the database changes: N rounds of two items enqueued, a claim of up
to 64 that takes them (``columns=True``), a claim that finds nothing, the ack. Milliseconds
of this thread's CPU (``time.thread_time``) a claim of each kind, and an ack.

``--unprepared``: PostgreSQL connections prepare nothing (psycopg's ``prepare_threshold``
None), to measure what the server-side prepared statements psycopg makes by default save."""


def _engine(url: str) -> sa.Engine:
    engine = database.create_engine(url)
    if UNPREPARED and engine.dialect.name == "postgresql":

        @sa.event.listens_for(engine, "connect")
        def _unprepared(dbapi_connection: Any, _record: Any) -> None:
            dbapi_connection.prepare_threshold = None

    return engine


def measure(url: str, claim_size: int, n_items: int, tenants: int = 1) -> float:
    """Rows per second to claim and ack ``n_items`` in claims of ``claim_size``."""
    engine = _engine(url)
    queue = q.SqlQueue(engine, f"bench-{claim_size}")
    queue.migrate()
    queue.enqueue(_records(n_items, tenants))
    done = 0
    started = time.perf_counter()
    while done < n_items:
        claim = queue.claim(claim_size, lease_s=60)
        done += queue.ack(claim.lease_id, [i.id for i in claim.items])
    elapsed = time.perf_counter() - started
    engine.dispose()
    return n_items / elapsed


def measure_w1(url: str, n_items: int, claim_size: int) -> tuple[float, float]:
    """Microseconds a row to claim (as the scorer does) and to ack ``n_items`` W1 items."""
    with tempfile.TemporaryDirectory() as tmp:
        records = ingest.read_records(workloads.write_w1_parquet(Path(tmp) / "w1.parquet", n_items))
    engine = _engine(url)
    queue = q.SqlQueue(engine, f"w1-{uuid.uuid4().hex[:8]}")
    queue.migrate()
    queue.enqueue(records)
    claim_s, ack_s = claim_and_ack(queue, n_items, claim_size)
    engine.dispose()
    return claim_s / n_items * 1e6, ack_s / n_items * 1e6


def claim_and_ack(queue: q.SqlQueue, n_items: int, claim_size: int) -> tuple[float, float]:
    """Seconds to claim ``n_items`` as the scorer claims them (``columns=True``) and to ack
    them 2,048 at a time; objects alive now are frozen out of the cyclic GC meanwhile."""
    claim_s = ack_s = 0.0
    done = 0
    gc.freeze()
    try:
        while done < n_items:
            started = time.perf_counter()
            claim = queue.claim(claim_size, lease_s=600, columns=True)
            claim_s += time.perf_counter() - started
            ids = models.item_column(claim.items, "id")
            started = time.perf_counter()
            for k in range(0, len(ids), 2048):
                done += queue.ack(claim.lease_id, ids[k : k + 2048])
            ack_s += time.perf_counter() - started
    finally:
        gc.unfreeze()
    return claim_s, ack_s


def measure_stats(url: str, n_done: int) -> tuple[float, float]:
    """Milliseconds to count the states of a queue of ``n_done`` done items and 750 live
    ones: the live states alone (NaN where ``stats`` cannot leave done out), and all."""
    engine = _engine(url)
    queue = q.SqlQueue(engine, "stats")
    queue.migrate()
    queue.enqueue(_records(1000, tenants=4))
    claim = queue.claim(500, lease_s=600)
    queue.ack(claim.lease_id, [i.id for i in claim.items[:250]])
    t = schema.items
    cols = [c for c in t.c if c.name != "id"]
    with engine.begin() as conn:
        have, k = 250, 0
        while have < n_done:
            k += 1
            copied = [c + f"-{k}" if c.name == "item_key" else c for c in cols]
            step = min(have, n_done - have)  # every done row, copied (rowcount is -1 on psycopg)
            more = sa.select(*copied).where(t.c.state == 2).limit(step)
            conn.execute(t.insert().from_select([c.name for c in cols], more))
            have += step
        if engine.dialect.name == "postgresql":
            conn.execute(sa.text("ANALYZE batching_items"))

    def ms(count: Callable[[], Any]) -> float:
        took = []
        for _ in range(3):
            started = time.perf_counter()
            count()
            took.append((time.perf_counter() - started) * 1e3)
        return sorted(took)[1]

    try:
        live = ms(lambda: queue.stats(all_queues=True, done=False))
    except TypeError:  # a version before stats(done=...)
        live = math.nan
    whole = ms(lambda: queue.stats(all_queues=True))
    engine.dispose()
    return live, whole


def measure_enqueue(url: str, n_items: int) -> tuple[float, float]:
    """Microseconds a row to enqueue ``n_items`` W1 tensor items into an empty queue, then to
    enqueue their first quarter again (every key present: nothing inserted)."""
    with tempfile.TemporaryDirectory() as tmp:
        records = ingest.read_records(workloads.write_w1_parquet(Path(tmp) / "w1.parquet", n_items))
    engine = _engine(url)
    queue = q.SqlQueue(engine, f"enq-{uuid.uuid4().hex[:8]}")
    queue.migrate()
    again = records[: max(1, n_items // 4)]
    try:
        started = time.perf_counter()
        assert queue.enqueue(records).inserted == n_items
        new_s = time.perf_counter() - started
        started = time.perf_counter()
        assert len(queue.enqueue(again).duplicates) == len(again)
        again_s = time.perf_counter() - started
    finally:
        engine.dispose()
    return new_s / n_items * 1e6, again_s / len(again) * 1e6


def measure_trickle(url: str, rounds: int) -> tuple[float, float, float]:
    """CPU milliseconds of a claim that takes two items, of one that finds nothing, as a
    scorer below capacity makes them, and of the two items' ack (``--trickle``)."""
    engine = _engine(url)
    queue = q.SqlQueue(engine, f"trickle-{uuid.uuid4().hex[:8]}")
    queue.migrate()
    body = models.Payload(b'{"x":[0.5]}')
    took_s = empty_s = ack_s = 0.0
    try:
        for i in range(rounds + 20):  # the first 20 warm the statement caches
            queue.enqueue([models.EnqueueRecord(f"k{i}-{j}", body) for j in range(2)])
            started = time.thread_time()
            claim = queue.claim(64, lease_s=60, columns=True)
            took = time.thread_time() - started
            started = time.thread_time()
            assert len(queue.claim(64, lease_s=60, columns=True)) == 0
            empty = time.thread_time() - started
            assert len(claim) == 2
            started = time.thread_time()
            assert queue.ack(claim.lease_id, models.item_column(claim.items, "id")) == 2
            acked = time.thread_time() - started
            if i >= 20:
                took_s, empty_s, ack_s = took_s + took, empty_s + empty, ack_s + acked
    finally:
        engine.dispose()
    return took_s / rounds * 1e3, empty_s / rounds * 1e3, ack_s / rounds * 1e3


def _pg_database(admin_url: str) -> tuple[str, str]:
    name = f"batching_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    return name, admin_url.rpartition("/")[0] + "/" + name


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pg",
        default="postgresql://postgres@127.0.0.1:5432/postgres",
        help="admin URL; '' skips PostgreSQL",
    )
    parser.add_argument(
        "--items", type=int, default=20_000, help="items per run at claim sizes 64 and 512"
    )
    parser.add_argument("--tenants", type=int, default=1, help="tenants the items are spread over")
    parser.add_argument("--w1", type=int, metavar="N", help="N W1 tensor items, as a scorer claims")
    parser.add_argument("--claim", type=int, default=16_384, help="claim size with --w1")
    parser.add_argument(
        "--enqueue", type=int, metavar="N", help="instead: enqueue N W1 tensor items, µs a row"
    )
    parser.add_argument(
        "--trickle",
        type=int,
        metavar="N",
        help="instead: N rounds of a claim of two items and an empty one, CPU ms each",
    )
    parser.add_argument(
        "--stats",
        type=int,
        metavar="N",
        help="instead: ms to count a queue of N done items (live states alone, and all)",
    )
    parser.add_argument(
        "--unprepared",
        action="store_true",
        help="PostgreSQL: prepare no statement (psycopg prepares a statement on its 6th use)",
    )
    args = parser.parse_args()
    global UNPREPARED
    UNPREPARED = args.unprepared
    if args.enqueue:
        _enqueue(args)
        return
    if args.w1:
        _w1(args)
        return
    if args.stats:
        results = _on_each_database(args, lambda url: measure_stats(url, args.stats))
        title = f"{args.stats:,} done items, 750 live: milliseconds to count them"
        _table(title, ("live", "all"), results)
        return
    if args.trickle:
        _trickle(args)
        return
    sizes = {1: max(1, args.items // 10), 64: args.items, 512: args.items}
    rows: dict[str, dict[int, float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        rows["sqlite"] = {
            s: measure(f"sqlite:///{Path(tmp) / f'b{s}.db'}", s, n, args.tenants)
            for s, n in sizes.items()
        }
    if args.pg:
        name, url = _pg_database(args.pg)
        try:
            rows["postgresql"] = {s: measure(url, s, n, args.tenants) for s, n in sizes.items()}
        finally:
            with psycopg.connect(args.pg, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    print(
        f"claim+ack rows/s ({platform.processor() or platform.machine()}, "
        f"{platform.python_version()}, {args.tenants} tenant(s))"
    )
    print(f"{'database':<12}{'size 1':>10}{'size 64':>10}{'size 512':>10}{'512 / 1':>10}")
    for db, r in rows.items():
        print(f"{db:<12}{r[1]:>10.0f}{r[64]:>10.0f}{r[512]:>10.0f}{r[512] / r[1]:>9.1f}x")


def _on_each_database(
    args: argparse.Namespace, measure_one: Callable[[str], tuple[float, ...]]
) -> dict[str, tuple[float, ...]]:
    """``measure_one(url)`` on a scratch SQLite file, then (``--pg``) on a scratch
    PostgreSQL database dropped afterwards."""
    with tempfile.TemporaryDirectory() as tmp:
        results = {"sqlite": measure_one(f"sqlite:///{Path(tmp) / 'bench.db'}")}
    if args.pg:
        name, url = _pg_database(args.pg)
        try:
            results["postgresql"] = measure_one(url)
        finally:
            with psycopg.connect(args.pg, autocommit=True) as conn:
                conn.execute(f'DROP DATABASE "{name}" WITH (FORCE)')
    return results


def _table(title: str, columns: tuple[str, ...], results: dict[str, tuple[float, ...]]) -> None:
    """Print ``results`` (a row of figures by database) under ``title`` and ``columns``."""
    print(title)
    print(f"{'database':<12}" + "".join(f"{c:>9}" for c in columns))
    for db, figures in results.items():
        print(f"{db:<12}" + "".join(f"{f:>9.2f}" for f in figures))


def _enqueue(args: argparse.Namespace) -> None:
    results = _on_each_database(args, lambda url: measure_enqueue(url, args.enqueue))
    title = f"W1 tensor items, {args.enqueue:,}, one enqueue each: microseconds a row"
    _table(title, ("new", "present"), dict(results))


def _w1(args: argparse.Namespace) -> None:
    results = _on_each_database(args, lambda url: measure_w1(url, args.w1, args.claim))
    title = f"W1 tensor items, {args.w1:,}, claims of {args.claim:,}: microseconds a row"
    _table(title, ("claim", "ack", "both"), {db: (c, a, c + a) for db, (c, a) in results.items()})


def _trickle(args: argparse.Namespace) -> None:
    results = _on_each_database(args, lambda url: measure_trickle(url, args.trickle))
    title = f"{args.trickle:,} rounds below capacity: CPU milliseconds a claim, an ack"
    _table(title, ("2 items", "nothing", "ack"), dict(results))


if __name__ == "__main__":
    main()
