"""The rollout guard flow under the Prefect test harness: a candidate that fails every item
is rolled back by a flow run (audit row, ``batching.rollout.rolled_back`` event, comparison
artifact); a healthy one is left alone."""

from __future__ import annotations

import hashlib
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from torch import nn

from batching.compose import rollouts
from batching.config import load_config
from batching.ingress import rollout
from batching.model import zoo
from flows.rollout import ROLLED_BACK, rollout_guard
from flows.score import score
from tests.conftest import wait_for
from tests.flows.support import Pipeline, artifacts_of, events_named, make_pipeline, run_id_of


class Broken(nn.Module):
    """W1-shaped (64 floats in, 1 out); every forward pass fails."""

    batching_input = "dense"
    batching_input_dim = 64
    batching_output_dim = 1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        raise RuntimeError("the candidate cannot score")


def build_broken() -> nn.Module:
    return Broken()


def with_candidate(pipeline: Pipeline, tmp_path: Path, factory: str | None = None) -> None:
    """List a candidate version in the pipeline's registry (the ``factory``, else the built-in
    W1 model under another version name) and start it on 40% of the keys."""
    spec: dict[str, str] = {"name": "w1-mlp", "sha256": zoo.BUILTINS["w1-mlp"].sha256}
    if factory is not None:
        ckpt = tmp_path / "empty.safetensors"
        save_file({}, str(ckpt))
        sha = hashlib.sha256(ckpt.read_bytes()).hexdigest()
        spec = {"name": factory, "checkpoint": str(ckpt), "sha256": sha}
    spec["version"] = "w1-next"
    pipeline.overrides["model_versions"] = [spec | {"device": "cpu"}]
    pipeline.overrides["queue"] = {"max_attempts": 1}
    pipeline.overrides["rollout"] = {"min_items": 20}
    config = load_config(pipeline.config, pipeline.overrides)
    rollouts.start(
        config,
        None,
        candidate="w1-next",
        percent=40,
        actor="ops",
        reason="try w1-next",
    )


def test_the_guard_flow_rolls_a_failing_candidate_back_and_says_so(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 400)
    with_candidate(pipeline, tmp_path, f"{__name__}:build_broken")
    scored = score(**pipeline.params())
    assert 0 < scored["items_committed"] < 400  # the stable version's share
    since = time.time() - 1
    state = rollout_guard(**pipeline.params(), return_state=True)
    result = state.result()
    assert result["rolled_back"] is True
    assert "max_error_rate" in result["guard"]["breach"]
    queue = pipeline.queue()
    route = rollout.current(queue.engine, queue.queue)
    (last,) = rollout.history(queue.engine, queue.queue, 1)
    queue.engine.dispose()
    assert route is not None
    assert (route.stable, route.candidate) == ("w1-mlp-v1", None)
    assert (last.action, last.actor) == ("auto-rollback", "guard")
    (event,) = wait_for(lambda: events_named(ROLLED_BACK, since) or None, what="rolled_back")
    assert event.payload["queue"] == queue.queue
    assert event.payload["to"]["candidate"] is None
    (artifact,) = [a for a in artifacts_of(run_id_of(state)) if a.type == "table"]
    assert "max_error_rate" in (artifact.description or "")


def test_the_guard_flow_leaves_a_healthy_candidate_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pipeline = make_pipeline(tmp_path, 200)
    with_candidate(pipeline, tmp_path)  # the same model, another version name
    score(**pipeline.params())
    # the database from the workers' environment, as every other flow takes it (the guard
    # once failed every minute on the config's default file: a Prefect review)
    overrides = dict(pipeline.overrides)
    monkeypatch.setenv("BATCHING_DB_URL", overrides.pop("database")["url"])
    monkeypatch.chdir(tmp_path)  # no ./batching.db to fall back on
    result = rollout_guard(**pipeline.params(overrides=overrides))
    assert result["rolled_back"] is False
    assert result["guard"]["breach"] is None
    by_role = {v["role"]: v for v in result["versions"]}
    assert by_role["candidate"]["committed"] + by_role["stable"]["committed"] == 200
    assert by_role["candidate"]["errors"] == 0


def test_score_flows_pinned_to_one_version_each_score_only_its_items(tmp_path: Path) -> None:
    pipeline = make_pipeline(tmp_path, 300)
    with_candidate(pipeline, tmp_path)
    stable = score(**pipeline.params(model_version="w1-mlp-v1"))
    assert 0 < stable["items_committed"] < 300
    assert pipeline.by_state()["ready"] == 300 - stable["items_committed"]
    candidate = score(**pipeline.params(model_version="w1-next"))
    assert stable["items_committed"] + candidate["items_committed"] == 300
    assert pipeline.by_state()["done"] == 300
