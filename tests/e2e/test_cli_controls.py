"""``batching queue pause | resume | cancel | cap | audit`` as an operator runs them: real
processes on a real SQLite file, plain and ``--json``; ``status`` shows a pause and a cap; an
enqueue past the cap exits 2 with one line (``--json``: a QueueFull error document)."""

from __future__ import annotations

import getpass
import sqlite3
from pathlib import Path

from batching.model import workloads
from tests.e2e.test_cli import DB, batching, write_config
from tests.e2e.test_cli_json import assert_error_doc, document


def queue(*args: str, cwd: Path) -> dict[str, object]:
    """``batching queue ARGS --db DB --json``, which must succeed: its document."""
    r = batching("queue", *args, "--db", DB, "--json", cwd=cwd)
    assert r.rc == 0, (r.out, r.err)
    doc = document(r)
    assert doc["ok"] is True
    return dict(doc)


def test_pause_cap_cancel_resume_and_their_audit(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(6))
    first = batching("enqueue", str(jsonl), "--db", DB, "-q", "tab", "--json", cwd=tmp_path)
    assert first.rc == 0, first.err
    enqueued = document(first)
    assert (enqueued["ok"], enqueued["inserted"], enqueued["duplicates"]) == (True, 6, [])
    run = str(enqueued["enqueue_run"])
    assert run.startswith("enq-")

    paused = queue("pause", "tab", "--reason", "bad model", "--actor", "alice", cwd=tmp_path)
    assert (paused["action"], paused["changed"]) == ("pause", True)
    assert paused["control"] == {
        "queue": "tab",
        "paused": True,
        "paused_at": paused["control"]["paused_at"],  # type: ignore[index]
        "paused_by": "alice",
        "reason": "bad model",
        "max_depth": None,
        "ledger_horizon": None,
    }

    config = write_config(tmp_path, queue={"name": "tab"})
    idle = batching("score", "-c", str(config), "--json", cwd=tmp_path)  # until empty: ends
    assert idle.rc == 0, idle.err
    assert document(idle)["summary"]["items_committed"] == 0
    assert "note: queue 'tab' is paused (by alice: bad model)" in idle.err
    assert "this run ends once its batches are done" in idle.err  # not "waiting"
    assert "waiting for `batching queue resume`" not in idle.err

    capped = queue("cap", "tab", "--max-depth", "6", "--reason", "backlog", cwd=tmp_path)
    assert (capped["depth"], capped["control"]["max_depth"]) == (6, 6)  # type: ignore[index]
    shown = batching("status", "--db", DB, "-q", "tab", cwd=tmp_path)
    assert "queue 'tab' PAUSED by alice since " in shown.out
    assert ": bad model (`batching queue resume tab`)" in shown.out
    assert "queue 'tab' depth cap 6 items ready or leased (now 6)" in shown.out

    more = workloads.write_lines(tmp_path / "more.jsonl", workloads.w1_json_lines(8))
    refused = batching("enqueue", str(more), "--db", DB, "-q", "tab", "--json", cwd=tmp_path)
    message = assert_error_doc(refused, "QueueFull", 2)  # stderr: the same one line
    assert "queue 'tab' is at its depth cap (6 items ready or leased" in message
    assert "nothing was enqueued" in message
    assert "`batching queue cap tab --max-depth N`" in message

    keys = tmp_path / "keys.txt"
    keys.write_text("w1-0\n\nw1-1\n")
    by_key = queue("cancel", "tab", "--keys-file", str(keys), "--reason", "dup", cwd=tmp_path)
    assert (by_key["cancelled"], by_key["in_flight"]) == (2, 0)
    by_run = queue("cancel", "tab", "--enqueue-run", run, "--reason", "bad file", cwd=tmp_path)
    assert by_run["cancelled"] == 4
    assert set(by_run) == {"ok", "action", "queue", "cancelled", "in_flight"}

    resumed = queue("resume", "tab", "--actor", "bob", cwd=tmp_path)
    assert (resumed["changed"], resumed["control"]["paused"]) == (True, False)  # type: ignore[index]
    state = document(batching("status", "--db", DB, "-q", "tab", "--json", cwd=tmp_path))
    assert (state["by_state"]["cancelled"], state["by_state"]["ready"]) == (6, 0)
    assert state["controls"]["tab"]["paused"] is False
    assert state["controls"]["tab"]["max_depth"] == 6

    rows = queue("audit", "tab", cwd=tmp_path)["rows"]
    assert [(r["action"], r["actor"], r["reason"]) for r in rows] == [  # type: ignore[attr-defined]
        ("pause", "alice", "bad model"),
        ("cap", getpass.getuser(), "backlog"),  # the OS user, without --actor
        ("cancel", getpass.getuser(), "dup"),
        ("cancel", getpass.getuser(), "bad file"),
        ("resume", "bob", None),
    ]
    assert queue("pause", "side", "--reason", "drill", "--new", cwd=tmp_path)["changed"] is True
    every = queue("audit", cwd=tmp_path)["rows"]
    assert isinstance(every, list)
    assert isinstance(rows, list)
    assert len(every) == len(rows) + 1  # every queue's
    by_config = queue("audit", "-c", str(config), cwd=tmp_path)["rows"]  # its queue's alone
    assert by_config == rows  # once every queue's: -c names the queue, as for every control


def test_a_pause_or_cap_of_a_queue_with_no_items_and_no_control_is_refused_as_a_typo(
    tmp_path: Path,
) -> None:
    """A review: `queue pause tabb` warned and paused a queue nobody uses (its alert then
    fired for it) while the real queue, in an incident, went on unpaused; exit 0."""
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(2))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tab", cwd=tmp_path).rc == 0
    # A cancel of the typo first (a warning, exit 0) leaves no audit row that would make it
    # a known queue, and an audit row alone would not: the pause below is still refused.
    cancel = ("cancel", "tba", "--key", "k1", "--reason", "oops", "--db", DB)
    assert batching("queue", *cancel, cwd=tmp_path).rc == 0
    assert queue("audit", "tba", cwd=tmp_path)["rows"] == []
    with sqlite3.connect(tmp_path / "queue.db") as db:  # as an older release's cancel left it
        db.execute(
            "INSERT INTO batching_queue_audit (queue, action, actor, at, reason, detail) "
            "VALUES ('tba', 'cancel', 'bob', 1.0, 'oops', '{}')"
        )
    for args in (("pause", "tba", "--reason", "incident"), ("cap", "atb", "--max-depth", "5")):
        r = batching("queue", *args, "--db", DB, cwd=tmp_path)
        assert r.rc == 2, r.err
        assert f"error: queue '{args[1]}' has no items and no control yet" in r.err
        assert "queues in this database: tab" in r.err
        assert "(a typo?); nothing changed" in r.err
        assert "add --new" in r.err
        rows = queue("audit", args[1], cwd=tmp_path)["rows"]
        assert isinstance(rows, list)
        assert [r["action"] for r in rows] in ([], ["cancel"]), rows  # nothing changed
        new = batching("queue", *args, "--new", "--db", DB, cwd=tmp_path)
        assert (new.rc, new.err) == (0, "")
    r = batching("queue", "pause", "tab", "--reason", "incident", "--db", DB, cwd=tmp_path)
    assert (r.rc, r.err) == (0, "")
    resumed = batching("queue", "resume", "tbb", "--db", DB, cwd=tmp_path)  # resume: a warning
    assert resumed.rc == 0
    assert "warning: queue 'tbb' has no items and no control yet" in resumed.err


def test_a_tenant_filter_that_matches_no_tenant_warns_of_a_typo(tmp_path: Path) -> None:
    """A review: `queue cancel --tenant evli` (and `redrive --tenant`) said 0 item(s), exit
    0, and nothing hinted at the typo."""
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    jsonl = workloads.write_lines(tmp_path / "w1.jsonl", workloads.w1_json_lines(2))
    assert batching("enqueue", str(jsonl), "--db", DB, "-q", "tab", cwd=tmp_path).rc == 0
    cancel = ("queue", "cancel", "tab", "--reason", "flood", "--db", DB)
    r = batching(*cancel, "--tenant", "evli", cwd=tmp_path)
    assert r.rc == 0, r.err
    tenant = "default"  # the W1 lines' tenant
    assert r.err.strip() == (
        "warning: queue 'tab' has no ready or leased item of tenant 'evli'; tenants that "
        f"have: {tenant} (a typo?)"
    )
    redrive = ("redrive", "--db", DB, "-q", "tab", "--only", "cancelled", "--reason", "undo")
    assert (
        "tenants that have: none (a typo?)"
        in batching(*redrive, "--tenant", "evli", cwd=tmp_path).err
    )
    assert batching(*cancel, "--tenant", tenant, cwd=tmp_path).err == ""  # it matched
    again = batching(*redrive, "--tenant", tenant, cwd=tmp_path)
    assert (again.rc, again.err) == (0, "")


def test_one_cancel_is_taken_back_by_its_filter_and_redrive_and_purge_are_audited(
    tmp_path: Path,
) -> None:
    """`redrive --only cancelled` took back every cancel the queue held, and neither redrive
    nor purge was in the audit."""
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    runs = []
    for name in ("a", "b"):
        lines = workloads.w1_json_lines(3, prefix=f"{name}-")
        jsonl = workloads.write_lines(tmp_path / f"{name}.jsonl", lines)
        r = batching("enqueue", str(jsonl), "--db", DB, "-q", "tab", "--json", cwd=tmp_path)
        runs.append(str(document(r)["enqueue_run"]))
    for run in runs:
        queue("cancel", "tab", "--enqueue-run", run, "--reason", "flood", cwd=tmp_path)
    args = ("redrive", "--db", DB, "-q", "tab", "--only", "cancelled")
    r = batching(
        *args, "--enqueue-run", runs[1], "--actor", "carol", "--reason", "oops", cwd=tmp_path
    )
    assert (r.rc, r.out.strip()) == (0, "redrove 3 item(s) in queue 'tab' back to ready")
    state = document(batching("status", "--db", DB, "-q", "tab", "--json", cwd=tmp_path))
    assert (state["by_state"]["cancelled"], state["by_state"]["ready"]) == (3, 3)
    r = batching(
        "purge", "--db", DB, "-q", "tab", "--older-than", "0s", "--reason", "tidy", cwd=tmp_path
    )
    assert r.rc == 0, r.err
    rows = queue("audit", "tab", cwd=tmp_path)["rows"]
    tail = [(r["action"], r["actor"], r["reason"], r["detail"]) for r in rows][-2:]  # type: ignore[attr-defined]
    assert tail[0][:3] == ("redrive", "carol", "oops")
    assert tail[0][3]["redriven"] == 3
    assert tail[0][3]["enqueue_run"] == runs[1]
    assert tail[1][:3] == ("purge", getpass.getuser(), "tidy")
    assert tail[1][3]["purged"] == 3
