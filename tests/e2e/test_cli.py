"""The ``batching`` command as a user runs it: a real process, a real SQLite file, real outputs.

Every command must exit 0 (ok), 1 (failed) or 2 (bad input), and never print a traceback.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import threading
from dataclasses import dataclass
from http.server import ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml

from batching.model import workloads
from batching.store import database
from tests.conftest import REPO, LineageBackend

BATCHING = str(Path(sys.executable).with_name("batching"))
DEPLOYMENTS = REPO / "deployments"
COMMANDS = (
    "init",
    "queue",
    "enqueue",
    "api",
    "status",
    "redrive",
    "purge",
    "lineage",
    "reconcile",
    "maintain",
    "score",
    "bulk",
    "check",
    "profile",
    "demo",
    "metrics",
    "rollout",
    "replay",
)
DB = "sqlite:///queue.db"  # relative: a copied workspace keeps working
SECRET_DB = "postgresql://u:sekret@127.0.0.1:9/x"
N_ROWS = 300


@dataclass(frozen=True)
class Result:
    rc: int
    out: str
    err: str

    def json(self) -> Any:
        return json.loads(self.out)


def batching(*args: str, cwd: Path, env: dict[str, str] | None = None) -> Result:
    """Run ``batching ARGS`` in ``cwd``; a traceback on stderr fails the test whatever the code."""
    base = {k: v for k, v in os.environ.items() if k != "BATCHING_DB_URL"}
    proc = subprocess.run(
        [BATCHING, *args],
        cwd=cwd,
        env={**base, **(env or {})},
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stdout, proc.stdout
    return Result(proc.returncode, proc.stdout, proc.stderr)


def one_error_line(r: Result) -> str:
    lines = r.err.strip().splitlines()
    assert len(lines) == 1, r.err
    assert lines[0].startswith("error: "), r.err
    return lines[0]


def write_config(folder: Path, **changes: Any) -> Path:
    """The shipped W1 config, moved into ``folder``: its queue file, outputs and lineage there."""
    data = yaml.safe_load((DEPLOYMENTS / "tabular.yaml").read_text())
    data |= {"name": "e2e-tabular", "database": {"url": DB}}
    data["batching"] = {"max_batch_size": 32, "max_wait_s": 0.02}
    data["output"] = {"kind": "parquet", "path": "outputs"}
    data["service_profile"] = str(DEPLOYMENTS / data["service_profile"])
    for section, values in changes.items():
        data[section] = {**data.get(section, {}), **values} if isinstance(values, dict) else values
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def status(cwd: Path) -> dict[str, int]:
    r = batching("status", "--db", DB, "-q", "tabular", "--json", cwd=cwd)
    assert r.rc == 0, r.err
    return dict(r.json()["by_state"])


def committed_files(ws: Path) -> list[Path]:
    return sorted((ws / "outputs").rglob("*.parquet"))


# ----------------------------------------------------------------------------- help


def test_help_lists_every_command_and_each_command_has_help(tmp_path: Path) -> None:
    top = batching("--help", cwd=tmp_path)
    assert top.rc == 0
    listed = set(re.findall(r"^│ (\w+) ", top.out, flags=re.MULTILINE))
    assert listed == set(COMMANDS)
    for command in COMMANDS:
        r = batching(command, "--help", cwd=tmp_path)
        assert r.rc == 0, (command, r.err)
        assert f"Usage: batching {command}" in r.out
    bare = batching(cwd=tmp_path)
    assert bare.rc in (0, 2)
    assert "Usage: batching" in bare.out + bare.err


def test_a_usage_error_is_one_line_naming_the_help_to_read(tmp_path: Path) -> None:
    for args, says in (
        (("score", "--bogus"), "No such option: --bogus (see `batching score --help`)"),
        (("enqueue",), "Missing argument 'file'. (see `batching enqueue --help`)"),
        (("queue", "bogus"), "No such command 'bogus'. (see `batching queue --help`)"),
        (("score", "--max-seconds", "nan"), "Invalid value for '--max-seconds'"),
        (("queue", "pause", "--db"), "Option '--db' requires an argument."),
    ):
        r = batching(*args, cwd=tmp_path)
        assert (r.rc, r.out) == (2, ""), (args, r.out)
        [line] = r.err.strip().splitlines()
        assert line.startswith("error: "), (args, line)
        assert says in line, (args, line)
    bare = batching("rollout", cwd=tmp_path)  # a bare group: its help, as before
    assert (bare.rc, "Usage: batching rollout" in bare.out + bare.err) == (2, True)


def test_version_prints_the_installed_version(tmp_path: Path) -> None:
    from importlib.metadata import version

    r = batching("--version", cwd=tmp_path)
    assert (r.rc, r.out.strip()) == (0, f"batching {version('batching')}")


def test_python_m_runs_the_same_cli(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "batching.cli", "--help"],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr
    assert set(re.findall(r"^│ (\w+) ", proc.stdout, flags=re.MULTILINE)) == set(COMMANDS)


# ----------------------------------------------------------------------------- queue commands


def test_init_twice_then_nothing_to_do(tmp_path: Path) -> None:
    first = batching("init", "--db", DB, cwd=tmp_path)
    assert first.rc == 0, first.err
    assert "schema upgraded" in first.out
    second = batching("init", "--db", DB, cwd=tmp_path)
    assert second.rc == 0, second.err
    assert "nothing to do" in second.out


def test_queue_commands_with_a_config_act_on_its_database_and_queue(tmp_path: Path) -> None:
    """``-c`` is read as ``score -c`` reads it: the config's database and queue, unless --db
    or -q say otherwise. ``status -c`` once failed (no such option) during an incident."""
    config = write_config(tmp_path)
    first = batching("init", "-c", str(config), cwd=tmp_path)
    assert first.rc == 0, first.err
    assert "sqlite:///queue.db: schema upgraded" in first.out
    path = workloads.write_lines(tmp_path / "three.jsonl", workloads.w1_json_lines(3))
    assert batching("enqueue", str(path), "-c", str(config), cwd=tmp_path).rc == 0

    seen = batching("status", "-c", str(config), "--json", cwd=tmp_path)
    assert seen.rc == 0, seen.err
    assert seen.json()["by_state"]["ready"] == 3
    assert {g["queue"] for g in seen.json()["groups"]} == {"tabular"}
    other = batching("status", "-c", str(config), "-q", "side", "--json", cwd=tmp_path)
    assert other.json()["by_state"]["ready"] == 0
    assert "queue 'side' has no items; queues in this database: tabular" in other.err

    redrive = batching("redrive", "-c", str(config), cwd=tmp_path)
    assert (redrive.rc, redrive.out.strip()) == (
        0,
        "redrove 0 item(s) in queue 'tabular' back to ready",
    )
    purge = batching("purge", "-c", str(config), "--older-than", "0s", cwd=tmp_path)
    assert purge.rc == 0, purge.err
    assert "from queue 'tabular'" in purge.out
    assert not (tmp_path / "batching.db").exists()  # the default file was never the target

    missing = batching("status", "-c", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert missing.rc == 2
    assert "nope.yaml: cannot read config" in one_error_line(missing)


def test_enqueue_jsonl_and_parquet_reports_duplicates(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(5))
    parquet = workloads.write_w1_parquet(tmp_path / "w1.parquet", 8)  # w1-0..w1-7

    r = batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "committed 5 new item(s)" in r.out
    again = batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert again.rc == 0, again.err
    assert "committed 0 new item(s)" in again.out
    assert "5 already present" in again.out
    assert "duplicates: w1-0, w1-1, w1-2, w1-3, w1-4" in again.out
    pq = batching("enqueue", str(parquet), "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert pq.rc == 0, pq.err
    assert "committed 3 new item(s)" in pq.out
    assert "5 already present" in pq.out
    assert status(tmp_path) == {
        "ready": 8,
        "leased": 0,
        "done": 0,
        "dead": 0,
        "expired": 0,
        "cancelled": 0,
    }


def test_enqueue_shows_progress_on_a_terminal_only(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(5))
    args = ("enqueue", str(jsonl), "--db", DB, "-q", "tabular")
    piped = batching(*args, cwd=tmp_path)
    assert (piped.rc, piped.err) == (0, "")
    # FORCE_COLOR makes rich treat the captured stderr as a terminal.
    shown = batching(*args, "-q", "other", cwd=tmp_path, env={"FORCE_COLOR": "1"})
    assert shown.rc == 0, shown.err
    assert "reading w1.jsonl" in shown.err
    assert "enqueueing" in shown.err
    assert "committed" in shown.out
    quiet = batching(*args, "-q", "third", "--quiet", cwd=tmp_path, env={"FORCE_COLOR": "1"})
    assert (quiet.rc, quiet.err) == (0, "")


MALFORMED = [
    ('{"item_key": "bad", "payload": {"x": [1]}', "not valid JSON"),
    ('{"item_key": "bad"}', "missing payload"),
    ('{"item_key": 7, "payload": {"x": [1]}}', "item_key must be a non-empty string"),
    ('{"item_key": "bad", "payload": {}, "colour": "red"}', "unknown field(s) colour"),
    ('["not", "an", "object"]', "expected a JSON object"),
    (
        '{"item_key": "deep", "payload": {"x": ' + "[" * 100_000 + "]" * 100_000 + "}}",
        "nested too deeply",
    ),
]


@pytest.mark.parametrize(("line", "reason"), MALFORMED)
def test_a_malformed_record_names_file_and_line_and_enqueues_nothing(
    tmp_path: Path, line: str, reason: str
) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    good = list(workloads.w1_json_lines(3))
    path = tmp_path / "requests.jsonl"
    path.write_text("\n".join([*good, line, *workloads.w1_json_lines(1, prefix="after-")]) + "\n")
    r = batching("enqueue", str(path), "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert r.rc == 2
    message = one_error_line(r)
    assert f"{path}:4" in message
    assert reason in message
    assert status(tmp_path)["ready"] == 0, "part of a bad file was enqueued"


def test_a_parquet_file_without_payload_is_refused(tmp_path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    path = tmp_path / "requests.parquet"
    pq.write_table(pa.table({"item_key": ["a", "b"]}), path)
    r = batching("enqueue", str(path), "--db", DB, cwd=tmp_path)
    assert r.rc == 2
    assert "missing column(s) payload" in one_error_line(r)


@pytest.mark.parametrize(
    ("url", "code"),
    [
        ("nope://x", 2),
        ("not a url", 2),
        ("sqlite:////nonexistent-dir/queue.db", 2),
        ("postgresql://u@127.0.0.1:notaport/x", 2),  # SQLAlchemy: ValueError, not ArgumentError
        ("postgresql://u@[::1/x", 2),
        ("sqlite://", 2),  # no file: each connection would get its own empty memory database
        ("sqlite:///:memory:", 2),
        ("sqlite:///file:x?mode=memory&uri=true", 2),
        ("postgresql+psycopg2://u@127.0.0.1:9/x", 2),  # a driver that is not installed
        ("sqlite:///file::memory:?uri=1", 2),
        ("sqlite:///x.db?timeout=abc", 2),  # pysqlite's float() of an option
        ("sqlite:///x.db?mode=ro", 2),  # a URI argument without uri=true (SQLAlchemy ignores it)
        ("postgresql://u@127.0.0.1:5432/", 2),  # no database: the server's default would do
        ("postgresql://u@127.0.0.1:99999/x", 2),  # a port out of range
    ],
)
def test_a_bad_db_url_is_one_line(tmp_path: Path, url: str, code: int) -> None:
    r = batching("status", "--db", url, cwd=tmp_path)
    assert r.rc == code
    one_error_line(r)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["status", "--all", "-q", "text"], "--all and --queue together: give one"),
        (["lineage", "--events", "e.jsonl", "-c", "c.yaml"], "--events and --config name two"),
    ],
)
def test_options_that_contradict_each_other_are_refused(
    tmp_path: Path, args: list[str], message: str
) -> None:
    r = batching(*args, cwd=tmp_path)
    assert r.rc == 2
    assert message in one_error_line(r)


@pytest.mark.parametrize("flag", ["--db", "--output"])
def test_an_empty_override_is_refused_not_ignored(tmp_path: Path, flag: str) -> None:
    r = batching("score", "-c", str(DEPLOYMENTS / "tabular.yaml"), flag, "", cwd=tmp_path)
    assert r.rc == 2
    assert f"{flag} is empty; give a value or leave the option out" in one_error_line(r)


def test_an_unreachable_server_is_one_line_without_the_password(tmp_path: Path) -> None:
    # Port 1 on the loopback: nothing listens there, the connection is refused at once.
    r = batching("status", "--db", "postgresql://scorer:s3cret@127.0.0.1:1/queue", cwd=tmp_path)
    line = one_error_line(r)
    assert r.rc == 1
    assert "database postgresql://scorer:***@127.0.0.1:1/queue failed" in line
    assert "is the server running? check the host and port" in line
    assert "s3cret" not in r.err + r.out


@pytest.mark.parametrize("command", ["status", "redrive", "purge", "reconcile"])
def test_a_missing_database_file_says_run_init_and_is_not_created(
    tmp_path: Path, command: str
) -> None:
    extra = {"purge": ["--older-than", "1d"], "reconcile": ["-c", str(write_config(tmp_path))]}
    r = batching(command, "--db", "sqlite:///typo.db", *extra.get(command, []), cwd=tmp_path)
    assert r.rc == 2
    assert f"no database at {tmp_path / 'typo.db'}" in one_error_line(r)
    assert "batching init" in r.err
    assert not (tmp_path / "typo.db").exists(), "a read created the database it did not find"


def test_a_read_command_leaves_another_programs_database_as_it_was(tmp_path: Path) -> None:
    import hashlib
    import sqlite3

    other = tmp_path / "other.db"
    with contextlib.closing(sqlite3.connect(other)) as db:
        db.execute("CREATE TABLE foo (x)")
        db.commit()
    (tmp_path / "empty.db").write_bytes(b"")
    before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    for name in before:
        r = batching("status", "--db", f"sqlite:///{name}", cwd=tmp_path)
        assert "run `batching init" in one_error_line(r)
        assert r.rc == 2  # not this version's queue database: bad input, like a missing file
    after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in tmp_path.iterdir()}
    assert after == before, "a read-only command rewrote (or added) a file: WAL switched on?"
    assert batching("init", "--db", "sqlite:///q.db", cwd=tmp_path).rc == 0
    with contextlib.closing(sqlite3.connect(tmp_path / "q.db")) as db:
        assert db.execute("PRAGMA journal_mode").fetchone() == ("wal",)


@pytest.mark.parametrize(
    ("command", "url", "message"),
    [
        ("init", "sqlite:///adir", "the path must name a file (not a folder)"),
        ("status", "sqlite:///notes.db", "file is not a database; the path names a file that"),
        ("init", "sqlite:///notes.db", "file is not a database; the path names a file that"),
        ("status", "postgresql://u@127.0.0.1:5432/x?sslmode=bogus", "use sslmode=disable,"),
    ],
)
def test_a_url_naming_something_else_is_bad_input(
    tmp_path: Path, command: str, url: str, message: str
) -> None:
    (tmp_path / "adir").mkdir()
    (tmp_path / "notes.db").write_text("not a database\n")
    r = batching(command, "--db", url, cwd=tmp_path)
    assert r.rc == 2, r.err
    assert message in one_error_line(r)
    assert (tmp_path / "notes.db").read_text() == "not a database\n"


def test_init_in_a_folder_that_does_not_exist_names_it(tmp_path: Path) -> None:
    r = batching("init", "--db", "sqlite:///nodir/queue.db", cwd=tmp_path)
    assert r.rc == 2
    assert f"no folder {tmp_path / 'nodir'} for the database file queue.db" in one_error_line(r)
    assert not (tmp_path / "nodir").exists()


def test_a_database_without_schema_says_run_init(tmp_path: Path) -> None:
    (tmp_path / "empty.db").touch()  # e.g. made by the sqlite3 shell
    r = batching("status", "--db", "sqlite:///empty.db", cwd=tmp_path)
    assert r.rc == 2  # bad input, like a missing file: run init
    assert "run `batching init --db sqlite:///empty.db`" in one_error_line(r)


def test_a_password_in_the_db_url_is_never_printed(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(2))
    runs = [
        batching("init", "--db", SECRET_DB, cwd=tmp_path),
        batching("status", "--db", SECRET_DB, cwd=tmp_path),
        batching("enqueue", str(jsonl), "--db", SECRET_DB, cwd=tmp_path),
        batching("redrive", cwd=tmp_path, env={"BATCHING_DB_URL": SECRET_DB}),
        batching("score", "-c", str(config), "--db", SECRET_DB, "--quiet", cwd=tmp_path),
        batching("reconcile", "-c", str(config), "--db", SECRET_DB, cwd=tmp_path),
    ]
    for r in runs:
        assert r.rc == 1
        line = one_error_line(r)
        assert "sekret" not in r.out + r.err
        assert "u:***@127.0.0.1:9/x" in line


def test_a_password_in_the_url_query_is_never_printed(tmp_path: Path) -> None:
    r = batching("status", "--db", "postgresql://u@127.0.0.1:9/x?password=sekret", cwd=tmp_path)
    assert r.rc == 1
    assert "sekret" not in r.out + r.err
    assert "password=***" in one_error_line(r)


@pytest.mark.parametrize(
    "url",
    [
        "sqlite:///file:queue.db?mode=ro&uri=true",
        "sqlite:///file:queue.db?uri=1",
        "sqlite:///file://localhost/{dir}/queue.db?uri=true",
        "sqlite:///file:///{dir}/queue.db?uri=true",
    ],
)
def test_a_sqlite_uri_url_opens_the_file_it_names(tmp_path: Path, url: str) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    r = batching("status", "--db", url.format(dir=str(tmp_path).lstrip("/")), cwd=tmp_path)
    assert r.rc == 0, r.err


@pytest.mark.parametrize(
    "url",
    [
        "postgresql//u:sekret@127.0.0.1:9/x",
        "u:sekret@127.0.0.1:9/x",
        " postgresql://u:sekret@127.0.0.1:9/x",
        "postgresql://u:sekret@127.0.0.1:port/x",
    ],
)
def test_a_password_in_a_malformed_db_url_is_never_printed(tmp_path: Path, url: str) -> None:
    for r in (
        batching("status", "--db", url, cwd=tmp_path),
        batching("init", cwd=tmp_path, env={"BATCHING_DB_URL": url}),
        batching("score", "-c", str(write_config(tmp_path)), "--db", url, cwd=tmp_path),
    ):
        assert r.rc == 2, r.err
        assert "sekret" not in r.out + r.err
        assert "u:***@127.0.0.1" in one_error_line(r)


def test_a_raw_at_sign_in_a_password_is_refused_without_printing_any_of_it(
    tmp_path: Path,
) -> None:
    """The driver read the part after the first '@' as the host and printed it."""
    r = batching("status", "--db", "postgresql://u:sek@ret99@127.0.0.1:9/x", cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "ret99" not in r.out + r.err
    assert "u:***@127.0.0.1" in line
    assert "%40" in line


# ----------------------------------------------------------------------------- config commands


def test_check_passes_on_every_shipped_config(tmp_path: Path) -> None:
    for name in ("tabular.yaml", "online.yaml", "bulk.yaml"):
        r = batching("check", "-c", str(DEPLOYMENTS / name), cwd=tmp_path)
        assert r.rc == 0, (name, r.out, r.err)
        assert r.out.rstrip().endswith(": ok")


def test_check_names_an_output_setting_its_kind_ignores(tmp_path: Path) -> None:
    """A copy of tabular.yaml switched to kind sql kept output.path: the rows went to
    batching_results, and nothing said the path was ignored."""
    import yaml

    data = yaml.safe_load((DEPLOYMENTS / "tabular.yaml").read_text())
    data["output"] = {"kind": "sql", "path": "outputs/zzz"}
    data["service_profile"] = str(DEPLOYMENTS / data["service_profile"])
    path = tmp_path / "sql.yaml"
    path.write_text(yaml.safe_dump(data))
    r = batching("check", "-c", str(path), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "output.path is ignored by kind sql (rows go to batching_results)" in r.out + r.err


def test_check_names_a_metrics_file_no_run_can_write_and_a_run_warns_once(
    tmp_path: Path,
) -> None:
    """A review: metrics.textfile_path in a folder that does not exist passed check, and
    every run printed the same warning twice and wrote nothing."""
    import yaml

    data = yaml.safe_load((DEPLOYMENTS / "tabular.yaml").read_text())
    data["metrics"] = {"textfile_path": "metrics/batching.prom"}
    data["service_profile"] = str(DEPLOYMENTS / data["service_profile"])
    data["output"] = {"kind": "parquet", "path": str(tmp_path / "out")}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    r = batching("check", "-c", str(path), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert f"folder {tmp_path / 'metrics'} does not exist" in r.out + r.err
    db = f"sqlite:///{tmp_path / 'm.db'}"
    assert batching("init", "--db", db, cwd=tmp_path).rc == 0
    run = batching("score", "-c", str(path), "--db", db, "--quiet", cwd=tmp_path)
    assert run.rc == 0, run.err
    assert run.err.count("metrics not written to") == 1, run.err


def test_check_on_the_prefect_deployment_file_says_which_file_to_give(tmp_path: Path) -> None:
    r = batching("check", "-c", str(DEPLOYMENTS / "prefect.yaml"), cwd=tmp_path)
    assert r.rc == 2
    assert "a Prefect deployment file" in one_error_line(r)
    assert "deployments/tabular.yaml" in r.err


def test_check_verifies_the_pinned_checkpoint_before_the_policy(tmp_path: Path) -> None:
    """Before, `check` said ok with a wrong model.sha256 (only score refused it), and for a
    factory without a checkpoint blamed the service profile (new-user walkthrough)."""
    wrong = "0" * 64
    r = batching("check", "-c", str(write_config(tmp_path, model={"sha256": wrong})), cwd=tmp_path)
    assert r.rc == 2
    assert f"but the config pins {wrong}" in one_error_line(r)
    factory = write_config(tmp_path, model={"name": "nosuchmod:build"})
    r = batching("check", "-c", str(factory), cwd=tmp_path)
    assert r.rc == 2
    assert "so it needs a checkpoint: set model.checkpoint" in one_error_line(r)


def test_check_fails_with_the_numbers_when_the_window_breaks_the_objective(tmp_path: Path) -> None:
    near = write_config(tmp_path, batching={"max_batch_size": 512, "max_wait_s": 0.499})
    r = batching("check", "-c", str(near), cwd=tmp_path)
    assert r.rc == 1
    text = " ".join((r.out + r.err).split())
    assert "max_wait_s 0.499" in text
    assert "exceeds latency_slo_s 0.5" in text

    beyond = write_config(tmp_path, batching={"max_wait_s": 2.0})  # refused at load
    r = batching("check", "-c", str(beyond), cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "max_wait_s must be < latency_slo_s (0.5), got 2" in line


@pytest.mark.parametrize(
    ("command", "text", "reason"),
    [
        ("check", "name: [unclosed\n", "not valid YAML"),
        ("check", "- just\n- a list\n", "expected a mapping"),
        ("check", "name: x\n", "model"),
        ("score", "name: x\nmodle: {}\n", "modle"),
        ("reconcile", "name: [unclosed\n", "not valid YAML"),
    ],
)
def test_a_bad_config_is_one_line_and_exit_2(
    tmp_path: Path, command: str, text: str, reason: str
) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text)
    r = batching(command, "-c", str(path), cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert str(path) in line
    assert reason in line


def test_a_missing_config_file_is_one_line(tmp_path: Path) -> None:
    r = batching("check", "-c", str(tmp_path / "nope.yaml"), cwd=tmp_path)
    assert r.rc == 2
    assert "cannot read config" in one_error_line(r)


# ----------------------------------------------------------------------------- a scored queue


@dataclass(frozen=True)
class Scored:
    """A workspace where ``score --max-items 100`` then ``score`` ran on W1 plus two poison items."""

    path: Path
    first: Result
    second: Result
    after_first: dict[str, int]

    def run_id(self, r: Result) -> str:
        match = re.search(r"run ([0-9a-f-]{36})", r.out)
        assert match, r.out
        return match.group(1)


@pytest.fixture(scope="module")
def scored(tmp_path_factory: pytest.TempPathFactory) -> Scored:
    ws = tmp_path_factory.mktemp("scored")
    config = write_config(ws)
    assert batching("init", "--db", DB, cwd=ws).rc == 0
    parquet = workloads.write_w1_parquet(ws / "w1.parquet", N_ROWS)
    assert batching("enqueue", str(parquet), "--db", DB, "-q", "tabular", cwd=ws).rc == 0
    poison = ws / "poison.jsonl"
    poison.write_text(
        '{"item_key": "poison-short", "payload": {"x": [1, 2, 3]}}\n'
        '{"item_key": "poison-shape", "payload": {"y": 1}}\n'
    )
    r = batching("enqueue", str(poison), "--db", DB, "-q", "tabular", "--max-attempts", "1", cwd=ws)
    assert r.rc == 0, r.err
    first = batching("score", "-c", str(config), "--max-items", "100", "--quiet", cwd=ws)
    assert first.rc == 0, first.err
    after_first = status(ws)
    second = batching("score", "-c", str(config), cwd=ws)  # with its progress bar
    assert second.rc == 0, second.err
    return Scored(ws, first, second, after_first)


@pytest.fixture
def ws(scored: Scored, tmp_path: Path) -> Path:
    """A private copy of the scored workspace (tests may break it), whose ledger names the
    copy's staging folder: its batches were written here, as far as reconcile can tell."""
    import sqlite3

    copy = tmp_path / "ws"
    shutil.copytree(scored.path, copy)
    with sqlite3.connect(copy / "queue.db") as db:
        db.execute(
            "UPDATE batching_batches SET staging_path = replace(staging_path, ?, ?)",
            (str(scored.path), str(copy)),
        )
    return copy


def test_score_max_items_stops_after_n_then_a_full_run_drains_the_queue(
    scored: Scored, tmp_path: Path
) -> None:
    assert scored.after_first == {
        "ready": 202,
        "leased": 0,
        "done": 100,
        "dead": 0,
        "expired": 0,
        "cancelled": 0,
    }
    assert status(scored.path) == {
        "ready": 0,
        "leased": 0,
        "done": 300,
        "dead": 2,
        "expired": 0,
        "cancelled": 0,
    }
    for r in (scored.first, scored.second):
        assert "items committed" in r.out
        assert "outputs: " in r.out
    assert scored.run_id(scored.first) != scored.run_id(scored.second)
    # No progress bar on a pipe: before, its end left a blank line in the captured stderr.
    assert scored.second.err == "", scored.second.err
    import pyarrow.dataset as ds

    table = ds.dataset(scored.path / "outputs", format="parquet", partitioning="hive").to_table()
    assert sorted(table["item_key"].to_pylist()) == sorted(f"w1-{i}" for i in range(N_ROWS))


def test_a_run_that_scores_nothing_says_why(tmp_path: Path) -> None:
    from batching.ingress import queue as q

    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(3))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
    typo = batching(
        "score", "-c", str(write_config(tmp_path, queue={"name": "tabluar"})), cwd=tmp_path
    )
    assert typo.rc == 0, typo.err
    assert "warning: queue 'tabluar' has no items; queues in this database: tabular" in typo.err

    engine = database.create_engine(f"sqlite:///{tmp_path / 'queue.db'}")
    q.SqlQueue(engine, "tabular").claim(3, lease_s=600)  # another scorer holds them
    engine.dispose()
    held = batching("score", "-c", str(write_config(tmp_path)), cwd=tmp_path)
    assert held.rc == 0, held.err
    assert "3 item(s) of queue 'tabular' are leased by other scorers" in held.err


def test_an_until_empty_run_says_when_items_wait_out_a_retry_backoff(tmp_path: Path) -> None:
    """An input the model overflows on gives an inf score (a NaN input is refused at decode,
    dead at once): the item fails and waits out its backoff, which an until-empty run does
    not wait for. Before, it exited 0 saying nothing of it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    rows = pa.array([[0.1] * 64, [3e38] * 64], type=pa.list_(pa.float32()))
    pq.write_table(pa.table({"item_key": ["ok", "big"], "payload": rows}), tmp_path / "r.parquet")
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    assert batching("enqueue", "r.parquet", "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
    config = write_config(tmp_path, queue={"backoff_base_s": 120})  # still waiting at the end
    r = batching("score", "-c", str(config), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "1 item(s) of queue 'tabular' are waiting out a retry backoff" in r.err
    shown = batching("status", "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert "1 ready waiting out a retry backoff" in shown.out


def test_score_on_an_uninitialised_database_is_one_line(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    r = batching("score", "-c", str(config), "--db", "sqlite:///other.db", "--quiet", cwd=tmp_path)
    assert r.rc == 2
    assert "batching init" in one_error_line(r)
    assert not (tmp_path / "other.db").exists()
    assert not list(tmp_path.rglob("events.jsonl")), "a run that never started is in lineage"


def test_score_sends_lineage_where_openlineage_url_points(tmp_path: Path) -> None:
    received: list[dict[str, Any]] = []
    server = ThreadingHTTPServer(
        ("127.0.0.1", 0), type("S", (LineageBackend,), {"received": received})
    )
    threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
    try:
        assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
        jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(5))
        assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
        url = f"http://127.0.0.1:{server.server_address[1]}"
        r = batching(
            "score", "-c", str(write_config(tmp_path)), cwd=tmp_path, env={"OPENLINEAGE_URL": url}
        )
    finally:
        server.shutdown()
        server.server_close()
    assert r.rc == 0, r.err
    assert [e["eventType"] for e in received] == ["START", "COMPLETE"]
    assert not list(tmp_path.rglob("events.jsonl")), "lineage also went to the config's file"
    assert "lineage: " not in r.out  # no local log to point at


def test_an_expired_item_is_an_sla_miss_that_reconcile_reports_but_cannot_repair(
    tmp_path: Path,
) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    late = {"item_key": "late", "payload": {"x": [0.5] * 64}, "deadline": "2020-01-01T00:00:00Z"}
    (tmp_path / "late.jsonl").write_text(json.dumps(late) + "\n")
    sent = batching("enqueue", "late.jsonl", "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert sent.rc == 0
    assert "warning: 1 record(s) of late.jsonl are already past their deadline" in sent.err
    config = str(write_config(tmp_path))
    scored = batching("score", "-c", config, cwd=tmp_path)
    assert scored.rc == 0
    assert "1 item(s) of queue 'tabular' expired: deadline passed" in scored.err  # counted
    r = batching("reconcile", "-c", config, cwd=tmp_path)
    assert r.rc == 1
    assert "0 critical, 1 warning finding(s); sla_miss not repaired" in r.out
    assert "--repair" not in r.out  # before: "`--repair` fixes what can be fixed"
    repaired = batching("reconcile", "-c", config, "--repair", "--json", cwd=tmp_path)
    assert repaired.rc == 1  # what is left after the repair: the miss
    assert repaired.json()["after_repair"]["counts"] == {"sla_miss": 1, "expired": 1}


def test_score_refuses_a_malformed_openlineage_url_before_claiming(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(5))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
    env = {"OPENLINEAGE_URL": "marquez:5000"}
    r = batching("score", "-c", str(write_config(tmp_path)), cwd=tmp_path, env=env)
    assert r.rc == 2
    assert "lineage url 'marquez:5000' is not a URL like http://marquez:5000" in one_error_line(r)
    assert status(tmp_path)["ready"] == 5


@pytest.mark.parametrize("output", ["afile", "afile/sub", "/proc/no-such-folder"])
def test_an_output_folder_that_cannot_be_made_is_one_line_before_any_lineage(
    tmp_path: Path, output: str
) -> None:
    (tmp_path / "afile").write_text("not a folder")
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    r = batching("score", "-c", str(config), "--db", DB, "--output", output, cwd=tmp_path)
    assert r.rc == 2
    assert "cannot be created" in one_error_line(r)
    assert not list(tmp_path.rglob("events.jsonl")), "a run that never started is in lineage"


def test_an_empty_file_enqueues_nothing_and_says_so(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    (tmp_path / "empty.jsonl").write_text("")
    r = batching("enqueue", "empty.jsonl", "--db", DB, cwd=tmp_path)
    assert r.rc == 0
    assert "warning: empty.jsonl holds no records; nothing to enqueue" in r.err


def test_enqueue_names_what_it_was_given_when_that_is_no_file(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    for arg, says in (
        ("-", "-: standard input is not read (a file is enqueued whole, or not at all)"),
        ("/dev/null", "/dev/null: not a file (a pipe or a device)"),
        ("nope.jsonl", "nope.jsonl: no such file"),
        (".", ".: is a folder"),
    ):
        r = batching("enqueue", arg, "--db", DB, cwd=tmp_path)
        assert r.rc == 2, r.err
        assert f"{says}; give a .jsonl or .parquet file" in one_error_line(r)


def test_a_postgresql_database_that_does_not_exist_is_named_with_the_fix(
    pg_url: str, tmp_path: Path
) -> None:
    missing = pg_url.rpartition("/")[0] + "/batching_no_such_db"
    r = batching("status", "--db", missing, cwd=tmp_path)
    assert r.rc == 1
    line = one_error_line(r)
    assert 'database "batching_no_such_db" does not exist; create it (createdb' in line
    host = pg_url.split("@", 1)[1]  # a user that does not exist gets other advice
    r = batching("status", "--db", f"postgresql://batching_no_such_role@{host}", cwd=tmp_path)
    assert r.rc == 1
    assert "does not exist; check the user name in the URL" in one_error_line(r)


def test_score_names_the_database_it_read_when_the_environment_overrode_the_config(
    tmp_path: Path,
) -> None:
    """$BATCHING_DB_URL overrides the config's database.url; the run now says which it read
    (a walkthrough scored another database than the config named, and nothing said so)."""
    other = f"sqlite:///{tmp_path / 'other.db'}"
    assert batching("init", "--db", other, cwd=tmp_path).rc == 0
    row = {"item_key": "k", "payload": {"x": [0.1] * 64}}
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    assert batching("enqueue", "in.jsonl", "--db", other, "-q", "tabular", cwd=tmp_path).rc == 0
    config = str(write_config(tmp_path, database={"url": "sqlite:///named.db"}))
    r = batching("score", "-c", config, cwd=tmp_path, env={"BATCHING_DB_URL": other})
    assert r.rc == 0, r.err
    assert f"queue: tabular in {other}" in r.out


def test_a_sql_sinks_lineage_log_sits_beside_its_config_whatever_the_folder(
    tmp_path: Path,
) -> None:
    """Before, a SQL sink's local lineage went to ./outputs/lineage of the folder `score` ran
    in, and `batching lineage -c` run from another folder found no log (new-user walkthrough)."""
    (tmp_path / "cfg").mkdir()
    (tmp_path / "run").mkdir()
    db = f"sqlite:///{tmp_path / 'q.db'}"
    assert batching("init", "--db", db, cwd=tmp_path).rc == 0
    rows = [{"item_key": f"k{i}", "payload": {"x": [0.1] * 64}} for i in range(5)]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    assert batching("enqueue", "in.jsonl", "--db", db, "-q", "tabular", cwd=tmp_path).rc == 0
    config = str(write_config(tmp_path / "cfg", database={"url": db}, output={"kind": "sql"}))
    assert batching("score", "-c", config, cwd=tmp_path / "run").rc == 0
    assert not (tmp_path / "run" / "outputs").exists()
    assert (tmp_path / "cfg" / "outputs" / "lineage" / "events.jsonl").is_file()
    shown = batching("lineage", "-c", config, "--json", cwd=tmp_path)
    assert shown.rc == 0, shown.err


def test_tables_keep_long_names_whole_when_output_is_not_a_terminal(scored: Scored) -> None:
    """Piped (a CI log, a script), rich laid tables out in 80 columns and cut the lineage
    dataset names mid-path (found by a new-user walkthrough)."""
    events = str(scored.path / "lineage" / "events.jsonl")
    r = batching("lineage", "--events", events, cwd=scored.path)
    assert r.rc == 0, r.err
    assert str(scored.path / "outputs") in r.out


def test_lineage_finds_the_log_of_a_run_scored_with_another_output(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    row = {"item_key": "k", "payload": {"x": [0.1] * 64}}
    (tmp_path / "in.jsonl").write_text(json.dumps(row) + "\n")
    assert batching("enqueue", "in.jsonl", "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
    config = str(write_config(tmp_path))
    assert batching("score", "-c", config, "--output", "elsewhere/out", cwd=tmp_path).rc == 0
    shown = batching("lineage", "-c", config, "--output", "elsewhere/out", "--json", cwd=tmp_path)
    assert shown.rc == 0, shown.err
    assert shown.json()["state"] == "COMPLETE"
    assert batching("lineage", "-c", config, cwd=tmp_path).rc == 2  # not where the config writes
    bare = batching("lineage", "--output", "elsewhere/out", cwd=tmp_path)
    assert bare.rc == 2
    assert "--output needs --config" in one_error_line(bare)


def test_lineage_json_shows_each_run(scored: Scored) -> None:
    latest = batching("lineage", "-c", "pipeline.yaml", "--json", cwd=scored.path)
    assert latest.rc == 0, latest.err
    assert latest.json()["run_id"] == scored.run_id(scored.second)
    events = str(scored.path / "lineage" / "events.jsonl")
    run = scored.run_id(scored.first)
    first = batching("lineage", "--events", events, "--run", run, "--json", cwd=scored.path)
    assert first.rc == 0, first.err
    summary = first.json()
    assert summary["run_id"] == run
    assert summary["state"] == "COMPLETE"
    assert summary["event_types"] == ["START", "COMPLETE"]
    assert summary["job"]["name"] == "e2e-tabular"
    (output,) = summary["outputs"]
    assert output["row_count"] == 100
    assert output["name"].endswith("outputs")
    assert summary["model"]["version"] == "w1-mlp-v1"
    table = batching("lineage", "--events", events, "--run", run, cwd=scored.path)
    assert table.rc == 0
    assert run in table.out
    unknown = batching("lineage", "--events", events, "--run", "nope", cwd=scored.path)
    assert unknown.rc == 2
    one_error_line(unknown)


def test_reconcile_clean_then_a_deleted_file_then_repair(ws: Path) -> None:
    config = str(ws / "pipeline.yaml")
    clean = batching("reconcile", "-c", config, cwd=ws)
    assert clean.rc == 0, clean.out + clean.err
    assert "clean" in clean.out

    gone = committed_files(ws)[0]
    gone.unlink()
    broken = batching("reconcile", "-c", config, "--json", cwd=ws)
    assert broken.rc == 1
    report = broken.json()
    assert (report["ok"], report["clean"]) == (False, False)
    assert report["counts"] == {"missing_file": 1, "dead": 2}
    (finding,) = [f for f in report["findings"] if f["class"] == "missing_file"]
    assert finding["severity"] == "critical"
    lost_keys = set(finding["item_keys"])
    assert lost_keys
    assert any(gone.name in f for f in finding["files"])

    repaired = batching("reconcile", "-c", config, "--repair", cwd=ws)
    # It shows what it found and did, then checks again: the exit code says what is left
    # (before, exit 1 from the findings as found, and "run again" to learn the outcome).
    assert repaired.rc == 0, repaired.out
    found, _, left = repaired.out.partition("after repair:")
    assert "missing_file" in found
    assert f"{len(lost_keys)} item(s) requeued: `batching score` scores them again" in found
    assert "missing_file" not in left
    assert "clean: every done item" in left
    assert "ERROR" not in repaired.err, repaired.err  # it ends clean: no error logged
    after = batching("reconcile", "-c", config, "--json", cwd=ws)
    assert after.rc == 0, after.out
    assert after.json()["counts"] == {"dead": 2}  # info only
    state = status(ws)
    assert state["ready"] == len(lost_keys)
    assert state["done"] == N_ROWS - len(lost_keys)


def test_reconcile_of_a_wrong_output_folder_is_refused_not_repaired(ws: Path) -> None:
    """A typo in --output read as every file lost: --repair rescored the whole dataset."""
    config = str(ws / "pipeline.yaml")
    before = status(ws)
    for extra in ((), ("--repair",)):
        r = batching("reconcile", "-c", config, "--output", "outputs-typo", *extra, cwd=ws)
        assert r.rc == 2
        line = one_error_line(r)
        assert "no Parquet files under" in line
        assert (
            "(written under " in line
        )  # where the scorer wrote (the copied workspace: its original)
        assert "--dataset-lost" in line
    assert status(ws) == before, "a refused reconcile changed the queue"

    shutil.rmtree(ws / "outputs")  # the dataset really is gone: judged when asked
    lost = batching("reconcile", "-c", config, "--dataset-lost", "--repair", "--json", cwd=ws)
    assert lost.rc == 0, lost.err  # what is left after the repair: nothing
    assert lost.json()["counts"]["missing_file"] > 0  # as found
    assert lost.json()["after_repair"]["clean"] is True
    assert status(ws)["ready"] == N_ROWS


def test_reconcile_scoped_by_run_and_since(scored: Scored, ws: Path) -> None:
    config = str(ws / "pipeline.yaml")
    run = scored.run_id(scored.first)
    r = batching("reconcile", "-c", config, "--run", run, "--since", "1h", "--json", cwd=ws)
    assert r.rc == 0, r.err
    assert (r.json()["run_id"], r.json()["clean"]) == (run, True)
    bad = batching("reconcile", "-c", config, "--since", "soon", cwd=ws)
    assert bad.rc == 2
    assert "--since" in one_error_line(bad)


def test_redrive_moves_dead_items_back_to_ready(ws: Path) -> None:
    r = batching("redrive", "--db", DB, "-q", "tabular", "--only", "dead", cwd=ws)
    assert r.rc == 0, r.err
    assert "redrove 2 item(s)" in r.out
    state = status(ws)
    assert (state["dead"], state["ready"]) == (0, 2)
    bad = batching("redrive", "--db", DB, "-q", "tabular", "--only", "alive", cwd=ws)
    assert bad.rc == 2
    assert "--only must be dead, expired, all or cancelled" in one_error_line(bad)


def test_purge_removes_old_done_items_only(ws: Path) -> None:
    kept = batching("purge", "--db", DB, "-q", "tabular", "--older-than", "7d", cwd=ws)
    assert kept.rc == 0, kept.err
    assert "deleted 0 done or cancelled item(s)" in kept.out
    r = batching("purge", "--db", DB, "-q", "tabular", "--older-than", "0s", "--archive", cwd=ws)
    assert r.rc == 0, r.err
    assert f"archived {N_ROWS} done or cancelled item(s)" in r.out
    assert status(ws) == {
        "ready": 0,
        "leased": 0,
        "done": 0,
        "dead": 2,
        "expired": 0,
        "cancelled": 0,
    }
    bad = batching("purge", "--db", DB, "--older-than=-1d", cwd=ws)
    assert bad.rc == 2
    one_error_line(bad)


def test_purge_ledger_deletes_the_rows_of_old_batches_and_status_shows_the_horizon(
    ws: Path,
) -> None:
    """The ledger's rows go with --ledger only, after their items, up to a UTC midnight."""
    import sqlite3

    with sqlite3.connect(ws / "queue.db") as db:  # scored three days ago, as far as it knows
        db.execute("UPDATE batching_batches SET committed_at = committed_at - 3 * 86400")
        db.execute("UPDATE batching_items SET finished_at = finished_at - 3 * 86400")
        (batches,) = db.execute("SELECT count(*) FROM batching_batches").fetchone()
    items_only = batching("purge", "--db", DB, "-q", "tabular", "--older-than", "1d", cwd=ws)
    assert items_only.rc == 0, items_only.err
    assert "ledger" not in items_only.out
    r = batching("purge", "--db", DB, "-q", "tabular", "--older-than", "1d", "--ledger", cwd=ws)
    assert r.rc == 0, r.err
    day = re.search(r"ledger kept from (\d{4}-\d{2}-\d{2}) 00:00 UTC", r.out)
    assert day is not None, r.out
    assert f"deleted {batches} ledger row(s) of queue 'tabular' that no item needs" in r.out
    with sqlite3.connect(ws / "queue.db") as db:
        assert db.execute("SELECT count(*) FROM batching_batches").fetchone() == (0,)
    shown = batching("status", "--db", DB, "-q", "tabular", cwd=ws)
    assert f"queue 'tabular' ledger kept from {day[1]} 00:00:00 UTC" in shown.out
    as_json = batching("status", "--db", DB, "-q", "tabular", "--json", cwd=ws).json()
    assert as_json["controls"]["tabular"]["ledger_horizon"] is not None


def test_an_argument_that_is_not_utf8_is_refused_before_anything_is_done(ws: Path) -> None:
    """`purge --actor` with a byte that is not UTF-8 deleted the items, then failed writing
    its audit row (a review): every argument is checked before any command runs."""
    before = status(ws)
    for extra in (["--actor", os.fsdecode(b"ops\xff")], ["--reason", os.fsdecode(b"r\xfe")]):
        r = batching("purge", "--db", DB, "-q", "tabular", "--older-than", "0s", *extra, cwd=ws)
        assert r.rc == 2, r.err
        assert "holds bytes that are not UTF-8 text" in one_error_line(r)
        assert "'ops\\xff'" in r.err or "'r\\xfe'" in r.err
    assert status(ws) == before
    named = ws / os.fsdecode(b"recs-\xe9.jsonl")  # a path is not text: it opens as it is
    workloads.write_lines(named, workloads.w1_json_lines(3, prefix="latin"))
    ok = subprocess.run(  # bytes out: the command says the file's name as it is
        [BATCHING, "enqueue", str(named), "--db", DB, "-q", "tabular"],
        cwd=ws,
        capture_output=True,
        timeout=300,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    assert b"recs-\xe9.jsonl: committed 3 new item(s)" in ok.stdout
    as_json = batching("status", "--db", DB, "-q", os.fsdecode(b"q\xff"), "--json", cwd=ws)
    assert as_json.rc == 2
    assert as_json.json()["error"]["kind"] == "UsageError"


def test_audit_limits_and_status_since_without_costs_are_refused(ws: Path) -> None:
    huge = batching("queue", "audit", "tabular", "--db", DB, "--limit", "9" * 21, cwd=ws)
    assert huge.rc == 2
    assert "the audit limit must be 1 to 1,000,000" in one_error_line(huge)
    since = batching("status", "--db", DB, "-q", "tabular", "--since", "1d", cwd=ws)
    assert since.rc == 2
    assert "--since applies to --costs" in one_error_line(since)


def test_demo_scores_both_workloads_and_shows_committed_outputs(tmp_path: Path) -> None:
    """The README's first command ends in `batching demo`: it must work in an empty folder."""
    import pyarrow.dataset as ds

    r = batching("demo", "--dir", "d", "--n-text", "40", "--n-tabular", "600", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "items committed" in r.out
    assert "(1 float, model w1-mlp-v1)" in r.out
    assert "(256 floats, model w2-text-v1)" in r.out
    rows = {
        kind: ds.dataset(tmp_path / "d" / "outputs" / kind, partitioning="hive").count_rows()
        for kind in ("text", "tabular")
    }
    assert rows == {"text": 40, "tabular": 600}
    status = batching("status", "--db", "sqlite:///d/demo.db", "--all", cwd=tmp_path)
    assert status.rc == 0, status.err
    lines = status.out.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert any(line.split()[:1] == ["tabular"] and "600" in line.split() for line in lines)
    assert any(line.split()[:1] == ["text"] and "40" in line.split() for line in lines)


def test_the_sql_demo_keeps_its_lineage_in_its_folder(tmp_path: Path) -> None:
    """A results table has no folder: the lineage log went beside the shipped configs, into
    the clone (deployments/outputs/)."""
    shipped = DEPLOYMENTS / "outputs"
    existed = shipped.exists()
    r = batching(
        "demo", "--dir", "d", "--sink", "sql", "--n-text", "10", "--n-tabular", "20", cwd=tmp_path
    )
    assert r.rc == 0, r.err
    events = tmp_path / "d" / "outputs" / "lineage" / "events.jsonl"
    assert f"lineage events: {events}" in r.out
    assert len(events.read_text().splitlines()) >= 4  # START and COMPLETE of two runs
    assert shipped.exists() == existed


@pytest.mark.parametrize("name", ["", "q" * 201])
def test_a_queue_name_no_config_could_use_is_refused(tmp_path: Path, name: str) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(2))
    r = batching("enqueue", str(jsonl), "--db", DB, "-q", name, cwd=tmp_path)
    assert r.rc == 2
    assert "must be 1 to 200 characters" in r.err
    assert status(tmp_path) == {
        "ready": 0,
        "leased": 0,
        "done": 0,
        "dead": 0,
        "expired": 0,
        "cancelled": 0,
    }


def test_a_queue_without_items_names_the_queues_there(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(2))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tabular", cwd=tmp_path).rc == 0
    r = batching("status", "--db", DB, "-q", "tabluar", "--json", cwd=tmp_path)
    assert r.rc == 0
    assert json.loads(r.out)["by_state"]["ready"] == 0
    assert "queue 'tabluar' has no items; queues in this database: tabular" in r.err
    for command in (["redrive"], ["purge", "--older-than", "0s"]):
        r = batching(*command, "--db", DB, "-q", "tabluar", cwd=tmp_path)
        assert r.rc == 0
        assert "queue 'tabluar' has no items; queues in this database: tabular" in r.err
    r = batching("redrive", "--db", DB, "-q", "tabular", cwd=tmp_path)
    assert "warning" not in r.err, "a real queue with nothing to redrive is not a typo"
    # reconcile of a config whose queue.name is a typo: it judged nothing and said clean
    shipped = (REPO / "deployments" / "tabular.yaml").read_text()
    typo = tmp_path / "typo.yaml"
    typo.write_text(shipped.replace("  name: tabular\n", "  name: tabluar\n", 1))
    r = batching("reconcile", "-c", str(typo), "--db", DB, "--output", "out", cwd=tmp_path)
    assert "queue 'tabluar' has no items; queues in this database: tabular" in r.err
    assert "judged nothing: queue 'tabluar' has no items" in r.out
    r = batching(
        "reconcile", "-c", str(typo), "--db", DB, "--output", "out", "--json", cwd=tmp_path
    )
    assert json.loads(r.out)["unknown_queue"].startswith("queue 'tabluar' has no items")
    # A queue with a control or an audit row and no item (capped first, or purged empty) is
    # no typo, and is among the queues a typo's warning names.
    cap = ("queue", "cap", "capped", "--max-depth", "5", "--new", "--db", DB)
    assert batching(*cap, cwd=tmp_path).rc == 0
    assert "warning" not in batching("status", "--db", DB, "-q", "capped", cwd=tmp_path).err
    r = batching("status", "--db", DB, "-q", "tabluar", cwd=tmp_path)
    assert "queues in this database: capped, tabular" in r.err


def test_maintain_compacts_a_delta_output_and_says_a_parquet_one_needs_nothing(
    tmp_path: Path,
) -> None:
    from tests.integration.test_pipeline import write_config

    db = f"sqlite:///{tmp_path / 'q.db'}"
    assert batching("init", "--db", db, cwd=tmp_path).rc == 0
    workloads.write_w1_parquet(tmp_path / "w1.parquet", 200)
    assert batching("enqueue", "w1.parquet", "-q", "tabular", "--db", db, cwd=tmp_path).rc == 0
    delta = write_config(
        "tabular.yaml",
        tmp_path,
        batching={"max_batch_size": 32, "claim_size": 32},
        output={"kind": "delta", "max_rows_per_commit": 32},
    )
    assert batching("score", "-c", str(delta), "--db", db, "--quiet", cwd=tmp_path).rc == 0
    done = batching("maintain", "-c", str(delta), "--db", db, "--json", cwd=tmp_path)
    assert done.rc == 0, done.err
    assert json.loads(done.out)["files_added"] == 1
    bad = batching(
        "maintain", "-c", str(delta), "--db", db, "--vacuum-retention", "soon", cwd=tmp_path
    )
    assert bad.rc == 2
    assert "--vacuum-retention must be a duration" in bad.err
    short = batching(  # refused before anything runs (compaction ran, then vacuum failed)
        "maintain", "-c", str(delta), "--db", db, "--vacuum-retention", "1h", "--json", cwd=tmp_path
    )
    assert short.rc == 2
    assert "--vacuum-retention 1h" in short.err
    assert "nothing was done" in short.err
    # whole hours for delta-rs, rounded up: a vacuum never keeps less than it was asked to
    half = batching(
        "maintain", "-c", str(delta), "--db", db, "--vacuum-retention", "30m", cwd=tmp_path
    )
    assert half.rc == 2
    assert "--vacuum-retention 0.5h (rounded up to 1h)" in half.err
    parquet = write_config("tabular.yaml", tmp_path)  # the same file, now a Parquet output
    left = batching("maintain", "-c", str(parquet), "--db", db, cwd=tmp_path)
    assert (left.rc, "needs no housekeeping" in left.out) == (0, True)
