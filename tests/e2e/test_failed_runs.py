"""A run that commits nothing while its items fail is a failed run: ``batching score`` and
``batching bulk --in-place`` exit 1 and say so (they exited 0, and CI and Prefect showed green
while every item was dead-lettered)."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from tests.e2e.test_cli import DB, DEPLOYMENTS, batching, write_config


def test_a_score_run_whose_every_item_fails_exits_1(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    path = tmp_path / "bad.jsonl"  # W1 takes 64 numbers: 63 fail at decode, dead at once
    path.write_text(
        "".join(
            json.dumps({"item_key": f"b{i}", "payload": {"x": [0.5] * 63}}) + "\n" for i in range(5)
        )
    )
    assert batching("enqueue", str(path), "-q", "tabular", "-c", str(config), cwd=tmp_path).rc == 0
    r = batching("score", "-c", str(config), "--json", cwd=tmp_path)
    assert r.rc == 1, r.err
    doc = r.json()
    assert doc["ok"] is False
    assert doc["summary"]["items_failed"] == 5
    assert "committed nothing and 5 item(s) failed in queue 'tabular'" in doc["errors"][0]
    assert "5 x " in doc["errors"][0], doc["errors"][0]  # the reason, counted: what to fix
    path.write_text(
        "".join(
            json.dumps({"item_key": f"w{i}", "payload": {"x": [0.5] * 63}}) + "\n" for i in range(6)
        )
    )
    assert batching("enqueue", str(path), "-q", "tabular", "-c", str(config), cwd=tmp_path).rc == 0
    workers = batching("score", "-c", str(config), "--workers", "2", "--json", cwd=tmp_path)
    assert workers.rc == 1, workers.err
    assert workers.json()["ok"] is False
    assert any("committed nothing" in e for e in workers.json()["errors"])
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"item_key": "g", "payload": {"x": [0.5] * 64}}) + "\n")
    assert batching("enqueue", str(good), "-q", "tabular", "-c", str(config), cwd=tmp_path).rc == 0
    assert batching("score", "-c", str(config), cwd=tmp_path).rc == 0


def test_a_bulk_in_place_run_of_only_bad_rows_exits_1(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    folder = tmp_path / "input"
    folder.mkdir()
    rows = pa.table(
        {
            "item_key": [f"r{i}" for i in range(20)],
            # a list of any length: rows of a fixed length the model does not take are
            # refused at plan; these fail one by one when scored
            "payload": pa.array([[0.5] * 63] * 20, type=pa.list_(pa.float32())),
        }
    )
    pq.write_table(rows, folder / "part-0.parquet")
    config = DEPLOYMENTS / "tabular-inplace.yaml"
    r = batching(
        "bulk",
        str(folder),
        "-c",
        str(config),
        "--in-place",
        "--db",
        DB,
        "--output",
        str(tmp_path / "out"),
        cwd=tmp_path,
    )
    assert r.rc == 1, (r.out, r.err)
    assert "committed nothing and 20 item(s) failed" in r.err


def test_a_bulk_in_place_run_that_leaves_dead_shards_says_so(tmp_path: Path) -> None:
    """A shard whose data cannot be read (a corrupt page behind a valid footer) goes dead and
    its rows get no output; the run committed the rest and exited 0, and only its log and
    failed count said so. The dataset is not scored whole: exit 1, naming the dead shards'
    rows and what to do."""
    import numpy as np

    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    folder = tmp_path / "input"
    folder.mkdir()
    rng = np.random.default_rng(7)
    for name, n in (("part-0", 200), ("part-1", 50)):
        rows = pa.table(
            {
                "item_key": [f"{name}-{i}" for i in range(n)],
                "payload": pa.array(
                    rng.random((n, 64), dtype=np.float32).tolist(), type=pa.list_(pa.float32(), 64)
                ),
            }
        )
        pq.write_table(rows, folder / f"{name}.parquet", row_group_size=100)
    broken = folder / "part-0.parquet"
    data = bytearray(broken.read_bytes())
    for k in range(200, 1200):  # inside the first row group's pages; the footer stays valid
        data[k] ^= 0x5A
    broken.write_bytes(bytes(data))
    config = DEPLOYMENTS / "tabular-inplace.yaml"
    out = str(tmp_path / "out")
    r = batching("bulk", str(folder), "-c", str(config), "--in-place", "--db", DB, "--output", out,
                 cwd=tmp_path)  # fmt: skip
    assert r.rc == 1, (r.out, r.err)
    assert "error: 200 of 250 input rows have no output yet: 200 in dead shards" in r.err


def test_a_bulk_in_place_run_refused_at_its_start_queues_nothing(tmp_path: Path) -> None:
    """An output that is a file, a checkpoint of another digest and a service profile that is
    not UTF-8 are refused before any shard is queued (the shards were queued first, and a
    refused run left them ready behind it: a sweep found it)."""
    import sqlite3

    import yaml

    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    folder = tmp_path / "input"
    folder.mkdir()
    rows = pa.table({"payload": pa.array([[0.5] * 64] * 10, type=pa.list_(pa.float32(), 64))})
    pq.write_table(rows, folder / "part-0.parquet")
    data = yaml.safe_load((DEPLOYMENTS / "tabular-inplace.yaml").read_text())
    data["service_profile"] = str(DEPLOYMENTS / data["service_profile"])
    wrong_sha = {**data, "model": {**data["model"], "sha256": "0" * 64}}
    (tmp_path / "profile.json").write_bytes(b"\xff\xfe{}")
    bad_profile = {**data, "service_profile": str(tmp_path / "profile.json")}
    (tmp_path / "a-file").write_text("")
    cases = [
        (data, ["--output", "a-file"], "cannot be created"),
        (wrong_sha, [], "but the config pins " + "0" * 64),
        (bad_profile, [], "service profile is not valid JSON in UTF-8"),
    ]
    for k, (doc, extra, says) in enumerate(cases):
        config = tmp_path / f"config-{k}.yaml"
        config.write_text(yaml.safe_dump(doc))
        r = batching(
            "bulk", str(folder), "-c", str(config), "--in-place", "--db", DB, *extra, cwd=tmp_path
        )
        assert r.rc == 2, (k, r.err)
        assert says in r.err, (k, r.err)
        assert len(r.err.strip().splitlines()) == 1, r.err
        with sqlite3.connect(tmp_path / "queue.db") as db:
            assert db.execute("SELECT count(*) FROM batching_items").fetchone() == (0,), k
    r = batching("check", "-c", str(tmp_path / "config-2.yaml"), cwd=tmp_path)
    assert r.rc == 2, r.err
    assert "service profile is not valid JSON in UTF-8" in r.err
    good = str(tmp_path / "config-0.yaml")
    for args, says in (
        (["/dev/null", "--in-place"], "/dev/null: not a file or a folder; give a Parquet or Delta"),
        ([str(folder)], "bulk scores a dataset in place only; add --in-place"),
    ):
        r = batching("bulk", *args, "-c", good, "--db", DB, cwd=tmp_path)
        assert r.rc == 2, r.err
        assert says in " ".join(r.err.split()), r.err
