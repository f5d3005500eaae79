"""The forward-pass watchdog: its state and verdicts alone, then a scorer on the in-memory
twins with a fake runner whose forward pass never returns on one item (no I/O)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest

from batching import config, errors, models, outcomes
from batching.loop import watchdog
from batching.loop.scorer import Scorer
from batching.testing import FakeClock, InMemoryQueue, MemoryOutputs

Fate = watchdog.Fate

# ----------------------------------------------------------------------------- alone


def test_a_pass_is_declared_hung_once_past_the_timeout() -> None:
    now = [0.0]
    watch: watchdog.ForwardWatch[str] = watchdog.ForwardWatch(10.0, clock=lambda: now[0])
    assert watch.overdue() is None  # nothing in flight
    watch.started("a")
    now[0] = 9.9
    assert watch.overdue() is None
    assert watch.finished() is False  # returned in time: its result stands
    watch.started("b")
    now[0] = 19.8
    assert watch.overdue() is None  # b started at 9.9
    now[0] = 20.0
    assert watch.overdue() == "b"
    assert watch.hung == "b"
    assert watch.ran_s == pytest.approx(10.1)
    assert watch.overdue() is None  # declared once
    assert watch.finished() is True  # its result, should it come, is dropped


@pytest.mark.parametrize(
    ("works", "n", "isolated", "expected"),
    [
        (True, 8, False, Fate.CRASH),  # an input hung it: the crash rule finds which
        (True, 1, False, Fate.CRASH),  # alone by chance, not in a round: no charge yet
        (True, 1, True, Fate.CHARGE),  # alone in an isolation round: its own input
        (True, 4, True, Fate.CRASH),  # a round of several: bisect further
        (None, 1, True, Fate.CHARGE),  # no probe: as the crash rule would charge it
        (None, 8, False, Fate.CRASH),
        (False, 1, True, Fate.MODEL),  # the model fails its own input: nobody charged
        (False, 8, False, Fate.MODEL),
    ],
)
def test_fate(works: bool | None, n: int, isolated: bool, expected: Fate) -> None:
    assert watchdog.fate(works, n, isolated=isolated) is expected
    # a rollout candidate at fault is charged (the guard rolls it back), never paused for
    candidate = Fate.CANDIDATE if expected is Fate.MODEL else expected
    assert watchdog.fate(works, n, isolated=isolated, candidate=True) is candidate


def test_an_interrupt_reaches_only_a_pass_still_in_flight() -> None:
    watch: watchdog.ForwardWatch[str] = watchdog.ForwardWatch(0.0)
    assert watch.interrupt() is False  # nothing hung
    watch.started("a")
    assert watch.overdue() == "a"
    assert watch.finished() is True
    assert watch.interrupt() is False  # the thread moved on: it must not get Abandoned


def test_on_thread_lets_the_caller_go_once_a_native_hang_is_settled() -> None:
    settled, never = threading.Event(), threading.Event()
    hung = errors.ForwardHung("hung")
    threading.Timer(0.2, settled.set).start()
    with pytest.raises(errors.ForwardHung, match="hung"):
        watchdog.on_thread(settled, lambda: hung, never.wait)
    never.set()


def test_on_thread_returns_or_raises_what_the_work_did() -> None:
    settled = threading.Event()
    assert watchdog.on_thread(settled, lambda: errors.ForwardHung("x"), lambda: 7) == 7
    with pytest.raises(ZeroDivisionError):
        watchdog.on_thread(settled, lambda: errors.ForwardHung("x"), lambda: 1 // 0)


def test_probe_answers_false_when_it_raises_or_never_answers() -> None:
    never = threading.Event()

    def boom() -> bool:
        raise RuntimeError("CUDA error")

    assert watchdog.probe(None, 1.0) is None
    assert watchdog.probe(lambda: True, 1.0) is True
    assert watchdog.probe(lambda: False, 1.0) is False
    assert watchdog.probe(boom, 1.0) is False
    started = time.monotonic()
    assert watchdog.probe(lambda: never.wait(), 0.2) is False
    assert time.monotonic() - started < 5
    never.set()


# ----------------------------------------------------------------------------- in a scorer


@dataclass
class HangingRunner:
    """A batch holding an item with payload ``b"hang"`` never returns from ``forward`` (until
    ``release``), one of ``b"fail"`` items fails whole; ``healthy`` is the model's probe,
    answering ``works`` (or hanging too)."""

    works: bool = True
    probe_hangs: bool = False
    spins: bool = False  # hang in Python code (a loop), not in a native wait
    abandoned: threading.Event = field(default_factory=threading.Event)
    release: threading.Event = field(default_factory=threading.Event)
    batches: list[list[str]] = field(default_factory=list)
    returned: list[list[str]] = field(default_factory=list)

    def decode(self, items: Sequence[models.WorkItem]) -> list[models.WorkItem]:
        return list(items)

    def forward(self, items: list[models.WorkItem]) -> outcomes.ScoreResult:
        keys = [i.item_key for i in items]
        self.batches.append(keys)
        if any(i.payload.data == b"hang" for i in items):
            try:
                if not self.spins:
                    self.release.wait()  # native: the watchdog's interrupt waits for it
                while self.spins and not self.release.is_set():
                    time.sleep(0.01)
                keys.append("the interrupt never came")
            except watchdog.Abandoned:
                self.abandoned.set()
                raise
        self.returned.append(keys)
        bad = {i.id for i in items if i.payload.data == b"fail"}  # whole: the breaker holds it
        outputs = {i.id: np.ones(1, np.float32) for i in items if i.id not in bad}
        whole = "RuntimeError: boom" if len(items) > 1 and len(bad) == len(items) else None
        failures = dict.fromkeys(bad, "RuntimeError: boom")
        n = len(items)
        return outcomes.ScoreResult(outputs, failures, 0.0, n, n, whole_batch_error=whole)

    def healthy(self) -> bool:
        if self.probe_hangs:
            self.release.wait()
        return self.works


@dataclass
class Rig:
    clock: FakeClock
    queue: InMemoryQueue
    runner: HangingRunner
    outputs: MemoryOutputs
    scorer: Scorer[Any]
    pauses: list[str]


@pytest.fixture
def make() -> Iterator[Any]:
    runners: list[HangingRunner] = []

    def build(records: Sequence[tuple[str, bytes]], *, max_attempts: int = 3) -> Rig:
        clock = FakeClock()
        queue = InMemoryQueue("q1", clock=clock, max_attempts=max_attempts, backoff_base_s=0)
        queue.enqueue(models.EnqueueRecord(k, models.Payload(p)) for k, p in records)
        cfg = config.PipelineConfig(
            model=config.ModelSpec(name="fake", version="v1", sha256="0" * 64),
            queue=config.QueueConfig(
                name="q1", poll_s=0.001, lease_s=0.6, heartbeat_s=0.05, forward_timeout_s=0.3
            ),
            batching=config.BatchingPolicy(max_batch_size=4, claim_size=8, max_wait_s=10.0),
            output=config.OutputConfig(max_rows_per_commit=1),
            latency_slo_s=60.0,
        )
        runner, outputs, pauses = HangingRunner(), MemoryOutputs(queue), list[str]()
        runners.append(runner)
        scorer = Scorer(cfg, queue, runner, outputs, clock=clock, pause_queue=pauses.append)
        return Rig(clock, queue, runner, outputs, scorer, pauses)

    yield build
    for runner in runners:  # let the hung threads end
        runner.release.set()


def state(r: Rig, key: str) -> tuple[models.State, int]:
    row = r.queue.item(key)
    return row.state, row.attempts


def records(n: int, hang: int | None) -> list[tuple[str, bytes]]:
    return [(f"k{i}", b"hang" if i == hang else b"{}") for i in range(n)]


def test_a_hung_batch_goes_to_the_crash_rule_and_nobody_is_charged(make: Any) -> None:
    r = make(records(8, hang=1))
    with pytest.raises(errors.ForwardHung) as caught:
        r.scorer.run()
    message = str(caught.value)
    assert message.startswith("a forward pass of 4 item(s) ran ")
    assert "past queue.forward_timeout_s (0.3 s)" in message
    assert "isolation rounds to find which" in message
    assert message.endswith(
        "restart the scorer (a pass hung in native code runs on until its process ends)"
    )
    hung = ["k0", "k1", "k2", "k3"]
    assert r.runner.batches[0] == hung
    # The hung batch's lease is over now: the next claim's reaper refunds it, suspects all.
    assert {k: r.queue.item(k).lease_expires_at < r.clock() for k in hung} == dict.fromkeys(
        hung, True
    )
    r.queue.release_expired()
    for k in hung:
        row = r.queue.item(k)
        assert (row.state, row.attempts, row.isolate_n) == (models.State.READY, 0, 2)
    # The rest went back unused or committed; nobody was charged.
    for k in ("k4", "k5", "k6", "k7"):
        assert state(r, k) in {(models.State.READY, 0), (models.State.DONE, 1)}
    # Hung in a native wait, the pass gets the watchdog's interrupt once the wait returns
    assert not r.runner.abandoned.is_set()
    r.runner.release.set()
    assert r.runner.abandoned.wait(5)
    assert hung not in r.runner.returned
    assert not set(r.outputs.rows) & set(hung)


def test_an_item_that_hangs_alone_in_an_isolation_round_is_charged(make: Any) -> None:
    r = make(records(1, hang=0), max_attempts=1)
    row = r.queue._store.keys[("q1", "k0")]
    r.queue._store.rows[row].isolate_n = 1  # as the reaper marks a lost worker's item
    with pytest.raises(errors.ForwardHung, match="so this item hung it: failed, an attempt"):
        r.scorer.run()
    row_now = r.queue.item("k0")
    assert (row_now.state, row_now.attempts) == (models.State.DEAD, 1)
    assert row_now.last_error.startswith("forward pass hung on this item, scored alone: past ")
    assert r.scorer.stats.isolated == 1
    assert r.pauses == []


@pytest.mark.parametrize("probe", ["fails", "hangs"])
def test_a_model_that_fails_its_probe_is_at_fault_and_the_queue_is_paused(
    make: Any, probe: str
) -> None:
    r = make(records(8, hang=1))
    r.runner.works = False
    r.runner.probe_hangs = probe == "hangs"
    with pytest.raises(errors.ForwardHung) as caught:
        r.scorer.run()
    assert "the model or the device is at fault" in str(caught.value)
    assert "queue 'q1' is paused (`batching queue resume q1 --reason ...`" in str(caught.value)
    assert r.pauses == [
        "forward pass hung past queue.forward_timeout_s (0.3 s) and the model failed its own "
        "probe input"
    ]
    for k in ("k0", "k1", "k2", "k3"):  # given back unused, not left to the reaper
        assert state(r, k) == (models.State.READY, 0)
        assert r.queue.item(k).isolate_n == 0


def test_a_pass_within_the_timeout_is_left_alone(make: Any) -> None:
    r = make(records(8, hang=None))
    stats = r.scorer.run()
    assert stats.committed == 8
    assert r.scorer._watch.hung is None


def test_a_pass_hung_in_python_code_is_interrupted_and_its_thread_ends(make: Any) -> None:
    r = make(records(8, hang=1))
    r.runner.spins = True
    with pytest.raises(errors.ForwardHung):
        r.scorer.run()
    assert r.runner.abandoned.wait(5), "the hung pass was not interrupted"
    assert ["k0", "k1", "k2", "k3"] not in r.runner.returned
    assert r.scorer.stats.committed + r.scorer.stats.released == 4  # k4..k7, none charged


def test_breaker_held_batches_go_back_unused_after_a_hang(make: Any) -> None:
    # A whole-failed batch the breaker holds (its failures undecided) when the next batch
    # hangs: the forward stage that would settle it is gone; it is released, not left leased.
    r = make([*[(f"f{i}", b"fail") for i in range(4)], *records(4, hang=0)])
    with pytest.raises(errors.ForwardHung):
        r.scorer.run()
    for k in ("f0", "f1", "f2", "f3"):
        row = r.queue.item(k)
        assert (row.state, row.attempts, row.lease_id) == (models.State.READY, 0, None)


class RefusingQueue(InMemoryQueue):
    """The database refuses every settle of a hung batch."""

    def release(self, lease_id: str, ids: Sequence[int] | None = None) -> int:
        raise errors.QueueError("database is locked")

    def heartbeat(self, lease_id: str, lease_s: float) -> int:
        if lease_s < 0:
            raise errors.QueueError("database is locked")
        return super().heartbeat(lease_id, lease_s)


@pytest.mark.parametrize("works", [True, False])
def test_a_refused_settle_says_so_and_still_pauses_a_broken_model(works: bool) -> None:
    queue = RefusingQueue("q1", clock=FakeClock())
    pauses: list[str] = []

    def pause(reason: str) -> None:
        pauses.append(reason)

    fate = watchdog.fate(works, 4, isolated=False)
    settled = watchdog.settle(
        queue, fate, {"lease-1": [1, 2, 3, 4]}, timeout_s=9, lease_s=60, model_version="v1",
        pause=lambda reason: pause(reason),
    )  # fmt: skip
    assert settled.done is False
    text = watchdog.message(12.0, 9, 4, "q1", settled)
    assert "The database refused to settle the batch: its lease runs out by itself" in text
    assert ("is paused" in text) is (not works)
    assert pauses == ([] if works else [watchdog.pause_reason(9)])


def test_a_pass_that_raises_leaves_no_flight_to_be_declared_hung(make: Any) -> None:
    # Left in flight, a pass that raised was declared hung later in a slow shutdown: a
    # false page, an interrupt sent to a dead thread's id, a fate applied to its batch.
    r = make(records(4, hang=None))

    def boom(items: list[models.WorkItem]) -> outcomes.ScoreResult:
        raise RuntimeError("CUDA error")

    r.runner.forward = boom
    with pytest.raises(RuntimeError):
        r.scorer.run()
    r.scorer._watch.timeout_s = 0.0
    assert r.scorer._watch.overdue() is None
    assert r.pauses == []


def test_a_lease_already_taken_back_is_said_so() -> None:
    queue = InMemoryQueue("q1", clock=FakeClock())  # the lease holds nothing any more
    for fate in (Fate.CRASH, Fate.CHARGE, Fate.MODEL):
        settled = watchdog.settle(
            queue, fate, {"gone": [1]}, timeout_s=9, lease_s=60, model_version=None,
            pause=lambda reason: None,
        )  # fmt: skip
        assert (settled.done, settled.lost) == (True, True)
        assert "lease was already gone" in watchdog.message(12.0, 9, 1, "q1", settled)
