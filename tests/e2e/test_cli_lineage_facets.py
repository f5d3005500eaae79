"""``batching score`` with ``--db``, ``--output`` and ``OPENLINEAGE_NAMESPACE``: the run's
``batching_config`` facet says what it used, as its own datasets and job do."""

from __future__ import annotations

import json
from pathlib import Path

from batching import naming
from batching.evidence import lineage_log
from batching.model import workloads
from tests.e2e.test_cli import batching, write_config

OTHER_DB = "sqlite:///other.db"  # the config names queue.db


def test_the_config_facet_of_a_cli_run_matches_its_datasets_and_job(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    assert batching("init", "--db", OTHER_DB, cwd=tmp_path).rc == 0
    rows = workloads.write_w1_parquet(tmp_path / "w1.parquet", 50)
    r = batching("enqueue", str(rows), "--db", OTHER_DB, "-q", "tabular", cwd=tmp_path)
    assert r.rc == 0, r.err
    args = ("score", "-c", str(config), "--db", OTHER_DB, "--output", "elsewhere", "--quiet")
    r = batching(*args, cwd=tmp_path, env={"OPENLINEAGE_NAMESPACE": "cli-ns"})
    assert r.rc == 0, r.err

    events = lineage_log.read_events(tmp_path / "lineage" / "events.jsonl")
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]
    for event in events:
        used = event["run"]["facets"]["batching_config"]["config"]
        (source,) = event["inputs"]
        (target,) = event["outputs"]
        db = naming.sql_dataset_id(used["database"]["url"], "batching_items")
        assert (
            db
            == (source["namespace"], source["name"])
            == naming.sql_dataset_id(f"sqlite:///{tmp_path / 'other.db'}", "batching_items")
        )
        out = naming.file_dataset_id(used["output"]["path"])
        assert out == (target["namespace"], target["name"]) == ("file", str(tmp_path / "elsewhere"))
        assert used["lineage"]["namespace"] == event["job"]["namespace"] == "cli-ns"
    assert "queue.db" not in json.dumps(events[-1]["run"]["facets"]["batching_config"])
