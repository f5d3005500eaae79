"""Queue controls without a database: the refusal's message, the lines ``status`` prints, the
enqueue run id, and a scorer on the in-memory twin of a paused queue."""

from __future__ import annotations

import re

from batching import config, errors, models
from batching.cli.controls import control_lines, when
from batching.cli.queue import enqueue_run_id
from batching.ingress import admission, controls
from batching.loop.scorer import Scorer
from batching.loop.stats import RunLimits
from batching.testing import FakeClock, InMemoryQueue, MemoryOutputs
from tests.unit.test_testing import DoubleIt, records


def test_a_full_queue_says_what_it_holds_and_how_to_raise_the_cap() -> None:
    exc = admission.queue_full("q1", 95, 6, 100)
    assert isinstance(exc, errors.QueueError)
    assert errors.QueueFull in errors.USAGE_ERRORS  # exit 2: refused, nothing enqueued
    assert str(exc) == (
        "queue 'q1' is at its depth cap (95 items ready or leased + at least 6 new > cap 100); "
        "nothing was enqueued: retry later or raise the cap with "
        "`batching queue cap q1 --max-depth N`"
    )


def test_status_lines_name_who_paused_since_when_why_and_the_cap() -> None:
    held = {
        "b": controls.QueueControl("b", max_depth=10),
        "a": controls.QueueControl(
            "a", paused=True, paused_at=1_800_000_000.0, paused_by="alice", reason="bad model"
        ),
        "c": controls.QueueControl("c"),
    }
    assert control_lines(held, {"b": 4}) == [
        "queue 'a' PAUSED by alice since 2027-01-15 08:00:00 UTC: bad model "
        "(`batching queue resume a`)",
        "queue 'b' depth cap 10 items ready or leased (now 4)",
    ]
    assert when(None) == "-"


def test_an_enqueue_run_id_sorts_by_time_and_is_unique() -> None:
    first, second = enqueue_run_id(1_800_000_000.0), enqueue_run_id(1_800_000_000.0)
    assert re.fullmatch(r"enq-20270115T080000Z-[0-9a-f]{8}", first)
    assert first != second
    assert len(first) <= 64  # batching_items.enqueue_run


def test_a_run_until_empty_on_a_paused_queue_ends_and_a_resumed_one_scores() -> None:
    clock = FakeClock()
    queue = InMemoryQueue("q", clock=clock)
    queue.enqueue(records(20))
    cfg = config.PipelineConfig(
        model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
        batching=config.BatchingPolicy(max_batch_size=8, max_wait_s=0.0),
        queue=config.QueueConfig(poll_s=0.001),
    )
    queue.pause()
    claim = queue.claim(5, lease_s=30)
    assert (claim.items, claim.paused) == ((), True)
    assert queue.sibling("other").claim(1, lease_s=30).paused is False
    paused = Scorer(cfg, queue, DoubleIt(), MemoryOutputs(queue), clock=clock).run(RunLimits())
    assert (paused.claimed, paused.committed) == (0, 0)
    assert queue.stats().by_state["ready"] == 20

    queue.resume()
    resumed = Scorer(cfg, queue, DoubleIt(), MemoryOutputs(queue), clock=clock).run(RunLimits())
    assert resumed.committed == 20
    assert queue.stats().by_state == {
        "ready": 0,
        "leased": 0,
        "done": 20,
        "dead": 0,
        "expired": 0,
        "cancelled": 0,
    }
    assert int(models.State.CANCELLED) == 5  # the code stored in batching_items.state
