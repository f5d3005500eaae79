"""Drill: the output volume fills up mid-run (a small tmpfs, as a full disk on the host).

The run stops with exit 1 and one error line naming the errno (28, "No space left on device");
the batch it could not write is given back, no item is charged an attempt or left leased; once
the volume has room again the next run commits everything exactly once. Needs root (``mount``);
elsewhere it skips and says why.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.drills.conftest import Drill, assert_nothing_lost, metric_sum, report, textfile
from tests.integration.test_pipeline import items

N = 400
BATCHES = {"max_batch_size": 16, "claim_size": 64, "max_wait_s": 0.01}


@pytest.mark.drill
def test_disk_full_fails_the_run_naming_errno_28_and_loses_nothing(
    drill: Drill, small_volume: Path
) -> None:
    out = small_volume / "out"
    prom = drill.folder / "run.prom"  # the run's metrics (node_exporter's textfile collector)
    drill.queue(
        N,
        batching=BATCHES,
        output={"max_rows_per_commit": 16},
        metrics={"textfile_path": str(prom)},
    )
    assert drill.config_path is not None
    text = drill.config_path.read_text().replace(str(drill.outputs), str(out))
    drill.config_path.write_text(text)

    failed = drill.score("--json")
    assert failed.rc == 1, failed.out + failed.err
    error = json.loads(failed.out)["error"]
    assert error["exit_code"] == 1
    assert "\n" not in error["message"]
    assert "No space left on device" in error["message"], error
    assert "Errno 28" in error["message"] or "errno 28" in error["message"].lower(), error
    assert failed.err.strip().splitlines()[-1].startswith("error: ")
    assert "ERROR batching.loop.scorer: scoring stage failed" in failed.err, failed.err

    states = drill.states()
    assert states["DEAD"] == 0
    assert states["LEASED"] == 0, "the batch that could not be written stayed leased"
    assert states["READY"] > 0, "the volume took everything: nothing tested"
    assert max(r.attempts for r in items(drill.admin_url).values()) <= 1, "an item was charged"
    # The failed run's metrics are written all the same: what it committed, nothing dead,
    # and the run no longer active (the no-heartbeat alert is for runs that say they run).
    run = textfile(prom)
    assert metric_sum(run, "batching_items_committed_total") == states["DONE"]
    assert metric_sum(run, "batching_run_active") == 0

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_volume)], check=True)
    again = drill.score()
    assert again.rc == 0, again.err
    verdict = assert_nothing_lost(drill, N, root=out)
    report(
        "disk_full",
        items=verdict.items,
        lost=verdict.lost,
        duplicated=verdict.duplicated,
        done_before=states["DONE"],
        exit_failed=failed.rc,
        fail_s=f"{failed.duration_s:.1f}",
        exit_again=again.rc,
        rerun_s=f"{again.duration_s:.1f}",
    )
