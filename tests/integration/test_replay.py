"""``batching replay`` for real: the built-in W2 text encoder (padding makes its outputs depend
on who shares a forward pass) scores a run on a real SQLite queue into Parquet and SQL
outputs; the replay scores the same passes again and gets every item bit for bit; another
version gives a drift report; purged items are named and skipped; the replay's lineage
events validate against the OpenLineage schemas and link to the run replayed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pyarrow.dataset as pads
import pytest
import sqlalchemy as sa

from batching import config as cfg
from batching import errors
from batching.compose import build, replay
from batching.compose import run as wiring
from batching.evidence import lineage
from batching.ingress import ingest
from batching.loop.stats import RunLimits
from batching.model import workloads, zoo
from batching.store import database, schema
from tests import olspec
from tests.conftest import REPO

BATCHING = str(Path(sys.executable).with_name("batching"))


def make_config(tmp_path: Path, **overrides: Any) -> cfg.PipelineConfig:
    spec = {"name": "w2-text", "sha256": zoo.BUILTINS["w2-text"].sha256, "device": "cpu"}
    settings: dict[str, Any] = {
        "model": {"version": "w2-a"},
        # the same weights in float32: another version whose outputs drift a little
        "model_versions": [spec | {"version": "w2-b", "dtype": "float32"}],
        "batching": {"max_batch_size": 16, "claim_size": 64, "max_wait_s": 0.01},
        "output": {"path": str(tmp_path / "out")},
        "lineage": {"path": str(tmp_path / "lineage" / "events.jsonl")},
        "service_profile": None,
    }
    settings["model"] |= {"dtype": "bfloat16", "device": "cpu"}
    return cfg.load_config(REPO / "deployments" / "online.yaml", settings | overrides)


def scored_run(url: str, config: cfg.PipelineConfig, n: int, output: str | None = None) -> str:
    queue = build.open_queue(config, url, create=True)
    queue.migrate()
    lines = list(workloads.w2_json_lines(n))
    records = [ingest.record_from_mapping(json.loads(line), str(i)) for i, line in enumerate(lines)]
    assert queue.enqueue(records).inserted == n
    queue.engine.dispose()
    outcome = wiring.run_score(config, db_url=url, output=output, limits=RunLimits())
    assert outcome.summary["items_committed"] == n
    return outcome.run_id


def events(config: cfg.PipelineConfig) -> list[dict[str, Any]]:
    path = Path(config.lineage.path or "")
    return [json.loads(line) for line in path.read_text().splitlines()]


@pytest.mark.parametrize("sink", ["parquet", "sql"])
def test_a_replay_of_a_run_reproduces_its_outputs_bit_for_bit(
    sqlite_url: str, tmp_path: Path, sink: str
) -> None:
    overrides: dict[str, Any] = {}
    if sink == "sql":
        overrides["output"] = {"kind": "sql", "table": "w2_results"}
    config = make_config(tmp_path, **overrides)
    run_id = scored_run(sqlite_url, config, 160)
    report = replay.replay(config, sqlite_url, run_id, output=tmp_path / "replay")
    assert report.items == report.identical == 160
    assert (report.differing, report.skipped, report.passes_unrecorded) == (0, 0, 0)
    assert report.passes >= 10  # batches of at most 16: the run's passes, one by one
    side = pads.dataset(tmp_path / "replay", format="parquet", partitioning="hive").to_table()
    assert sorted(side.column("item_key").to_pylist()) == sorted(f"w2-{i}" for i in range(160))
    assert set(side.column("run").to_pylist()) == {run_id}

    registry = olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())
    mine = [e for e in events(config) if e["run"]["runId"] == report.replay_run_id]
    assert [e["eventType"] for e in mine] == ["START", "COMPLETE"]
    for ev in mine:
        olspec.assert_valid_event(ev, registry)
    facet = mine[-1]["run"]["facets"]["batching_replay"]
    assert (facet["originalRunId"], facet["identical"], facet["items"]) == (run_id, 160, 160)
    assert mine[-1]["job"]["name"] == f"{config.name}.replay"


def test_a_run_scored_into_another_folder_is_replayed_from_it_given_dataset(
    sqlite_url: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path)
    elsewhere = str(tmp_path / "elsewhere")
    run_id = scored_run(sqlite_url, config, 40, output=elsewhere)
    with pytest.raises(errors.SinkError, match=r"is not in the dataset .*give it with --dataset"):
        replay.replay(config, sqlite_url, run_id, output=tmp_path / "replay")
    report = replay.replay(
        config, sqlite_url, run_id, output=tmp_path / "replay", dataset=elsewhere
    )
    assert report.items == report.identical == 40


def test_a_run_of_two_worker_processes_is_replayed_whole(sqlite_url: str, tmp_path: Path) -> None:
    # each worker numbers its own passes: the ledger's pass ids keep them apart
    config = make_config(tmp_path)
    queue = build.open_queue(config, sqlite_url, create=True)
    queue.migrate()
    lines = list(workloads.w2_json_lines(120))
    queue.enqueue([ingest.record_from_mapping(json.loads(x), str(i)) for i, x in enumerate(lines)])
    queue.engine.dispose()
    outcome = wiring.run_score_workers(config, 2, db_url=sqlite_url, limits=RunLimits())
    assert outcome.summary["items_committed"] == 120
    report = replay.replay(config, sqlite_url, outcome.run_id, output=tmp_path / "replay")
    assert report.items == report.identical == 120
    assert report.skipped == 0


def test_another_version_drifts_and_purged_items_are_named_and_skipped(
    sqlite_url: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path)
    run_id = scored_run(sqlite_url, config, 96)
    engine = database.create_engine(sqlite_url)
    gone = ["w2-3", "w2-40", "w2-77"]
    with engine.begin() as conn:  # as a purge does: the rows and their payloads
        ids = (
            conn.execute(sa.select(schema.items.c.id).where(schema.items.c.item_key.in_(gone)))
            .scalars()
            .all()
        )
        conn.execute(sa.delete(schema.payloads).where(schema.payloads.c.id.in_(ids)))
        conn.execute(sa.delete(schema.items).where(schema.items.c.id.in_(ids)))
    engine.dispose()
    report = replay.replay(
        config, sqlite_url, run_id, output=tmp_path / "replay", model_version="w2-b"
    )
    assert (report.skipped, sorted(report.skipped_keys)) == (3, sorted(gone))
    assert report.items == 93
    assert report.model_versions == {"w2-b": 93}
    assert report.differing > 0  # bfloat16 against float32 weights
    assert 0 < report.mean_abs_diff <= report.max_abs_diff < 1.0

    with pytest.raises(errors.InputError, match="committed no batch"):
        replay.replay(config, sqlite_url, lineage.new_run_id(), output=tmp_path / "r2")
    with pytest.raises(errors.InputError, match="not in the config's registry"):
        replay.replay(config, sqlite_url, run_id, output=tmp_path / "r2", model_version="w9")


def test_the_replay_command_says_what_it_found_in_one_line_each(
    sqlite_url: str, tmp_path: Path
) -> None:
    config = make_config(tmp_path)
    run_id = scored_run(sqlite_url, config, 32)
    path = tmp_path / "pipeline.yaml"
    path.write_text(json.dumps(config.model_dump(mode="json", exclude_none=True)))
    args = [BATCHING, "replay", run_id, "-c", str(path), "--db", sqlite_url]
    done = subprocess.run(
        [*args, "--output", str(tmp_path / "r"), "--json"], capture_output=True, text=True
    )
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["identical"] == 32
    bad = subprocess.run([*args[:2], "nope", *args[3:]], capture_output=True, text=True)
    assert bad.returncode == 2
    assert bad.stderr.count("\n") == 1
    assert "committed no batch" in bad.stderr
    for output, says in (
        (tmp_path / "out", "overlaps the config's output dataset"),  # its own dataset
        (tmp_path / "out" / "side", "overlaps the config's output dataset"),
        (path, "is a file; give a folder"),
    ):
        refused = subprocess.run([*args, "--output", str(output)], capture_output=True, text=True)
        assert refused.returncode == 2, refused.stderr
        assert refused.stderr.count("\n") == 1
        assert says in refused.stderr
    assert not list((tmp_path / "out").rglob("replay=*"))  # nothing written into the dataset
    nowhere = [*args, "--output", str(tmp_path / "r2"), "--dataset", str(tmp_path / "nowhere")]
    refused = subprocess.run(nowhere, capture_output=True, text=True)
    assert (refused.returncode, refused.stderr.count("\n")) == (2, 1), refused.stderr
    assert "--dataset" in refused.stderr
