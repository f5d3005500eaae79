"""Drill: slow dependencies. Latency is injected (:mod:`tests.drills.delay_proxy`) in front of
the database (every round trip slower) and in front of the lineage backend (slower than the
transport's timeout: every delivery times out).

The run still finishes with exit 0 and every item committed exactly once; the lineage it could
not deliver is counted, said on stderr, and kept in the spool; once the backend answers in time
again, ``batching lineage flush`` delivers it and the backend has the run's START and COMPLETE.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from http.server import ThreadingHTTPServer
from typing import Any

import pytest

from tests.conftest import LineageBackend
from tests.drills.conftest import Drill, assert_nothing_lost, report
from tests.drills.delay_proxy import DelayProxy

N = 2000
DB_DELAY_S = 0.005  # each way: +10 ms on every database round trip
LINEAGE_TIMEOUT_S = 0.5
LINEAGE_DELAY_S = 1.0  # each way: past the lineage timeout
BATCHES = {"max_batch_size": 32, "claim_size": 128, "max_wait_s": 0.01}


@pytest.fixture
def lineage_backend() -> Iterator[tuple[int, list[dict[str, Any]]]]:
    received: list[dict[str, Any]] = []
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), type("B", (LineageBackend,), {"received": received})
    )
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    yield int(server.server_address[1]), received
    server.shutdown()
    server.server_close()


@pytest.mark.drill
def test_slow_database_and_lineage_backend_lose_nothing(
    drill: Drill, lineage_backend: tuple[int, list[dict[str, Any]]]
) -> None:
    backend_port, received = lineage_backend
    with (
        DelayProxy(drill.cluster.port, delay_s=DB_DELAY_S) as db_proxy,
        DelayProxy(backend_port, delay_s=LINEAGE_DELAY_S) as lineage_proxy,
    ):
        lineage = {
            "transport": "http",
            "url": f"http://127.0.0.1:{lineage_proxy.port}",
            "timeout_s": LINEAGE_TIMEOUT_S,
            "retries": 0,
        }
        drill.queue(N, batching=BATCHES, lineage=lineage)
        slow_url = drill.url.replace(f":{drill.cluster.port}/", f":{db_proxy.port}/")
        run = drill.batching(
            "score", "-c", str(drill.config_path), "--db", slow_url, "--quiet", "--json"
        )
        assert run.rc == 0, run.err
        assert db_proxy.connections >= 1, "the run did not go through the proxy: nothing tested"
        summary = json.loads(run.out)
        run_id = summary["run_id"]
        # The signal: lineage not delivered is counted and said, the run is not failed for it.
        assert summary["lineage_failures"] >= 2, summary
        assert f"lineage event spooled run_id={run_id}" in run.err, run.err
        verdict = assert_nothing_lost(drill, N)
        # The spool's backlog shows in `batching metrics serve` (the lineage alert reads it).
        spooled = drill.gauge("batching_lineage_spool_events")
        assert spooled > 0

        # The backend is back to answering in time (still slow): the spool is flushed to it.
        lineage_proxy.delay_s = 0.05
        flushed = drill.batching(
            "lineage", "flush", "-c", str(drill.config_path), "--db", drill.url
        )
        assert flushed.rc == 0, flushed.out + flushed.err
        # Every event of the run arrived; one whose answer came too late may arrive twice
        # (OpenLineage consumers key an event by run, type and time).
        events = {(e["eventType"], e["eventTime"]) for e in received if e["run"]["runId"] == run_id}
        assert {kind for kind, _ in events} >= {"START", "COMPLETE"}, events
        again = drill.batching("lineage", "flush", "-c", str(drill.config_path), "--db", drill.url)
        assert again.rc == 0, again.out + again.err  # nothing left in the spool
        assert drill.gauge("batching_lineage_spool_events") == 0
    report(
        "slow_dependency",
        items=verdict.items,
        lost=verdict.lost,
        duplicated=verdict.duplicated,
        exit=run.rc,
        run_s=f"{run.duration_s:.1f}",
        lineage_failures=summary["lineage_failures"],
        spooled=int(spooled),
        events_received=len(received),
        events_distinct=len(events),
        exit_flush=flushed.rc,
    )
