"""An output that fails under a real scorer (a partition folder made immutable, a full disk)
stops the run with a non-zero exit and charges no item: the failure is the output's, and
what was acked is published by the next start (``batching score``, real files, real mounts).

Both need root (``chattr``, ``mount``); elsewhere they skip and say why.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

from batching import config as cfg
from batching import models
from batching.compose import build
from batching.evidence import findings
from batching.evidence import reconcile as rc
from tests.integration.conftest import BATCHING
from tests.integration.test_pipeline import dataset, enqueue, items, w1_records, write_config

N = 400
BATCHES = {"max_batch_size": 16, "claim_size": 64, "max_wait_s": 0.01}


def run(args: list[str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [BATCHING, *args], cwd=cwd, capture_output=True, text=True, timeout=300, check=False
    )


def states(url: str) -> Counter[str]:
    return Counter(models.State(r.state).name for r in items(url).values())


def score_args(path: Path, url: str) -> list[str]:
    return ["score", "-c", str(path), "--db", url, "--quiet", "--until-empty"]


@pytest.fixture
def immutable(tmp_path: Path) -> Iterator[Path]:
    """Today's partition folder of the W1 model, immutable (``chattr +i``)."""
    day = time.strftime("%Y-%m-%d", time.gmtime())
    folder = tmp_path / "outputs" / f"date={day}" / "model_version=w1-mlp-v1"
    folder.mkdir(parents=True)
    made = subprocess.run(["chattr", "+i", str(folder)], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"chattr +i not possible here: {made.stderr.strip()}")
    yield folder
    subprocess.run(["chattr", "-i", str(folder)], check=True)


@pytest.mark.slow
def test_a_publish_the_folder_refuses_stops_the_run_and_reconcile_calls_it_critical(
    immutable: Path, sqlite_url: str, tmp_path: Path
) -> None:
    path = write_config("tabular.yaml", tmp_path, batching=BATCHES)
    config = cfg.load_config(path)
    enqueue(sqlite_url, config, w1_records(N, tmp_path))

    failed = run(score_args(path, sqlite_url), tmp_path)
    assert failed.returncode == 1, failed.stdout + failed.stderr
    assert "committed but not published" in failed.stderr
    assert "Traceback" not in failed.stderr
    after = states(sqlite_url)
    assert 0 < after["DONE"] < N, "the run went on acking into a folder that refused its files"
    assert after["LEASED"] == 0
    assert max(r.attempts for r in items(sqlite_url).values()) <= 1

    # Acked, not visible: critical once no live scorer can still be publishing it.
    queue = build.open_queue(config, sqlite_url)
    sink = build.open_sink(queue, build.resolve(config, sqlite_url, None), read_only=True)
    later = time.time() + findings.PUBLISH_GRACE_S + 1
    report = rc.reconcile(queue, sink, now=later)
    unpublished = report.by_kind(findings.Kind.UNPUBLISHED)
    assert unpublished
    assert {f.severity for f in unpublished} == {findings.Severity.CRITICAL}
    assert sum(len(f.item_keys) for f in unpublished) == after["DONE"]
    assert not report.ok
    queue.engine.dispose()

    subprocess.run(["chattr", "-i", str(immutable)], check=True)
    again = run(score_args(path, sqlite_url), tmp_path)
    assert again.returncode == 0, again.stderr
    assert states(sqlite_url) == Counter(DONE=N)
    assert len(dataset(tmp_path / "outputs")) == N
    clean = run(["reconcile", "-c", str(path), "--db", sqlite_url], tmp_path)
    assert clean.returncode == 0, clean.stdout


@pytest.mark.slow
def test_a_full_disk_fails_the_run_with_its_errno_and_charges_no_item(
    small_volume: Path, sqlite_url: str, tmp_path: Path
) -> None:
    events = tmp_path / "events.jsonl"
    path = write_config(
        "tabular.yaml",
        tmp_path,
        batching=BATCHES,
        output={"max_rows_per_commit": 16},  # a file per batch of 16: 25 files, 4 KiB or more each
        lineage={"transport": "file", "path": str(events)},
    )
    config_text = path.read_text().replace(str(tmp_path / "outputs"), str(small_volume / "out"))
    path.write_text(config_text)
    config = cfg.load_config(path)
    enqueue(sqlite_url, config, w1_records(N, tmp_path))

    for _ in range(5):  # as often as max_attempts: before, a run's reaped batch cost an attempt
        failed = run(score_args(path, sqlite_url), tmp_path)
        assert failed.returncode == 1, failed.stdout + failed.stderr
        assert "No space left on device" in failed.stderr
        assert "Traceback" not in failed.stderr
    rows = items(sqlite_url).values()
    assert states(sqlite_url)["DEAD"] == 0
    assert states(sqlite_url)["LEASED"] == 0, "the batch that could not be written stayed leased"
    assert max(r.attempts for r in rows) <= 1, "an item was charged for the output's failure"
    fails = [
        e for e in map(json.loads, events.read_text().splitlines()) if e["eventType"] == "FAIL"
    ]
    assert len(fails) == 5
    assert all("No space left on device" in json.dumps(e["run"]["facets"]) for e in fails)

    subprocess.run(["mount", "-o", "remount,size=16m", str(small_volume)], check=True)
    again = run(score_args(path, sqlite_url), tmp_path)
    assert again.returncode == 0, again.stderr
    assert states(sqlite_url) == Counter(DONE=N)
    assert len(dataset(small_volume / "out")) == N
