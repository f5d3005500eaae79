"""Bad input to ``lineage``, ``profile``, ``demo``, ``check`` and ``reconcile``: one line, exit 2.

Each case was found by a new-user walkthrough; before its fix it printed a traceback or a
misleading message.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import pytest

from tests.e2e.test_cli import DB, DEPLOYMENTS, batching, one_error_line, write_config

TABULAR = str(DEPLOYMENTS / "tabular.yaml")


def _event(run_id: str, kind: str, at: str, **extra: object) -> str:
    run = {"runId": run_id, **extra.pop("run", {})}  # type: ignore[dict-item]
    event = {"eventType": kind, "eventTime": at, "run": run, "job": {"namespace": "n", "name": "j"}}
    return json.dumps(event | extra)


# ----------------------------------------------------------------------------- lineage


def test_lineage_skips_events_without_a_run_naming_file_and_line(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    lines = [
        _event("r1", "START", "2024-01-01T00:00:00+00:00"),
        '{"eventType": "START"}',
        _event("r1", "COMPLETE", "2024-01-01T00:00:01+00:00"),
        _event("r2", "START", "2024-01-01T00:00:02+00:00", run={"facets": [1]}, outputs=["x"]),
    ]
    events.write_text("\n".join(lines) + "\n")
    r = batching("lineage", "--events", str(events), "--run", "r1", "--json", cwd=tmp_path)
    assert r.rc == 0, r.err
    assert r.json()["event_types"] == ["START", "COMPLETE"]
    assert f"{events}:2: lineage event skipped (no run.runId)" in r.err
    latest = batching("lineage", "--events", str(events), "--json", cwd=tmp_path)
    assert latest.rc == 0, latest.err
    assert (latest.json()["run_id"], latest.json()["outputs"]) == ("r2", [])


def test_lineage_on_a_file_without_events_says_so(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    for text, says in (
        ("", "no lineage events; run `batching score` first"),
        ('{"eventType": "START"}\n', "no line of it is a lineage event; give the events file"),
    ):
        events.write_text(text)
        r = batching("lineage", "--events", str(events), cwd=tmp_path)
        assert r.rc == 2
        assert one_error_line(r).startswith(f"error: {events}: {says}")


# ----------------------------------------------------------------------------- profile


def test_profile_refuses_an_unwritable_out_before_measuring(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    (tmp_path / "folder").mkdir()
    for out in ("folder", "afile/sub/p.json"):
        r = batching("profile", "-c", TABULAR, "--out", out, cwd=tmp_path)
        assert r.rc == 2
        line = one_error_line(r)
        assert line.startswith(f"error: {out}: cannot write the service profile there")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile", "folder"]
    assert not list((tmp_path / "folder").iterdir())


def test_profile_creates_the_folder_of_out(tmp_path: Path) -> None:
    r = batching(
        "profile", "-c", TABULAR, "--batch-sizes", "1", "--repeats", "1", "--out", "new/p.json",
        cwd=tmp_path,
    )  # fmt: skip
    assert r.rc == 0, r.err
    assert json.loads((tmp_path / "new" / "p.json").read_text())["points"]


def test_profile_bounds_batch_sizes_and_lengths(tmp_path: Path) -> None:
    for option, value in (("--batch-sizes", "1,100000000"), ("--lengths", "16,1000000")):
        r = batching("profile", "-c", TABULAR, option, value, "--out", "p.json", cwd=tmp_path)
        assert r.rc == 2
        assert f"{option} must be at most 65536, got {value.split(',')[1]}" in one_error_line(r)
    r = batching("profile", "-c", TABULAR, "--batch-sizes", "1,1", "--out", "p.json", cwd=tmp_path)
    assert r.rc == 2
    assert "--batch-sizes lists 1 twice; give each value once" in one_error_line(r)
    assert not (tmp_path / "p.json").exists()


@pytest.mark.parametrize(
    ("body", "message"),
    [
        (
            "raise RuntimeError('no weights')",
            "model factory 'mymod:boom' failed: RuntimeError: no weights",
        ),
        # the user's code as well: exit 2, as when it raises (it exited 1)
        ("return None", "model factory 'mymod:boom' returned NoneType, expected a torch.nn.Module"),
    ],
)
def test_a_failing_model_factory_is_one_line(tmp_path: Path, body: str, message: str) -> None:
    from safetensors.torch import save_file

    (tmp_path / "mymod.py").write_text(f"def boom():\n    {body}\n")
    save_file({}, tmp_path / "empty.safetensors")
    sha = hashlib.sha256((tmp_path / "empty.safetensors").read_bytes()).hexdigest()
    model = {"name": "mymod:boom", "version": "v1", "checkpoint": "empty.safetensors"}
    config = write_config(tmp_path, model=model | {"sha256": sha, "device": "cpu"})
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    r = batching("profile", "-c", str(config), "--out", "p.json", cwd=tmp_path,
                 env={"PYTHONPATH": path})  # fmt: skip
    assert r.rc == 2, r.err
    assert message in one_error_line(r)


def test_check_refuses_a_listed_version_whose_factory_cannot_be_imported(tmp_path: Path) -> None:
    """A factory that cannot be built on the meta device is left to the scorer's load; one
    that cannot even be imported passed ``check`` and ``rollout start`` too, and every item
    routed to it went dead at the first score."""
    from safetensors.torch import save_file

    save_file({}, tmp_path / "empty.safetensors")
    sha = hashlib.sha256((tmp_path / "empty.safetensors").read_bytes()).hexdigest()
    nope = {"name": "mypkg.models:nope", "version": "v2", "checkpoint": "empty.safetensors"}
    config = write_config(tmp_path, model_versions=[nope | {"sha256": sha}])
    r = batching("check", "-c", str(config), cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "model_versions 'v2': model factory 'mypkg.models:nope' cannot be imported" in line
    assert "check the name and that its package is installed" in line


def test_check_refuses_a_pinned_checkpoint_that_cannot_load(tmp_path: Path) -> None:
    """The sha256 pins the bytes, not that they load: a file of garbage, pinned by its own
    digest, and W1's checkpoint named as W2's model both passed ``check`` and failed at the
    first ``score``, though check is the step that runs before merge."""
    from batching.model import zoo

    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"garbage\n")
    sha = hashlib.sha256(garbage.read_bytes()).hexdigest()
    model = {"checkpoint": "garbage.safetensors", "sha256": sha}
    r = batching("check", "-c", str(write_config(tmp_path, model=model)), cwd=tmp_path)
    assert r.rc == 2
    assert "garbage.safetensors is not valid safetensors" in one_error_line(r)

    w1 = zoo.BUILTINS["w1-mlp"].checkpoint_path
    wrong = {"name": "w2-text", "checkpoint": str(w1)}
    wrong["sha256"] = hashlib.sha256(w1.read_bytes()).hexdigest()
    r = batching("check", "-c", str(write_config(tmp_path, model=wrong)), cwd=tmp_path)
    assert r.rc == 2
    assert "does not fit the model" in one_error_line(r)
    assert batching("check", "-c", str(write_config(tmp_path)), cwd=tmp_path).rc == 0


# ----------------------------------------------------------------------------- demo


def test_demo_refuses_a_dir_that_is_a_file_or_cannot_be_made(tmp_path: Path) -> None:
    (tmp_path / "afile").write_text("x")
    r = batching("demo", "--dir", "afile", cwd=tmp_path)
    assert r.rc == 2
    assert one_error_line(r) == "error: afile: not a folder; pass --dir a new or existing folder"
    r = batching("demo", "--dir", "afile/demo", cwd=tmp_path)
    assert r.rc == 2
    assert one_error_line(r).startswith("error: afile/demo: cannot write the demo files there")


def test_demo_refuses_a_folder_whose_demo_db_is_not_a_database_before_writing(
    tmp_path: Path,
) -> None:
    folder = tmp_path / "u"
    folder.mkdir()
    (folder / "demo.db").write_text("precious")
    (folder / "text-requests.jsonl").write_text("mine")
    r = batching("demo", "--dir", "u", cwd=tmp_path)
    assert r.rc == 2
    assert "file is not a database" in one_error_line(r)
    assert (folder / "text-requests.jsonl").read_text() == "mine"  # nothing overwritten
    assert sorted(p.name for p in folder.iterdir()) == ["demo.db", "text-requests.jsonl"]


# ----------------------------------------------------------------------------- damaged file


def test_a_damaged_sqlite_file_is_named_with_what_to_do_by_every_command(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    (tmp_path / "r.jsonl").write_text(
        "".join(
            json.dumps({"item_key": f"k{i}", "payload": {"x": [i]}}) + "\n" for i in range(3000)
        )
    )
    assert batching("enqueue", "r.jsonl", "-q", "q", "--db", DB, cwd=tmp_path).rc == 0
    with (tmp_path / "queue.db").open("r+b") as f:  # pages past the schema's
        f.seek(8192)
        f.write(b"\xde\xad" * 3000)
    for args in (
        ("enqueue", "r.jsonl", "-q", "other", "--db", DB),
        ("status", "--db", DB),
        ("init", "--db", DB),  # not "nothing to do"
    ):
        r = batching(*args, cwd=tmp_path)
        assert r.rc == 1, (args, r.out, r.err)
        line = one_error_line(r)
        assert "database disk image is malformed; the SQLite file is damaged" in line, line
        assert "unexpected" not in line


# ----------------------------------------------------------------------------- check


def test_an_error_prints_brackets_in_names_as_they_are(tmp_path: Path) -> None:
    # Rich reads `[prod]` as a style tag and drops it unless the message is escaped.
    r = batching("check", "-c", "conf[prod].yaml", cwd=tmp_path)
    assert r.rc == 2
    assert one_error_line(r).startswith("error: conf[prod].yaml: cannot read config")


def test_check_recommends_an_option_that_exists(tmp_path: Path) -> None:
    r = batching("check", "-c", str(DEPLOYMENTS / "online.yaml"), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert "--max-length" not in r.err
    assert "re-run `batching profile --lengths`" in r.err


def test_check_names_a_missing_service_profile(tmp_path: Path) -> None:
    (tmp_path / "folder").mkdir()
    for name in ("missing.json", "folder"):
        config = write_config(tmp_path, service_profile=name)
        r = batching("check", "-c", str(config), cwd=tmp_path)
        assert r.rc == 2
        line = one_error_line(r)
        assert f"{tmp_path / name}: service profile not found" in line
        assert f"run `batching profile -c {config}` to create it" in line


def test_check_names_an_unknown_model_not_the_service_profile(tmp_path: Path) -> None:
    """Before: it blamed the profile and advised `batching profile`, which failed too."""
    r = batching("check", "-c", str(write_config(tmp_path, model={"name": "nosuch"})), cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "model 'nosuch' is not built in" in line
    assert "package.module:function" in line


# ----------------------------------------------------------------------------- reconcile


def test_reconcile_refuses_a_run_not_in_the_ledger(tmp_path: Path) -> None:
    config = write_config(tmp_path)
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    r = batching("reconcile", "-c", str(config), "--run", "nosuch", cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "no run nosuch of queue 'tabular' in the run ledger of sqlite:///queue.db" in line
    assert "omit --run" in line


# ----------------------------------------------------------------------------- whatever else


EVENT = (
    '{"run": {"runId": "r1"}, "eventType": "START", "job": {"namespace": "n", "name": "j"},'
    ' "eventTime": "2026-12-01T00:00:00+00:00"}\n'
)


def test_binary_or_incomplete_event_lines_are_skipped_not_a_traceback(tmp_path: Path) -> None:
    events = tmp_path / "events.jsonl"
    events.write_bytes(b'\x89PNG\x00\xff\xfe\n{"run": {"runId": "r"}}\n' + EVENT.encode())
    r = batching("lineage", "--events", str(events), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert f"{events}:1: lineage event skipped (not a JSON object)" in r.err
    assert f"{events}:2: lineage event skipped (no eventType or job)" in r.err
    assert "r1" in r.out


def test_a_file_that_is_no_event_log_gets_one_line_not_a_wall(tmp_path: Path) -> None:
    """Before, `--events README.md` printed ~560 warnings before its one-line error, then
    five warnings and a count: a file with no event at all is not an events file."""
    text = tmp_path / "notes.md"
    text.write_text("".join(f"line {i}\n" for i in range(100)))
    r = batching("lineage", "--events", str(text), cwd=tmp_path)
    assert r.rc == 2
    assert "no line of it is a lineage event; give the events file a run wrote" in (
        one_error_line(r)
    )
    # Among real events, the first five bad lines are named, then a count.
    mixed = tmp_path / "events.jsonl"
    mixed.write_text(EVENT + text.read_text())
    r = batching("lineage", "--events", str(mixed), cwd=tmp_path)
    assert r.rc == 0, r.err
    assert len(r.err.strip().splitlines()) == 6, r.err  # five named lines, the count
    assert f"{mixed}: 95 more lines skipped (not lineage events)" in r.err
    missing = batching("lineage", "--events", str(tmp_path / "nope.jsonl"), cwd=tmp_path)
    assert missing.rc == 2
    assert "no lineage event log; check the path" in missing.err  # not "pass --events"
    folder = batching("lineage", "--events", str(tmp_path), cwd=tmp_path)
    assert folder.rc == 2
    assert "a folder, not a lineage event log; give its JSONL file" in one_error_line(folder)


def test_an_async_database_driver_is_refused_naming_the_one_to_use(tmp_path: Path) -> None:
    r = batching("status", "--db", "postgresql+asyncpg://u:sekret@127.0.0.1:9/x", cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "database driver 'asyncpg'" in line
    assert "write the URL as postgresql://" in line
    assert "sekret" not in line


def test_an_unexpected_error_is_one_line_without_credentials(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A bug still ends in one line (the traceback only with BATCHING_DEBUG=1)."""
    from typer.testing import CliRunner

    from batching.cli import common as cli
    from batching.cli import evidence  # noqa: F401  (the lineage command)
    from batching.evidence import lineage_log

    def boom(_path: object) -> list[dict[str, object]]:
        raise RuntimeError("boom at postgresql://u:sekret@h/db")

    monkeypatch.setattr(lineage_log, "read_events", boom)
    events = tmp_path / "events.jsonl"
    events.write_text("{}\n")
    monkeypatch.delenv("BATCHING_DEBUG", raising=False)
    result = CliRunner().invoke(cli.app, ["lineage", "--events", str(events)])
    assert result.exit_code == 1
    (line,) = result.output.strip().splitlines()
    assert line.startswith("error: unexpected RuntimeError: boom at postgresql://u:***@h/db")
    assert "BATCHING_DEBUG=1" in line
    monkeypatch.setenv("BATCHING_DEBUG", "1")
    debug = CliRunner().invoke(cli.app, ["lineage", "--events", str(events)])
    assert isinstance(debug.exception, RuntimeError)


def test_rollout_status_bounds_its_history_by_its_own_name(tmp_path: Path) -> None:
    """``--history 100001`` said "the audit limit must be 1 to 1,000,000, got 1000010": an
    internal name and ten times the number given (a sweep)."""
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    r = batching("rollout", "status", "-c", str(config), "--history", "100001", cwd=tmp_path)
    assert r.rc == 2
    line = one_error_line(r)
    assert "'--history'" in line
    assert "less than or equal to 10000" in line
    ok = batching("rollout", "status", "-c", str(config), "--history", "10000", cwd=tmp_path)
    assert ok.rc == 0, ok.err


@pytest.mark.parametrize("name", ["t" * 201, "a\x01b"])
def test_rollout_start_refuses_a_tenant_no_item_can_carry(tmp_path: Path, name: str) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    args = ["rollout", "start", "-c", str(config), "--candidate", "x", "--reason", "r"]
    r = batching(*args, "--tenants", f"acme,{name}", cwd=tmp_path)
    assert r.rc == 2
    assert "is not a tenant name (at most 200 printable characters)" in one_error_line(r)
