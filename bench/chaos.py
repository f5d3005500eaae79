"""Crash-fuzz ("chaos") of the "nothing lost" guarantee: real `batching score` processes
killed at random, then drained, repaired and checked item by item. Not a test.

Each round, in a scratch folder and a scratch database (a SQLite file; with --pg a fresh
PostgreSQL database ``chaos_*``, dropped after the round):
  1. `batching init`, then `batching enqueue` of 500-12,000 W1 rows (queue ``tabular``,
     sometimes ``--max-attempts`` 1 or 2), with a copy of ``deployments/tabular.yaml``:
     lease_s 3-5, shipped or small batches, and one output: the Parquet dataset, the SQL
     results table, a results table in another database or a Delta table (the last two
     roll forward from the outbox);
  2. 1-4 times: `batching score` (1 or 2 workers) as a process group of its own, sometimes with
     `batching reconcile [--repair]` beside it, then one blow after a random delay or a random
     share of the work: SIGKILL to the parent, to one worker or to the whole group, SIGTERM,
     SIGTERM then SIGKILL, or none (it runs to the end);
  3. drain: wait out the leases, `batching score --until-empty` until nothing is ready or
     leased, `batching reconcile --repair` (drain again if it requeued), `batching reconcile`;
  4. check, from the database and the outputs (pyarrow reads every visible Parquet file,
     deltalake the Delta table): every item done with exactly one output row, in the batch its
     row names, or dead/expired with a reason; no unknown key, no key twice; every visible file
     a live ledger row (committed or published) with its path, row count and sha256; after the
     drain, no batch left committed or in the outbox. The same check runs after each blow and
     after the drain, once nothing runs (after a blow a done item may still await its publish).

Some rounds add a fault of their own (drawn with the round): a **killer item**, one request
that kills its scorer's process whenever it is scored (``os._exit``, a segfault or SIGKILL,
through ``tests/integration/die_on.py``), which must end dead alone while every other item
commits with no attempt charged for it; a **full disk** (the output on a small tmpfs,
enlarged before the drain) and an **immutable partition folder** (``chattr +i``, lifted before
the drain), where a scorer must exit 1 and charge nobody; on PostgreSQL, a **backend
terminate** blow (``pg_terminate_backend`` of every connection of the round's database),
after which the scorer must reconnect and exit 0. The mounts and ``chattr`` need root; without
them those faults are not drawn.

A violation breaks the guarantee (or a reconcile after the drain finds a critical problem); an
anomaly is documented behaviour not met with nothing lost (a SIGTERM that does not exit 0, a
hang, a traceback, a reconcile warning after the drain).

    python bench/chaos.py [--rounds 10] [--seed S] [--pg URL] [--keep] [-v]
    python bench/chaos.py --rounds 8 --pg postgresql://postgres@127.0.0.1:5432/postgres

Round i draws its plan (sizes, settings, blows, delays) from seed S + i, printed with it:
`--seed <round seed> --rounds 1` replays the plan; where a blow lands in the scorer's threads
is up to the machine. A round with a violation or anomaly keeps its folder (each command's
output under ``log/``) and database, and prints its story. Exit 0: no violation; 1:
violations; 2: bad arguments.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import pyarrow.parquet as pq
import sqlalchemy as sa
import yaml
from deltalake import DeltaTable

from batching import crashes, models
from batching.config import load_config
from batching.model import workloads
from batching.outputs.delta import DeltaSink
from batching.store import database as db
from batching.store import schema

DEPLOY = Path(__file__).resolve().parents[1] / "deployments"
BATCHING = Path(sys.executable).with_name("batching")
QUEUE = "tabular"
DIE_ON = Path(__file__).resolve().parents[1] / "tests" / "integration" / "die_on.py"
ITEM_DEATHS = {"exit": 3, "segv": -signal.SIGSEGV, "kill": -signal.SIGKILL}
OUTPUT_FAULTS = {
    "disk-full": ("No space left on device",),
    # at a commit, or at the start-up's roll-forward of what an earlier run left in staging
    "immutable": ("committed but not published", "cannot publish"),
}
PARTITION = "model_version=w1-mlp-v1"
FAULT_CYCLE = ("killer", "disk-full", "immutable", None)
FAULT_CYCLE_PG = ("killer", None)  # the round without a fault runs long: its terminate lands
"""``--faults cycle`` (CI's smoke): every fault in a few rounds, not by chance."""
BLOWS = (
    "sigkill-parent",
    "sigkill-worker",
    "sigkill-group",
    "sigterm",
    "sigterm+sigkill",
    "none",
)
SINKS = ("parquet", "sql", "warehouse", "delta")
"""Outputs a round writes: a Parquet dataset, the queue database's results table, a results
table in another database (rolled forward from the outbox), a Delta table (likewise)."""
BATCHING_SETTINGS: tuple[dict[str, int], ...] = (
    {},  # shipped: 2048 / 8192
    {"max_batch_size": 64, "claim_size": 128},
    {"max_batch_size": 8, "claim_size": 32},
)
LIVE = set(models.LIVE_BATCH_STATES)
EXIT_S = 120.0  # a scorer (or reconcile) still running this long after its blow: a hang
DRAIN_RUNS = 6


# ----------------------------------------------------------------------------- plan


@dataclass(frozen=True)
class Phase:
    """One scorer start and what happens to it, drawn before it starts (replayable)."""

    workers: int
    blow: str
    by_progress: float | None  # blow once this share of what is left is done, or ...
    delay_s: float  # ... this long after the start
    kill_after_term_s: float
    worker_pick: int
    reconcile: str | None  # None, "check" or "repair"
    reconcile_at_s: float


def draw_phase(rng: random.Random, *, pg: bool = False, one_process: bool = False) -> Phase:
    """A random phase: workers, blow, when, and an optional reconcile beside the scorer.
    ``pg``: a backend terminate may be the blow; ``one_process``: no ``--workers`` (a killer
    item's scorer dies by a hook that spawned workers would not load)."""
    blow = rng.choice(BLOWS + (("pg-terminate",) if pg else ()))
    if one_process and blow == "sigkill-worker":
        blow = "sigkill-parent"
    workers = 2 if blow == "sigkill-worker" else rng.choice((1, 1, 2))
    workers = 1 if one_process else workers
    return Phase(
        workers=workers,
        blow=blow,
        by_progress=rng.uniform(0.05, 0.9) if rng.random() < 0.5 else None,
        delay_s=rng.uniform(0.3, 7.0),
        kill_after_term_s=rng.uniform(0.05, 1.5),
        worker_pick=rng.randrange(2),
        reconcile=rng.choice((None, None, "check", "repair")),
        reconcile_at_s=rng.uniform(0.5, 5.0),
    )


# ----------------------------------------------------------------------------- processes


def clean_env() -> dict[str, str]:
    """This process's environment without what would point a command elsewhere."""
    drop = ("BATCHING_DB_URL", "OPENLINEAGE")
    return {k: v for k, v in os.environ.items() if not k.upper().startswith(drop)}


def group_pids(pgid: int) -> list[int]:
    """Live (not zombie) processes of process group ``pgid``, from /proc."""
    pids = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        fields = stat[stat.rfind(")") + 2 :].split()  # state, ppid, pgrp, ...
        if int(fields[2]) == pgid and fields[0] != "Z":
            pids.append(int(entry.name))
    return pids


def worker_pids(pgid: int) -> list[int]:
    """The spawned scorer workers of a `batching score --workers N` group (not the
    multiprocessing resource tracker, not the parent)."""
    found = []
    for pid in group_pids(pgid):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if pid != pgid and b"spawn_main" in cmdline:
            found.append(pid)
    return sorted(found)


def wait_gone(pgid: int, timeout_s: float) -> bool:
    """Wait until no process of group ``pgid`` is left; False after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while group_pids(pgid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def kill_group(pgid: int) -> None:
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@dataclass
class Job:
    """A `batching` command started by a round, with where its output goes."""

    name: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    def stdout(self) -> str:
        return self.out.read_text(errors="replace")

    def report(self) -> dict[str, Any]:
        """A reconcile's ``--json`` report ({} when it printed none)."""
        try:
            return dict(json.loads(self.stdout()))
        except ValueError:
            return {}


# ----------------------------------------------------------------------------- PostgreSQL


def pg_url(admin_url: str, name: str) -> str:
    return sa.make_url(admin_url).set(database=name).render_as_string(hide_password=False)


def pg_admin(admin_url: str, sql: str) -> None:
    import psycopg

    with psycopg.connect(admin_url, autocommit=True, connect_timeout=5) as conn:
        conn.execute(sql)


# ----------------------------------------------------------------------------- one round


@dataclass
class Totals:
    rounds: int = 0
    items: int = 0
    files_read: int = 0
    violations: int = 0
    anomalies: int = 0
    blows: Counter[str] = field(default_factory=Counter)
    reconciles: Counter[str] = field(default_factory=Counter)
    lease_lost_warnings: int = 0


@dataclass
class Round:
    """One round's workspace, database, plan, and what was seen."""

    index: int
    seed: int
    work: Path
    db_url: str
    totals: Totals
    cycle: bool = False  # --faults cycle: round i has FAULT_CYCLE[i % 4], phase 1 a terminate
    rng: random.Random = field(init=False)
    config: Path = field(init=False)
    sink: str = "parquet"
    lease_s: float = 5.0
    n_items: int = 0
    keys: set[str] = field(default_factory=set)
    n_cmd: int = 0
    blows: list[str] = field(default_factory=list)
    end: Counter[models.State] = field(default_factory=Counter)
    actions: list[str] = field(default_factory=list)
    violations: list[str] = field(default_factory=list)
    anomalies: list[str] = field(default_factory=list)
    running: list[Job] = field(default_factory=list)
    fault: str | None = None  # "killer", "disk-full", "immutable" or None
    killer: tuple[str, str] | None = None  # (item key, how it kills: exit, segv, kill)
    volume: Path | None = None  # the tmpfs of a full-disk round
    frozen: Path | None = None  # the immutable partition folder

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        (self.work / "log").mkdir(parents=True, exist_ok=True)
        self.engine = db.create_engine(self.db_url)
        self.warehouse_url = f"sqlite:///{self.work / 'warehouse.db'}"

    # -- set-up ---------------------------------------------------------------------------

    def write_config(self) -> None:
        """A copy of tabular.yaml with this round's settings, validated by the project."""
        data = yaml.safe_load((DEPLOY / "tabular.yaml").read_text())
        self.lease_s = float(self.rng.choice((3, 4, 5)))
        self.sink = self.rng.choices(SINKS, weights=(45, 15, 15, 25))[0]
        self.fault = self.draw_fault()
        data["database"]["url"] = self.db_url
        data["queue"]["lease_s"] = self.lease_s
        data["batching"].update(self.rng.choice(BATCHING_SETTINGS))
        if self.fault == "killer":  # claims of 32: its rounds find it in ~5 deaths, not ~13
            data["batching"].update(BATCHING_SETTINGS[2])
        data["output"].update(kind=self.sink, path=str(self.work / "outputs"))
        if self.sink == "warehouse":  # a results table in another database than the queue's
            data["output"].update(kind="sql", table="results", url=self.warehouse_url)
        if self.rng.random() < 0.25:
            data["output"]["commit_interval_s"] = 0.2
        data["service_profile"] = str(DEPLOY / data["service_profile"])
        data["lineage"] = {"transport": "file", "path": str(self.work / "lineage.jsonl")}
        self.config = self.work / "pipeline.yaml"
        self.config.write_text(yaml.safe_dump(data))
        load_config(self.config)  # fails here, not in every scorer, on a bad setting
        size = data["batching"]["max_batch_size"]
        self.actions.append(
            f"{self.sink} sink, lease_s {self.lease_s:g}, batch {size}, fault {self.fault}"
        )

    def draw_fault(self) -> str | None:
        """This round's own fault, if any; an output fault makes it a Parquet round."""
        roll = self.rng.random()
        fault = (
            "killer" if roll < 0.25 else "disk-full" if roll < 0.35 else
            "immutable" if roll < 0.45 else None
        )  # fmt: skip
        if self.cycle:
            cycle = FAULT_CYCLE_PG if self.db_url.startswith("postgresql") else FAULT_CYCLE
            fault = cycle[self.index % len(cycle)]
        if fault in OUTPUT_FAULTS and not shutil.which(
            "chattr" if fault == "immutable" else "mount"
        ):
            return None
        if fault in OUTPUT_FAULTS:
            self.sink = "parquet"
        if fault == "disk-full" and not self.mount_small_disk():
            return None
        return fault

    def mount_small_disk(self) -> bool:
        """The output and its staging folder on a tmpfs of 64-256 KiB (through symlinks, so
        the round's paths stay the same); False when this machine cannot mount one."""
        volume = self.work / "volume"
        volume.mkdir()
        size = self.rng.choice(("64k", "128k", "256k"))
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(volume)],
            capture_output=True, check=False,
        )  # fmt: skip
        if done.returncode != 0:
            return False
        self.volume = volume
        for name in ("outputs", "outputs.staging"):
            (volume / name).mkdir()
            (self.work / name).symlink_to(volume / name)
        self.actions.append(f"output on a {size} tmpfs")
        return True

    def freeze_partition(self) -> None:
        """Today's partition folder, immutable: every publish into it fails."""
        day = time.strftime("%Y-%m-%d", time.gmtime())
        folder = self.work / "outputs" / f"date={day}" / PARTITION
        folder.mkdir(parents=True, exist_ok=True)
        if subprocess.run(["chattr", "+i", str(folder)], capture_output=True).returncode == 0:
            self.frozen = folder
            self.actions.append(f"{folder.relative_to(self.work)} made immutable")

    def lift_fault(self) -> None:
        """Before the drain: the disk grows, the folder thaws (the killer stays)."""
        if self.volume is not None:
            subprocess.run(["mount", "-o", "remount,size=64m", str(self.volume)], check=True)
        if self.frozen is not None:
            subprocess.run(["chattr", "-i", str(self.frozen)], check=True)
            self.frozen = None

    def enqueue(self) -> None:
        self.n_items = self.rng.randint(500, 12_000)
        # 1 or 2: an item alone in an isolation round when a blow lands may run out; 5 in a
        # killer round, where a good item dead of a worker's death is a violation.
        attempts = 5 if self.fault == "killer" else self.rng.choice((5, 5, 2, 1))
        # One to three enqueues, so claims hold items of one enqueue time (read back as one
        # value) or of several (each item's time read back).
        parts = self.rng.choice((1, 2, 3))
        self.keys = set()
        self.must("init", "init", "--db", self.db_url)
        for part in range(parts):
            n = self.n_items // parts + (part < self.n_items % parts)
            prefix = f"r{self.seed}-{part}-"
            path = workloads.write_w1_parquet(self.work / f"w1-{part}.parquet", n, prefix=prefix)
            self.keys |= {f"{prefix}{i}" for i in range(n)}
            self.must(
                "enqueue", "enqueue", str(path), "-q", QUEUE, "--db", self.db_url, "--quiet",
                "--max-attempts", str(attempts),
            )  # fmt: skip
        self.actions.append(f"{self.n_items} items in {parts} enqueue(s), max attempts {attempts}")
        if self.fault == "killer":
            key = self.rng.choice(sorted(self.keys))
            self.killer = (key, self.rng.choice(sorted(ITEM_DEATHS)))
            self.actions.append(f"killer item {key} ({self.killer[1]})")

    # -- commands -------------------------------------------------------------------------

    def logs(self, name: str) -> tuple[Path, Path]:
        self.n_cmd += 1
        stem = self.work / "log" / f"{self.n_cmd:02d}-{name}"
        return stem.with_suffix(".out"), stem.with_suffix(".err")

    def start(self, name: str, *args: str) -> Job:
        """`batching ARGS` in a process group of its own; output to log/NN-name.{out,err}."""
        out, err = self.logs(name)
        command = [str(BATCHING), *args]
        if self.killer is not None and args[0] == "score":  # a scorer that dies on the killer
            command = [sys.executable, str(DIE_ON), *self.killer, "--", *args]
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                command, stdout=o, stderr=e, cwd=self.work,
                env=clean_env(), start_new_session=True,
            )  # fmt: skip
        job = Job(name, proc, out, err)
        self.running.append(job)
        return job

    def finish(self, job: Job) -> int:
        """Wait for ``job`` and its group; kill what hangs (an anomaly); returns its code."""
        try:
            rc = job.proc.wait(EXIT_S)
        except subprocess.TimeoutExpired:
            self.anomaly(f"{job.name}: still running {EXIT_S:g}s on; killed")
            kill_group(job.pid)
            rc = job.proc.wait()
        if not wait_gone(job.pid, 60):
            self.anomaly(f"{job.name}: processes of its group outlived it by 60s: killed")
            kill_group(job.pid)
            wait_gone(job.pid, 10)
        self.running.remove(job)
        err = job.err.read_text(errors="replace")
        self.totals.lease_lost_warnings += err.count("heartbeat found lease lost")
        if "Traceback" in err:
            self.anomaly(f"{job.name}: traceback in {job.err}")
        return rc

    def run(self, name: str, *args: str) -> tuple[int, Job]:
        """Run `batching ARGS` to its end; returns the exit code and the job."""
        job = self.start(name, *args)
        return self.finish(job), job

    def must(self, name: str, *args: str) -> None:
        rc, job = self.run(name, *args)
        if rc != 0:
            raise RuntimeError(f"`batching {' '.join(args)}` exited {rc}; see {job.err}")

    def score_args(self, *extra: str) -> list[str]:
        return ["score", "-c", str(self.config), "--db", self.db_url, "--quiet", *extra]

    def reconcile_args(self, *extra: str) -> list[str]:
        return ["reconcile", "-c", str(self.config), "--db", self.db_url, "--json", *extra]

    def fault_exit(self, rc: int, job: Job) -> bool:
        """``rc`` is what this round's fault makes a scorer exit with: the killer item's death,
        or exit 1 naming the output's failure."""
        if self.killer is not None and rc == ITEM_DEATHS[self.killer[1]]:
            return True
        err = job.err.read_text(errors="replace")
        return rc == 1 and any(said in err for said in OUTPUT_FAULTS.get(self.fault or "", ()))

    def violation(self, text: str) -> None:
        self.violations.append(text)

    def anomaly(self, text: str) -> None:
        self.anomalies.append(text)

    # -- database -------------------------------------------------------------------------

    def counts(self) -> Counter[models.State]:
        t = schema.items
        stmt = sa.select(t.c.state, sa.func.count()).where(t.c.queue == QUEUE).group_by(t.c.state)
        with self.engine.connect() as conn:
            return Counter({models.State(s): int(n) for s, n in conn.execute(stmt)})

    def leases(self) -> set[str]:
        """Lease ids held on items now."""
        t = schema.items
        stmt = (
            sa.select(t.c.lease_id)
            .distinct()
            .where(t.c.queue == QUEUE, t.c.state == int(models.State.LEASED))
        )
        with self.engine.connect() as conn:
            return {str(v) for v in conn.execute(stmt).scalars()}

    def last_lease_expiry(self) -> float | None:
        t = schema.items
        stmt = sa.select(sa.func.max(t.c.lease_expires_at)).where(
            t.c.queue == QUEUE, t.c.state == int(models.State.LEASED)
        )
        with self.engine.connect() as conn:
            value = conn.execute(stmt).scalar()
        return None if value is None else float(value)

    def wait_out_leases(self) -> None:
        """Sleep until every lease held now has expired (the next claim reaps them)."""
        expiry = self.last_lease_expiry()
        if expiry is not None:
            time.sleep(max(0.0, min(expiry - time.time(), self.lease_s)) + 0.3)

    # -- phases ---------------------------------------------------------------------------

    def phase(self, n: int) -> None:
        """Start a scorer, maybe a reconcile beside it, deliver the blow, wait, check."""
        pg = self.db_url.startswith("postgresql")
        plan = draw_phase(self.rng, pg=pg, one_process=bool(self.killer))
        if self.cycle and pg and n == 1:  # a terminate on every PostgreSQL round
            plan = dataclasses.replace(plan, blow="pg-terminate")
        before, held = self.counts(), self.leases()
        workers = ("--workers", "2") if plan.workers == 2 else ()
        job = self.start(f"score{n}", *self.score_args(*workers))
        recon, what = self.until_blow(plan, job, before)
        rc = self.finish(job)
        self.judge_exit(n, what, rc, job, held)
        text = f"phase {n}: {plan.workers} worker(s), {what}, exit {rc}"
        if recon is not None:
            text += self.finish_reconcile(recon, plan.reconcile or "")
        self.actions.append(text)
        self.blows.append(what.split()[0] + (" missed" if "missed" in what else ""))
        self.check(f"after phase {n}", final=False)

    def judge_exit(self, n: int, what: str, rc: int, job: Job, held: set[str]) -> None:
        """A run left alone or sent SIGTERM exits 0, releasing what it leased (also when the
        SIGTERM lands as the interpreter exits, after the summary)."""
        if what.split()[0] not in ("none", "sigterm", "pg-terminate"):
            return
        if rc != 0 and not self.fault_exit(rc, job):
            self.anomaly(f"phase {n}: score after {what} exited {rc}, expected 0; see {job.err}")
        if rc == 0 and self.leases() - held:
            self.anomaly(f"phase {n}: score exited 0 after {what} with items of its own leased")

    def until_blow(self, plan: Phase, job: Job, before: Counter[Any]) -> tuple[Job | None, str]:
        """Poll until the blow's moment (starting the reconcile on the way); deliver it."""
        started = time.monotonic()
        left = before[models.State.READY] + before[models.State.LEASED]
        target = None
        if plan.by_progress is not None:
            target = before[models.State.DONE] + max(1, int(left * plan.by_progress))
        recon = None
        while job.proc.poll() is None:
            elapsed = time.monotonic() - started
            if elapsed > EXIT_S:  # a run that never ends: finish() reports and kills it
                break
            if plan.reconcile and recon is None and elapsed >= plan.reconcile_at_s:
                extra = ("--repair",) if plan.reconcile == "repair" else ()
                recon = self.start(f"{job.name}-reconcile", *self.reconcile_args(*extra))
            if plan.blow != "none" and self.moment(plan, elapsed, target):
                return recon, self.deliver(plan, job)
            time.sleep(0.05)
        if plan.blow != "none":
            self.totals.blows["missed (ended first)"] += 1
            return recon, f"{plan.blow} missed (ended first)"
        self.totals.blows["none"] += 1
        return recon, "none"

    def moment(self, plan: Phase, elapsed: float, target: int | None) -> bool:
        if elapsed > 90:  # a progress target the run never reaches: blow anyway
            return True
        if target is None:
            return elapsed >= plan.delay_s
        return self.counts()[models.State.DONE] >= target

    def deliver(self, plan: Phase, job: Job) -> str:
        """Send the blow; returns what was done, with the done count at that moment."""
        if plan.blow == "sigkill-worker":
            return self.kill_worker(plan, job)
        done = self.counts()[models.State.DONE]
        if plan.blow == "pg-terminate":  # every connection of the round's database but this one
            import psycopg

            with psycopg.connect(self.db_url, autocommit=True, connect_timeout=5) as conn:
                n = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity"
                    " WHERE datname = current_database() AND pid <> pg_backend_pid()"
                ).fetchone()
            self.totals.blows[plan.blow] += 1
            return f"pg-terminate at done {done} ({n[0] if n else 0} connections)"
        if plan.blow == "sigkill-parent":
            os.kill(job.pid, signal.SIGKILL)
        elif plan.blow == "sigkill-group":
            kill_group(job.pid)
        else:
            os.kill(job.pid, signal.SIGTERM)
            if plan.blow == "sigterm+sigkill":
                time.sleep(plan.kill_after_term_s)
                if job.proc.poll() is not None:
                    self.totals.blows["sigterm (exited before its sigkill)"] += 1
                    return f"sigterm at done {done}, exited within {plan.kill_after_term_s:.2f}s"
                kill_group(job.pid)
        self.totals.blows[plan.blow] += 1
        return f"{plan.blow} at done {done}"

    def kill_worker(self, plan: Phase, job: Job) -> str:
        """SIGKILL one of the two workers, once both are there."""
        deadline = time.monotonic() + 30
        while job.proc.poll() is None and time.monotonic() < deadline:
            pids = worker_pids(job.pid)
            if len(pids) == 2:
                done = self.counts()[models.State.DONE]
                os.kill(pids[plan.worker_pick], signal.SIGKILL)
                self.totals.blows["sigkill-worker"] += 1
                return f"sigkill-worker at done {done}"
            time.sleep(0.05)
        self.totals.blows["missed (ended first)"] += 1
        return "sigkill-worker missed (never two workers)"

    def finish_reconcile(self, job: Job, kind: str) -> str:
        """Wait for a reconcile run beside the scorer; note critical findings it reported."""
        rc = self.finish(job)
        self.totals.reconciles[f"{kind} exit {rc}"] += 1
        findings = job.report().get("findings", [])
        critical = sorted({f["class"] for f in findings if f["severity"] == "critical"})
        if critical:
            self.anomaly(f"{job.name}: reconcile {kind} beside a scorer found critical {critical}")
        classes = sorted({f["class"] for f in findings})
        return f"; reconcile {kind} beside it: exit {rc} {classes}"

    # -- drain ----------------------------------------------------------------------------

    def drain(self) -> bool:
        """Score until nothing is ready or leased (waiting out leases first); False if not.
        A killer item kills a run in every isolation round it is in: more runs for it."""
        runs = DRAIN_RUNS + (20 if self.killer else 0)
        for n in range(runs):
            self.wait_out_leases()
            rc, job = self.run(f"drain{n}", *self.score_args("--until-empty"))
            if rc != 0 and not self.fault_exit(rc, job):
                self.anomaly(f"drain run {n} exited {rc}; see {job.err}")
            counts = self.counts()
            if not counts[models.State.READY] and not counts[models.State.LEASED]:
                return True
        self.violation(f"queue not drained after {runs} runs: {dict(counts)}")
        return False

    def repair(self, n: int) -> bool:
        """`batching reconcile --repair` after a drain: criticals are violations, warnings
        anomalies (crash recovery at the drain's start should have left neither); returns
        whether it requeued items (to drain again)."""
        rc, job = self.run(f"repair{n}", *self.reconcile_args("--repair"))
        report = job.report()
        if rc not in (0, 1) or not report:
            self.violation(f"reconcile --repair exited {rc}, report {bool(report)}; see {job.err}")
        found = [(f["class"], f["severity"], f["count"]) for f in report.get("findings", [])]
        repairs = [(r["action"], r["n_items"]) for r in report.get("repairs", [])]
        self.actions.append(f"repair {n}: findings {found}, repairs {repairs}")
        self.judge(f"reconcile --repair after drain {n}", found)
        return any(n_items for _, n_items in repairs)

    def judge(self, what: str, found: list[tuple[str, str, int]]) -> None:
        for cls, severity, count in found:
            if severity == "critical":
                self.violation(f"{what}: critical {cls} ({count})")
            elif severity == "warning":
                self.anomaly(f"{what}: warning {cls} ({count})")

    def settle(self) -> None:
        """Drain, repair (drain again if it requeued), then a last reconcile must be clean."""
        self.lift_fault()
        for n in range(3):
            if not self.drain():
                return
            if n == 0:
                self.check("drained, before repair", final=True)
            if not self.repair(n):
                break
        rc, job = self.run("reconcile", *self.reconcile_args())
        findings = job.report().get("findings", [])
        found = [(f["class"], f["severity"], f["count"]) for f in findings]
        self.judge("last reconcile", found)
        if rc not in (0, 1) or (rc == 1) != any(f[1] != "info" for f in found):
            self.violation(f"last reconcile exited {rc} with findings {found}")
        self.actions.append(f"last reconcile: exit {rc}, findings {found}")

    # -- the check ------------------------------------------------------------------------

    def check(self, stage: str, *, final: bool) -> None:
        """Items, ledger and outputs agree; each problem is a violation naming ``stage``."""
        root = self.work / "outputs"
        # Outputs read first: a file (a Delta commit, a warehouse row) appears after its row.
        files = sorted(root.rglob("*.parquet")) if self.sink == "parquet" else []
        table = self.outside_rows(root)
        with self.engine.connect() as conn:
            t, out = schema.items, schema.results
            items = {r.item_key: r for r in conn.execute(sa.select(t).where(t.c.queue == QUEUE))}
            ledger = {r.batch_id: r for r in conn.execute(sa.select(schema.batches))}
            sql = sa.select(out.c.item_key, out.c.batch_id)
            table += [tuple(r) for r in conn.execute(sql)] if self.sink == "sql" else []
            outbox = set(conn.execute(sa.select(schema.outbox.c.batch_id)).scalars())
        rows: dict[str, list[str]] = {}
        problems = [p for f in files for p in self.check_file(root, f, ledger, rows)]
        for key, batch_id in table:
            rows.setdefault(key, []).append(batch_id)
            if batch_id not in ledger or ledger[batch_id].state not in LIVE:
                problems.append(f"output row {key} in batch {batch_id}: no live ledger row")
        problems += self.check_ledger(root, ledger, final=final)
        if final and outbox:
            problems.append(f"{len(outbox)} batch(es) still in the outbox after the drain")
        problems += self.check_items(items, rows, final=final)
        self.totals.files_read += len(files)
        self.violations += [f"{stage}: {p}" for p in problems]

    def outside_rows(self, root: Path) -> list[tuple[str, str]]:
        """``(item_key, batch_id)`` of every row of a Delta table or a warehouse table."""
        if self.sink == "delta":
            if not DeltaTable.is_deltatable(str(root)):
                return []
            got = DeltaSink.read(str(root), "SELECT item_key, batch_id FROM t")
            return list(zip(got["item_key"].to_pylist(), got["batch_id"].to_pylist(), strict=True))
        if self.sink == "warehouse" and (self.work / "warehouse.db").is_file():
            engine = db.create_engine(self.warehouse_url)
            try:
                with engine.connect() as conn:
                    if not sa.inspect(conn).has_table("results"):
                        return []
                    found = conn.execute(sa.text("SELECT item_key, batch_id FROM results"))
                    return [(str(k), str(b)) for k, b in found]
            finally:
                engine.dispose()
        return []

    def check_file(
        self, root: Path, path: Path, ledger: dict[str, Any], rows: dict[str, list[str]]
    ) -> list[str]:
        """One visible file: read it, and compare with its ledger row."""
        rel = path.relative_to(root).as_posix()
        batch_id = path.name.removeprefix("part-").removesuffix(".parquet")
        data = pq.ParquetFile(path).read(columns=["item_key", "batch_id"])
        for key in data["item_key"].to_pylist():
            rows.setdefault(key, []).append(batch_id)
        row = ledger.get(batch_id)
        if row is None or row.state not in LIVE:
            return [f"visible file {rel}: ledger {row.state if row else 'has no row'}"]
        problems = []
        if set(data["batch_id"].to_pylist()) != {batch_id}:
            problems.append(f"{rel}: batch_id column is not {batch_id}")
        if row.path != rel or row.n_rows != data.num_rows:
            problems.append(f"{rel}: ledger says {row.path}, {row.n_rows} rows; {data.num_rows}")
        if row.sha256 != hashlib.sha256(path.read_bytes()).hexdigest():
            problems.append(f"{rel}: sha256 differs from the ledger's")
        return problems

    def check_ledger(self, root: Path, ledger: dict[str, Any], *, final: bool) -> list[str]:
        """Live Parquet rows have their file: published in the dataset; committed in the
        dataset or still staged (not after a drain: recovery rolls it forward)."""
        problems = []
        for row in ledger.values():
            if final and row.state == models.BatchState.COMMITTED and row.sink != "parquet":
                problems.append(f"ledger {row.batch_id} ({row.sink}) still committed after a drain")
            if row.state not in LIVE or row.sink != "parquet":
                continue
            visible = (root / row.path).is_file()
            staged = bool(row.staging_path) and Path(row.staging_path).is_file()
            if final and (row.state != models.BatchState.PUBLISHED or not visible):
                problems.append(f"ledger {row.batch_id} {row.state}, file visible {visible}")
            elif not visible and (row.state == models.BatchState.PUBLISHED or not staged):
                problems.append(f"ledger {row.batch_id} {row.state}: its file is nowhere")
        return problems

    def check_items(
        self, items: dict[str, Any], rows: dict[str, list[str]], *, final: bool
    ) -> list[str]:
        """Each key: done with one row (final: exactly one, in its batch), or dead/expired
        with a reason and no row; no row for a key never enqueued."""
        problems = [f"output row for unknown key {k}" for k in sorted(set(rows) - self.keys)]
        problems += [f"key {k} never reached the queue" for k in sorted(self.keys - set(items))]
        for key in sorted(self.keys & set(items)):
            item, found = items[key], rows.get(key, [])
            state = models.State(item.state)
            if len(found) > 1:
                problems.append(f"{key}: {len(found)} output rows, batches {found}")
            if state is models.State.DONE:
                if final and not found:
                    problems.append(f"{key}: done in batch {item.batch_id}, no output row")
                if found and self.sink in ("parquet", "delta") and found[0] != item.batch_id:
                    problems.append(f"{key}: done in batch {item.batch_id}, row in {found[0]}")
            elif found:
                problems.append(f"{key}: {state.name} but has an output row in {found[0]}")
            elif state in (models.State.DEAD, models.State.EXPIRED) and not item.last_error:
                problems.append(f"{key}: {state.name} without a reason")
            elif final and state in (models.State.READY, models.State.LEASED):
                problems.append(f"{key}: still {state.name}")
        return problems + (self.check_killer(items) if final and self.killer else [])

    def check_killer(self, items: dict[str, Any]) -> list[str]:
        """The killer ends dead, charged alone; no other item is dead of a worker's death."""
        assert self.killer is not None
        key = self.killer[0]
        killer = items[key]
        problems = []
        if killer.state != models.State.DEAD or killer.last_error != crashes.KILLER:
            state = models.State(killer.state).name
            problems.append(f"killer {key}: {state} ({killer.last_error!r}), not dead alone")
        lost = (crashes.KILLER, crashes.CHARGED)
        charged = sorted(
            k for k, r in items.items()
            if k != key and r.state == models.State.DEAD and r.last_error in lost
        )  # fmt: skip
        problems += [f"{k}: a good item dead of its worker's death" for k in charged[:20]]
        return problems

    # -- the round ------------------------------------------------------------------------

    def play(self) -> None:
        self.write_config()
        self.enqueue()
        if self.fault == "immutable":
            self.freeze_partition()
        for n in range(1, self.rng.randint(1, 4) + 1):
            counts = self.counts()
            if not counts[models.State.READY] and not counts[models.State.LEASED]:
                break
            self.phase(n)
        self.settle()
        self.check("final", final=True)
        self.end = self.counts()

    def close(self) -> None:
        for job in list(self.running):
            kill_group(job.pid)
            job.proc.wait()
        self.engine.dispose()
        if self.frozen is not None:
            subprocess.run(["chattr", "-i", str(self.frozen)], check=False)
        if self.volume is not None:  # its files go with it; the round is over
            subprocess.run(["umount", "-l", str(self.volume)], check=False)


# ----------------------------------------------------------------------------- main


class Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        """Bad arguments: one line, exit 2."""
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = Parser(
        prog="chaos.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rounds", type=int, default=10, help="rounds to play (default 10)")
    parser.add_argument(
        "--seed", type=int, default=None, help="seed of round 0 (default: drawn, printed)"
    )
    parser.add_argument(
        "--pg", metavar="URL", help="PostgreSQL admin URL: each round in a fresh chaos_* database"
    )
    parser.add_argument("--keep", action="store_true", help="keep every round's folder and db")
    parser.add_argument(
        "--faults",
        choices=("drawn", "cycle"),
        default="drawn",
        help="a round's own fault: drawn by its seed (default), or cycle: round i has "
        "killer, disk-full, immutable, none (i mod 4); on PostgreSQL killer, none (i mod 2), "
        "each with a backend terminate as its first blow",
    )
    parser.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="print every round's actions, not only failed ones",
    )
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error(f"--rounds must be at least 1, got {args.rounds}")
    if args.pg and not args.pg.startswith(("postgresql://", "postgres://")):
        parser.error(f"--pg must be a postgresql:// URL, got {args.pg!r}")
    if not BATCHING.is_file():
        parser.error(f"no `batching` beside {sys.executable}: run with the project's .venv python")
    return args


@contextmanager
def database(admin_url: str | None, work: Path, seed: int, keep: list[bool]) -> Iterator[str]:
    """This round's database URL; a PostgreSQL one is created, and dropped unless ``keep[0]``
    is true by the end of the round."""
    if admin_url is None:
        yield f"sqlite:///{work / 'queue.db'}"
        return
    name = f"chaos_{seed}_{os.getpid()}"
    pg_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    pg_admin(admin_url, f'CREATE DATABASE "{name}"')
    try:
        yield pg_url(admin_url, name)
    finally:
        if not keep[0]:
            pg_admin(admin_url, f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def play_round(index: int, seed: int, args: argparse.Namespace, totals: Totals) -> None:
    """One round from its seed; prints its line, and its story when it failed (kept)."""
    started = time.monotonic()
    work = Path(tempfile.mkdtemp(prefix=f"chaos-{seed}-"))
    keep = [bool(args.keep)]
    with database(args.pg, work, seed, keep) as url:
        rnd = Round(index, seed, work, url, totals, cycle=args.faults == "cycle")
        try:
            rnd.play()
        except Exception as exc:  # a round that could not be played is a failure to look at
            rnd.violation(f"round aborted: {type(exc).__name__}: {exc}")
        finally:
            rnd.close()
        failed = bool(rnd.violations or rnd.anomalies)
        keep[0] = keep[0] or failed
    report_round(rnd, time.monotonic() - started)
    if failed or args.verbose:
        print_story(rnd, url, kept=keep[0])
    if not keep[0]:
        shutil.rmtree(work, ignore_errors=True)


def report_round(rnd: Round, wall_s: float) -> None:
    """Add the round to the totals and print its line."""
    t = rnd.totals
    t.rounds += 1
    t.items += rnd.n_items
    t.violations += len(rnd.violations)
    t.anomalies += len(rnd.anomalies)
    end = ", ".join(f"{s.name.lower()} {n}" for s, n in sorted(rnd.end.items()))
    verdict = f"{len(rnd.violations)} VIOLATION(S)" if rnd.violations else "ok"
    print(
        f"round {rnd.index} seed {rnd.seed}: {rnd.n_items} items, {rnd.sink}"
        f"{' + ' + rnd.fault if rnd.fault else ''}, "
        f"lease {rnd.lease_s:g}s, blows [{', '.join(rnd.blows)}] -> {end or '?'}: {verdict}, "
        f"{len(rnd.anomalies)} anomalies ({wall_s:.1f}s)",
        flush=True,
    )


def print_story(rnd: Round, url: str, *, kept: bool) -> None:
    """What the round did and what was wrong; where to look and how to replay it."""
    print(f"  replay: python bench/chaos.py --seed {rnd.seed} --rounds 1")
    if kept:
        print(f"  kept: {rnd.work} (database {db.redact(url)})")
    for label, lines in (
        ("action", rnd.actions),
        ("VIOLATION", rnd.violations[:20]),
        ("anomaly", rnd.anomalies[:20]),
    ):
        for line in lines:
            print(f"  {label}: {line}")
    if len(rnd.violations) > 20:
        print(f"  ... and {len(rnd.violations) - 20} more violations")
    sys.stdout.flush()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1_000_000)
    if args.pg:
        try:
            pg_admin(args.pg, "SELECT 1")
        except Exception as exc:  # unreachable or refused: bad argument, one line
            print(
                f"chaos.py: --pg {db.redact(args.pg)}: {str(exc).splitlines()[0]}",
                file=sys.stderr,
            )
            return 2
    print(
        f"chaos: {args.rounds} round(s) from seed {seed} on {'PostgreSQL' if args.pg else 'SQLite'}"
    )
    started, totals = time.monotonic(), Totals()
    for i in range(args.rounds):
        play_round(i, seed + i, args, totals)
    blows = ", ".join(f"{k} {n}" for k, n in sorted(totals.blows.items()))
    recon = ", ".join(f"{k} {n}" for k, n in sorted(totals.reconciles.items()))
    print(
        f"chaos: {totals.rounds} rounds, {totals.items} items; blows: {blows}; "
        f"reconciles beside: {recon or 'none'}; {totals.files_read} files read; "
        f"{totals.violations} violations, {totals.anomalies} anomalies, "
        f"{totals.lease_lost_warnings} lease-lost warnings; "
        f"{time.monotonic() - started:.0f}s"
    )
    return 1 if totals.violations else 0


if __name__ == "__main__":
    sys.exit(main())
