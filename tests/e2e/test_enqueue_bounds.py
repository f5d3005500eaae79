"""``batching enqueue`` streams its file (memory bounded, all or nothing) and refuses an item
past the model's limits, naming FILE:LINE and the limit."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from batching.model import workloads
from tests.e2e.test_cli import (
    BATCHING,
    DB,
    DEPLOYMENTS,
    batching,
    one_error_line,
    status,
    write_config,
)

RSS_PROBE = """
import resource, subprocess, sys
subprocess.run(sys.argv[1:], check=True, capture_output=True)
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
"""


def peak_rss(*args: str, cwd: Path) -> int:
    """Peak resident bytes of ``batching ARGS``, run as the only child of a fresh process."""
    proc = subprocess.run(
        [sys.executable, "-c", RSS_PROBE, BATCHING, *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return int(proc.stdout.strip())


@pytest.mark.slow
def test_enqueue_memory_does_not_grow_with_the_file(tmp_path: Path) -> None:
    # It held the whole file parsed (~2.75x a 200 MB file); streamed, it holds a chunk.
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    small = workloads.write_lines(tmp_path / "small.jsonl", workloads.w1_json_lines(10))
    big = workloads.write_lines(tmp_path / "big.jsonl", workloads.w1_json_lines(50_000))
    size = big.stat().st_size
    assert size > 60 * 2**20
    base = peak_rss("enqueue", str(small), "--db", DB, "-q", "base", cwd=tmp_path)
    peak = peak_rss("enqueue", str(big), "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert status(tmp_path)["ready"] == 50_000
    assert peak - base < size // 2, (
        f"enqueue grew {(peak - base) / 2**20:.0f} MiB for a {size / 2**20:.0f} MiB file"
    )


def test_a_bad_last_line_of_a_many_chunk_file_enqueues_nothing(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    path = tmp_path / "requests.jsonl"
    lines = [*workloads.w1_json_lines(2500), '{"item_key": "last", "payload": {"x": [1]}']
    path.write_text("\n".join(lines) + "\n")
    r = batching("enqueue", str(path), "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert r.rc == 2
    assert f"{path}:2501: not valid JSON" in one_error_line(r)
    assert status(tmp_path)["ready"] == 0, "the chunks before the bad line were enqueued"


def test_an_item_past_the_models_token_limit_refuses_the_file(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path, model={"max_item_tokens": 8})
    path = tmp_path / "requests.jsonl"
    rows = [{"item_key": f"k{i}", "payload": {"tokens": list(range(1, 9))}} for i in range(3)]
    rows.insert(1, {"item_key": "long", "payload": {"tokens": list(range(1, 10))}})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    r = batching("enqueue", str(path), "--db", DB, "-q", "tabular", "-c", str(config), cwd=tmp_path)
    assert r.rc == 2
    message = one_error_line(r)
    assert f"{path}:2: item 'long' holds 9 token ids, over the limit of 8" in message
    assert "model.max_item_tokens" in message
    assert status(tmp_path)["ready"] == 0
    # Without --config the defaults apply: the same file is within them.
    ok = batching("enqueue", str(path), "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert ok.rc == 0, ok.err
    assert status(tmp_path)["ready"] == 4


def test_check_prints_the_largest_item(tmp_path: Path) -> None:
    r = batching("check", "-c", str(DEPLOYMENTS / "online.yaml"), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "online.yaml: largest item: up to model.max_item_tokens 1024 tokens" in r.out


def test_enqueue_with_a_config_writes_to_its_database_not_the_local_file(tmp_path: Path) -> None:
    """``-c`` names the queue's database as ``score -c`` reads it; a ./batching.db left by the
    quickstart once took the items, and the config's scorers never saw them."""
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0  # the config's (queue.db)
    assert batching("init", cwd=tmp_path).rc == 0  # ./batching.db, the default
    config = write_config(tmp_path)
    path = workloads.write_lines(tmp_path / "five.jsonl", workloads.w1_json_lines(5))
    r = batching("enqueue", str(path), "-q", "tabular", "-c", str(config), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "to queue 'tabular' of sqlite:///queue.db" in r.out
    assert status(tmp_path)["ready"] == 5  # queue.db
    local = batching(
        "status", "--db", "sqlite:///batching.db", "-q", "tabular", "--json", cwd=tmp_path
    )
    assert local.json()["by_state"].get("ready", 0) == 0


def test_enqueue_with_a_config_writes_to_its_queue_with_its_attempts(tmp_path: Path) -> None:
    """Without -q, ``-c`` names the queue (and a record's lane) as ``score -c`` claims them:
    it once went to queue 'default', and ``score -c`` of the same config found nothing."""
    import sqlite3

    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path, queue={"max_attempts": 2, "lane": "gpu"})
    path = workloads.write_lines(tmp_path / "five.jsonl", workloads.w1_json_lines(5))
    r = batching("enqueue", str(path), "-c", str(config), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "to queue 'tabular' of sqlite:///queue.db" in r.out
    other = workloads.write_lines(tmp_path / "two.jsonl", workloads.w1_json_lines(2, prefix="b-"))
    flags = ["-q", "side", "--max-attempts", "7"]
    assert batching("enqueue", str(other), "-c", str(config), *flags, cwd=tmp_path).rc == 0
    with sqlite3.connect(tmp_path / "queue.db") as conn:
        rows = conn.execute(
            "SELECT queue, lane, max_attempts, count(*) FROM batching_items "
            "GROUP BY 1, 2, 3 ORDER BY 1"
        ).fetchall()
    assert rows == [("side", "gpu", 7, 2), ("tabular", "gpu", 2, 5)]  # the lane it claims
    score = batching("score", "-c", str(config), "--quiet", "--json", cwd=tmp_path)
    assert score.rc == 0, score.err
    assert score.json()["summary"]["items_committed"] == 5
