"""``--json`` on ``batching check`` and ``batching score``: one JSON document on stdout with
the keys their help lists, the exit codes of the plain output, and a failure as a JSON error
object (``ok``, ``error.kind``, ``error.message``, ``error.exit_code``), never a traceback.
Real processes, a real SQLite file, the shipped W1 model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from batching.model import workloads
from tests.e2e.test_cli import DB, DEPLOYMENTS, Result, batching, one_error_line, write_config

CHECK_KEYS = {
    "ok",
    "config",
    "latency_slo_s",
    "adaptive",
    "max_wait_s",
    "commit_interval_s",
    "worst_case_latency_s",
    "predicted_service_s",
    "worst_batch",
    "estimated_memory_bytes",
    "largest_item",
    "errors",
    "warnings",
}
SCORE_KEYS = {
    "ok",
    "run_id",
    "queue",
    "database",
    "output",
    "events_path",
    "lineage_failures",
    "summary",
    "workers",
    "errors",
}


def document(r: Result) -> Any:
    """stdout as exactly one JSON document (``json.loads`` refuses anything after it)."""
    return json.loads(r.out)


def assert_error_doc(r: Result, kind: str, code: int) -> str:
    assert r.rc == code, (r.out, r.err)
    doc = document(r)
    assert doc["ok"] is False
    assert (doc["error"]["kind"], doc["error"]["exit_code"]) == (kind, code)
    assert one_error_line(r) == f"error: {doc['error']['message']}"  # stderr: the same line
    return str(doc["error"]["message"])


def test_check_json_passes_with_the_numbers(tmp_path: Path) -> None:
    r = batching("check", "-c", str(DEPLOYMENTS / "tabular.yaml"), "--json", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert r.err == ""
    doc = document(r)
    assert set(doc) == CHECK_KEYS
    assert (doc["ok"], doc["errors"], doc["latency_slo_s"]) == (True, [], 0.5)
    assert doc["worst_case_latency_s"] >= doc["max_wait_s"] + doc["predicted_service_s"] - 1e-9
    assert set(doc["worst_batch"]) == {"n_items", "length"}


def test_check_json_that_breaks_the_objective_exits_1_with_the_errors(tmp_path: Path) -> None:
    near = write_config(tmp_path, batching={"max_batch_size": 512, "max_wait_s": 0.499})
    r = batching("check", "-c", str(near), "--json", cwd=tmp_path)
    assert r.rc == 1, r.err
    doc = document(r)
    assert set(doc) == CHECK_KEYS
    assert doc["ok"] is False
    assert doc["max_wait_s"] == 0.499
    assert any("exceeds latency_slo_s 0.5" in e for e in doc["errors"]), doc["errors"]


def test_check_under_the_adaptive_rule_counts_no_wait_window(tmp_path: Path) -> None:
    """The config above, refused for its window, passes under ``adaptive``: a batch goes at
    once to a free model there, so ``max_wait_s`` is no part of the worst case."""
    near = write_config(
        tmp_path, batching={"max_batch_size": 512, "max_wait_s": 0.499, "adaptive": True}
    )
    r = batching("check", "-c", str(near), "--json", cwd=tmp_path)
    assert r.rc == 0, (r.out, r.err)
    doc = document(r)
    assert (doc["ok"], doc["adaptive"], doc["max_wait_s"]) == (True, True, 0.499)
    assert doc["worst_case_latency_s"] == doc["predicted_service_s"]
    text = batching("check", "-c", str(near), cwd=tmp_path)
    assert text.rc == 0, text.err
    assert "= adaptive (no wait window) + service" in text.out, text.out


def test_check_json_on_a_bad_config_is_a_json_error_and_exit_2(tmp_path: Path) -> None:
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    message = assert_error_doc(
        batching("check", "-c", str(bad), "--json", cwd=tmp_path), "ConfigError", 2
    )
    assert str(bad) in message
    assert "not valid YAML" in message


def test_score_json_reports_the_run(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(20))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    r = batching("score", "-c", str(config), "--json", cwd=tmp_path)
    assert r.rc == 0, r.err
    doc = document(r)
    assert set(doc) == SCORE_KEYS
    assert (doc["ok"], doc["errors"], doc["workers"]) == (True, [], [])
    assert doc["summary"]["items_committed"] == 20
    assert doc["summary"]["items_failed"] == 0
    assert doc["queue"] == "tabular"
    assert doc["database"] == DB
    assert Path(doc["output"]).name == "outputs"
    assert doc["events_path"] is not None
    assert Path(doc["events_path"]).is_file()
    assert len(doc["run_id"]) == 36


def test_score_json_with_workers_lists_each_worker(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(40))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    r = batching("score", "-c", str(config), "--workers", "2", "--json", cwd=tmp_path)
    assert r.rc == 0, r.err
    doc = document(r)
    assert set(doc) == SCORE_KEYS
    assert doc["summary"]["items_committed"] == 40
    assert [(w["index"], w["failed"], w["error"]) for w in doc["workers"]] == [
        (0, False, None),
        (1, False, None),
    ]
    assert len({doc["run_id"], *(w["run_id"] for w in doc["workers"])}) == 3


def test_score_json_on_an_uninitialised_database_is_a_json_error(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    r = batching("score", "-c", str(config), "--db", "sqlite:///other.db", "--json", cwd=tmp_path)
    message = assert_error_doc(r, "ConfigError", 2)
    assert "batching init" in message


def test_score_json_never_shows_a_password(tmp_path: Path) -> None:
    """A run that cannot reach its database fails (exit 1) as a JSON error without the
    password (port 1 on loopback: refused, as a server restarting refuses: ``Disconnected``,
    the kind a caller may retry)."""
    config = write_config(tmp_path, database={"url": "postgresql://u:sekret@127.0.0.1:1/x"})
    r = batching("score", "-c", str(config), "--json", cwd=tmp_path)
    message = assert_error_doc(r, "Disconnected", 1)
    assert "u:***@127.0.0.1:1/x" in message
    assert "sekret" not in r.out + r.err


def test_an_option_the_command_line_refuses_is_a_json_error_too(tmp_path: Path) -> None:
    for args, says in (
        (("check", "--json", "--nope"), "No such option: --nope"),
        (("score", "-c", "x.yaml", "--max-seconds", "nan", "--json"), "'--max-seconds'"),
    ):
        r = batching(*args, cwd=tmp_path)
        assert r.rc == 2, (r.out, r.err)
        doc = document(r)
        assert (doc["ok"], doc["error"]["kind"], doc["error"]["exit_code"]) == (
            False,
            "UsageError",
            2,
        )
        assert says in doc["error"]["message"]
        [line] = r.err.strip().splitlines()  # one line on stderr, as without --json
        assert line.startswith("error: "), line
        assert says in line, line
        assert line.endswith(" --help`)"), line
    assert batching("check", "--help", "--json", cwd=tmp_path).rc == 0
