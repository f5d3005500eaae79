"""p99 against offered load, us and the peers, from `bench/online_bench.py`'s summary.jsonl.

Runs where matplotlib is installed (the peers' plot venv), never in the project's venv:

    $PEERS/venv-plot/bin/python bench/plot_online.py DIR/summary.jsonl -o docs/img/online-p99.png

One panel per workload and arrival pattern; x: offered load as a fraction of the reference
capacity (ours, measured in the same run), y: p99 from scheduled arrival to result (log
scale). A hollow marker is a lower bound (requests still open at the cut-off); the dashed
line is the config's latency_slo_s; our fixed variant is dotted, pinned dashed, others dash-dot. Standard library + matplotlib only.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

STYLE = {"batching": "C0", "pytriton": "C1", "litserve": "C2", "ray_serve": "C3"}
VARIANT_LINES = {"fixed": ":", "adaptive": "-", "pinned": "--"}


def label(row: dict[str, Any]) -> str:
    return str(row["system"]) + (f" ({row['variant']})" if row.get("variant") else "")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("summary", type=Path)
    parser.add_argument("-o", "--out", type=Path, default=Path("online-p99.png"))
    args = parser.parse_args()
    rows = [json.loads(line) for line in args.summary.read_text().splitlines() if line]
    points = [r for r in rows if r["kind"] == "point" and r.get("p99_s") is not None]
    panels: dict[tuple[str, str], dict[str, list[dict[str, Any]]]] = defaultdict(
        lambda: defaultdict(list)
    )
    for r in points:
        panels[(r["workload"], r["pattern"])][label(r)].append(r)
    if not panels:
        raise SystemExit(f"{args.summary}: no load points with a p99 to plot")
    keys = sorted(panels, key=lambda k: (k[0] != "w2", k[1] != "poisson", k))
    fig, axes = plt.subplots(1, len(keys), figsize=(5.2 * len(keys), 4.2), squeeze=False)
    for ax, key in zip(axes[0], keys, strict=True):
        slo = None
        for n, (name, series) in enumerate(sorted(panels[key].items())):
            series.sort(key=lambda r: r["load"])
            color = STYLE.get(series[0]["system"], f"C{4 + n}")
            x = [r["load"] for r in series]
            y = [r["p99_s"] for r in series]
            variant = series[0].get("variant") or ""
            line = VARIANT_LINES.get(variant, "-" if not variant else "-.")
            ax.plot(x, y, line, color=color, label=name)
            for r in series:
                hollow = r.get("p99_censored")
                ax.plot(
                    r["load"],
                    r["p99_s"],
                    "^" if hollow else "o",
                    color=color,
                    markerfacecolor="none" if hollow else color,
                )
            slo = slo or series[0].get("slo_s")
        if slo:
            ax.axhline(slo, color="grey", linestyle="--", linewidth=1, label=f"SLO {slo:g} s")
        ax.set_yscale("log")
        ax.set_xlabel("offered load (x our measured capacity)")
        ax.set_ylabel("p99 arrival -> result (s)")
        ax.set_title(f"{key[0].upper()}, {key[1]} arrivals")
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=8)
    run = points[0].get("run_id", "")
    fig.suptitle(f"Open loop over HTTP: p99 vs offered load (run {run}; hollow = lower bound)")
    fig.tight_layout()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(args.out, dpi=110)
    print(args.out)


if __name__ == "__main__":
    main()
