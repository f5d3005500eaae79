"""The scoring loop: claim -> micro-batch -> decode -> forward -> commit, as overlapped stages.

Four threads joined by bounded queues, so memory stays bounded and no stage waits on another
more than it must:

* **claim**: claims items under a lease whenever fewer than half a claim's worth are pending,
  and adds them to the micro-batcher; a claim is mostly database time, which overlaps the
  stages below.
* **dispatch** (the caller's thread): when the forward stage is free, takes the next batch from
  the batcher and decodes it; the next batch keeps growing while the model is busy, and its
  decode overlaps the current forward pass.
* **forward**: runs the model on one decoded batch at a time.
* **commit**: commits outputs through the sink (outputs and ack in one transaction, only while
  the lease is held) and fails the items the model could not score; scored batches that wait
  for it are committed together (group commit).

A heartbeat thread extends every live lease every ``heartbeat_s``. ``stop()`` (wired to SIGTERM
by the CLI) stops claiming, releases items not yet in flight without using an attempt,
finishes the batches in flight, and returns.

The forward stage feeds each result to the retry-storm breaker (``breaker``): a batch whose
every item failed in the model is held (still leased) until a batch scores; enough of them in
a row pause the queue (``pause_queue``) and fail the run with ``RetryStorm``, everything it
holds released without using an attempt. A rollout's candidate batches bypass it: the guard
judges the candidate, and rolls it back rather than pause the queue.

Adapters (queue, runner, sink) are passed in; this module imports none of them.

Why it stays one module: the threads share one state (the leases held, the items pending in
the batcher, the first error) under two locks. What they hand each other (``stages``) and
what they count (``stats``) live apart; the code that takes the locks stays together, so
the locking reads in one place.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import itertools
import logging
import math
import operator
import queue as stdqueue
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from typing import Generic, TypeVar

from batching import errors, models, outcomes, ports, routing, tenant_share
from batching.config import PipelineConfig
from batching.loop import breaker, watchdog
from batching.loop.routes import Router, ShadowRows
from batching.loop.stages import END, D, Dispatched, End, LeasePart, Scored, by_lease, has_deadline
from batching.loop.stats import Progress, RunLimits, RunStats, Samples
from batching.policy.adaptive import SloController
from batching.policy.batcher import Late, MicroBatcher, ServiceTime
from batching.ports import Clock

logger = logging.getLogger(__name__)
J = TypeVar("J", Dispatched, Scored)  # type: ignore[type-arg]
CLAIM_LEAD_MIN_S = 0.002
"""The least time before a batch is cut that a held claim goes (``Scorer._claim_hold_s``)."""
CLAIM_HOLD_MAX_S = 0.25
"""The longest a held claim waits before it looks again (a long pass is held in steps)."""


class Scorer(Generic[D]):
    """Drains a queue through the model into a sink, within ``RunLimits``; ``D`` is the
    runner's decoded batch (``stages``).

    Args:
        config: the pipeline config (queue lease/heartbeat, batching policy).
        queue, runner, outputs: the ports (``protocols``): ``SqlQueue``, ``TorchRunner``,
            ``sinks.Outputs`` (a sink, and the run and model version it records).
        service_time: predicted forward seconds for (n_items, length), for deadline releases.
        on_progress: called from the commit thread after every group commit.
        pause_queue: called with the reason when the retry-storm breaker trips, before the
            items are released (``controls.pause`` on the queue); None: nothing is paused.
        observer: told what the run does as it goes (the metrics; ``ports.ScoreObserver``).
    """

    def __init__(
        self,
        config: PipelineConfig,
        queue: ports.ClaimPort,
        runner: ports.RunnerPort[D],
        outputs: ports.CommitPort,
        *,
        clock: Clock = time.time,
        service_time: ServiceTime | None = None,
        on_progress: Progress | None = None,
        wait_for_work: Callable[[float], object] | None = None,
        pause_queue: Callable[[str], object] | None = None,
        observer: ports.ScoreObserver | None = None,
        runners: Callable[[str], ports.RunnerPort[D]] | None = None,
        shadow_out: Callable[[ShadowRows], object] | None = None,
        model_version: str = "",
        pin: routing.Pin | None = None,
    ) -> None:
        self.config = config
        self.queue = queue
        # A rollout's route: each batch split by the version that scores it (``routes``)
        self.router = Router(runner, runners, shadow_out, model_version, pinned=pin is not None)
        self.pin = pin  # serve one version of a rollout: claim only its items
        self.outputs = outputs
        self.clock = clock
        policy = config.batching
        # SLO-adaptive release (``batching.adaptive``): told every forward, decode and commit
        self.controller = (
            SloController.for_policy(
                config.latency_slo_s, service_time, policy.max_batch_size, policy.length_buckets
            )
            if policy.adaptive
            else None
        )
        self.batcher = MicroBatcher(
            policy,
            clock,
            service_time,
            adaptive=self.controller,
            late_policy=config.queue.late_policy,
            default_deadline_s=config.queue.default_deadline_s,
            fair=(
                tenant_share.FairShare(config.queue.tenant_weights, config.queue.max_tenant_wait_s)
                if config.queue.fair_share
                else None
            ),
        )
        self.on_progress = on_progress
        self.observer: ports.ScoreObserver = observer or ports.NoObserver()
        self._wait = wait_for_work or (lambda s: time.sleep(s))
        self._stop = threading.Event()
        # Set only once the forward and commit stages are done: a stop() ends claims at once,
        # but the batches still in flight need their leases until they commit.
        self._stages_done = threading.Event()
        self._wake = threading.Event()  # new items, a free forward stage, or claims over
        self._claim_wanted = threading.Event()  # a batch left the batcher
        self._claims_over = threading.Event()
        self._exhausted = False  # the last claim found nothing ready
        # Suspects (items of a lost worker) wait: claim them alone once nothing is in flight.
        self._isolating = False
        self._unsettled = False  # a commit was cut off: settle its batch again at the end
        self._batch_lock = threading.Lock()  # the batcher: claim thread adds, dispatcher polls
        self._leases: dict[str, int] = {}
        # Leases whose items could not be given back (the database was cut off): the run's
        # retry gives them back before it claims (``compose.run``), not their expiry.
        self.unreleased: set[str] = set()
        self._open_lease: str | None = None  # claims add to it while it holds items
        self._open_lease_at = -math.inf  # when it was opened
        self._item_lease: dict[int, str] = {}
        # Forward passes, named for the ledger: unique across scorers, workers and attempts of
        # a run (each numbers its own), so a replay never merges two passes into one.
        self._pass_prefix = uuid.uuid4().hex[:12]
        self._pass_n = itertools.count(1)
        self._lock = threading.Lock()
        self._to_forward: stdqueue.Queue[Dispatched[D] | End] = stdqueue.Queue(maxsize=1)
        self._to_commit: stdqueue.Queue[Scored | End] = stdqueue.Queue(
            maxsize=config.batching.max_inflight_batches
        )
        self._error: BaseException | None = None
        # Jobs a stage could not hand on after another failed: released at the shutdown.
        self._stranded: list[Dispatched[D] | Scored] = []
        self.stats = RunStats(started_at=clock(), latencies_s=Samples([config.latency_slo_s]))
        self.breaker: breaker.Breaker[Scored] = breaker.Breaker(config.breaker)
        # A pass that never returns: found by the heartbeat (``watchdog``), settled at the end.
        self._watch: watchdog.ForwardWatch[Dispatched[D]] = watchdog.ForwardWatch(
            config.queue.forward_timeout_s
        )
        self._isolated: set[str] = set()  # leases of isolation rounds (``crashes``)
        self._in_flight: tuple[object, bool] = (runner, False)  # the pass's runner, candidate?
        self._shadow_hung = False  # a shadow pass hung: no more shadowing this run
        self.pause_queue = pause_queue
        self._paused = False  # a claim found the queue paused (``models.Claim.paused``)
        self._claim_s: float | None = None  # a claim's seconds, moving average (_claim_lead_s)

    @property
    def runner(self) -> ports.RunnerPort[D]:
        """The run's own model (the router's, for batches without a version)."""
        return self.router.runner

    @runner.setter
    def runner(self, runner: ports.RunnerPort[D]) -> None:
        self.router.runner = runner

    def stop(self) -> None:
        """Ask the run to finish: no new claims, in-flight batches commit, the rest is released."""
        self._stop.set()

    def run(self, limits: RunLimits | None = None) -> RunStats:
        """Score until a limit is reached; returns the run's stats (also on ``stop()``)."""
        threads = [
            threading.Thread(
                target=self._guard, args=(self._forward_loop,), name="forward", daemon=True
            ),
            threading.Thread(
                target=self._guard, args=(self._commit_loop,), name="commit", daemon=True
            ),
            threading.Thread(
                target=self._guard, args=(self._heartbeat_loop,), name="heartbeat", daemon=True
            ),
        ]
        self.observer.started(self.stats.started_at)
        for t in threads:
            t.start()
        try:
            self._feed(limits or RunLimits())
        finally:
            try:
                self._release_pending()
            finally:  # a failed release still ends the stages and the heartbeats
                self._put(self._to_forward, END)
                while threads[0].is_alive() and self._watch.hung is None:
                    threads[0].join(0.2)  # a hung pass never returns (``watchdog``)
                    if not threads[2].is_alive():  # no heartbeat left to watch it
                        self._watch_forward()
                threads[1].join()
                if self._error is not None:  # the forward stage is gone: nothing settles these
                    with self._lock:
                        self._stranded.extend(self.breaker.settle())
                self._release_stranded()
                fate = self._judge_hung()  # the probe, while the heartbeats go on
                self._settle()
                self._stop.set()
                self._stages_done.set()
                threads[2].join()
                self._settle_hung(fate)  # after the last heartbeat: an ended lease stays so
                self.stats.finished_at = self.clock()
                if self.controller is not None:
                    self.stats.adaptive = self.controller.terms()
                self.observer.finished(self.stats.finished_at)
        if self._error is not None:
            raise self._error
        return self.stats

    # -- feeder ------------------------------------------------------------------------------

    def _feed(self, limits: RunLimits) -> None:
        """Run the claim thread and the dispatch loop (this thread) until claims are over and
        every claimed item has been dispatched, or the run stops."""
        claimer = threading.Thread(
            target=self._guard, args=(functools.partial(self._claim_loop, limits),), name="claim"
        )
        claimer.daemon = True
        claimer.start()
        try:
            # Guarded like every stage: a failed decode or Ctrl-C stops the claim thread too,
            # and run() raises it once everything is released.
            self._guard(self._dispatch_loop)
        finally:
            self._claim_wanted.set()
            claimer.join()

    def _claim_loop(self, limits: RunLimits) -> None:
        """Claim whenever fewer than ``_low_water()`` items are pending, so claims (mostly
        database time, without the GIL) overlap decoding and the forward pass."""
        deadline = self.clock() + limits.max_seconds if limits.max_seconds is not None else None
        idle_s = self.config.queue.poll_s
        try:
            while not self._stop.is_set() and self._error is None:
                if (limits.max_items is not None and self.stats.claimed >= limits.max_items) or (
                    deadline is not None and self.clock() >= deadline
                ):
                    return
                if self._pending() >= self._low_water() or (
                    self._isolating and not self._drained()
                ):
                    self._claim_wanted.wait(self.config.queue.poll_s)
                    self._claim_wanted.clear()
                    continue
                hold_s = self._claim_hold_s()
                if hold_s > 0:
                    self._claim_wanted.wait(hold_s)
                    self._claim_wanted.clear()
                    continue
                got = self._claim(limits)
                self._exhausted = not got
                self._wake.set()
                if got:
                    idle_s = self.config.queue.poll_s
                else:
                    if limits.until_empty:
                        return
                    # Poll again only after idle_s (new items wake it sooner: a NOTIFY on
                    # PostgreSQL, a data_version change on SQLite): each claim is a write
                    # transaction, and an idle scorer should cost the database next to nothing.
                    # It doubles while nothing is found, up to idle_poll_max_s.
                    self._wait(idle_s)
                    idle_s = min(2 * idle_s, max(self.config.queue.idle_poll_max_s, idle_s))
        finally:
            self._claims_over.set()
            self._wake.set()

    def _claim_hold_s(self) -> float:
        """Seconds to hold the next claim: online, under the adaptive rule and ``late_policy:
        expire``, while the model is busy with a pass that ends later than a claim and a
        decode from now. The next batch is cut as that pass ends (``SloController.due``), so
        an item claimed any earlier waits in the batcher all the same; claimed on each
        enqueue's commit instead, as they came, a scorer at half its capacity made ~1.7
        claims an arrival (0.8 with items), the largest part of its CPU beside the model's
        (docs/design.md, "Claims paced by the pass"). The claim goes ``_claim_lead_s``
        before the predicted cut; a pass that runs past its prediction holds nothing.
        0: claim now."""
        ctrl = self.controller
        if (
            ctrl is None
            or self.config.profile != "online"
            # under ``score`` an item whose own deadline passes while it waits in the table
            # is expired by the next claim, where claimed at once it would be scored late
            or self.config.queue.late_policy != "expire"
            or self._isolating
            or not self._watch.in_flight  # by the clock alone, a step back would hold claims
        ):
            return 0.0
        # the cut goes a decode ahead of the pass's end: of what is pending and one more
        size = min(self.config.batching.max_batch_size, self._pending() + 1)
        cut_at = ctrl.busy_until - ctrl.lead_s(size)
        return min(CLAIM_HOLD_MAX_S, max(0.0, cut_at - self._claim_lead_s() - self.clock()))

    def _claim_lead_s(self) -> float:
        # twice a claim's recent time (EWMA), and never under CLAIM_LEAD_MIN_S
        return max(CLAIM_LEAD_MIN_S, 2.0 * (self._claim_s or 0.0))

    def _dispatch_loop(self) -> None:
        while not self._stop.is_set() and self._error is None:
            self._wake.clear()  # before looking: a wake-up after this line is not lost
            over = self._claims_over.is_set()
            flush = over or self._isolating or self._bulk_ready() or self._dry_flush()
            if self._to_forward.empty() and self._dispatch(flush=flush):
                continue
            if over and self._pending() == 0:
                return
            self._idle()

    def _dry_flush(self) -> bool:
        # The last claim found the queue empty: nothing more is coming to wait for, so the
        # fixed window goes at once. Not with the adaptive rule: it already takes a batch at
        # once at a free model, and a flush cut the next batch as the forward in flight
        # started, where the rule lets it grow until that forward ends (the flushed batch
        # only waited in the hand-off meanwhile, smaller).
        return self._exhausted and self.controller is None

    def _pending(self) -> int:
        with self._batch_lock:
            return len(self.batcher)

    def _bulk_ready(self) -> bool:
        # Bulk profile: throughput only. Once a full batch is pending, cut length-sorted batches
        # (the batcher's flush cut) instead of waiting for a bucket to fill or a window to pass.
        size = self.config.batching.max_batch_size
        return self.config.profile == "bulk" and self._pending() >= size

    def _low_water(self) -> int:
        # Claim again once fewer than half a claim (and at least two full batches) are
        # pending: the claim runs while those are decoded and scored, and each claim takes a
        # full claim_size, so write transactions stay rare (one per item would contend with
        # every commit for SQLite's write lock). Online, one full batch: a backlog held in
        # the batcher is served oldest first, one left in the queue is claimed by tenants'
        # fair shares (and what is claimed commits under one lease, so claims cost no commits).
        batching = self.config.batching
        batches = 1 if self.config.profile == "online" else 2
        return max(batching.effective_claim_size // 2, batches * batching.max_batch_size)

    def _drained(self) -> bool:
        with self._lock:
            return not self._leases

    def _claim(self, limits: RunLimits) -> bool:
        """One claim; False when nothing was ready. Suspects (the items of a worker that died)
        are claimed in isolation rounds: once the claims before have all committed, the
        suspects' own claim, flushed at once, and no other claim until it is done. A death
        then is charged to them alone (``batching.crashes``)."""
        n = self.config.batching.effective_claim_size
        if limits.max_items is not None:
            n = min(n, limits.max_items - self.stats.claimed)
        started = time.perf_counter()
        with self._lock:  # add to the lease still held: a batch then spans one lease
            open_lease = self._open_lease if self._open_lease in self._leases else None
            if self.clock() - self._open_lease_at >= self.config.queue.lease_s / 2:
                # Not past half a lease: no item of it can have expired and been reaped yet,
                # so an id is never given to an item after one of its items could be
                # taken back (reaped items are suspects, claimed apart, besides).
                open_lease = None
        claim = self.queue.claim(
            n,
            lease_s=self.config.queue.lease_s,
            lane=self.config.queue.lane,
            columns=True,
            isolate=self._isolating,
            lease_id=None if self._isolating else open_lease,
            pin=self.pin,
        )
        took = time.perf_counter() - started
        self.stats.stage_s["claim"] += took
        if claim.items:  # a claim that finds nothing reads, and is no guide to one that writes
            self._claim_s = (
                took if self._claim_s is None else self._claim_s + 0.2 * (took - self._claim_s)
            )
        if claim.paused != self._paused:  # once per change, not once per poll
            paused = (
                "queue paused; this run ends once its batches are done (--until-empty)"
                if limits.until_empty
                else "queue paused; waiting for `batching queue resume`"
            )
            logger.warning(
                paused if claim.paused else "queue resumed; claiming",
                extra={"action": "queue_paused" if claim.paused else "queue_resumed"},
            )
        self._paused = claim.paused
        self.router.observe(claim.route)
        if claim.expired:  # its transaction expired items past their deadline first
            self.observer.expired(claim.expired)
            self.stats.expired += sum(n for _, n in claim.expired)  # as the metric counts
        if claim.isolated:
            self.stats.isolated += len(claim.items)
            self._isolating = bool(claim.items)
            self._isolated.add(claim.lease_id)
        else:
            self._isolating = claim.suspects
        if not claim.items:
            return self._isolating or claim.isolated
        with self._lock:
            self._leases[claim.lease_id] = self._leases.get(claim.lease_id, 0) + len(claim.items)
            if claim.lease_id != self._open_lease:
                self._open_lease_at = self.clock()
            self._open_lease = None if claim.isolated else claim.lease_id
            ids = models.item_column(claim.items, "id")
            self._item_lease.update(zip(ids, itertools.repeat(claim.lease_id)))
        self.stats.claimed += len(claim.items)
        with self._batch_lock:
            self.batcher.add(claim.items)
        return True

    def _dispatch(self, *, flush: bool) -> bool:
        with self._batch_lock:
            batch = self.batcher.poll(flush=flush)
            late = self.batcher.take_late()
        if late:
            self._expire(late)
        if batch is None:
            return bool(late)
        self._claim_wanted.set()
        ids = models.item_column(batch.items, "id")
        with self._lock:  # the leases as claimed now: a reaped item may be claimed again
            leases = dict(zip(ids, map(self._item_lease.__getitem__, ids), strict=True))
        parts = self.router.split(batch)  # one per model version (a rollout's route)
        for n, part in enumerate(parts):
            started = time.perf_counter()
            try:
                try:
                    runner = self.router.runner_for(part)
                except (errors.ModelError, errors.CheckpointError) as exc:
                    if not self.router.is_candidate(part):  # the stable one: the run stops
                        raise
                    self._unloadable(part, leases, exc)  # the candidate's fault: its items fail
                    continue
                decoded = runner.decode(part.items)
            except BaseException:
                with self._batch_lock:  # back where the shutdown releases them from
                    for rest in parts[n:]:
                        self.batcher.add(rest.items)
                raise
            decode_s = time.perf_counter() - started
            self.stats.stage_s["decode"] += decode_s
            if self.controller is not None:
                self.controller.decoded(len(part), decode_s)
            if len(parts) > 1:
                part_ids = set(models.item_column(part.items, "id"))
                part_leases = {i: lease for i, lease in leases.items() if i in part_ids}
            else:
                part_leases = leases
            pass_id = f"{self._pass_prefix}-{next(self._pass_n)}"  # the ledger records its items
            part = dataclasses.replace(part, pass_id=pass_id)
            self._put(self._to_forward, Dispatched(part, part_leases, decoded))
        return True

    def _unloadable(
        self, part: models.Batch, leases: dict[int, str], exc: errors.BatchingError
    ) -> None:
        """A rollout routed ``part`` to its candidate, which cannot be loaded (a checkpoint not
        the pinned one, a factory that raises): its items fail as if its forward pass had
        failed them, recorded against that version, so the rollout's guard sees its error rate
        and rolls it back, and the stable version's items go on being scored (before, the run
        ended, and every scorer of the queue with it, while the guard saw nothing). A stable
        version that cannot load still stops the run, its items given back: no guard judges
        it, and every item of the queue would be charged."""
        version = self.router.version_of(part)
        reason = f"{errors.one_line(exc)}; the rollout's guard rolls it back"
        logger.warning(
            "model version cannot be loaded; its items fail, charged to it",
            extra={"action": "version_unloadable", "model_version": version, "error": reason},
        )
        by_lease: dict[str, list[models.WorkItem]] = {}
        for item in part.items:
            by_lease.setdefault(leases[item.id], []).append(item)
        for lease_id, items in by_lease.items():
            self._forget(lease_id, items)  # before they can be claimed again (see _forget)
            res = self.queue.fail(
                lease_id, {i.id: reason for i in items}, retry=True, model_version=version
            )
            self.stats.failed += res.retried + res.dead
            self.stats.count_failures([reason] * len(items))
            self.observer.failed(items, retry=True, model_version=version)
        self._claim_wanted.set()

    def _expire(self, late: list[Late]) -> None:
        """Expire items the batcher found late (``late_policy: expire``), unscored, each
        with its reason; counted in the stats and the metrics."""
        self._claim_wanted.set()
        by_lease: dict[str, list[Late]] = {}
        with self._lock:
            for one in late:
                by_lease.setdefault(self._item_lease[one.item.id], []).append(one)
        for lease_id, part in by_lease.items():
            n = self.queue.expire(lease_id, {one.item.id: one.reason for one in part})
            self.stats.expired += n
            items = [one.item for one in part]
            if n:
                tenants = collections.Counter(item.tenant for item in items)
                self.observer.expired(sorted(tenants.items()))
            self._forget(lease_id, items)

    def _put(self, q: stdqueue.Queue[J | End], job: J | End) -> None:
        # A stage that died never takes its next job: give up once an error is recorded, and
        # leave the job with the others stranded between the stages, for the shutdown to release.
        while self._error is None:
            try:
                q.put(job, timeout=0.1)
                return
            except stdqueue.Full:
                continue
        if not isinstance(job, End):
            with self._lock:
                self._stranded.append(job)

    def _get(
        self, q: stdqueue.Queue[J | End], on_idle: Callable[[], None] | None = None
    ) -> J | End:
        while self._error is None:
            try:
                return q.get(timeout=0.1)
            except stdqueue.Empty:
                if on_idle is not None:
                    on_idle()
        return END

    def _idle(self) -> None:
        # The model is busy: even a due batch waits (no spinning) until the forward stage takes
        # its next batch. Otherwise sleep until the next batch is due, new items arrive, or
        # poll_s passes.
        pause = self.config.queue.poll_s
        if self._to_forward.empty():
            with self._batch_lock:
                wake = self.batcher.next_deadline()
            if wake is not None:
                pause = min(pause, max(0.0, wake - self.clock()))
        if pause > 0:
            self._wake.wait(pause)

    # -- forward and commit ------------------------------------------------------------------

    def _forward_loop(self) -> None:
        while True:
            job = self._get(self._to_forward, on_idle=self._settle_when_idle)
            self._wake.set()  # the forward stage is free: the dispatcher may decode the next
            if isinstance(job, End):
                self._settle_held()
                self._put(self._to_commit, END)
                return
            controller, batch = self.controller, job.batch
            if controller is not None:
                cost = max(models.item_column(batch.items, "cost"))
                controller.forward_started(len(batch), cost, self.clock())
            started = time.perf_counter()
            runner = self.router.runner_for(batch)
            # what ran it, for the watchdog's probe: the route may change while it hangs
            self._in_flight = (runner, self.router.is_candidate(batch))
            self._watch.started(job)
            try:
                result = runner.forward(job.decoded)
            finally:  # a pass that raised is no pass in flight
                hung = self._watch.finished()
            if hung:  # declared hung meanwhile: settled by the watchdog
                return
            forward_s = time.perf_counter() - started
            self.stats.stage_s["forward"] += forward_s
            shadowed = self._shadow(batch, result)  # a rollout's sample, scored aside
            if shadowed is not None:  # its device time is the candidate's
                self.stats.add_device_time(*shadowed)
                self.stats.shadowed = self.router.shadowed
                self.stats.shadow_failed = self.router.shadow_failures
            if controller is not None:
                controller.forward_done(len(batch), cost, forward_s, self.clock(), batch.formed_at)
                self._wake.set()  # the model is free: the next batch may go now
                self._claim_wanted.set()  # a claim held for a pass that ended early goes now
            self._hand_on(Scored(job.batch, job.leases, result))

    def _shadow(
        self, batch: models.Batch, result: outcomes.ScoreResult
    ) -> tuple[Sequence[models.WorkItem], str, float] | None:
        """The router's shadow pass, bounded by ``forward_timeout_s``: a candidate that hangs
        on it is left behind (a daemon thread), counted as failed, and shadowing stops for
        the run; the batch commits as scored, as after any shadow failure."""
        if self._shadow_hung or not self.router.shadows(batch):  # no thread a batch for nothing
            return None
        box: list[tuple[Sequence[models.WorkItem], str, float] | None] = []
        thread = threading.Thread(
            target=lambda: box.append(self.router.shadow(batch, result)),
            name="shadow",
            daemon=True,
        )
        thread.start()
        thread.join(self._watch.timeout_s)
        if box:
            return box[0]
        self._shadow_hung = True
        self.router.shadow_failures += len(batch)
        logger.error(
            "shadow pass hung past queue.forward_timeout_s; shadowing stops for this run, the "
            "batch commits as scored (roll the candidate back: `batching rollout rollback`)",
            extra={"action": "shadow_hung", "n_items": len(batch)},
        )
        return None

    # -- retry-storm breaker (``breaker``) ------------------------------------------------------

    def _hand_on(self, job: Scored) -> None:
        """Through the breaker to the commit stage: held while a streak is undecided; on a
        trip, the streak's batches wait with the stranded ones for the shutdown's release."""
        result = job.result
        if self.router.is_candidate(job.batch):
            # A candidate's failures are the rollout guard's to judge (it rolls the candidate
            # back); through the breaker they would pause the queue for the stable traffic.
            self._put(self._to_commit, job)
            return
        step = self.breaker.observe(
            job, breaker.verdict(result), len(job.batch), result.whole_batch_error
        )
        for ready in step.forward:
            self._put(self._to_commit, ready)
        if step.trip is None:
            return
        if self._model_works(job.batch, step.trip.jobs):  # poison items, not a broken model
            logger.warning(
                "batches failed whole, but the model scores its own probe input: their items "
                "failed on their own inputs and are charged (no retry storm)",
                extra={"action": "breaker_probe_passed", "n_batches": len(step.trip.jobs)},
            )
            for held in step.trip.jobs:
                self._put(self._to_commit, held)
            return
        self._trip(step.trip)

    def _model_works(self, batch: models.Batch, streak: Sequence[Scored]) -> bool:
        """The runner's own probe (``TorchRunner.healthy``), False without one: before, a run
        of poison items in a row (more batches of them than ``max_failed_batches``) tripped
        the breaker at every run, paused the queue and was never charged. False too when a
        batch of the streak showed the model at fault (a contract every batch breaks and no
        item alone: a probe of one item passes it)."""
        if any(job.result.model_at_fault for job in streak):
            return False
        probe = getattr(self.router.runner_for(batch), "healthy", None)
        within = min(self._watch.timeout_s, watchdog.PROBE_S)  # a stuck device hangs it too
        return watchdog.probe(probe, within) is True

    def _trip(self, trip: breaker.Trip[Scored]) -> None:
        """Pause the queue, leave the streak's batches to be released, fail the run: raising
        here stops the claims, and the shutdown releases all the run holds (``run``)."""
        self.stats.breaker_trips += 1
        self.observer.breaker_tripped()
        why = breaker.pause(
            self.pause_queue,
            self.config.breaker,
            f"retry storm: {len(trip.sizes)} batches in a row failed: {trip.error}",
        )
        with self._lock:
            self._stranded.extend(trip.jobs)
        raise errors.RetryStorm(trip.message(self.config.queue.name, why))

    def _settle_when_idle(self) -> None:
        """The forward stage is idle: once the run holds nothing but the held batches and no
        claim is coming (the queue ran dry or is paused, claims are over, or an isolation
        round waits for the run to drain), no batch will decide the streak: settle it."""
        held = self.breaker.held_items
        if not held or not (self._exhausted or self._isolating or self._claims_over.is_set()):
            return
        with self._lock:
            leased = sum(self._leases.values())
        if leased <= held:
            self._settle_held()

    def _settle_held(self) -> None:
        """End an undecided streak: its failures are applied (an attempt used each, as for a
        broken streak), or, when the queue was found paused, its items are released."""
        jobs = self.breaker.settle()
        if self._paused:
            for job in jobs:
                self._release_job(job)
            return
        for job in jobs:
            self._put(self._to_commit, job)

    def _commit_loop(self) -> None:
        # Idle for 0.1 s: the sink records what it deferred (the Parquet sink's publish marks),
        # so a quiet scorer leaves nothing pending for long. Under load, marks ride on commits.
        finished = False
        try:
            while not finished:
                job = self._get(self._to_commit, on_idle=self._flush_sink)
                if isinstance(job, End):
                    break
                jobs, finished = self._group(job)
                started = time.perf_counter()
                self._commit(jobs)
                self.stats.stage_s["commit"] += time.perf_counter() - started
                if self.on_progress is not None:
                    self.on_progress(self.stats)
        finally:  # also when a commit failed: what was published gets its mark
            self._flush_sink()

    def _flush_sink(self) -> None:
        # What a sink defers is recorded later anyway (the next commit, recover()): a database
        # hiccup here is logged, never a reason to fail the run.
        try:
            self.outputs.flush()
        except errors.QueueError:
            logger.warning("sink flush failed; retried later", exc_info=True)

    def _group(self, first: Scored) -> tuple[list[Scored], bool]:
        """Group commit: ``first`` plus the scored batches already waiting, or arriving within
        ``output.commit_interval_s`` (0: none), up to ``output.max_rows_per_commit`` rows. It
        turns many small commits (a file, fsyncs and transactions each) into one: under load
        without waiting; when the model is the bottleneck, only by waiting (W2 bulk at 1 s: 8
        files for 3,000 rows against 101, and 5-8% more rows/s). The end of the run closes the
        group at once; so does an item with a deadline (the batcher released it in time for
        the deadline, not for the deadline plus the wait) and a failed stage.
        """
        jobs, rows = [first], len(first.batch)
        interval = self.config.output.commit_interval_s
        until = time.monotonic() + interval
        urgent = not interval or has_deadline(first.batch)
        while rows < self.config.output.max_rows_per_commit:
            stop = urgent or self._error is not None
            wait_s = 0.0 if stop else min(until - time.monotonic(), 0.1)
            try:
                job = (
                    self._to_commit.get(timeout=wait_s)
                    if wait_s > 0
                    else self._to_commit.get_nowait()
                )
            except stdqueue.Empty:
                if wait_s > 0 and time.monotonic() < until:
                    continue
                break
            if isinstance(job, End):
                return jobs, True
            jobs.append(job)
            rows += len(job.batch)
            urgent = urgent or has_deadline(job.batch)
        return jobs, False

    def _commit(self, jobs: list[Scored]) -> None:
        started, now = time.perf_counter(), self.clock()
        parts = by_lease(jobs)
        for n, (lease_id, part) in enumerate(parts):
            try:
                self.stats.commits += self._commit_lease_part(lease_id, part, now)
            except errors.Disconnected:
                # The connection died mid-commit, so the batch may or may not have committed:
                # what is still leased goes back, and the ledger settles the batch as at
                # start-up (rolled forward if it committed). The pool reconnects; go on.
                self._give_back(parts[n:])
                logger.warning(
                    "database connection lost during a commit; items given back, run goes on",
                    extra={"action": "reconnect", "lease_id": lease_id},
                )
                self._unsettled = True
                try:
                    self.outputs.recover()
                except errors.Disconnected:  # cut again: the run's end settles it (_settle)
                    logger.warning(
                        "database connection lost again; the batch is settled at the run's end",
                        extra={"action": "reconnect", "lease_id": lease_id},
                    )
                return
            except (errors.SinkError, errors.QueueError):
                # The output or the database failed, not these items: give them back without
                # using an attempt (left to the reaper, items on their last one would go dead).
                self._give_back(parts[n:])
                raise
        for job in jobs:
            self.stats.batch_sizes[len(job.batch)] += 1
            self.stats.reasons[job.batch.reason] += 1
            self.stats.service_s.add(job.result.service_s)
            self.stats.real_tokens += job.result.real_tokens
            self.stats.padded_tokens += job.result.padded_tokens
            self.observer.batch_committed(job.batch, job.result)
            version = self.router.version_of(job.batch)
            self.stats.add_device_time(job.batch.items, version, job.result.service_s)
            if self.controller is not None:
                self.controller.committed(job.batch.formed_at, job.result.service_s, self.clock())
        if self.controller is not None:
            self.observer.adaptive_state(self.controller.terms())
        self.observer.commit_timed(time.perf_counter() - started)
        self.observer.heartbeat(self.clock())

    def _commit_lease_part(self, lease_id: str, part: LeasePart, now: float) -> int:
        """Commit one lease's scored items and fail its failed ones; returns sink commits made."""
        made = 0
        ok, outputs, held = part.scored()
        lost = False
        if ok:
            try:
                committed = self.outputs.commit(
                    ok, lease_id, outputs, now, part.model_version, part.forwards
                )
            except errors.LeaseLost as exc:
                logger.warning(
                    "lease lost",
                    extra={"action": "lease_lost", "lease_id": lease_id, "error": str(exc)},
                )
                self.stats.lease_lost += len(ok)
                self.observer.lease_lost(len(ok))
                lost = True
            else:
                done = self.clock()
                self.stats.bytes_written += committed.n_bytes or 0
                self.stats.committed += len(ok)
                if part.model_version is not None:
                    self.stats.by_version[part.model_version] += len(ok)
                since = functools.partial(operator.sub, done)
                self.stats.latencies_s.extend(map(since, models.item_column(ok, "enqueued_at")))
                self.observer.committed(ok, done, part.model_version)
                made = 1
        self._forget(lease_id, held)  # before any goes back to ready (see _forget)
        if lost:
            # Items of the batch the lease still holds (claimed into it later than those
            # that expired) go back now, not when the run ends: its heartbeats would keep
            # them leased, and nobody would commit them.
            self._release_held(lease_id, models.item_column(ok, "id"))
        for failures, retry in ((part.failures, True), (part.undecodable, False)):
            if failures:
                res = self.queue.fail(
                    lease_id, failures, retry=retry, model_version=part.model_version
                )
                self.stats.failed += res.retried + res.dead
                self.stats.count_failures(failures.values())
                failed = [i for i in held if i.id in failures]
                self.observer.failed(failed, retry=retry, model_version=part.model_version)
        return made

    def _release_held(self, lease_id: str, ids: Sequence[int]) -> None:
        try:
            self.stats.released += self.queue.release(lease_id, ids)
        except errors.QueueError:
            self.unreleased.add(lease_id)
            logger.warning(
                "items not released; they return when the lease expires",
                extra={"action": "release_failed", "lease_id": lease_id},
            )

    def _give_back(self, parts: Sequence[tuple[str, LeasePart]]) -> None:
        """Release what these parts hold that is still leased (a committed item is ``done``:
        the fenced release leaves it alone)."""
        for lease_id, part in parts:
            held = part.scored()[2]
            self._forget(lease_id, held)  # before they can be claimed again (see _forget)
            try:
                self.stats.released += self.queue.release(lease_id, models.item_column(held, "id"))
                self.observer.released(held)
            except errors.QueueError:
                self.unreleased.add(lease_id)
                logger.warning(
                    "items not released; they return when the lease expires",
                    extra={"action": "release_failed", "lease_id": lease_id},
                    exc_info=True,
                )

    def _forget(self, lease_id: str, items: Sequence[models.WorkItem]) -> None:
        """Stop tracking ``items`` under ``lease_id``. Called BEFORE they go back to ready
        (release, fail): a claim adds to the open lease, so once ready it may take them again
        under this very lease id, and a forget after that deleted the new claim's entries
        (a chaos review: KeyError in the dispatch and the shutdown after connections were
        cut mid-commit)."""
        ids = models.item_column(items, "id")
        with self._lock:
            owners = map(self._item_lease.get, ids)
            mine = itertools.compress(ids, map(operator.eq, owners, itertools.repeat(lease_id)))
            # not those claimed again since (by another lease)
            collections.deque(map(self._item_lease.__delitem__, list(mine)), maxlen=0)
            left = self._leases.get(lease_id, 0) - len(items)
            if left > 0:
                self._leases[lease_id] = left
            else:
                self._leases.pop(lease_id, None)
                if not self._leases:  # an isolation round may start
                    self._claim_wanted.set()

    # -- leases ------------------------------------------------------------------------------

    def _heartbeat_loop(self) -> None:
        """Extend every lease the run holds, each heartbeat interval. A lease that extends no
        row is reported lost only when it does so twice and the run still holds it: once is
        mostly a commit that acked its last rows between the copy of the leases and the
        heartbeat (its batch still in the commit stage); a lease really lost stays held until
        its commit fails with LeaseLost, which is reported too."""
        interval = self.config.queue.effective_heartbeat_s
        missed: set[str] = set()
        while not self._stages_done.wait(interval):
            self.observer.heartbeat(self.clock())
            self._watch_forward()
            self._watch_schema()
            with self._lock:
                leases = list(self._leases)
            empty = {
                lease_id
                for lease_id in leases
                if self.queue.heartbeat(lease_id, self.config.queue.lease_s) == 0
            }
            with self._lock:
                held = set(self._leases)
            for lease_id in sorted(empty & missed & held):
                logger.warning(
                    "heartbeat found lease lost",
                    extra={"action": "lease_lost", "lease_id": lease_id},
                )
            missed = empty

    def _watch_schema(self) -> None:
        """Stop the run when the database's schema is no longer this release's: a newer
        release migrated it under the run (an upgrade review: a scorer of an older release
        went on claiming by its own rules beside the new one's range leases, and the new one
        threw away 200 items of work on lost leases). Read once a heartbeat, idle or not; a
        database that cannot be read now is the lease heartbeats' to report."""
        if self._stop.is_set():
            return
        changed = schema_changed(self.queue)
        if changed is not None:
            if self._error is None:
                self._error = changed
            self._stop.set()

    def _watch_forward(self) -> None:
        """Stop the run when the pass in flight is past ``forward_timeout_s`` (``watchdog``).
        Its lease is still extended until the shutdown settles the batch."""
        job = self._watch.overdue()
        if job is None:
            return
        logger.error(
            "forward pass hung: past queue.forward_timeout_s; stopping the run",
            extra={
                "action": "forward_hung",
                "n_items": len(job.batch),
                "ran_s": round(self._watch.ran_s, 1),
                "timeout_s": self._watch.timeout_s,
            },
        )
        self.observer.forward_hung()
        self._watch.interrupt()  # a pass hung in Python code ends here
        if self._error is None:  # the message is completed once the batch is settled
            self._error = errors.ForwardHung(
                watchdog.message(self._watch.ran_s, self._watch.timeout_s, len(job.batch), "", None)
            )
        self._stop.set()
        self._wake.set()

    def _judge_hung(self) -> watchdog.Fate | None:
        """The fate of a hung pass's batch by the model's probe (``watchdog.fate``)."""
        job = self._watch.hung
        if job is None:
            return None
        batch, limit = job.batch, self._watch.timeout_s
        runner, candidate = self._in_flight
        works = watchdog.probe(getattr(runner, "healthy", None), min(limit, watchdog.PROBE_S))
        isolated = all(lease_id in self._isolated for lease_id in set(job.leases.values()))
        return watchdog.fate(works, len(batch), isolated=isolated, candidate=candidate)

    def _settle_hung(self, fate: watchdog.Fate | None) -> None:
        """Apply the fate, once the rest of the run is released (the batch's leases then
        hold it alone) and the heartbeats are over (none extends an ended lease again)."""
        job = self._watch.hung
        if job is None or fate is None:
            return
        batch, limit = job.batch, self._watch.timeout_s
        ids_by_lease: dict[str, list[int]] = {}
        for item_id, lease_id in job.leases.items():
            ids_by_lease.setdefault(lease_id, []).append(item_id)
        version = self.router.version_of(batch)
        settled = watchdog.settle(
            self.queue,
            fate,
            ids_by_lease,
            timeout_s=limit,
            lease_s=self.config.queue.lease_s,
            model_version=version,
            pause=functools.partial(breaker.pause, self.pause_queue, self.config.breaker),
        )
        self.stats.failed += settled.failed
        self.stats.released += settled.released
        if settled.failed:
            self.observer.failed(list(batch.items), retry=True, model_version=version)
        if self._error is None or isinstance(self._error, errors.ForwardHung):
            name = self.config.queue.name
            self._error = errors.ForwardHung(
                watchdog.message(self._watch.ran_s, limit, len(batch), name, settled)
            )

    def _release_pending(self) -> None:
        pending = self.batcher.drain() if self._stop.is_set() or self._error is not None else []
        for batch in pending:
            by_lease: dict[str, list[int]] = {}
            with self._lock:
                for item in batch.items:
                    by_lease.setdefault(self._item_lease[item.id], []).append(item.id)
            for lease_id, ids in by_lease.items():
                given = [i for i in batch.items if i.id in set(ids)]
                self._forget(lease_id, given)  # before they can be claimed again
                self.stats.released += self.queue.release(lease_id, ids)
                self.observer.released(given)
        if self.stats.released:
            logger.info(
                "items released", extra={"action": "release", "n_items": self.stats.released}
            )

    def _release_stranded(self) -> None:
        """After a failed stage, give back the batches still queued between the stages: they
        were never run (or ran fine and wait for a commit that will not come). Left leased,
        the run's retry could not claim them until their lease expired. The batch a stage
        failed on is not among them: it keeps its attempt and waits for the reaper, unless
        the output or the database refused its commit (``_give_back``: not its fault)."""
        if self._error is None:
            return
        jobs = self._stranded
        for q in (self._to_forward, self._to_commit):
            while True:
                try:
                    job = q.get_nowait()
                except stdqueue.Empty:
                    break
                if not isinstance(job, End):
                    jobs.append(job)
        for job in jobs:
            self._release_job(job)

    def _release_job(self, job: Dispatched[D] | Scored) -> None:
        """Give back the items of one batch without using an attempt."""
        ids_by_lease: dict[str, list[int]] = {}
        for item_id, lease_id in job.leases.items():
            ids_by_lease.setdefault(lease_id, []).append(item_id)
        for lease_id, ids in ids_by_lease.items():
            mine = set(ids)
            self._forget(lease_id, [i for i in job.batch.items if i.id in mine])  # see _forget
            try:
                self.stats.released += self.queue.release(lease_id, ids)
                self.observer.released([i for i in job.batch.items if i.id in mine])
            except errors.QueueError:
                self.unreleased.add(lease_id)
                logger.warning(
                    "items not released; they return when the lease expires",
                    extra={"action": "release_failed", "lease_id": lease_id},
                    exc_info=True,
                )

    def _settle(self) -> None:
        """After a commit cut off midway: once every lease of the run is committed or given
        back, the ledger settles what that commit staged (the recover() right after it kept
        the staged file while its lease still held other items)."""
        if not self._unsettled:
            return
        try:
            self.outputs.recover()
        except (errors.QueueError, errors.SinkError):
            logger.warning(
                "settling a cut-off commit failed; the next start does it", exc_info=True
            )

    def _guard(self, target: Callable[[], None]) -> None:
        try:
            target()
        except watchdog.Abandoned:  # the watchdog unwound a hung pass: the run is stopping
            return
        except BaseException as exc:
            logger.exception("scoring stage failed", extra={"action": "stage_failed"})
            if not isinstance(self._error, errors.ForwardHung):  # why the run stopped
                self._error = exc
            self._stop.set()


def schema_changed(queue: ports.ClaimPort) -> errors.SchemaError | None:
    """The ``SchemaError`` when ``queue``'s database is no longer at this release's schema
    (logged: the run stops for it), else None; a database that cannot be read now is None
    (the lease heartbeats report that). The scoring loop's and the shard scorer's heartbeat."""
    try:
        queue.check_schema()
    except errors.SchemaError as exc:
        logger.error(
            "database schema changed under the run; stopping it",
            extra={"action": "schema_changed", "error": str(exc)},
        )
        return exc
    except errors.QueueError:
        return None
    return None
