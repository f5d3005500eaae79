"""``batching reconcile --full`` as a user runs it, on the scored W1 workspace of test_cli."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_cli import batching, committed_files, one_error_line, scored, ws

__all__ = ["scored", "ws"]  # fixtures, shared with test_cli


def test_full_sweep_finds_a_deleted_file_like_reconcile_and_resumes(ws: Path) -> None:
    config = str(ws / "pipeline.yaml")
    clean = batching("reconcile", "-c", config, "--full", cwd=ws)
    assert clean.rc == 0, clean.out + clean.err
    assert "full sweep finished" in clean.out
    assert "clean: every done item" in clean.out

    committed_files(ws)[0].unlink()
    whole = batching("reconcile", "-c", config, "--json", cwd=ws).json()
    swept = batching("reconcile", "-c", config, "--full", "--json", cwd=ws)
    assert swept.rc == 1
    report = swept.json()
    assert report["counts"] == whole["counts"]
    assert report["sweep"]["finished"] is True
    assert report["sweep"]["batches"] > 0
    assert {f["class"] for f in report["findings"]} == {"missing_file", "dead"}


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (["--full", "--since", "1h"], "--full sweeps everything; it takes no --since"),
        (["--full", "--run", "r1"], "--full sweeps everything; it takes no --run"),
        (["--restart"], "--restart is an option of a sweep: add --full"),
        (["--max-time", "1m"], "--max-time is an option of a sweep: add --full"),
        (["--full", "--max-time", "soon"], "--max-time"),
    ],
)
def test_full_with_options_of_a_window_is_refused(ws: Path, extra: list[str], says: str) -> None:
    r = batching("reconcile", "-c", str(ws / "pipeline.yaml"), *extra, cwd=ws)
    assert r.rc == 2
    assert says in one_error_line(r)
