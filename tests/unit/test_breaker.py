"""The retry-storm breaker: its state machine (tables of verdicts), then a scorer with it on
the in-memory twins and a fake runner whose model fails whole batches; no I/O."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from batching import config, errors, models, outcomes
from batching.loop import breaker
from batching.loop.scorer import Scorer
from batching.loop.stats import RunLimits
from batching.testing import FakeClock, InMemoryQueue, MemoryOutputs

S, W, N = breaker.Verdict.SCORED, breaker.Verdict.WHOLE_FAILED, breaker.Verdict.NEITHER

# ----------------------------------------------------------------------------- state machine


def feed(b: breaker.Breaker[str], verdicts: str) -> list[breaker.Step[str]]:
    """Feed ``verdicts`` (``s`` scored, ``w`` whole-failed, ``n`` neither), job i named
    ``<verdict><i>``; 10 items each."""
    codes = {"s": S, "w": W, "n": N}
    return [b.observe(f"{v}{i}", codes[v], 10, f"err{i}") for i, v in enumerate(verdicts)]


@pytest.mark.parametrize(
    ("verdicts", "handed_on", "held"),
    [
        ("sss", ["s0", "s1", "s2"], []),
        ("ww", [], ["w0", "w1"]),
        ("wws", ["w0", "w1", "s2"], []),  # a scored batch applies the held ones first
        ("wnw", ["n1"], ["w0", "w2"]),  # one item alone: neither extends nor breaks it
        ("wwsww", ["w0", "w1", "s2"], ["w3", "w4"]),  # the streak starts again
        ("nnnn", ["n0", "n1", "n2", "n3"], []),
    ],
)
def test_held_and_handed_on(verdicts: str, handed_on: list[str], held: list[str]) -> None:
    b: breaker.Breaker[str] = breaker.Breaker(config.BreakerConfig(max_failed_batches=3))
    steps = feed(b, verdicts)
    assert [j for s in steps for j in s.forward] == handed_on
    assert list(b.held) == held
    assert b.held_items == 10 * len(held)
    assert all(s.trip is None for s in steps)


@pytest.mark.parametrize(
    ("max_failed", "verdicts", "trip_at", "tripped"),
    [
        (3, "www", 2, ["w0", "w1", "w2"]),
        (3, "wnwnw", 4, ["w0", "w2", "w4"]),
        (3, "wwsnwww", 6, ["w4", "w5", "w6"]),
        (1, "sw", 1, ["w1"]),
    ],
)
def test_trips_after_max_failed_batches_in_a_row(
    max_failed: int, verdicts: str, trip_at: int, tripped: list[str]
) -> None:
    b: breaker.Breaker[str] = breaker.Breaker(config.BreakerConfig(max_failed_batches=max_failed))
    steps = feed(b, verdicts)
    trips = [(i, s.trip) for i, s in enumerate(steps) if s.trip is not None]
    assert [i for i, _ in trips] == [trip_at]
    trip = trips[0][1]
    assert trip is not None
    assert list(trip.jobs) == tripped
    assert trip.sizes == (10,) * len(tripped)
    assert trip.error == f"err{trip_at}"
    assert steps[trip_at].forward == ()  # the tripping batch is released, not applied
    assert b.held == ()


def test_disabled_hands_every_batch_on() -> None:
    b: breaker.Breaker[str] = breaker.Breaker(config.BreakerConfig(enabled=False))
    steps = feed(b, "wwwww")
    assert [j for s in steps for j in s.forward] == [f"w{i}" for i in range(5)]
    assert all(s.trip is None for s in steps)


def test_settle_hands_back_what_is_held_and_resets() -> None:
    b: breaker.Breaker[str] = breaker.Breaker(config.BreakerConfig(max_failed_batches=3))
    feed(b, "ww")
    assert b.settle() == ("w0", "w1")
    assert b.held == ()
    assert feed(b, "w")[0].trip is None  # a new streak


def result(outputs: dict[int, Any], failures: dict[int, str], whole: str | None = None) -> Any:
    return outcomes.ScoreResult(outputs, failures, 0.0, 1, 1, whole_batch_error=whole)


@pytest.mark.parametrize(
    ("res", "expected"),
    [
        (result({1: np.ones(1)}, {2: "boom"}), S),
        (result({}, {1: "boom", 2: "boom"}, "boom"), W),
        (result({}, {1: "boom"}), N),  # one item alone: poison or model, no telling
        (result({}, {}), N),
    ],
)
def test_verdict(res: outcomes.ScoreResult, expected: breaker.Verdict) -> None:
    assert breaker.verdict(res) is expected


@pytest.mark.parametrize(
    ("paused", "tail"),
    [
        (None, "the queue is paused: fix or roll back the model, then "
               "`batching queue resume q1 --reason ...`"),
        ("breaker.pause_queue is false", "the queue is not paused (breaker.pause_queue is "
                                         "false): fix or roll back the model, then score again"),
    ],
)  # fmt: skip
def test_the_message_names_queue_batches_error_and_the_way_back(
    paused: str | None, tail: str
) -> None:
    trip = breaker.Trip(("a", "b"), (32, 7), "RuntimeError: CUDA error " + "x" * 400)
    message = trip.message("q1", paused)
    assert message.startswith(
        "retry storm on queue 'q1': 2 batches in a row (32, 7 items) failed in the forward "
        "pass with no single poison item found; last model error: RuntimeError: CUDA error x"
    )
    assert message.endswith(tail)
    assert "\n" not in message
    assert len(message) < 600  # the model error is cut


# ----------------------------------------------------------------------------- in a scorer

ERROR = "RuntimeError: CUDA error: an illegal memory access was encountered"


@dataclass
class BrokenRunner:
    """Items with payload ``b"bad"`` fail in the model; a batch of them reports a whole-batch
    error, as ``TorchRunner`` does once bisection found no single poison."""

    broken: bool = False  # every item fails
    batches: list[list[str]] = field(default_factory=list)

    def decode(self, items: Sequence[models.WorkItem]) -> list[models.WorkItem]:
        return list(items)

    def forward(self, items: list[models.WorkItem]) -> outcomes.ScoreResult:
        self.batches.append([i.item_key for i in items])
        bad = {i.id for i in items if self.broken or i.payload.data == b"bad"}
        outputs = {i.id: np.ones(1, np.float32) for i in items if i.id not in bad}
        whole = ERROR if len(items) > 1 and len(bad) == len(items) else None
        return outcomes.ScoreResult(
            outputs, dict.fromkeys(bad, ERROR), 0.0, len(items), len(items), whole_batch_error=whole
        )


@dataclass
class Rig:
    queue: InMemoryQueue
    runner: BrokenRunner
    outputs: MemoryOutputs
    scorer: Scorer[Any]
    pauses: list[str]


def rig(
    records: Sequence[tuple[str, bytes]],
    *,
    pause: bool = True,
    max_batch_size: int = 4,
    claim_size: int = 8,
    max_attempts: int = 3,
    **breaker_settings: Any,
) -> Rig:
    clock = FakeClock()
    queue = InMemoryQueue("q1", clock=clock, max_attempts=max_attempts, backoff_base_s=60)
    queue.enqueue(models.EnqueueRecord(k, models.Payload(p)) for k, p in records)
    cfg = config.PipelineConfig(
        model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
        queue=config.QueueConfig(name="q1", poll_s=0.001),
        batching=config.BatchingPolicy(
            max_batch_size=max_batch_size, claim_size=claim_size, max_wait_s=10.0
        ),
        output=config.OutputConfig(max_rows_per_commit=1),
        breaker=config.BreakerConfig(**breaker_settings),
        latency_slo_s=60.0,
    )
    runner, outputs, pauses = BrokenRunner(), MemoryOutputs(queue), list[str]()
    scorer = Scorer(
        cfg, queue, runner, outputs, clock=clock, pause_queue=pauses.append if pause else None
    )
    return Rig(queue, runner, outputs, scorer, pauses)


def items(prefix: str, n: int, payload: bytes = b"{}") -> list[tuple[str, bytes]]:
    return [(f"{prefix}{i}", payload) for i in range(n)]


def attempts(r: Rig, keys: Sequence[str]) -> dict[str, tuple[models.State, int]]:
    return {k: (r.queue.item(k).state, r.queue.item(k).attempts) for k in keys}


def test_a_storm_stops_the_run_pauses_and_burns_no_attempt() -> None:
    records = items("k", 40)
    r = rig(records)
    r.runner.broken = True
    with pytest.raises(errors.RetryStorm) as caught:
        r.scorer.run()
    assert len(r.runner.batches) == 3  # the streak, then nothing more reached the model
    keys = [k for k, _ in records]
    assert set(attempts(r, keys).values()) == {(models.State.READY, 0)}
    assert r.pauses == [f"retry storm: 3 batches in a row failed: {ERROR}"]
    stats = r.scorer.stats
    assert (stats.breaker_trips, stats.failed, stats.committed) == (1, 0, 0)
    assert stats.released == stats.claimed
    assert str(caught.value).startswith("retry storm on queue 'q1': 3 batches in a row (4, 4, 4")
    assert "`batching queue resume q1 --reason ...`" in str(caught.value)


def test_a_scored_batch_breaks_the_streak_and_the_held_failures_use_one_attempt() -> None:
    bad, good = items("bad", 8, b"bad"), items("ok", 4)
    r = rig([*bad, *good], max_attempts=1)
    stats = r.scorer.run()
    assert r.runner.batches[:2] == [[k for k, _ in bad[:4]], [k for k, _ in bad[4:]]]
    assert set(attempts(r, [k for k, _ in bad]).values()) == {(models.State.DEAD, 1)}
    assert r.queue.item("bad0").last_error == ERROR
    assert set(r.outputs.rows) == {k for k, _ in good}
    assert (stats.failed, stats.committed, stats.breaker_trips) == (8, 4, 0)
    assert r.pauses == []


def test_a_streak_left_undecided_at_the_end_uses_the_attempts() -> None:
    # Two whole-failed batches and nothing after: no trip, and no run after run that never
    # uses an attempt either.
    bad = items("bad", 8, b"bad")
    r = rig(bad)
    stats = r.scorer.run()
    assert set(attempts(r, [k for k, _ in bad]).values()) == {(models.State.READY, 1)}
    assert (stats.failed, stats.breaker_trips) == (8, 0)


def test_a_streak_left_undecided_by_an_idle_queue_is_settled_while_the_run_goes_on() -> None:
    bad = items("bad", 8, b"bad")
    r = rig(bad)
    r.scorer.on_progress = lambda stats: r.scorer.stop() if stats.failed == 8 else None
    stats = r.scorer.run(RunLimits(until_empty=False))  # stops once the held ones are applied
    assert set(attempts(r, [k for k, _ in bad]).values()) == {(models.State.READY, 1)}
    assert stats.failed == 8


def test_one_item_batches_cannot_trip_it_and_use_their_attempts() -> None:
    # A poison item alone is no sign of a broken model: it fails, as before, until dead.
    r = rig(items("bad", 5, b"bad"), max_batch_size=1, max_attempts=1)
    stats = r.scorer.run()
    assert set(attempts(r, [f"bad{i}" for i in range(5)]).values()) == {(models.State.DEAD, 1)}
    assert (stats.failed, stats.breaker_trips) == (5, 0)


def test_disabled_fails_every_item_as_before() -> None:
    r = rig(items("k", 12), max_attempts=1, enabled=False)
    r.runner.broken = True
    stats = r.scorer.run()
    assert (stats.failed, stats.breaker_trips) == (12, 0)
    assert r.queue.item("k0").state is models.State.DEAD


@pytest.mark.parametrize("pause", ["none", "fails"])
def test_without_a_pause_it_still_stops_and_says_the_queue_is_not_paused(pause: str) -> None:
    r = rig(items("k", 20), pause=pause == "fails")
    r.runner.broken = True
    if pause == "fails":

        def refuse(reason: str) -> None:
            raise errors.QueueError("database is locked")

        r.scorer.pause_queue = refuse
    with pytest.raises(errors.RetryStorm) as caught:
        r.scorer.run()
    why = "no pause was wired in" if pause == "none" else "pausing it failed: QueueError"
    assert f"the queue is not paused ({why}" in str(caught.value)
    assert str(caught.value).endswith("then score again")
    assert set(attempts(r, [f"k{i}" for i in range(20)]).values()) == {(models.State.READY, 0)}


class PausesAfter(InMemoryQueue):
    """Claims find the queue paused once ``after`` claims were made (``models.Claim.paused``,
    as the queue controls report it)."""

    after = 1
    claims = 0

    def claim(self, n: int, **kw: Any) -> models.Claim:
        self.claims += 1
        if self.claims > self.after:
            return models.Claim("none", (), self.clock(), paused=True)
        return super().claim(n, **kw)


def test_a_streak_left_undecided_by_a_paused_queue_is_released() -> None:
    bad = items("bad", 8, b"bad")
    r = rig(bad)
    queue = PausesAfter("q1", clock=r.queue.clock, backoff_base_s=0)
    queue.enqueue(models.EnqueueRecord(k, models.Payload(p)) for k, p in bad)
    scorer = Scorer(r.scorer.config, queue, r.runner, MemoryOutputs(queue), clock=queue.clock)
    stats = scorer.run()
    assert {(queue.item(k).state, queue.item(k).attempts) for k, _ in bad} == {
        (models.State.READY, 0)
    }
    assert (stats.failed, stats.released) == (0, 8)


def test_held_batches_do_not_stall_an_isolation_round() -> None:
    # A lost worker's suspect waits for the run to drain; held batches are all the run holds
    # then, and no batch can come to decide their streak: they are settled, the round runs.
    r = rig([*items("bad", 8, b"bad"), ("suspect", b"{}")])
    suspect = r.queue._store.keys[("q1", "suspect")]
    r.queue._store.rows[suspect].isolate_n = 1  # as the reaper marks a lost worker's item
    stats = r.scorer.run()
    assert set(r.outputs.rows) == {"suspect"}
    assert stats.isolated == 1
    assert set(attempts(r, [f"bad{i}" for i in range(8)]).values()) == {(models.State.READY, 1)}
