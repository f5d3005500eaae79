"""Drill: the database restarts mid-run (``pg_ctl restart -m fast``, as a minor-version upgrade
or a failover does): every connection is cut and refused for a moment. The scorer reconnects
with backoff, says so in its log, and finishes; every item is committed exactly once."""

from __future__ import annotations

import json

from tests.drills.conftest import Drill, assert_nothing_lost, finish, metric_sum, report, textfile
from tests.integration.test_pipeline import wait_for_done

N = 3000


def test_database_restart_mid_run_scorer_reconnects_and_loses_nothing(drill: Drill) -> None:
    prom = drill.folder / "run.prom"  # the run's metrics (node_exporter's textfile collector)
    drill.queue(N, queue={"lease_s": 30}, metrics={"textfile_path": str(prom)})
    proc = drill.start_score("--json")
    done_before = wait_for_done(drill.url, 300, proc)
    drill.cluster.restart("fast")
    run = finish(proc, timeout_s=240)

    assert run.rc == 0, run.err
    summary = json.loads(run.out)
    assert summary["ok"] is True
    # The signal: each lost connection is logged, with the verb that met it.
    assert "database connection lost" in run.err, run.err
    assert "reconnect" in run.err
    verdict = assert_nothing_lost(drill, N)
    assert done_before < N
    # The run's committed counter went on counting across the reconnects.
    committed = summary["summary"]["items_committed"]
    assert metric_sum(textfile(prom), "batching_items_committed_total") == committed
    report(
        "database_restart",
        items=verdict.items,
        lost=verdict.lost,
        duplicated=verdict.duplicated,
        done_before=done_before,
        committed_by_run=summary["summary"]["items_committed"],
        exit=run.rc,
        run_s=f"{run.duration_s:.1f}",
    )
