"""``batching.testing``: the twins users' tests run a scorer against, used as its docstring
says (the queue twin's contract is tests/integration/test_queue_verbs.py)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import pytest

from batching import config, errors, models, outcomes
from batching.loop.scorer import Scorer
from batching.loop.stats import RunLimits
from batching.testing import FakeClock, InMemoryQueue, MemoryOutputs


class DoubleIt:
    """A runner whose output is twice the first value of each JSON payload ``{"x": [v]}``."""

    def decode(self, items: Sequence[models.WorkItem]) -> list[models.WorkItem]:
        return list(items)

    def forward(self, decoded: list[models.WorkItem]) -> outcomes.ScoreResult:
        outputs = {
            i.id: np.array([2.0 * float(i.payload.data.split(b"[")[1].split(b"]")[0])], "<f4")
            for i in decoded
        }
        return outcomes.ScoreResult(outputs, {}, 0.001, len(decoded), len(decoded))


def records(n: int) -> list[models.EnqueueRecord]:
    return [models.EnqueueRecord(f"k{i}", models.Payload(b'{"x": [%d]}' % i)) for i in range(n)]


def test_a_scorer_runs_in_memory_with_the_twins() -> None:
    clock = FakeClock()
    queue = InMemoryQueue("q", clock=clock)
    queue.enqueue(records(50))
    outputs = MemoryOutputs(queue)
    cfg = config.PipelineConfig(
        model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
        batching=config.BatchingPolicy(max_batch_size=8, max_wait_s=0.0),
        queue=config.QueueConfig(poll_s=0.001),
    )
    stats = Scorer(cfg, queue, DoubleIt(), outputs, clock=clock).run(RunLimits())
    assert stats.committed == 50
    assert {k: r.output for k, r in outputs.rows.items()} == {f"k{i}": [2.0 * i] for i in range(50)}
    assert queue.stats().by_state["done"] == 50


def test_memory_outputs_commit_all_or_nothing_under_the_lease() -> None:
    clock = FakeClock()
    queue = InMemoryQueue(clock=clock)
    queue.enqueue(records(3))
    claim = queue.claim(3, lease_s=10)
    outputs = MemoryOutputs(queue)
    clock.advance(11)
    queue.release_expired()
    scores = {i.id: np.zeros(1, "<f4") for i in claim.items}
    with pytest.raises(errors.LeaseLost):
        outputs.commit(claim.items, claim.lease_id, scores, clock())
    assert outputs.rows == {}
    again = queue.claim(3, lease_s=10, isolate=True)  # the lost lease's items are suspects
    result = outputs.commit(again.items, again.lease_id, scores_of(again), clock())
    assert (result.n_rows, sorted(outputs.rows)) == (2, ["k0", "k1"])


def scores_of(claim: models.Claim) -> dict[int, np.ndarray]:
    return {i.id: np.ones(1, "<f4") for i in claim.items}
