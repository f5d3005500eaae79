"""GPU slots under the real Prefect harness: a score or bulk run given ``gpu_slot`` holds that
global concurrency limit while it scores; a missing or misconfigured slot fails the run with
the fix, and a taken one makes it wait (or fail after ``gpu_slot_wait_s``)."""

from __future__ import annotations

import importlib
import inspect
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prefect.client.orchestration import get_client
from prefect.client.schemas.actions import GlobalConcurrencyLimitCreate
from prefect.concurrency.sync import concurrency

from batching.model import workloads
from flows import credentials
from flows.bulk import bulk
from flows.score import score
from tests.flows.support import REPO, make_pipeline


@pytest.fixture
def slot() -> Iterator[str]:
    name = f"gpu-test-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=1))
        yield name
        client.delete_global_concurrency_limit_by_name(name)


def test_a_slot_that_does_not_exist_fails_the_run_with_the_command_that_creates_it(
    tmp_path: Path,
) -> None:
    pipeline = make_pipeline(tmp_path, 10)
    state = score(**pipeline.params(gpu_slot="gpu-nowhere-0"), return_state=True)
    assert state.is_failed()
    assert "`prefect gcl create gpu-nowhere-0 --limit 1`" in str(state.message)
    assert pipeline.by_state()["ready"] == 10  # nothing claimed


def test_a_bulk_run_that_cannot_have_its_slot_queues_nothing(tmp_path: Path, slot: str) -> None:
    """A review: a bulk run with a missing slot, or one held past gpu_slot_wait_s, failed
    after it had queued its file, which the online scorer on another GPU then took."""
    pipeline = make_pipeline(tmp_path, 0)
    params = pipeline.params(
        input_path=str(workloads.write_w1_parquet(tmp_path / "in.parquet", 50))
    )
    missing = bulk(**params, gpu_slot="gpu-nowhere-0", return_state=True)
    assert missing.is_failed()
    assert "`prefect gcl create gpu-nowhere-0 --limit 1`" in str(missing.message)
    with concurrency(slot, occupy=1, strict=True):  # another run on this GPU
        taken = bulk(**params, gpu_slot=slot, gpu_slot_wait_s=1.0, return_state=True)
    assert taken.is_failed()
    assert f"gpu_slot {slot!r} stayed taken for 1 s" in str(taken.message)
    assert sum(pipeline.by_state().values()) == 0  # nothing queued


def test_slot_settings_that_cannot_work_fail_the_run_before_it_claims(
    tmp_path: Path, slot: str
) -> None:
    """A walk-through: a wait of 0 (or below) timed out with the slot free and said another
    run held it; an empty name got Prefect's raw 405; two workers under one slot put two
    scorers on one GPU without a word."""
    pipeline = make_pipeline(tmp_path, 10)
    for given, says in (
        ({"gpu_slot": slot, "gpu_slot_wait_s": 0}, "gpu_slot_wait_s must be > 0 (or none), got 0"),
        ({"gpu_slot": slot, "gpu_slot_wait_s": -1}, "gpu_slot_wait_s must be > 0 (or none)"),
        ({"gpu_slot": " "}, "gpu_slot is empty; name a Prefect global concurrency limit"),
        ({"gpu_slot": slot, "workers": 2}, f"workers 2 with gpu_slot {slot!r}: a GPU slot is"),
    ):
        state = score(**pipeline.params(**given), return_state=True)
        assert state.is_failed(), given
        assert says in str(state.message), (given, state.message)
    assert pipeline.by_state()["ready"] == 10  # nothing claimed


def test_a_slot_that_lets_two_runs_in_is_refused(tmp_path: Path) -> None:
    name = f"gpu-test-{uuid.uuid4().hex[:8]}"
    with get_client(sync_client=True) as client:
        client.create_global_concurrency_limit(GlobalConcurrencyLimitCreate(name=name, limit=2))
        try:
            pipeline = make_pipeline(tmp_path, 10)
            state = score(**pipeline.params(gpu_slot=name), return_state=True)
        finally:
            client.delete_global_concurrency_limit_by_name(name)
    assert state.is_failed()
    assert f"`prefect gcl update {name} --limit 1`" in str(state.message)
    assert pipeline.by_state()["ready"] == 10


def test_a_taken_slot_fails_the_run_after_its_wait(tmp_path: Path, slot: str) -> None:
    pipeline = make_pipeline(tmp_path, 10)
    with concurrency(slot, occupy=1, strict=True):  # another run on this GPU
        state = score(**pipeline.params(gpu_slot=slot, gpu_slot_wait_s=1.0), return_state=True)
    assert state.is_failed()
    assert f"gpu_slot {slot!r} stayed taken for 1 s" in str(state.message)
    assert pipeline.by_state()["ready"] == 10


@pytest.mark.parametrize("flow", ["score", "bulk"])
def test_a_run_waits_for_its_slot_then_scores(tmp_path: Path, slot: str, flow: str) -> None:
    """While another holder has the slot (the nightly bulk run on this GPU, say), a score or
    bulk run claims nothing; once the slot is free, the run takes it and scores every item.
    (Without the slot, the run scores at once: this fails.)"""
    pipeline = make_pipeline(tmp_path, 200 if flow == "score" else 0)
    params = pipeline.params(gpu_slot=slot)
    if flow == "bulk":
        params["input_path"] = str(workloads.write_w1_parquet(tmp_path / "in.parquet", 200))
    run = score if flow == "score" else bulk
    states: list[Any] = []
    with concurrency(slot, occupy=1, strict=True):
        thread = threading.Thread(target=lambda: states.append(run(**params, return_state=True)))
        thread.start()
        time.sleep(4.0)  # waiting for the slot (a bulk run before its enqueue)
        assert thread.is_alive()
        assert pipeline.by_state()["done"] == 0  # nothing scored on a GPU in use
    thread.join(120)
    assert states[0].is_completed(), states[0].message
    assert {k: v for k, v in pipeline.by_state().items() if v} == {"done": 200}


GPU_YAML = REPO / "deployments" / "prefect-gpu.yaml"


def test_the_gpu_deployments_give_each_slot_one_device_and_store_no_secret() -> None:
    spec = yaml.safe_load(GPU_YAML.read_text(encoding="utf-8"))
    devices: dict[str, set[str]] = {}
    for d in spec["deployments"]:
        path, _, attr = d["entrypoint"].partition(":")
        module = importlib.import_module(Path(path).with_suffix("").as_posix().replace("/", "."))
        accepted = inspect.signature(getattr(module, attr).fn).parameters
        assert set(d["parameters"]) <= set(accepted), d["name"]
        slot = d["parameters"]["gpu_slot"]
        pool = d["work_pool"]["name"]
        assert slot.startswith(f"{pool}-"), d["name"]  # a slot belongs to its host's pool
        devices.setdefault(slot, set()).add(
            d["work_pool"]["job_variables"]["env"]["CUDA_VISIBLE_DEVICES"]
        )
    assert all(len(found) == 1 for found in devices.values()), devices
    assert len({next(iter(found)) for found in devices.values()}) == len(devices)
    assert credentials.check_prefect_yaml(GPU_YAML, env={}) == []


def test_a_slot_held_where_torch_sees_no_gpu_says_so(
    slot: str, caplog: pytest.LogCaptureFixture
) -> None:
    """A review: on a host without a GPU, a slot run scored on the CPU and only a structured
    extra of 'model loaded' said so."""
    import logging

    import torch

    from flows import slots

    if torch.cuda.is_available():
        pytest.skip("this host has a CUDA device")
    with caplog.at_level(logging.WARNING, logger="batching.flows.slots"), slots.gpu_slot(slot):
        pass
    assert any("no CUDA device visible" in r.getMessage() for r in caplog.records)
