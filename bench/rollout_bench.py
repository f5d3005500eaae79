"""What a rollout costs the scorer: W1 (tensor payloads) through the full pipeline (SQLite
queue -> score -> committed Parquet) with no route, a 10% canary, a 10% canary with a 5%
shadow, and a scorer pinned to the stable version (``score --model-version``), interleaved
``--rounds`` times; rows/s of each and its ratio to no route in the same round. Not a test.

    python bench/rollout_bench.py [--items 100000] [--rounds 3]

The candidate is the built-in W1 model under another version name (the same weights, so the
model's own cost is equal and only the routing shows).
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import tempfile
from pathlib import Path
from typing import Any

from batching.compose import build, rollouts
from batching.compose import run as app
from batching.config import load_config
from batching.ingress import ingest
from batching.loop import stats as run_stats
from batching.model import workloads, zoo

DEPLOY = Path(__file__).resolve().parents[1] / "deployments"
VARIANTS: dict[str, dict[str, Any]] = {
    "no route": {},
    "canary 10%": {"percent": 10.0},
    "canary 10% + shadow 5%": {"percent": 10.0, "shadow": 5.0},
    "pinned to stable": {"percent": 10.0, "pin": True},
}


def one(tmp: Path, records: list[Any], tag: str, variant: dict[str, Any]) -> dict[str, Any]:
    spec = {"name": "w1-mlp", "sha256": zoo.BUILTINS["w1-mlp"].sha256, "version": "w1-next"}
    cfg = load_config(
        DEPLOY / "tabular.yaml",
        {
            "database": {"url": f"sqlite:///{tmp / f'{tag}.db'}"},
            "output": {"path": str(tmp / f"out-{tag}")},
            "lineage": {"transport": "none"},
            "model_versions": [spec],
        },
    )
    queue = build.open_queue(cfg, cfg.database.url, create=True)
    queue.migrate()
    queue.enqueue(records)
    queue.engine.dispose()
    if "percent" in variant:
        rollouts.start(
            cfg,
            None,
            candidate="w1-next",
            percent=variant["percent"],
            shadow=variant.get("shadow", 0.0),
            actor="bench",
            reason="bench",
        )
    pinned = cfg.model.version if variant.get("pin") else None
    outcome = app.run_score(cfg, limits=run_stats.RunLimits(), model_version=pinned)
    s = outcome.summary
    return {"items": s["items_committed"], "rows_s": s["items_per_s"], "batches": s["batches"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--items", type=int, default=100_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--out", type=Path, default=Path("rollout_bench.json"))
    args = parser.parse_args()
    logging.disable(logging.WARNING)
    runs: dict[str, list[dict[str, Any]]] = {name: [] for name in VARIANTS}
    with tempfile.TemporaryDirectory() as folder:
        tmp = Path(folder)
        records = ingest.read_records(workloads.write_w1_parquet(tmp / "w1.parquet", args.items))
        for r in range(args.rounds):
            for n, (name, variant) in enumerate(VARIANTS.items()):
                runs[name].append(one(tmp, records, f"r{r}v{n}", variant))
    base = [run["rows_s"] for run in runs["no route"]]
    print(f"W1, {args.items} rows, {args.rounds} rounds (median rows/s; ratio to no route)")
    for name, got in runs.items():
        rates = [g["rows_s"] for g in got]
        ratio = statistics.median(x / b for x, b in zip(rates, base, strict=True))
        items = got[0]["items"]
        print(f"  {name:<24} {statistics.median(rates):>9,.0f}  {ratio:.2f}x  ({items} items)")
    args.out.write_text(json.dumps(runs, indent=2))


if __name__ == "__main__":
    main()
