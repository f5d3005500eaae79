"""Bulk scoring in place: the scorer of input shards (:mod:`batching.ingress.shards`).

A :class:`ShardScorer` claims one shard at a time (lane ``shard``), reads its rows from the
input file (refused when the file is not the one planned), scores them in micro-batches of
``batching.max_batch_size`` rows (token inputs sorted by length first, and cut by
``max_batch_cost``), and commits them as one Parquet file with the ack of the shard, in one
transaction (``outputs.shard_batch.ShardBatch``). The next shard is claimed and read ahead,
and this one committed while the next is scored; a heartbeat thread keeps the leases.

A shard whose every row failed is the model's fault, not the rows': it goes back to the queue
under the usual attempt rule. A shard whose file changed or vanished is dead with that
reason. A lost worker's shard is split in two (``shards.split``), claimed with nothing else
in flight. A forward pass runs on a thread of its own, watched like the scoring loop's
(``loop.watchdog``): one that never returns is settled and stops the run.

Why it stays one module: the claim-ahead, scoring, commit and heartbeat threads share the
shards held (``_held``) under one lock; the code that takes it stays together.
"""

from __future__ import annotations

import concurrent.futures as cf
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NoReturn

import pyarrow as pa

from batching import config as cfg
from batching import errors, models, ports
from batching.compose.inplace import shard_table
from batching.ingress import queue as q
from batching.ingress import shards
from batching.loop import breaker, scorer, watchdog
from batching.loop import stats as run_stats
from batching.model import rows as rows_
from batching.outputs import contract as sinks
from batching.outputs import shard_batch

if TYPE_CHECKING:  # torch: only a run that scores loads it
    from batching.model.runner import TorchRunner

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class _Fetched:
    """A claimed shard and its rows (None: refused, already dead with its reason)."""

    claim: models.Claim
    shard: shards.Shard | None
    table: pa.Table | None


class ShardScorer:
    """Claims, scores and commits input shards until the queue has none or a limit is hit
    (the scorer :func:`batching.compose.run.run_score` runs for ``bulk --in-place``)."""

    def __init__(
        self,
        config: cfg.PipelineConfig,
        queue: q.SqlQueue,
        runner: TorchRunner,
        outputs: sinks.Outputs,
        *,
        on_progress: run_stats.Progress | None = None,
        wait_for_work: Callable[[float], object] | None = None,
        observer: ports.ScoreObserver | None = None,
        pause_queue: Callable[[str], object] | None = None,
    ) -> None:
        self.config, self.queue, self.runner, self.outputs = config, queue, runner, outputs
        self.observer = observer or ports.NoObserver()
        self.pause_queue = pause_queue
        self.stats = run_stats.RunStats(
            started_at=time.time(), latencies_s=run_stats.Samples([config.latency_slo_s])
        )
        self._on_progress = on_progress
        self.unreleased: set[str] = set()  # leases not given back: the database was cut off
        self._wait = wait_for_work or time.sleep
        self._stop = threading.Event()
        self._schema_changed: errors.SchemaError | None = None  # see _watch_schema
        self._done = threading.Event()  # the heartbeat's: leases are kept until the end
        self._verified = shards.Verified()
        self._held: set[str] = set()
        self._lock = threading.Lock()
        self._lease_s = config.queue.lease_s
        self._suspects = False  # the last plain claim found none, and lost workers' shards wait
        # A pass that never returns (``loop.watchdog``): found and settled by the heartbeat
        self._watch: watchdog.ForwardWatch[object] = watchdog.ForwardWatch(
            config.queue.forward_timeout_s
        )
        self._scoring: _Fetched | None = None  # the shard in the model
        self._hung: errors.ForwardHung | None = None
        self._settled = threading.Event()  # the watchdog settled a hung shard (``_hung``)
        self._probing: set[str] = set()  # its lease, while the probe decides its fate
        self._beating = threading.Lock()  # held by the heartbeat while it extends leases

    def stop(self) -> None:
        """Claim nothing more; the shard being scored still commits."""
        self._stop.set()

    def run(self, limits: run_stats.RunLimits) -> run_stats.RunStats:
        """Score shards until none is ready (``until_empty``), a limit is hit or :meth:`stop`.
        The next shard is claimed and read ahead, and this one committed while the next is
        scored; a shard read ahead and not scored goes back to the queue unscored."""
        deadline = None if limits.max_seconds is None else time.monotonic() + limits.max_seconds

        def may_claim() -> bool:
            if self._stop.is_set() or (deadline is not None and time.monotonic() >= deadline):
                return False
            return limits.max_items is None or self.stats.claimed < limits.max_items

        # On a GPU the next shard is read while this one is scored; on a CPU, once it is
        # (while it commits): read beside the forward, the reader took the model's cores
        # (1M W1 rows on 2 cores: 237k and 265k rows/s against 260k and 290k, alternated).
        early = self.runner.device.type != "cpu"
        beat = threading.Thread(target=self._heartbeat, name="shard-heartbeat", daemon=True)
        beat.start()
        self.observer.started(time.time())
        ahead: cf.Future[_Fetched | None] | None = None
        committing: cf.Future[None] | None = None
        reads = cf.ThreadPoolExecutor(1, thread_name_prefix="shard-read")
        commits = cf.ThreadPoolExecutor(1, thread_name_prefix="shard-commit")
        try:
            ahead = reads.submit(self._fetch) if may_claim() else None
            while ahead is not None:
                got, ahead = ahead.result(), None
                if got is None and self._suspects:
                    # A lost worker's shard: claimed with nothing else in flight, so a death
                    # while it runs is its own (``batching.crashes``); split or scored alone.
                    if committing is not None:
                        committing.result()
                        committing = None
                    got = self._fetch(isolate=True) if may_claim() else None
                    if got is None and limits.until_empty:
                        break
                    if got is None:
                        self._wait(self.config.queue.poll_s)
                    elif got.table is not None and (job := self._score(got)) is not None:
                        self._commit(*job)
                    if may_claim():
                        ahead = reads.submit(self._fetch)
                    continue
                if got is None and limits.until_empty:
                    break
                if got is None:
                    self._wait(self.config.queue.poll_s)
                if early and may_claim():
                    ahead = reads.submit(self._fetch)
                if got is None or got.table is None:
                    if not early and may_claim():
                        ahead = reads.submit(self._fetch)
                    continue
                job = self._score(got)
                if not early and may_claim():
                    ahead = reads.submit(self._fetch)
                if committing is not None:
                    committing.result()  # one commit in flight: a failed one stops the run
                committing = None if job is None else commits.submit(self._commit, *job)
            if committing is not None:
                committing.result()
        finally:
            self._give_back(ahead)
            reads.shutdown()
            commits.shutdown()
            self._release_held()
            self._done.set()
            beat.join()
            self.outputs.flush()
            self.stats.finished_at = time.time()
            self.observer.finished(self.stats.finished_at)
        if self._schema_changed is not None:  # stopped claiming for it; the shard held went back
            raise self._schema_changed
        return self.stats

    # -- the steps ------------------------------------------------------------------------

    def _fetch(self, isolate: bool = False) -> _Fetched | None:
        """Claim a shard (``isolate``: a lost worker's) and read its rows; None when none is
        ready (``_suspects`` then says whether lost workers' shards wait). A shard that
        cannot be read as planned is dead with the reason, and one of a lost worker split in
        two (its ``table`` None)."""
        started = time.perf_counter()
        claim = self.queue.claim(1, lease_s=self._lease_s, lane=shards.LANE, isolate=isolate)
        self.stats.stage_s["claim"] += time.perf_counter() - started
        self._suspects = not isolate and not claim.items and claim.suspects
        if not claim.items:
            return None
        with self._lock:
            self._held.add(claim.lease_id)
        item = claim.items[0]
        started = time.perf_counter()
        try:
            shard = shards.Shard.of(item.payload)
            if claim.isolated and shard.rows > 1:  # its worker was lost: corner the killer
                self._split(claim, item, shard)
                return _Fetched(claim, None, None)
            table = shards.read(shard, self._verified, ("payload", "item_key"))
        except errors.InputError as exc:
            self._give_up(claim, item, str(exc))
            return _Fetched(claim, None, None)
        self.stats.claimed += shard.rows
        self.stats.stage_s["decode"] += time.perf_counter() - started
        return _Fetched(claim, shard, table)

    def _release_held(self) -> None:
        """A run that failed gives back the shards it still holds, unscored and uncharged
        (left to expire, they would come back as a lost worker's and be split)."""
        with self._lock:
            held, self._held = list(self._held), set()
        for lease in held:
            try:
                self.queue.release(lease)
            except errors.QueueError:  # the run's retry gives it back first (compose.run)
                self.unreleased.add(lease)
                logger.warning("release failed; the lease will expire", exc_info=True)

    def _give_back(self, ahead: cf.Future[_Fetched | None] | None) -> None:
        """Release a shard claimed ahead and not scored (no attempt used)."""
        if ahead is None:
            return
        try:
            got = ahead.result()
        except Exception:
            return  # its claim failed: nothing is held
        if got is not None and got.table is not None:
            self.queue.release(got.claim.lease_id)
            with self._lock:
                self._held.discard(got.claim.lease_id)

    def _score(self, got: _Fetched) -> tuple[models.Claim, shards.Shard, pa.Table, int, int] | None:
        claim, shard, table = got.claim, got.shard, got.table
        assert shard is not None
        assert table is not None
        item = claim.items[0]
        b = self.config.batching
        self._scoring = got
        scored = watchdog.on_thread(
            self._settled,
            self._hung_error,
            functools.partial(
                rows_.score_rows,
                runner=self.runner,
                payload=table.column("payload"),
                max_batch=b.max_batch_size,
                max_cost=b.max_batch_cost,
                watch=self._watch,
            ),
        )
        self._scoring = None
        self.stats.stage_s["forward"] += scored.service_s
        if scored.whole_error is not None:  # the model failed, not the rows
            self._release_failed(claim, item, scored)
            return None
        self.stats.batch_sizes.update(scored.sizes)
        self.stats.service_s.add(scored.service_s)
        self.stats.real_tokens += scored.real_tokens
        self.stats.padded_tokens += scored.padded_tokens
        self.stats.add_device_time([item], self.outputs.model_version, scored.service_s)
        keys = table.column("item_key") if "item_key" in table.column_names else None
        batch = (str(uuid.uuid4()), self.outputs.run_id, time.time())
        rows = shard_table(shard, item, scored, keys, batch)
        return claim, shard, rows, shard.rows - scored.n_failed, scored.n_failed

    def _commit(
        self, claim: models.Claim, shard: shards.Shard, rows: pa.Table, ok: int, failed: int
    ) -> None:
        started = time.perf_counter()
        item = claim.items[0]
        batch = shard_batch.ShardBatch(
            (item,),
            {},
            claim.lease_id,
            self.outputs.run_id,
            self.outputs.model_version,
            time.time(),
            batch_id=str(rows.column("batch_id")[0]),
            rows=rows,
        )
        try:
            result = self.outputs.sink.commit(batch)
        except errors.LeaseLost:
            self.stats.lease_lost += shard.rows
            self.observer.lease_lost(1)
            return
        finally:
            with self._lock:
                self._held.discard(claim.lease_id)
            self.stats.stage_s["commit"] += time.perf_counter() - started
        self.stats.committed += ok
        self.stats.failed += failed
        self.stats.commits += 1
        self.stats.bytes_written += result.n_bytes or 0
        self.stats.by_version[self.outputs.model_version] += ok
        self.stats.latencies_s.add(time.time() - item.enqueued_at)
        self.observer.commit_timed(time.perf_counter() - started)
        self.observer.committed([item], time.time(), self.outputs.model_version)
        if failed:
            logger.warning(
                "rows refused by the model",
                extra={"action": "shard_rows_failed", "item_key": item.item_key, "n_items": failed},
            )
        if self._on_progress is not None:
            self._on_progress(self.stats)

    def _split(self, claim: models.Claim, item: models.WorkItem, shard: shards.Shard) -> None:
        closed = shards.split(self.queue, claim.lease_id, item, shard)
        with self._lock:
            self._held.discard(claim.lease_id)
        self.stats.isolated += shard.rows
        logger.warning(
            "shard split in two: its worker was lost while scoring it",
            extra={"action": "shard_split", "item_key": item.item_key, "closed": closed},
        )

    def _give_up(self, claim: models.Claim, item: models.WorkItem, reason: str) -> None:
        """The shard cannot be read as planned: dead, with the reason (a retry reads the same)."""
        self.queue.fail(claim.lease_id, {item.id: reason}, retry=False)
        self.observer.failed([item], retry=False)
        self.stats.failed += int(item.cost)  # its rows: the summary says they were refused
        self.stats.count_failures([reason], int(item.cost))
        with self._lock:
            self._held.discard(claim.lease_id)
        logger.error(reason, extra={"action": "shard_refused", "item_key": item.item_key})

    def _release_failed(
        self, claim: models.Claim, item: models.WorkItem, scored: rows_.Scored
    ) -> None:
        """Every row failed: the model's fault, not the rows' (or every row refused, the
        config's: the wrong model for the data), never a file of errors committed as the
        shard's output, which would mark the data scored for good. With the breaker on and at
        least ``breaker.max_failed_batches`` micro-batches failed whole, the run trips: the
        shard goes back unchanged (no attempt used), the queue pauses and the run fails with
        ``RetryStorm``, as the scoring loop's breaker does. Else the shard is retried under
        the attempt rule."""
        reason = str(scored.whole_error)
        b = self.config.breaker
        if b.enabled and scored.whole_failed >= b.max_failed_batches:
            self.queue.release(claim.lease_id)
            with self._lock:
                self._held.discard(claim.lease_id)
            self._trip(breaker.Trip((), tuple(scored.sizes), reason))
        self.queue.fail(claim.lease_id, {item.id: reason})
        self.stats.count_failures([reason], int(item.cost))
        self.observer.failed([item], retry=True)
        with self._lock:
            self._held.discard(claim.lease_id)
        self.stats.failed += int(item.cost)  # its rows, retried or dead, as a failed item counts
        logger.error(
            "every row of a shard failed; the shard goes back to the queue",
            extra={"action": "shard_failed", "item_key": item.item_key, "error": reason},
        )

    def _trip(self, trip: breaker.Trip[Any]) -> NoReturn:
        self.stats.breaker_trips += 1
        self.observer.breaker_tripped()
        reason = f"retry storm: a shard failed whole: {trip.error}"
        why = breaker.pause(self.pause_queue, self.config.breaker, reason)
        raise errors.RetryStorm(trip.message(self.queue.queue, why))

    def _heartbeat(self) -> None:
        every = self.config.queue.effective_heartbeat_s
        while not self._done.wait(every):
            if self._watch.overdue() is not None:
                self._hung_found()
            self._watch_schema()
            self.observer.heartbeat(time.time())
            with self._beating:  # a hung shard's settle waits for the beat to finish
                with self._lock:
                    held = [*self._held, *self._probing]
                for lease in held:
                    try:
                        self.queue.heartbeat(lease, self._lease_s)
                    except errors.QueueError:
                        logger.warning("heartbeat failed", extra={"action": "heartbeat_failed"})

    def _watch_schema(self) -> None:
        """Stop claiming once the database's schema is no longer this release's (a newer one
        migrated it under the run), as the scoring loop's heartbeat does; ``run`` then raises
        the ``SchemaError``. A database that cannot be read now is the lease beats' to say."""
        if self._schema_changed is not None:
            return
        self._schema_changed = scorer.schema_changed(self.queue)
        if self._schema_changed is not None:
            self._stop.set()

    def _hung_error(self) -> errors.ForwardHung:
        return self._hung or errors.ForwardHung("a forward pass was declared hung")

    def _hung_found(self) -> None:
        """The pass in flight is past ``forward_timeout_s`` (``loop.watchdog``): its shard is
        no longer released by this run (only extended, until the probe decided its fate), its
        thread is interrupted, and it is settled on a thread of its own (the probe must not
        hold the heartbeats)."""
        got = self._scoring
        if got is None or got.shard is None:
            return
        logger.error(
            "forward pass hung: past queue.forward_timeout_s; stopping the run",
            extra={"action": "forward_hung", "item_key": got.claim.items[0].item_key},
        )
        self.observer.forward_hung()
        self._stop.set()
        with self._lock:  # not released by this run; extended while the probe runs
            self._held.discard(got.claim.lease_id)
            self._probing.add(got.claim.lease_id)
        self._watch.interrupt()
        threading.Thread(target=self._settle_hung, args=(got,), daemon=True).start()

    def _settle_hung(self, got: _Fetched) -> None:
        """Settle a hung shard by the model's probe (``watchdog.fate``: a shard is one item,
        which isolation splits), then let the scoring thread stop the run."""
        claim, item, limit = got.claim, got.claim.items[0], self._watch.timeout_s
        n = got.shard.rows if got.shard is not None else 1
        try:
            works = watchdog.probe(
                getattr(self.runner, "healthy", None), min(limit, watchdog.PROBE_S)
            )
            with self._beating, self._lock:  # no heartbeat extends it once it is settled
                self._probing.discard(claim.lease_id)
            settled = watchdog.settle(
                self.queue,
                watchdog.fate(works, n, isolated=claim.isolated),
                {claim.lease_id: [item.id]},
                timeout_s=limit,
                lease_s=self._lease_s,
                model_version=self.outputs.model_version,
                pause=functools.partial(breaker.pause, self.pause_queue, self.config.breaker),
            )
            if settled.failed:
                self.stats.failed += int(item.cost)  # its rows
                self.observer.failed([item], retry=True)
            message = watchdog.message(self._watch.ran_s, limit, n, self.queue.queue, settled)
            self._hung = errors.ForwardHung(message)
        finally:
            self._settled.set()
