"""The noisy-tenant run of ``online_bench.py``, simulated: what the scheduler alone costs quiet
tenants beside a flooding one, with no HTTP, no database and no noise from the machine.

The real batcher, SLO controller and fair share (``queue.fair_share``) run on a fake clock; the
parts around them are modelled after the scorer (``batching/loop/scorer.py``):

- **queue**: each tenant's ready items in age order, admitted while the queue's depth (ready
  and claimed, not committed) is under the cap (capacity x ``latency_slo_s`` / 2, as the bench
  sets it), else shed (a 429);
- **claims**: when fewer than the online low water (half a claim, at least one batch) are
  pending in the batcher, one claim of ``claim_size`` ranked by the tenants' fair tags
  (:mod:`batching.tenant_share`), ``CLAIM_S`` after it was wanted;
- **forward**: one batch decoded ahead (the hand-off slot), the forward pass as the W2 service
  profile predicts it for its size and padded length, times a seeded +-10% jitter; the commit
  ``COMMIT_S`` after it. The controller is told what the loop tells it.

W2's items: lengths uniform in [8, 128] tokens, cost = length, ``deployments/online.yaml``'s
batching policy, adaptive, ``late_policy: expire`` with ``default_deadline_s`` = the SLO (the
bench's adaptive variant). Capacity is the simulated drain rate of a standing backlog.

Runs, as the bench's: the three quiet tenants ``alone`` at 0.9/13 of capacity each,
``with_noisy`` (a fourth at 10x each of them, 90% in all), and ``even`` (the same 90% over four
tenants). It prints the quiet tenants' p50/p99, their ratio with the noisy tenant over alone
(the issue's target: <= 1.25), and the throughput of each run. Percentiles are of the items
scored; those expired (``late_policy``) or shed are counted apart. Usage::

    python bench/tenant_sim.py [--seconds 60] [--seeds 3] [--low-water N]

To compare with another commit, run this file from a worktree of it: it imports the library
beside it.
"""

from __future__ import annotations

import argparse
import collections
import math
import random
import statistics
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from batching import config, models, tenant_share  # noqa: E402
from batching.plan.profile import ServiceProfile  # noqa: E402
from batching.policy import adaptive, batcher  # noqa: E402
from batching.testing import FakeClock  # noqa: E402

PROFILE = ROOT / "deployments/profiles/w2-text-cpu.json"
SLO_S = 1.0
CLAIM_S = 0.004  # a claim's transaction, from wanting it to its items in the batcher
COMMIT_S = 0.006  # from the end of a forward pass to its commit
QUIET = ("tenant-a", "tenant-b", "tenant-c")
NOISY_FACTOR = 10


@dataclass
class Result:
    latencies: dict[str, list[float]] = field(default_factory=lambda: collections.defaultdict(list))
    shed: collections.Counter[str] = field(default_factory=collections.Counter)
    expired: collections.Counter[str] = field(default_factory=collections.Counter)
    end_s: float = 0.0
    sizes: list[int] = field(default_factory=list)
    # per quiet item: (in the queue, in the batcher, behind the forward in flight, its own pass)
    parts: list[tuple[float, float, float, float]] = field(default_factory=list)

    def of(self, tenants: tuple[str, ...]) -> list[float]:
        return sorted(x for t in tenants for x in self.latencies.get(t, []))

    def done(self) -> int:
        return sum(len(v) for v in self.latencies.values())


def pct(values: list[float], q: float) -> float:
    if not values:
        return math.nan
    return values[min(len(values) - 1, math.ceil(q * len(values)) - 1)]


def arrivals(rates: dict[str, float], seconds: float, seed: int) -> list[tuple[float, str, int]]:
    rng = random.Random(seed)
    out = []
    for tenant, rate in sorted(rates.items()):
        t = 0.0
        while rate > 0:
            t += rng.expovariate(rate)
            if t >= seconds:
                break
            out.append((t, tenant, rng.randint(8, 128)))
    out.sort()
    return out


def simulate(
    trace: list[tuple[float, str, int]],
    max_depth: int | None,
    *,
    low_water: int | None = None,
    seed: int = 7,
) -> Result:
    """Run ``trace`` (arrival second, tenant, tokens) through queue, claims and scorer."""
    profile = ServiceProfile.load(PROFILE)
    cfg = config.load_config(ROOT / "deployments/online.yaml")
    pol = cfg.batching
    rng = random.Random(seed)
    clock = FakeClock(0.0)
    ctrl = adaptive.SloController.for_policy(
        SLO_S, profile.predict, pol.max_batch_size, tuple(pol.length_buckets)
    )
    b = batcher.MicroBatcher(
        pol,
        clock,
        profile.predict,
        adaptive=ctrl,
        late_policy="expire",
        default_deadline_s=SLO_S,
        fair=tenant_share.FairShare({}, cfg.queue.max_tenant_wait_s),
    )
    share = tenant_share.FairShare({}, cfg.queue.max_tenant_wait_s)
    claim_size = pol.effective_claim_size
    if low_water is None:  # the scorer's, online
        low_water = max(claim_size // 2, pol.max_batch_size)
    ready: dict[str, collections.deque[models.WorkItem]] = collections.defaultdict(
        collections.deque
    )
    out = Result()
    depth = 0
    claim_at: float | None = None
    running: tuple[models.Batch, float, float] | None = None
    slot: models.Batch | None = None
    i = 0
    claimed_at: dict[int, float] = {}
    started: dict[int, float] = {}  # id(batch) -> when its forward began

    def start(batch: models.Batch) -> tuple[models.Batch, float, float]:
        cost = max(item.cost for item in batch.items)
        s = profile.predict(len(batch), cost) * (1.0 + rng.uniform(-0.1, 0.1))
        ctrl.forward_started(len(batch), cost, clock.now)
        out.sizes.append(len(batch))
        started[id(batch)] = clock.now
        return batch, clock.now, clock.now + s

    def claim() -> None:
        nonlocal depth
        ranking = share.ranking(clock.now)
        terms = {term.tenant: term for term in ranking.shares}
        tags = []
        for tenant, items in ready.items():
            term = terms.get(tenant)
            start_tag = ranking.default_start if term is None else term.start
            step = ranking.default_step if term is None else term.step
            aged = term is not None and term.aged
            for k, item in enumerate(list(items)[:claim_size]):
                tags.append((0 if aged and k == 0 else 1, start_tag + k * step, item.id, tenant))
        tags.sort()
        taken = collections.Counter(t for *_, t in tags[:claim_size])
        share.charge(taken, clock.now)
        got = [ready[t].popleft() for t, n in taken.items() for _ in range(n)]
        claimed_at.update((item.id, clock.now) for item in got)
        if got:
            b.add(sorted(got, key=lambda it: it.id))

    while True:
        if i >= len(trace) and not depth:
            break
        times = []
        if i < len(trace):
            times.append(trace[i][0])
        if running is not None:
            times.append(running[2])
        if claim_at is not None:
            times.append(claim_at)
        if slot is None and len(b):
            due = b.next_deadline()
            assert due is not None
            times.append(max(due, clock.now))
        if not times:
            break
        clock.now = max(clock.now, min(times))
        while i < len(trace) and trace[i][0] <= clock.now:
            at, tenant, tokens = trace[i]
            i += 1
            if max_depth is not None and depth >= max_depth:
                out.shed[tenant] += 1
                continue
            depth += 1
            ready[tenant].append(
                models.WorkItem(i, f"k{i}", models.Payload(b"{}"), at, tenant=tenant, cost=tokens)
            )
        if running is not None and running[2] <= clock.now:
            batch, began, end = running
            done = end + COMMIT_S
            for item in batch.items:
                out.latencies[item.tenant].append(done - item.enqueued_at)
                if item.tenant in QUIET:
                    claimed = claimed_at.pop(item.id)
                    out.parts.append(
                        (
                            claimed - item.enqueued_at,
                            batch.formed_at - claimed,
                            began - batch.formed_at,
                            done - began,
                        )
                    )
            depth -= len(batch)
            out.end_s = max(out.end_s, done)
            cost = max(item.cost for item in batch.items)
            ctrl.forward_done(len(batch), cost, end - began, end, batch.formed_at)
            ctrl.committed(batch.formed_at, end - began, done)
            running = None
            if slot is not None:
                running, slot = start(slot), None
        if claim_at is not None and claim_at <= clock.now:
            claim_at = None
            claim()
        if claim_at is None and len(b) < low_water and any(ready.values()):
            claim_at = clock.now + CLAIM_S
        if slot is None:
            got = b.poll()
            for late in b.take_late():
                out.expired[late.item.tenant] += 1
                claimed_at.pop(late.item.id, None)
                depth -= 1
            if got is not None:
                if running is None:
                    running = start(got)
                else:
                    slot = got
    return out


def capacity(seed: int) -> float:
    """Items a second with a standing backlog: 10 s of arrivals at about three times it."""
    trace = arrivals({"x": 600.0}, 10.0, seed)
    res = simulate(trace, None, seed=seed)
    return res.done() / res.end_s  # the backlog lasts the whole run; expired items left early


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seconds", type=float, default=60.0, help="arrivals per run (default 60)")
    p.add_argument("--seeds", type=int, default=3, help="runs of each kind (default 3)")
    p.add_argument(
        "--low-water",
        type=int,
        help="claim below this many items pending (default: the scorer's online rule, half a "
        "claim and at least one batch)",
    )
    args = p.parse_args(argv)
    cap = capacity(1)
    per_quiet = 0.9 * cap / (len(QUIET) + NOISY_FACTOR)
    even = 0.9 * cap / (len(QUIET) + 1)
    runs = {
        "alone": {t: per_quiet for t in QUIET},
        "with_noisy": {t: per_quiet for t in QUIET} | {"noisy": NOISY_FACTOR * per_quiet},
        "even": {t: even for t in (*QUIET, "noisy")},
    }
    max_depth = int(cap * SLO_S / 2)
    print(f"capacity {cap:.1f}/s (simulated drain), depth cap {max_depth}")
    print(
        "| seed | run | quiet p50 s | quiet p99 s | noisy p99 s | done/s | shed q/n | expired q/n |"
    )
    print("|---:|---|---:|---:|---:|---:|---|---|")
    ratios = []
    for seed in range(1, args.seeds + 1):
        p99 = {}
        for name, rates in runs.items():
            trace = arrivals(rates, args.seconds, 100 * seed + len(name))
            res = simulate(trace, max_depth, low_water=args.low_water)
            quiet = res.of(QUIET)
            noisy = res.of(("noisy",))
            p99[name] = pct(quiet, 0.99)
            qs, ns = sum(res.shed[t] for t in QUIET), res.shed["noisy"]
            qe, ne = sum(res.expired[t] for t in QUIET), res.expired["noisy"]
            print(
                f"| {seed} | {name} | {pct(quiet, 0.5):.3f} | {p99[name]:.3f} | "
                f"{pct(noisy, 0.99):.3f} | {res.done() / args.seconds:.1f} | {qs}/{ns} | {qe}/{ne} |"
            )
            if name == "with_noisy":
                parts = ", ".join(
                    f"{what} {statistics.mean(x):.3f}/{pct(sorted(x), 0.99):.3f}"
                    for what, x in zip(
                        ("queue", "batcher", "behind", "own pass"),
                        zip(*res.parts, strict=True),
                        strict=True,
                    )
                )
                print(f"|  | quiet time, mean/p99 s: {parts} | | | | | | |")
        ratios.append(p99["with_noisy"] / p99["alone"])
    print("quiet p99 with the noisy tenant / alone: " + ", ".join(f"{r:.2f}x" for r in ratios))
    return 0


if __name__ == "__main__":
    sys.exit(main())
