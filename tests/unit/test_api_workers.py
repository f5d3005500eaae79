"""The supervisor of ``batching api --workers N`` (``batching.cli.api_workers``), on fake
processes and a fake clock: a worker that dies is replaced, workers that keep dying at their
start stop the server, and a stop terminates every worker, killing one that stays."""

from __future__ import annotations

import itertools
import os
import signal
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from batching.cli import api_workers
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
        waiting = self.supervisor._retry_at
        live = [w.sentinel for s, w in self.supervisor.workers.items() if s not in waiting]
        assert sorted(sentinels) == sorted(live)
        self.now += self.step_s
        self.waits += 1
        event = self.events.get(self.waits)
        if event is not None:
            event(self)

    def die_live(self, code: int) -> None:
        """Every worker not waiting out a pause dies with ``code``."""
        for slot in list(self.supervisor.workers):
            if slot not in self.supervisor._retry_at:
                self.die(slot, code)

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


def test_workers_all_dying_at_their_start_stop_the_server_with_exit_1() -> None:
    events: dict[int, Callable[[Harness], None]] = {
        k: (lambda h: h.die_live(1)) for k in range(1, 40)
    }  # every live worker dies a second after its start
    h = Harness(events, step_s=1.0)
    assert h.supervisor.run() == 1
    assert h.said[-1].startswith(
        "error: every API worker exited within 10 s of its start 3 times in a row (the last, "
    )
    pauses = [line.rsplit("another", 1)[1] for line in h.said[:-1]]
    assert pauses == [" in 1 s", " in 1 s", " in 2 s", " in 2 s", " in 4 s"]  # per slot
    assert all(w.exitcode is not None for _, w in h.started)


def test_a_bad_input_at_every_start_exits_2_as_the_single_process_does() -> None:
    events: dict[int, Callable[[Harness], None]] = {
        k: (lambda h: h.die_live(2)) for k in range(1, 40)
    }
    h = Harness(events, step_s=1.0)
    assert h.supervisor.run() == 2


def test_one_slot_dying_at_its_start_backs_off_while_the_other_serves() -> None:
    """A database down for a moment when a worker dies: its replacements fail, each after a
    longer pause, and the server goes on with the other worker (it stopped whole, exit 1,
    within two seconds: a review)."""
    events: dict[int, Callable[[Harness], None]] = {}
    for k in range(1, 60):
        events[k] = lambda h: h.die(1, 1) if 1 not in h.supervisor._retry_at else None
    events[60] = lambda h: h.supervisor.stop()
    h = Harness(events, step_s=1.0)
    assert h.supervisor.run() == 0
    pauses = [float(line.split(" in ")[-1].split()[0]) for line in h.said if " in " in line]
    assert pauses[:6] == [1, 2, 4, 8, 16, 30]
    assert set(pauses[6:]) <= {30}
    assert all(slot == 1 for slot, _ in h.started[2:])
    assert h.started[0][1].terminated  # the first worker served to the end


def test_a_worker_that_lived_resets_its_slots_pause() -> None:
    events: dict[int, Callable[[Harness], None]] = {
        1: lambda h: h.die(0, 1),  # quick: a pause of 1 s
        3: lambda h: h.die(0, 1),  # quick again: 2 s
        6: lambda h: setattr(h, "step_s", 60.0),
        7: lambda h: h.die(0, 1),  # lived a minute: replaced at once
        8: lambda h: h.supervisor.stop(),
    }
    h = Harness(events, step_s=1.0)
    assert h.supervisor.run() == 0
    assert [line.rsplit("another", 1)[1] for line in h.said] == [" in 1 s", " in 2 s", ""]


def test_the_stop_hook_runs_before_the_workers_are_stopped() -> None:
    calls: list[str] = []
    h = Harness({1: lambda h: h.supervisor.stop()}, step_s=1.0)
    h.supervisor._on_stop = lambda: calls.append(
        "closed" if not any(w.terminated for _, w in h.started) else "late"
    )
    h.supervisor.run()
    assert calls == ["closed"]


def test_a_worker_that_ignores_sigterm_is_killed_after_the_grace() -> None:
    h = Harness({2: lambda h: h.supervisor.stop()}, step_s=1.0)
    h.stubborn = True
    assert h.supervisor.run() == 0
    assert all(w.terminated and w.killed for _, w in h.started)
    assert h.said == [
        f"warning: API worker {slot} (pid {w.pid}) did not stop within 5 s of SIGTERM; killed"
        for slot, w in h.started
    ]


def test_a_metrics_folder_left_by_a_killed_parent_is_removed_by_the_next(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    left = tmp_path / f"batching-api-metrics-{dead.pid}-abc"
    live = tmp_path / f"batching-api-metrics-{os.getppid()}-def"  # another parent, running
    other = tmp_path / "batching-api-metrics-notapid"
    for folder in (left, live, other):
        folder.mkdir()
    made = Path(api_workers._metrics_folder())
    assert made.name.startswith(f"batching-api-metrics-{os.getpid()}-")
    assert not left.exists()
    assert live.exists()
    assert other.exists()


def test_a_worker_that_cannot_be_started_stops_those_already_started() -> None:
    h = Harness({}, step_s=1.0)
    started = h.start

    def start(slot: int) -> FakeWorker:
        if slot == 1:
            raise OSError("Resource temporarily unavailable")
        return started(slot)

    h.supervisor._start = start
    with pytest.raises(OSError, match="Resource temporarily"):
        h.supervisor.run()
    assert [(slot, w.terminated) for slot, w in h.started] == [(0, True)]
