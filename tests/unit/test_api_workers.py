"""The supervisor of ``batching api --workers N`` (``batching.cli.api_workers``), on fake
processes and a fake clock: a worker that dies is replaced, workers that keep dying at their
start stop the server, and a stop terminates every worker, killing one that stays."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Callable, Sequence

from batching.cli.api_workers import Supervisor

_PIDS = itertools.count(100)


class FakeWorker:
    def __init__(self, *, stubborn: bool = False) -> None:
        self.pid = next(_PIDS)
        self.sentinel = self.pid
        self.exitcode: int | None = None
        self.stubborn = stubborn
        self.terminated = self.killed = False

    def terminate(self) -> None:
        self.terminated = True
        if not self.stubborn:
            self.exitcode = -signal.SIGTERM

    def kill(self) -> None:
        self.killed = True
        self.exitcode = -signal.SIGKILL

    def join(self, timeout: float | None = None) -> None:
        pass


class Harness:
    """Workers started per slot, a clock moved by each wait, and events run at given waits."""

    def __init__(self, events: dict[int, Callable[[Harness], None]], *, step_s: float) -> None:
        self.now, self.step_s, self.waits = 0.0, step_s, 0
        self.events = events
        self.started: list[tuple[int, FakeWorker]] = []
        self.said: list[str] = []
        self.stubborn = False
        self.supervisor = Supervisor(
            self.start, 2, self.said.append, self.wait, clock=lambda: self.now, grace_s=5.0
        )

    def start(self, slot: int) -> FakeWorker:
        worker = FakeWorker(stubborn=self.stubborn)
        self.started.append((slot, worker))
        return worker

    def wait(self, sentinels: Sequence[int], timeout: float) -> None:
        assert sorted(sentinels) == sorted(w.sentinel for w in self.supervisor.workers.values())
        self.now += self.step_s
        self.waits += 1
        event = self.events.get(self.waits)
        if event is not None:
            event(self)

    def die(self, slot: int, code: int) -> None:
        worker = self.supervisor.workers[slot]
        assert isinstance(worker, FakeWorker)
        worker.exitcode = code


def test_a_worker_that_dies_is_replaced_and_a_stop_terminates_them_all() -> None:
    h = Harness(
        {
            3: lambda h: h.die(1, -signal.SIGKILL),
            6: lambda h: h.supervisor.stop(),
        },
        step_s=20.0,
    )
    assert h.supervisor.run() == 0
    assert [slot for slot, _ in h.started] == [0, 1, 1]
    first_of_1 = h.started[1][1]
    assert h.said == [
        f"warning: API worker 1 (pid {first_of_1.pid}) exited with signal SIGKILL; starting another"
    ]
    assert h.supervisor.replaced == 1
    live = [w for _, w in h.started if w is not first_of_1]
    assert all(w.terminated and w.exitcode == -signal.SIGTERM for w in live)
    assert not first_of_1.terminated  # it was dead already


def test_workers_dying_at_their_start_stop_the_server_with_exit_1() -> None:
    h = Harness(
        {k: (lambda h: h.die(0, 2)) for k in (1, 2, 3)},
        step_s=1.0,  # each dies a second after its start: well within QUICK_S
    )
    assert h.supervisor.run() == 1
    assert [slot for slot, _ in h.started] == [0, 1, 0, 0]
    assert h.said[-1] == (
        "error: API workers exited 3 times in a row within 10 s of their start (the last, "
        "worker 0, with exit code 2; its error is above); stopping"
    )
    assert len(h.said) == 3  # two replacements said, then the stop
    assert h.started[1][1].terminated  # the other worker is stopped too


def test_a_worker_that_lived_resets_the_count_of_quick_deaths() -> None:
    events: dict[int, Callable[[Harness], None]] = {
        1: lambda h: h.die(0, 1),
        2: lambda h: h.die(0, 1),
        3: lambda h: setattr(h, "step_s", 60.0),
        4: lambda h: h.die(0, 1),  # lived a minute: a fresh start of the count
        5: lambda h: setattr(h, "step_s", 1.0),
        6: lambda h: h.die(0, 1),
        7: lambda h: h.supervisor.stop(),
    }
    h = Harness(events, step_s=1.0)
    assert h.supervisor.run() == 0
    assert h.supervisor.replaced == 4


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    h = Harness({2: lambda h: h.supervisor.stop()}, step_s=1.0)
    h.stubborn = True
    assert h.supervisor.run() == 0
    assert all(w.terminated and w.killed for _, w in h.started)
    assert h.said == [
        f"warning: API worker {slot} (pid {w.pid}) did not stop within 5 s of SIGTERM; killed"
        for slot, w in h.started
    ]
