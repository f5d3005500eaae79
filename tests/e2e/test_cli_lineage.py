"""``batching lineage --flush | --config-check`` and the spool line of ``batching status``, as a
user runs them: a real process, a real SQLite file, a loopback HTTP server for Marquez."""

from __future__ import annotations

from pathlib import Path

import pytest

from batching.model import workloads
from tests.e2e.test_cli import DB, batching, one_error_line, write_config
from tests.integration.test_lineage_spool import Marquez, marquez  # noqa: F401 (a fixture)


def workspace(ws: Path, n_rows: int = 40) -> Path:
    """A W1 config in ``ws`` with its queue file and ``n_rows`` items enqueued."""
    config = write_config(ws, lineage={"timeout_s": 1.0, "retries": 0})
    assert batching("init", "--db", DB, cwd=ws).rc == 0
    parquet = workloads.write_w1_parquet(ws / "w1.parquet", n_rows)
    assert batching("enqueue", str(parquet), "--db", DB, "-q", "tabular", cwd=ws).rc == 0
    return config


def test_score_posts_where_openlineage_yml_in_the_working_folder_says(
    tmp_path: Path,
    marquez: Marquez,  # noqa: F811
) -> None:
    """Before: openlineage.yml was not read; the events went to the local file, 0 POSTs."""
    config = workspace(tmp_path)
    (tmp_path / "openlineage.yml").write_text(f"transport:\n  type: http\n  url: {marquez.url}\n")
    r = batching("score", "-c", str(config), "--quiet", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert [e["eventType"] for e in marquez.events()] == ["START", "COMPLETE"]
    assert not (tmp_path / "outputs" / "lineage" / "events.jsonl").exists()


def test_what_a_run_could_not_send_waits_and_flush_sends_it(
    tmp_path: Path,
    marquez: Marquez,  # noqa: F811
) -> None:
    config = workspace(tmp_path)
    env = {"OPENLINEAGE_URL": marquez.url}
    marquez.down = True
    r = batching("score", "-c", str(config), "--quiet", cwd=tmp_path, env=env)
    assert r.rc == 0, r.err  # lineage down never fails a run
    status = batching("status", "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert "lineage spool: 2 event(s) of 1 run(s) waiting for a re-send" in status.out

    down = batching("lineage", "--flush", "-c", str(config), cwd=tmp_path, env=env)
    assert down.rc == 1
    line = one_error_line(down)
    assert "2 lineage event(s) still undelivered (last error: " in line
    assert "503" in line
    marquez.down = False
    up = batching("lineage", "flush", "-c", str(config), cwd=tmp_path, env=env)  # the same
    assert up.rc == 0, up.err
    assert "sent 2 event(s) to http; 0 left of 0 run(s)" in up.out
    assert [e["eventType"] for e in marquez.events()] == ["START", "COMPLETE"]
    again = batching("lineage", "--flush", "-c", str(config), cwd=tmp_path, env=env)
    assert again.rc == 0
    assert "empty; nothing to send" in again.out
    status = batching("status", "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert "lineage spool: empty" in status.out


def test_config_check_shows_each_setting_and_its_source_without_secrets(tmp_path: Path) -> None:
    config = write_config(tmp_path, lineage={"namespace": "scoring-prod"})
    (tmp_path / "openlineage.yml").write_text(
        "transport:\n  type: http\n  url: http://ol:pw-s3cret@marquez:5000\n  timeout: 3\n"
    )
    env = {"OPENLINEAGE_URL": "http://ignored:5000"}  # the file's transport wins, as the client's
    r = batching("lineage", "--config-check", "-c", str(config), cwd=tmp_path, env=env)
    assert r.rc == 0, r.err
    assert "s3cret" not in r.out + r.err
    rows = {line.split()[0]: line.split()[1:] for line in r.out.splitlines() if line.strip()}
    yml = str(tmp_path / "openlineage.yml")
    assert rows["transport"] == ["http", "openlineage.yml", f"({yml})"]
    assert rows["url"] == ["http://ol:***@marquez:5000", "openlineage.yml", f"({yml})"]
    assert rows["timeout_s"] == ["3.0", "openlineage.yml", f"({yml})"]
    assert rows["namespace"] == ["scoring-prod", "pipeline", "config", "(lineage.namespace)"]
    assert rows["retries"] == ["1", "default"]
    assert rows["api_key"] == ["-", "unset"]
    assert rows["openlineage.yml:"] == [yml]


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OPENLINEAGE__TRANSPORT__TYPE": "kafka"}, "transport type 'kafka' is not supported"),
        ({"OPENLINEAGE_URL": "marquez:5000"}, "not a URL like http://marquez:5000"),
        ({"OPENLINEAGE_CONFIG": "missing.yml"}, "OPENLINEAGE_CONFIG=missing.yml: no readable"),
    ],
)
def test_config_check_exits_1_with_one_line_on_an_invalid_setting(
    tmp_path: Path, env: dict[str, str], message: str
) -> None:
    r = batching("lineage", "--config-check", cwd=tmp_path, env=env)
    assert r.rc == 1
    assert message in one_error_line(r)


def test_flush_without_a_config_is_bad_input(tmp_path: Path) -> None:
    r = batching("lineage", "--flush", cwd=tmp_path)
    assert r.rc == 2
    assert "--flush needs --config" in one_error_line(r)


def test_an_unknown_lineage_action_is_bad_input(tmp_path: Path) -> None:
    r = batching("lineage", "flsh", cwd=tmp_path)
    assert r.rc == 2
    assert "lineage 'flsh': not an action; use `batching lineage flush`" in one_error_line(r)
