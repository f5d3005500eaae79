"""The scale-out tools run as shipped: the GPU check on the runner and batcher alone (its CPU
smoke, with the modules a bare GPU machine lacks made unimportable), and the simulated
accelerator scale-out bench on a few thousand items."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import PG_ADMIN_URL

REPO = Path(__file__).resolve().parents[2]

# Run gpu_check.py with prefect, sqlalchemy, pyarrow, pydantic, yaml and openlineage refused at
# import: the device machine has torch, numpy, safetensors (and a carried orjson) only.
_BARE = """
import runpy, sys
BLOCKED = {"prefect", "sqlalchemy", "pyarrow", "pydantic", "yaml", "openlineage", "psycopg"}
class Refuse:
    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in BLOCKED:
            raise ImportError(f"{name} is not on the GPU machine")
        return None
sys.meta_path.insert(0, Refuse())
sys.argv = ["gpu_check.py", *sys.argv[1:]]
runpy.run_path(%r, run_name="__main__")
"""


def test_the_gpu_check_runs_without_the_services_and_writes_every_check(tmp_path: Path) -> None:
    out = tmp_path / "gpu_check.json"
    script = _BARE % str(REPO / "bench" / "gpu_check.py")
    done = subprocess.run(
        [sys.executable, "-c", script, "--smoke", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=tmp_path,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    report = json.loads(out.read_text())
    for check in ("autocast_bf16", "pinned_copy", "oom_split", "w2_dynamic", "gpu_busy"):
        assert "error" not in report[check], (check, report[check])
    dynamic = report["w2_dynamic"]
    assert dynamic["items"] == 96
    assert dynamic["batches"] >= 96 / 32  # the bulk policy's caps: batches of at most 32
    assert report["autocast_bf16"]["min_cosine"] > 0.999  # on a CPU, the same float32 model
    if report["device"] == "cpu":
        assert report["oom_split"]["skipped"] == "no CUDA device"


@pytest.mark.slow
@pytest.mark.postgres
def test_the_scale_bench_drains_every_item_at_each_process_count(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    done = subprocess.run(
        [
            sys.executable,
            str(REPO / "bench" / "scale_bench.py"),
            "--items",
            "3000",
            "--scorers",
            "1",
            "2",
            "--pg",
            PG_ADMIN_URL,
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    results = json.loads(out.read_text())["results"]
    for db in ("sqlite", "postgresql"):
        assert [r["scorers"] for r in results[db]] == [1, 2]
        for row in results[db]:
            assert row["rows_s"] > 0
            assert 0 < row["vs_ideal"] <= 1.05, row  # the simulated forward bounds every run
