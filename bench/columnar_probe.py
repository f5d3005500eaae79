"""What W1 reaches with the scorer's own SQL and no Python object per row. Not a test.

A probe for the design question "is it the queue or the Python?": three threads (claim,
forward, commit) run W1 tensor rows through the same claim statement, the same one-row
read-back and the same ack as ``batching score``, but keep each claim as columns: ids and keys
from the read-back's JSON arrays, the payloads as one ``frombuffer`` matrix, the outputs as one
array, a Parquet file per batch (written, fsynced, renamed). No micro-batcher (batches are
slices of the claim), no ledger row, no heartbeats, no failure paths: an upper bound for a
columnar claim-to-commit path, not a scorer.

    python bench/columnar_probe.py [--items 50000] [--runs 3]

Prints the raw-model limit (best of before and after), the probe's rows/s per run and their
ratios to the limit.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import os
import queue
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import orjson
import pyarrow as pa
import pyarrow.parquet as pq
import sqlalchemy as sa
import torch
from workload_bench import config, enqueue, w1_limit

from batching.compose import build
from batching.ingress import ingest, sqlite_claim
from batching.model import workloads, zoo

DIM = 64


def claimer(q: Any, size: int, batch: int, out: queue.Queue[Any]) -> None:
    """Claim with the scorer's statement, read back as one row, cut the claim into batches."""
    while True:
        lease, now = str(uuid.uuid4()), q.clock()
        params = {"queue": q.queue, "lane": None, "now": now, "n": size, "lease": lease}
        params |= {"worker": "probe", "expires": now + 60, "budget": None}
        with q.begin() as conn:
            q._before_claim(conn, now)
            claimed = conn.execute(sa.text(q._claim_sql(None, None).update), params).rowcount
        if not claimed:
            out.put(None)
            return
        with q.read() as conn:
            row = conn.execute(sqlite_claim.CLAIMED, params).one()
        ids, keys = orjson.loads(row[0]), orjson.loads(row[1])
        matrix = np.frombuffer(row[sqlite_claim.BODIES], dtype="<f4").reshape(len(ids), DIM).copy()
        for s in range(0, len(ids), batch):
            out.put((lease, ids[s : s + batch], keys[s : s + batch], matrix[s : s + batch]))


def forwarder(model: torch.nn.Module, inbox: queue.Queue[Any], out: queue.Queue[Any]) -> None:
    with torch.inference_mode():
        while (job := inbox.get()) is not None:
            lease, ids, keys, x = job
            out.put((lease, ids, keys, model(torch.from_numpy(x)).numpy()))
    out.put(None)


def committer(q: Any, folder: Path, inbox: queue.Queue[Any], done: list[int]) -> None:
    """A Parquet file per batch (staged, fsynced, renamed), its items acked in one transaction."""
    while (job := inbox.get()) is not None:
        lease, ids, keys, y = job
        output = pa.FixedSizeListArray.from_arrays(pa.array(y.reshape(-1)), y.shape[1])
        buf = pa.BufferOutputStream()
        pq.write_table(pa.table({"item_key": keys, "output": output}), buf)
        data = buf.getvalue()
        staged = folder / f"{uuid.uuid4()}.staging"
        with staged.open("wb") as f:
            f.write(memoryview(data))
            f.flush()
            os.fsync(f.fileno())
        hashlib.sha256(memoryview(data)).hexdigest()
        with q.begin() as conn:
            done[0] += q.ack(lease, ids, conn=conn, batch_id=str(uuid.uuid4()))
        os.replace(staged, staged.with_suffix(".parquet"))


def probe(tmp: Path, tag: str, records: list[Any], model: torch.nn.Module) -> float:
    cfg = config("tabular.yaml", tmp, tag)
    enqueue(cfg, records)
    q = build.open_queue(cfg, cfg.database.url)
    folder = tmp / f"out-{tag}"
    folder.mkdir()
    to_forward: queue.Queue[Any] = queue.Queue(4)
    to_commit: queue.Queue[Any] = queue.Queue(4)
    done = [0]
    size, batch = cfg.batching.effective_claim_size, cfg.batching.max_batch_size
    threads = [
        threading.Thread(target=claimer, args=(q, size, batch, to_forward)),
        threading.Thread(target=forwarder, args=(model, to_forward, to_commit)),
        threading.Thread(target=committer, args=(q, folder, to_commit, done)),
    ]
    gc.freeze()  # as app.run_score does for a run
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    rate = done[0] / (time.perf_counter() - started)
    gc.unfreeze()
    q.engine.dispose()
    if done[0] != len(records):
        raise SystemExit(f"probe acked {done[0]} of {len(records)} items")
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=50_000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="columnar-probe-"))
    records = ingest.read_records(workloads.write_w1_parquet(tmp / "w1.parquet", args.items))
    x = workloads.w1_inputs(args.items)
    model, _ = zoo.build("w1-mlp")
    model.eval()
    limit = w1_limit(x)
    rates = [probe(tmp, f"probe{i}", records, model) for i in range(args.runs)]
    limit = max(limit, w1_limit(x))
    print(f"limit {limit:,.0f} rows/s")
    for rate in rates:
        print(f"columnar probe {rate:,.0f} rows/s = {rate / limit:.3f} x limit")


if __name__ == "__main__":
    main()
