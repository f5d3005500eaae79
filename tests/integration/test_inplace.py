"""Bulk scoring in place: a Parquet dataset queued as shards, scored with the real W1 model,
committed as Parquet files read back; reconcile, lineage, changed inputs, rows the model
refuses, and a scorer killed for real mid-run."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pds
import pyarrow.parquet as pq
import pytest
import torch
import yaml

from batching import config as cfg
from batching import errors, models
from batching.compose import build, inplace
from batching.compose import run as wiring
from batching.evidence import lineage, lineage_log
from batching.evidence import reconcile as rc
from batching.ingress import shards
from batching.loop import stats
from batching.model import workloads
from batching.model.runner import TorchRunner
from batching.outputs import parquet
from batching.store import schema
from tests import olspec
from tests.conftest import REPO, wait_for

DEPLOYMENTS = REPO / "deployments"
UNTIL_EMPTY = stats.RunLimits(until_empty=True)


def config(tmp_path: Path, **queue: Any) -> cfg.PipelineConfig:
    """tabular.yaml, its queue and output its own, lineage under ``tmp_path``."""
    return cfg.load_config(
        DEPLOYMENTS / "tabular.yaml",
        {
            "queue": {"name": "w1-shards", **queue},
            "output": {"path": str(tmp_path / "out")},
            "lineage": {"path": str(tmp_path / "lineage" / "events.jsonl")},
        },
    )


def write_dataset(folder: Path, files: int, rows: int, group: int) -> np.ndarray:
    """``files`` W1 files of ``rows`` rows (row groups of ``group``); returns every row."""
    folder.mkdir(parents=True, exist_ok=True)
    x = workloads.w1_inputs(files * rows)
    for f in range(files):
        part = x[f * rows : (f + 1) * rows]
        payload = pa.FixedSizeListArray.from_arrays(pa.array(part.reshape(-1)), 64)
        keys = pa.array([f"row-{f}-{i}" for i in range(rows)])
        table = pa.table({"item_key": keys, "payload": payload})
        pq.write_table(table, folder / f"part-{f}.parquet", row_group_size=group)
    return x


def migrate(url: str, c: cfg.PipelineConfig) -> None:
    queue = build.open_queue(c, url, create=True)
    queue.migrate()
    queue.engine.dispose()


def config_file(
    tmp_path: Path, url: str, queue: dict[str, Any], batching: dict[str, Any] | None = None
) -> tuple[Path, cfg.PipelineConfig]:
    """tabular.yaml with its own queue, output and lineage, written for a subprocess to load;
    the queue's schema is created on ``url``."""
    data = yaml.safe_load((DEPLOYMENTS / "tabular.yaml").read_text())
    data["queue"] = {"name": "w1-shards", **queue}
    data["service_profile"] = str(DEPLOYMENTS / data["service_profile"])
    data["output"]["path"] = str(tmp_path / "out")
    data["batching"].update(batching or {})
    data["lineage"] = {"transport": "file", "path": str(tmp_path / "events.jsonl")}
    conf = tmp_path / "inplace.yaml"
    conf.write_text(yaml.safe_dump(data))
    c = cfg.load_config(conf)
    migrate(url, c)
    return conf, c


BATCHING = str(Path(sys.executable).with_name("batching"))


def bulk_args(dataset: Path, conf: Path, url: str, *more: str) -> list[str]:
    """`batching bulk DATASET --in-place` on ``url`` (after the program), quiet, with ``more``."""
    return ["bulk", str(dataset), "-c", str(conf), "--in-place", "--quiet", "--db", url, *more]


def outputs(root: Path) -> pa.Table:
    return pds.dataset(root, format="parquet", partitioning="hive").to_table()


def once_each(table: pa.Table) -> int:
    """The rows of ``table``, checked to name each input row (file, row number) once."""
    pairs = zip(
        table.column("input_file").to_pylist(), table.column("input_row").to_pylist(), strict=True
    )
    assert len(set(pairs)) == table.num_rows, "an input row has more than one output row"
    return int(table.num_rows)


def expected(c: cfg.PipelineConfig, x: np.ndarray) -> np.ndarray:
    runner = TorchRunner.load(c.model, base_dir=c.base_dir)
    with torch.inference_mode():
        out: np.ndarray = runner.model(torch.from_numpy(x)).numpy()
    return out.reshape(len(x), -1)


def reconcile(url: str, c: cfg.PipelineConfig, root: Path) -> rc.Report:
    queue = build.open_queue(c, url)
    try:
        return rc.reconcile(queue, parquet.ParquetSink(queue, root), now=time.time())
    finally:
        queue.engine.dispose()


def test_every_row_scored_once_and_reconciled(db_url: str, tmp_path: Path) -> None:
    """Three files cut into shards of whole row groups: every input row has exactly one output
    row, the model's own output for it; reconcile is clean; a second run queues and scores
    nothing."""
    c = config(tmp_path)
    migrate(db_url, c)
    x = write_dataset(tmp_path / "in", files=3, rows=1000, group=256)
    found, queued = inplace.enqueue_shards(c, db_url, tmp_path / "in", rows_per_shard=500)
    assert [s.rows for s in found.shards] == [512, 488] * 3  # whole row groups
    assert queued.inserted == 6
    outcome = wiring.run_score(
        c, db_url=db_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
    )
    assert outcome.summary["items_committed"] == 3000
    assert outcome.summary["commits"] == 6
    table = outputs(tmp_path / "out")
    assert table.num_rows == 3000
    files = table.column("input_file").to_pylist()
    rows = table.column("input_row").to_numpy()
    assert len(set(zip(files, rows.tolist(), strict=True))) == 3000
    order = np.array([int(f[5]) * 1000 + r for f, r in zip(files, rows.tolist(), strict=True)])
    got = np.stack(table.column("output").to_numpy(zero_copy_only=False))[np.argsort(order)]
    np.testing.assert_allclose(got, expected(c, x), rtol=1e-5, atol=1e-6)
    keys = table.column("input_key").to_pylist()
    assert keys[0] == f"row-{files[0][5]}-{rows[0]}"
    assert table.column("error").null_count == 3000
    assert reconcile(db_url, c, tmp_path / "out").clean
    again, queued = inplace.enqueue_shards(c, db_url, tmp_path / "in", rows_per_shard=500)
    assert (queued.inserted, len(queued.duplicates)) == (0, 6)
    assert again.version == found.version
    rerun = wiring.run_score(
        c, db_url=db_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(again)
    )
    assert rerun.summary["items_committed"] == 0
    assert outputs(tmp_path / "out").num_rows == 3000
    from batching.compose import replay

    with pytest.raises(errors.InputError, match="scored input shards in place"):
        replay.replay(c, db_url, outcome.run_id, output=tmp_path / "replayed")


def test_lineage_names_the_input_and_its_version(sqlite_url: str, tmp_path: Path) -> None:
    c = config(tmp_path)
    migrate(sqlite_url, c)
    write_dataset(tmp_path / "in", files=2, rows=300, group=100)
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    wiring.run_score(c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found))
    events = lineage_log.read_events(tmp_path / "lineage" / "events.jsonl")
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]
    registry = olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())
    for event in events:
        olspec.assert_valid_event(event, registry)
    inputs = {i["name"]: i for i in events[-1]["inputs"]}
    data = inputs[str((tmp_path / "in").resolve())]
    assert data["namespace"] == "file"
    assert data["facets"]["version"]["datasetVersion"] == found.version
    out = events[-1]["outputs"][0]
    names = [f["name"] for f in out["facets"]["schema"]["fields"]]
    assert {"input_file", "input_row", "output", "error"} <= set(names)
    # what this run read, not the dataset: a rerun that found it all scored read nothing (a
    # review: every run reported the whole dataset)
    assert "inputStatistics" not in events[0]["inputs"][-1].get("inputFacets", {})
    assert data["inputFacets"]["inputStatistics"]["rowCount"] == 600
    assert out["outputFacets"]["outputStatistics"]["rowCount"] == 600
    wiring.run_score(c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found))
    again = lineage_log.read_events(tmp_path / "lineage" / "events.jsonl")[-1]
    read = {i["name"]: i for i in again["inputs"]}[data["name"]]
    assert read["inputFacets"]["inputStatistics"]["rowCount"] == 0


def test_a_changed_file_is_refused_not_half_scored(sqlite_url: str, tmp_path: Path) -> None:
    """A file rewritten after its shards were queued: its shards go dead with the reason, the
    other file is scored, and planning the changed dataset again is refused."""
    c = config(tmp_path)
    migrate(sqlite_url, c)
    write_dataset(tmp_path / "in", files=2, rows=400, group=200)
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in", rows_per_shard=200)
    changed = tmp_path / "in" / "part-1.parquet"
    table = pq.read_table(changed)
    pq.write_table(table.slice(0, 399), changed, row_group_size=200)
    outcome = wiring.run_score(
        c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
    )
    assert outcome.summary["items_committed"] == 400
    assert set(outputs(tmp_path / "out").column("input_file").to_pylist()) == {"part-0.parquet"}
    engine = build.open_queue(c, sqlite_url).engine
    t = schema.items
    with engine.connect() as conn:
        dead = conn.execute(t.select().where(t.c.state == 3)).all()
    engine.dispose()
    assert len(dead) == 2
    assert all("changed since it was planned" in r.last_error for r in dead)
    assert outcome.summary["items_failed"] == 400  # the refused rows are said, not hidden
    with pytest.raises(errors.InputError, match=r"part-1\.parquet: the queue holds shards of "):
        inplace.enqueue_shards(c, sqlite_url, tmp_path / "in", rows_per_shard=200)


def test_rows_already_queued_in_other_shards_are_refused_not_scored_twice(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Each shard is its own key and reconciles clean on its own, so the same rows queued
    in two shards were scored twice with every check green: the same file cut by another
    --rows-per-shard, or given once through its folder and once as itself. Both are refused;
    the same plan again is an idempotent rerun."""
    c = config(tmp_path)
    migrate(sqlite_url, c)
    folder = tmp_path / "in"
    write_dataset(folder / "sub", files=1, rows=400, group=100)
    found, queued = inplace.enqueue_shards(c, sqlite_url, folder, rows_per_shard=100)
    assert queued.inserted == 4
    with pytest.raises(errors.InputError, match=r"cut into other row groups \(4 shard\(s\), 2"):
        inplace.enqueue_shards(c, sqlite_url, folder, rows_per_shard=200)
    with pytest.raises(errors.InputError, match=r"the same file .* is queued as 'sub/part-0"):
        inplace.enqueue_shards(c, sqlite_url, folder / "sub" / "part-0.parquet", rows_per_shard=100)
    _, again = inplace.enqueue_shards(c, sqlite_url, folder, rows_per_shard=100)
    assert (again.inserted, len(again.duplicates)) == (0, 4)
    outcome = wiring.run_score(
        c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
    )
    assert outcome.summary["items_committed"] == 400
    assert once_each(outputs(tmp_path / "out")) == 400


def test_an_identical_copy_added_to_the_folder_later_is_a_file_of_its_own(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A byte-identical file added beside one already queued (an unchanged daily export) was
    refused as "the same file queued as" the first, and so was every later run of the
    folder, while both present from the first run were taken: the order of arrival decided."""
    c = config(tmp_path)
    migrate(sqlite_url, c)
    folder = tmp_path / "in"
    write_dataset(folder, files=1, rows=200, group=100)
    inplace.enqueue_shards(c, sqlite_url, folder, rows_per_shard=100)
    shutil.copy2(folder / "part-0.parquet", folder / "copy.parquet")
    _, queued = inplace.enqueue_shards(c, sqlite_url, folder, rows_per_shard=100)
    assert (queued.inserted, len(queued.duplicates)) == (2, 2)
    _, again = inplace.enqueue_shards(c, sqlite_url, folder, rows_per_shard=100)
    assert (again.inserted, len(again.duplicates)) == (0, 4)


def test_a_row_the_model_refuses_fails_alone(sqlite_url: str, tmp_path: Path) -> None:
    """JSON payloads, one of the wrong width: that row has its error and no output, every
    other row its output; the shard commits."""
    c = config(tmp_path)
    migrate(sqlite_url, c)
    x = workloads.w1_inputs(50)
    texts = [json.dumps({"x": row.tolist()}) for row in x]
    texts[17] = json.dumps({"x": [1.0, 2.0]})
    (tmp_path / "in").mkdir()
    pq.write_table(pa.table({"payload": texts}), tmp_path / "in" / "j.parquet")
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    outcome = wiring.run_score(
        c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
    )
    assert (outcome.summary["items_committed"], outcome.summary["items_failed"]) == (49, 1)
    table = outputs(tmp_path / "out").sort_by("input_row")
    errors_ = table.column("error").to_pylist()
    assert errors_[17] is not None
    assert "64" in errors_[17]
    assert [i for i, e in enumerate(errors_) if e is not None] == [17]
    out = table.column("output")
    assert out.null_count == 1
    assert not out[17].is_valid
    want = expected(c, x)
    got = np.array([out[i].values.to_numpy() for i in (0, 49)])
    np.testing.assert_allclose(got, want[[0, 49]], rtol=1e-5, atol=1e-6)
    assert reconcile(sqlite_url, c, tmp_path / "out").clean


def test_plain_scoring_refuses_a_queue_of_shards(sqlite_url: str, tmp_path: Path) -> None:
    c = config(tmp_path)
    migrate(sqlite_url, c)
    write_dataset(tmp_path / "in", files=1, rows=10, group=10)
    inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    with pytest.raises(errors.ConfigError, match="holds input shards"):
        wiring.run_score(c, db_url=sqlite_url, limits=UNTIL_EMPTY)


def test_bad_inputs_are_named(sqlite_url: str, tmp_path: Path) -> None:
    c = config(tmp_path)
    migrate(sqlite_url, c)
    with pytest.raises(errors.InputError, match="no such file or folder"):
        inplace.enqueue_shards(c, sqlite_url, tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(errors.InputError, match=r"no \.parquet file"):
        inplace.enqueue_shards(c, sqlite_url, tmp_path / "empty")
    pq.write_table(pa.table({"x": [1]}), tmp_path / "nopayload.parquet")
    with pytest.raises(errors.InputError, match="no payload column"):
        inplace.enqueue_shards(c, sqlite_url, tmp_path / "nopayload.parquet")
    (tmp_path / "junk.parquet").write_bytes(b"not parquet")
    with pytest.raises(errors.InputError, match="not a readable Parquet file"):
        inplace.enqueue_shards(c, sqlite_url, tmp_path / "junk.parquet")
    sql = config(tmp_path).model_copy(
        update={"output": c.output.model_copy(update={"kind": "sql"})}
    )
    with pytest.raises(errors.ConfigError, match=r"output\.kind: parquet"):
        inplace.enqueue_shards(sql, sqlite_url, tmp_path / "nopayload.parquet")


def test_rows_of_another_length_than_the_model_takes_are_refused_at_plan(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A review: 32 numbers a row (or 64 and 32 in one folder) were queued, and each shard
    failed whole after every retry, across several runs, before it went dead."""
    c = config(tmp_path)
    migrate(sqlite_url, c)

    def rows(path: Path, width: int) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        flat = pa.array(np.ones(10 * width, dtype=np.float32))
        pq.write_table(pa.table({"payload": pa.FixedSizeListArray.from_arrays(flat, width)}), path)

    rows(tmp_path / "narrow" / "a.parquet", 32)
    with pytest.raises(
        errors.InputError, match=r"rows hold 32 numbers and model 'w1-mlp' takes 64"
    ):
        inplace.enqueue_shards(c, sqlite_url, tmp_path / "narrow")
    rows(tmp_path / "mixed" / "a.parquet", 64)
    rows(tmp_path / "mixed" / "b.parquet", 32)
    with pytest.raises(errors.InputError, match=r"differ in length between files \(32, 64 numbers"):
        inplace.enqueue_shards(c, sqlite_url, tmp_path / "mixed")
    queue = build.open_queue(c, sqlite_url)
    assert sum(queue.stats().by_state.values()) == 0  # nothing queued
    queue.engine.dispose()
    found, queued = inplace.enqueue_shards(c, sqlite_url, tmp_path / "mixed" / "a.parquet")
    assert (found.payload_width, queued.inserted) == (64, 1)


def test_sigkill_mid_run_then_rerun_scores_each_row_once(sqlite_url: str, tmp_path: Path) -> None:
    """`batching bulk --in-place` killed with SIGKILL after its first commit, with shards in
    flight: a second run (after the lease runs out) scores the rest; every input row has
    exactly one output row and reconcile is clean."""
    # small batches: a slow run, time to kill it in the middle
    conf, c = config_file(tmp_path, sqlite_url, {"lease_s": 2}, {"max_batch_size": 64})
    write_dataset(tmp_path / "in", files=2, rows=20_000, group=1000)
    cmd = [BATCHING, *bulk_args(tmp_path / "in", conf, sqlite_url, "--rows-per-shard", "1000")]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True
    )
    engine = build.open_queue(c, sqlite_url).engine

    def committed() -> int | None:
        with engine.connect() as conn:
            n = conn.execute(schema.batches.select()).all()
        return len(n) if n else None

    try:
        wait_for(committed, timeout_s=120, what="a first shard committed")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
    first = committed() or 0
    assert first < 40, "the run finished before it was killed"
    time.sleep(2.5)  # its leases run out
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    engine.dispose()
    assert once_each(outputs(tmp_path / "out")) == 40_000
    assert reconcile(sqlite_url, c, tmp_path / "out").clean


def test_a_run_that_leaves_rows_without_output_says_why_and_exits_1(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A review: after a SIGKILL, a rerun scored what was ready and exited 0 while the dead
    scorer's shard stayed leased (its rows without output), and reconcile said clean. A
    shard held here by a lease of 10 minutes stands for that dead scorer's."""
    conf, c = config_file(tmp_path, sqlite_url, {"lease_s": 600})
    write_dataset(tmp_path / "in", files=2, rows=2000, group=1000)
    inplace.enqueue_shards(c, sqlite_url, tmp_path / "in", 1000)
    queue = build.open_queue(c, sqlite_url)
    held = queue.claim(1, lease_s=600, lane=shards.LANE)
    assert len(held.items) == 1
    cmd = [BATCHING, *bulk_args(tmp_path / "in", conf, sqlite_url, "--rows-per-shard", "1000")]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1, r.stderr
    assert (
        "error: 1,000 of 4,000 input rows have no output yet: 1,000 in shards leased"
        in " ".join(r.stderr.split())
    )
    assert once_each(outputs(tmp_path / "out")) == 3000
    judged = subprocess.run(
        [BATCHING, "reconcile", "-c", str(conf), "--db", sqlite_url],
        capture_output=True,
        text=True,
    )
    assert judged.returncode == 0, judged.stderr  # what is done is consistent ...
    assert "not judged yet: 1 item(s) leased and 0 ready" in judged.stdout  # ... and it says so
    swept = subprocess.run(
        [BATCHING, "reconcile", "-c", str(conf), "--db", sqlite_url, "--full", "--json"],
        capture_output=True,
        text=True,
    )
    assert json.loads(swept.stdout)["not_done"] == {"leased": 1, "ready": 0}, swept.stderr
    limited = subprocess.run([*cmd, "--max-seconds", "60"], capture_output=True, text=True)
    assert limited.returncode == 0, limited.stderr  # it asked to stop early: a note
    assert "note: 1,000 of 4,000 input rows" in " ".join(limited.stderr.split())
    queue.release(held.lease_id, [i.id for i in held.items])
    queue.engine.dispose()
    again = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    assert once_each(outputs(tmp_path / "out")) == 4000


def test_a_dataset_another_model_version_scored_is_refused_not_skipped(
    sqlite_url: str, tmp_path: Path
) -> None:
    """A review: the shard keys name the input, not the version, so a run with a new model
    version found every shard already queued, scored nothing and exited 0."""
    c = config(tmp_path)
    migrate(sqlite_url, c)
    write_dataset(tmp_path / "in", files=1, rows=500, group=500)
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    wiring.run_score(c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found))
    assert inplace.left_of(c, sqlite_url, found).rows == 0
    v2 = c.model_copy(update={"model": c.model.model_copy(update={"version": "w1-mlp-v2"})})
    with pytest.raises(
        errors.InputError,
        match=r"scored by model version\(s\) 'w1-mlp-v1'.*'w1-mlp-v2' into a queue",
    ):
        inplace.enqueue_shards(v2, sqlite_url, tmp_path / "in")
    _, again = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")  # the same version: a no-op
    assert again.inserted == 0


def test_plan_cuts_whole_row_groups(tmp_path: Path) -> None:
    write_dataset(tmp_path, files=1, rows=1000, group=300)
    seen: list[tuple[int, int]] = []
    found = shards.plan(tmp_path / "part-0.parquet", 500, lambda *n: seen.append(n))
    size = (tmp_path / "part-0.parquet").stat().st_size
    assert seen[-1] == (size, size)  # the fingerprinting's progress, to the last byte
    assert [(s.first_group, s.end_group, s.first_row, s.rows) for s in found.shards] == [
        (0, 2, 0, 600),
        (2, 4, 600, 400),
    ]
    assert shards.Shard.of(models.Payload(found.shards[1].payload())) == found.shards[1]
    with pytest.raises(errors.InputError, match="not an input shard"):
        shards.Shard.of(models.Payload(b'{"x": [1]}'))


DIE_ON = Path(__file__).with_name("die_on.py")


@pytest.mark.parametrize("how", ["exit", "hang"])
def test_a_row_that_kills_its_scorer_costs_only_itself(
    how: str, sqlite_url: str, tmp_path: Path
) -> None:
    """A row whose scoring kills the process (os._exit, no finally), or hangs its forward
    pass (the watchdog stops the run): the shard that held it is split in halves on its next
    claim until the row is alone, which is charged until dead; every other row is committed
    exactly once, and reconcile is clean."""
    queue = {"lease_s": 0.6, "max_attempts": 2, "forward_timeout_s": 1.0}
    conf, c = config_file(tmp_path, sqlite_url, queue)
    x = workloads.w1_inputs(64)
    x[37, 0] = 1234.5  # the poison row
    folder = tmp_path / "in"
    folder.mkdir()
    payload = pa.FixedSizeListArray.from_arrays(pa.array(x.reshape(-1)), 64)
    pq.write_table(pa.table({"payload": payload}), folder / "p.parquet")
    cmd = [
        sys.executable,
        str(DIE_ON),
        "x0=1234.5",
        how,
        "--",
        *bulk_args(folder, conf, sqlite_url),
    ]
    runs = []
    last = "1 of 64 input rows have no output yet: 1 in dead shards"  # the row, at the end
    for _ in range(14):  # log2(64) splits, then the row alone max_attempts times
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        runs.append(done.returncode)
        if last in " ".join(done.stderr.split()):
            break
        if how == "hang":  # the watchdog ended the lease: the next run takes it at once
            assert "past queue.forward_timeout_s (1 s)" in done.stderr, done.stderr[-2000:]
        else:
            time.sleep(0.7)  # the dead run's lease runs out
    assert runs[-1] == 1, runs  # every other row has its output: the dataset is not whole
    assert runs.count(3) >= 6 if how == "exit" else runs.count(1) >= 7, runs  # the row in flight
    engine = build.open_queue(c, sqlite_url).engine
    t = schema.items
    with engine.connect() as conn:
        dead = conn.execute(t.select().where(t.c.state == 3)).all()
        split = conn.execute(t.select().where(t.c.state == 5)).all()
    engine.dispose()
    assert len(dead) == 1
    assert "alone" in dead[0].last_error
    assert dead[0].cost == 1  # the row alone: one row lost, not its shard
    assert all("split into" in r.last_error for r in split)
    table = outputs(tmp_path / "out")
    rows = sorted(table.column("input_row").to_pylist())
    assert rows == [i for i in range(64) if i != 37]
    assert reconcile(sqlite_url, c, tmp_path / "out").clean


def test_a_delta_table_is_scored_as_of_its_version(sqlite_url: str, tmp_path: Path) -> None:
    """A local Delta table: its current version's files are the input and its version the
    dataset version in lineage; after an append, a second run scores only the new file."""
    from deltalake import write_deltalake

    c = config(tmp_path)
    migrate(sqlite_url, c)
    x = workloads.w1_inputs(300)
    table = tmp_path / "delta table ü"  # deltalake gives its file URIs percent-encoded

    def append(rows: np.ndarray) -> None:
        payload = pa.FixedSizeListArray.from_arrays(pa.array(rows.reshape(-1)), 64)
        write_deltalake(str(table), pa.table({"payload": payload}), mode="append")

    append(x[:100])
    append(x[100:200])
    found, queued = inplace.enqueue_shards(c, sqlite_url, table)
    assert (found.version, found.rows, queued.inserted) == ("1", 200, 2)
    first = wiring.run_score(
        c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
    )
    assert first.summary["items_committed"] == 200
    events = lineage_log.read_events(tmp_path / "lineage" / "events.jsonl")
    inputs = {i["name"]: i["facets"] for i in events[-1]["inputs"]}
    assert inputs[str(table.resolve())]["version"]["datasetVersion"] == "1"
    append(x[200:])
    found, queued = inplace.enqueue_shards(c, sqlite_url, table)
    assert (found.version, found.rows, queued.inserted, len(queued.duplicates)) == ("2", 300, 1, 2)
    again = wiring.run_score(
        c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
    )
    assert again.summary["items_committed"] == 100
    out = outputs(tmp_path / "out")
    assert out.num_rows == 300
    assert reconcile(sqlite_url, c, tmp_path / "out").clean


@pytest.mark.postgres
def test_two_scorer_processes_share_the_shards_on_postgresql(pg_url: str, tmp_path: Path) -> None:
    """`batching bulk --in-place --workers 2` on PostgreSQL: both processes claim shards,
    every input row has exactly one output row, reconcile is clean."""
    conf, c = config_file(tmp_path, pg_url, {})
    write_dataset(tmp_path / "in", files=2, rows=4000, group=500)
    done = subprocess.run(
        [
            BATCHING,
            *bulk_args(
                tmp_path / "in", conf, pg_url, "--json", "--rows-per-shard", "500", "--workers", "2"
            ),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["summary"]["items_committed"] == 8000
    assert len(doc["workers"]) == 2
    assert once_each(outputs(tmp_path / "out")) == 8000
    assert reconcile(pg_url, c, tmp_path / "out").clean


def storm_config(tmp_path: Path, url: str, max_batch_size: int) -> cfg.PipelineConfig:
    """A model whose every forward pass fails (``test_breaker.StormModel``), 40 rows of 4
    numbers queued as one shard."""
    from safetensors.torch import save_file

    ckpt = tmp_path / "empty.safetensors"
    save_file({}, str(ckpt))
    model = {"name": "tests.integration.test_breaker:build_storm", "version": "t1"}
    model |= {"checkpoint": str(ckpt), "sha256": hashlib.sha256(ckpt.read_bytes()).hexdigest()}
    c = cfg.load_config(
        DEPLOYMENTS / "tabular.yaml",
        {
            "model": model | {"device": "cpu"},
            "queue": {"name": "w1-shards", "max_attempts": 2, "backoff_base_s": 0.01},
            "batching": {"max_batch_size": max_batch_size},
            "output": {"path": str(tmp_path / "out")},
            "lineage": {"path": str(tmp_path / "lineage" / "events.jsonl")},
            "service_profile": None,
        },
    )
    migrate(url, c)
    (tmp_path / "in").mkdir()
    payload = pa.FixedSizeListArray.from_arrays(pa.array(np.ones(160, dtype=np.float32)), 4)
    pq.write_table(pa.table({"payload": payload}), tmp_path / "in" / "f.parquet")
    return c


def the_shard(url: str, c: cfg.PipelineConfig) -> Any:
    engine = build.open_queue(c, url).engine
    with engine.connect() as conn:
        (row,) = conn.execute(schema.items.select()).all()
    engine.dispose()
    return row


def failed_twice(url: str, c: cfg.PipelineConfig, found: Any) -> Any:
    """Two runs of the shard, each committing nothing (its two attempts); its row after."""
    for _ in range(2):
        outcome = wiring.run_score(
            c, db_url=url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
        )
        assert outcome.summary["items_committed"] == 0
        time.sleep(0.05)  # past the retry backoff
    return the_shard(url, c)


def test_a_model_failing_every_row_sends_the_shard_back(sqlite_url: str, tmp_path: Path) -> None:
    """Every forward pass fails (a broken device), in one micro-batch: not the rows' fault,
    so no file of errors is committed; the shard goes back to the queue with its attempt
    counted, and is dead with the model's error once its attempts run out."""
    c = storm_config(tmp_path, sqlite_url, max_batch_size=2048)
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    row = failed_twice(sqlite_url, c, found)
    assert (row.state, row.attempts) == (3, 2)
    assert "illegal memory access" in row.last_error
    assert not list((tmp_path / "out").rglob("*.parquet"))


def test_a_shard_whose_every_row_is_refused_is_not_committed(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Every row the wrong width for the model (the wrong model for the data, most often):
    no file of errors is committed as the shard's output, which would mark the data scored
    for good. The shard fails under the attempt rule, is dead with the first row's reason,
    and a redrive brings it back once the config is fixed."""
    c = config(tmp_path, max_attempts=2, backoff_base_s=0.01)
    migrate(sqlite_url, c)
    (tmp_path / "in").mkdir()
    # lists of any length (a fixed length the model does not take is refused at plan)
    payload = pa.array([[1.0] * 63] * 40, type=pa.list_(pa.float32()))
    pq.write_table(pa.table({"payload": payload}), tmp_path / "in" / "narrow.parquet")
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    row = failed_twice(sqlite_url, c, found)
    assert (row.state, row.attempts) == (3, 2)
    assert row.last_error.startswith("every row of the shard was refused, the first: ")
    assert "(64,)" in row.last_error
    assert not list((tmp_path / "out").rglob("*.parquet"))
    queue = build.open_queue(c, sqlite_url)
    assert queue.redrive() == 1
    queue.engine.dispose()


def test_a_shard_of_one_refused_row_commits_it_as_that_rows_error(
    sqlite_url: str, tmp_path: Path
) -> None:
    """One row, refused: the row's own fault, as it would be among others (a dead shard
    would stay dead however often it is redriven)."""
    c = config(tmp_path)
    migrate(sqlite_url, c)
    (tmp_path / "in").mkdir()
    pq.write_table(
        pa.table({"payload": [json.dumps({"x": [1.0, 2.0]})]}), tmp_path / "in" / "one.parquet"
    )
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    outcome = wiring.run_score(
        c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
    )
    assert (outcome.summary["items_committed"], outcome.summary["items_failed"]) == (0, 1)
    table = outputs(tmp_path / "out")
    assert table.num_rows == 1
    assert "64" in table.column("error")[0].as_py()
    assert the_shard(sqlite_url, c).state == 2  # done: its one row answered, with its error


def test_a_shard_failing_batch_after_batch_trips_the_breaker(
    sqlite_url: str, tmp_path: Path
) -> None:
    """Five micro-batches of the shard fail whole (breaker.max_failed_batches is 3): the run
    fails with RetryStorm, the shard is back in the queue without an attempt used, and the
    queue is paused, as the scoring loop's breaker does."""
    c = storm_config(tmp_path, sqlite_url, max_batch_size=8)
    found, _ = inplace.enqueue_shards(c, sqlite_url, tmp_path / "in")
    with pytest.raises(errors.RetryStorm, match="the queue is paused"):
        wiring.run_score(
            c, db_url=sqlite_url, limits=UNTIL_EMPTY, in_place=inplace.InPlace.of(found)
        )
    row = the_shard(sqlite_url, c)
    assert (row.state, row.attempts, row.lease_id) == (0, 0, None)
    queue = build.open_queue(c, sqlite_url)
    assert queue.claim(1, lease_s=5, lane=shards.LANE).paused
    queue.engine.dispose()
