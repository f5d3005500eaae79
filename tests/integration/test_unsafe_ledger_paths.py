"""A ledger row whose ``path`` leads out of the dataset root is never acted on.

Before: a row naming ``../../x.parquet`` or an absolute path made start-up recovery move a
staging file outside the dataset root, and ``reconcile --repair`` stopped with "unexpected
ValueError ... a bug" setting aside a file outside the root. Real SQLite / PostgreSQL and real
Parquet files; the rows are forged as a damaged or hostile database would hold them.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from batching import config as cfg
from batching.compose import build
from batching.evidence import reconcile as rc
from batching.evidence.reconcile import Kind, Severity
from batching.ingress import queue as q
from batching.outputs import parquet, parquet_layout
from batching.store import schema
from batching.testing import FakeClock
from tests.conftest import KeptRecords
from tests.integration.conftest import BATCHING
from tests.integration.test_pipeline import write_config
from tests.integration.test_reconcile import commit, commit_dying_at
from tests.integration.test_sinks import claim, scored


def forge(queue: q.SqlQueue, batch_id: str, **values: Any) -> None:
    with queue.begin() as conn:
        conn.execute(
            schema.batches.update().where(schema.batches.c.batch_id == batch_id).values(**values)
        )


def staged_files(root: Path) -> list[str]:
    return sorted(p.name for p in root.with_name(root.name + ".staging").iterdir())


def make_unsafe_rows(
    queue: q.SqlQueue, root: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> dict[str, Any]:
    """Two batches committed but not published (their files in staging), their rows naming
    ``../../x.parquet`` and an absolute path; one published batch whose row names an existing
    file outside the root (``victim``)."""
    sink = parquet.ParquetSink(queue, root)
    out = root.parents[1]  # root is <tmp>/data/outputs: ../../x.parquet is <tmp>/x.parquet
    dotdot = scored(claim(queue, ["a"]), clock)
    commit_dying_at(sink, "_publish", dotdot, monkeypatch)
    absolute = scored(claim(queue, ["b"]), clock)
    commit_dying_at(sink, "_publish", absolute, monkeypatch)
    published = commit(queue, sink, ["c"], clock)
    victim = out / "victim.parquet"
    victim.write_bytes(b"not yours")
    forge(queue, dotdot.batch_id, path="../../x.parquet")
    forge(queue, absolute.batch_id, path=str(out / "abs" / "x.parquet"))
    forge(queue, published.batch_id, path="../../victim.parquet")
    ids = {"dotdot": dotdot.batch_id, "absolute": absolute.batch_id}
    return ids | {"published": published.batch_id, "out": out, "victim": victim}


def nothing_moved_out(made: dict[str, Any]) -> None:
    out = made["out"]
    assert not (out / "x.parquet").exists()
    assert not (out / "abs").exists()
    assert made["victim"].read_bytes() == b"not yours"


def test_start_up_recovery_skips_rows_naming_paths_outside_the_root(
    queue: q.SqlQueue, tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data" / "outputs"
    made = make_unsafe_rows(queue, root, clock, monkeypatch)
    staged = staged_files(root)
    assert len(staged) == 2
    kept = KeptRecords()
    logging.getLogger("batching.outputs.parquet").addHandler(kept)
    try:
        result = parquet.ParquetSink(queue, root).recover()
    finally:
        logging.getLogger("batching.outputs.parquet").removeHandler(kept)
    assert result.rolled_forward == ()
    assert staged_files(root) == staged  # nothing moved, nothing deleted
    nothing_moved_out(made)
    skipped = {
        getattr(r, "batch_id", None)
        for r in kept.records
        if getattr(r, "action", "") == "unsafe_path"
    }
    assert skipped == {made["dotdot"], made["absolute"]}
    assert all(
        r.levelno == logging.ERROR for r in kept.records if getattr(r, "batch_id", None) in skipped
    )


def test_reconcile_reports_them_critical_and_repair_leaves_them(
    queue: q.SqlQueue, tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    root = tmp_path / "data" / "outputs"
    made = make_unsafe_rows(queue, root, clock, monkeypatch)
    sink = parquet.ParquetSink(queue, root, create=False)
    report = rc.reconcile(queue, sink, now=clock(), repair=True, dataset_lost=True)
    unsafe = report.by_kind(Kind.UNSAFE_PATH)
    assert {f.batch_ids[0] for f in unsafe} == {
        made["dotdot"],
        made["absolute"],
        made["published"],
    }
    assert all(f.severity is Severity.CRITICAL for f in unsafe)
    by_batch = {f.batch_ids[0]: f.message for f in unsafe}
    assert "outside the dataset root" in by_batch[made["dotdot"]]
    assert "'../../x.parquet'" in by_batch[made["dotdot"]]
    assert not report.by_kind(Kind.LOST_WRITE)  # its items are the unsafe row's, said once
    assert not report.ok
    nothing_moved_out(made)
    again = rc.reconcile(queue, sink, now=clock(), dataset_lost=True)
    assert {f.kind for f in again.findings if f.severity is Severity.CRITICAL} == {Kind.UNSAFE_PATH}


def test_reconcile_repair_on_the_command_line_exits_1_without_a_traceback(
    sqlite_url: str, tmp_path: Path, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = write_config("tabular.yaml", tmp_path)
    queue = build.open_queue(cfg.load_config(path), sqlite_url, create=True)
    root = tmp_path / "data" / "outputs"
    try:
        made = make_unsafe_rows(queue, root, clock, monkeypatch)
    finally:
        queue.engine.dispose()
    args = [BATCHING, "reconcile", "-c", str(path), "--db", sqlite_url, "--output", str(root)]
    env = os.environ | {"COLUMNS": "200"}
    done = subprocess.run(
        [*args, "--repair"], capture_output=True, text=True, timeout=300, check=False, env=env
    )
    said = done.stdout + done.stderr
    assert done.returncode == 1, said
    assert "Traceback" not in said, said
    assert "a bug" not in said, said
    assert "unsafe_path" in said, said
    nothing_moved_out(made)


@pytest.mark.parametrize(
    ("path", "staging_path"),
    [
        ("../x.parquet", None),
        ("/etc/x.parquet", None),
        ("date=x/../../x.parquet", None),
        ("date=x\\..\\..\\x.parquet", None),
        ("date=x/p\x00.parquet", None),
        ("", None),
        (None, None),
        ("link/x.parquet", None),  # a symlink in the root leading out
        ("date=x/part-1.parquet", "/s/.."),
        ("date=x/part-1.parquet", "/s/a\\b.parquet.tmp"),
        ("date=x/part-1.parquet", "/s/out.parquet.tmp"),  # a symlink in staging leading out
    ],
)
def test_every_escaping_path_is_unsafe(tmp_path: Path, path: Any, staging_path: Any) -> None:
    layout = parquet_layout.ParquetLayout.for_root(tmp_path / "outputs")
    layout.root.mkdir()
    layout.staging.mkdir()
    (layout.root / "link").symlink_to(tmp_path)
    (layout.staging / "out.parquet.tmp").symlink_to(tmp_path / "elsewhere")
    row = SimpleNamespace(batch_id="b1", path=path, staging_path=staging_path)
    assert parquet_layout.unsafe_row(layout, row) is not None
    fine = SimpleNamespace(
        batch_id="b1", path="date=x/part-1.parquet", staging_path="/s/b1.l1.parquet.tmp"
    )
    assert parquet_layout.unsafe_row(layout, fine) is None
    shutil.rmtree(layout.root)
