"""Several Prefect workers on one process work pool, scoring one PostgreSQL queue (slow, ~1 min).

A real ``prefect server start``, a process work pool, a deployment of the score flow made by
``prefect deploy`` from a ``prefect.yaml`` (as a user writes one), and two ``prefect worker
start --pool ... --limit 1`` processes: four flow runs of the deployment, at most one per
worker at a time, each scoring up to 1,000 of the queue's 3,000 W1 items. Every item ends
``done`` exactly once and is in the Parquet output exactly once; both workers ran flow runs,
and two of them scored at the same time.
"""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import sqlalchemy as sa
import torch
import yaml

from batching.compose import build
from batching.config import load_config
from batching.ingress import ingest
from batching.model import workloads, zoo
from batching.store import schema
from tests.conftest import REPO
from tests.e2e.prefect_stack import Stack

pytestmark = [pytest.mark.slow, pytest.mark.postgres]

N_ITEMS = 3000
PER_RUN = 1000
RUNS = 4
WORKERS = 2


W1 = zoo.BUILTINS["w1-mlp"]
# W1 whose forward pass takes 50 ms: a run of 1,000 items in batches of 5 scores for ~10 s,
# so runs on two workers overlap however their processes' starts fall.
SLOW_W1 = {
    "name": f"{__name__}:slow_w1",
    "version": "w1-slow",
    "checkpoint": str(W1.checkpoint_path),
    "sha256": W1.sha256,
    "device": "cpu",
}


class SlowW1(zoo.TabularMLP):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        time.sleep(0.05)
        return super().forward(x)


def slow_w1() -> SlowW1:
    return SlowW1()


def test_two_workers_on_a_pool_score_one_postgres_queue_exactly_once(
    stack: Stack, tmp_path: Path, pg_url: str
) -> None:
    cfg = load_config(
        REPO / "deployments" / "tabular.yaml", {"model": SLOW_W1, "service_profile": None}
    )
    queue = build.open_queue(cfg, pg_url, create=True)
    try:
        file = workloads.write_w1_parquet(tmp_path / "w1.parquet", N_ITEMS)
        queue.enqueue(ingest.read_records(file))
    finally:
        queue.engine.dispose()
    out = tmp_path / "outputs"
    profile = _slow_profile(tmp_path / "slow-w1.json")
    prefect_file = tmp_path / "prefect.yaml"
    prefect_file.write_text(
        yaml.safe_dump(
            {
                "name": "pool-test",
                "deployments": [
                    {
                        "name": "score-pg",
                        "entrypoint": "flows/score.py:score",
                        "parameters": {
                            "config": "deployments/tabular.yaml",
                            "db_url": pg_url,
                            "output": str(out),
                            "max_items": PER_RUN,
                            "overrides": {
                                "lineage": {"path": str(tmp_path / "events.jsonl")},
                                "model": SLOW_W1,
                                "service_profile": str(profile),
                                "batching": {"max_batch_size": 5, "claim_size": 50},
                            },
                        },
                        "work_pool": {"name": "pool", "work_queue_name": "default"},
                    }
                ],
            }
        )
    )
    stack.post("/work_pools/", {"name": "pool", "type": "process"})
    deploy = stack.start(
        "-m", "prefect", "--no-prompt", "deploy", "--all", "--prefect-file", str(prefect_file),
        name="deploy",
    )  # fmt: skip
    assert deploy.wait(120) == 0, (tmp_path / "deploy.log").read_text()
    deployment = stack.deployments()["score-pg"]

    env = stack.env() | {
        "PREFECT_WORKER_QUERY_SECONDS": "1",
        "PREFECT_WORKER_PREFETCH_SECONDS": "0",
    }
    for i in range(WORKERS):
        stack.start(
            "-m", "prefect", "worker", "start", "--pool", "pool", "--limit", "1",
            "--name", f"worker-{i}",
            name=f"worker-{i}", env=env,
        )  # fmt: skip
    # The last run scores with two scorer processes: spawned from a flow run that Prefect
    # loaded from flows/score.py, they inherit flows/ first on sys.path, where a module named
    # like the standard library's (flows/secrets.py, once) broke pydantic's import in every
    # child (found by a review; the in-process flow tests could not see it).
    runs = [
        stack.post(
            f"/deployments/{deployment['id']}/create_flow_run",
            {"parameters": {"workers": 2}} if n == RUNS - 1 else {},
        )["id"]
        for n in range(RUNS)
    ]
    for run_id in runs:
        state = stack.finished(run_id, timeout_s=300)["state"]
        assert state["type"] == "COMPLETED", (state["message"], _logs(tmp_path))

    # Every item done once in the queue, and once in the output.
    queue = build.open_queue(cfg, pg_url)
    try:
        assert {k: v for k, v in queue.stats().by_state.items() if v} == {"done": N_ITEMS}
        with queue.read() as conn:
            windows = conn.execute(
                sa.select(
                    schema.runs.c.run_id, schema.runs.c.started_at, schema.runs.c.finished_at
                ).where(schema.runs.c.parent_run_id.is_(None))
            ).all()
    finally:
        queue.engine.dispose()
    keys = pq.read_table(out)["item_key"].to_pylist()
    assert len(keys) == N_ITEMS
    assert len(set(keys)) == N_ITEMS

    # Both workers ran flow runs, and two runs scored at the same time.
    # (a worker names every run it sees; only the one that starts a run logs this line)
    logs = {i: (tmp_path / f"worker-{i}.log").read_text() for i in range(WORKERS)}
    names = {stack.flow_run(run_id)["name"]: run_id for run_id in runs}
    ran = {
        i: [
            r
            for name, r in names.items()
            if f"Flow run '{name}' submitted to infrastructure" in log
        ]
        for i, log in logs.items()
    }
    assert all(ran.values()), ran
    assert sorted(itertools.chain(*ran.values())) == sorted(runs)  # each run started once
    scored = [(start, end) for run_id, start, end in windows if run_id in runs]
    assert any(a[0] < b[1] and b[0] < a[1] for a, b in itertools.combinations(scored, 2)), scored


def test_the_gpu_deployments_deploy_with_their_slots_and_devices(stack: Stack) -> None:
    """``prefect deploy`` takes deployments/prefect-gpu.yaml as the how-to says: each GPU
    deployment on its host's pool, naming its slot, with its device in the environment."""
    stack.post("/work_pools/", {"name": "gpu1", "type": "process"})
    args = ("--no-prompt", "deploy", "--all", "--prefect-file", "deployments/prefect-gpu.yaml")
    deploy = stack.start("-m", "prefect", *args, name="deploy-gpu")
    assert deploy.wait(120) == 0, (stack.root / "deploy-gpu.log").read_text()
    found = {
        d["name"]: (d["parameters"]["gpu_slot"], d["job_variables"]["env"]["CUDA_VISIBLE_DEVICES"])
        for d in stack.deployments().values()
        if d["work_pool_name"] == "gpu1"
    }
    assert found == {
        "score-gpu1-0": ("gpu1-0", "0"),
        "score-nightly-gpu1-1": ("gpu1-1", "1"),
        "bulk-gpu1-1": ("gpu1-1", "1"),
    }


def _slow_profile(path: Path) -> Path:
    """The shipped W1 service profile, as the slow W1 measures: 50 ms more a pass."""
    profile = json.loads((REPO / "deployments" / "profiles" / "w1-mlp-cpu.json").read_text())
    profile["model"] = {"name": SLOW_W1["name"], "version": SLOW_W1["version"]}
    for point in profile["points"]:
        point["seconds"] += 0.05
    path.write_text(json.dumps(profile))
    return path


def _logs(root: Path) -> str:
    return "\n".join(p.read_text()[-3000:] for p in sorted(root.glob("worker-*.log")))
