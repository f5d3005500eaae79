"""What ``batching api --workers K`` admits a second, against one process. Not a test.

    python bench/api_workers_bench.py [--workers 1 2] [--rounds 2] [--seconds 15]
        [--in-flight 32] [--pg postgresql://...] [-c deployments/online.yaml]

Per round and per K (alternated, K in the order given): a fresh queue (a SQLite file, or a
scratch PostgreSQL database from ``--pg``, an admin URL whose server runs on this host),
``batching api --workers K`` on it with no scorer and no cap, then ``--in-flight`` one-item
POSTs kept in flight for ``--seconds`` over keep-alive connections by the bench's lean
asyncio client (``online_bench.RawHttp``, in this process). Reports the requests admitted a
second (201), the median and p99 answer, and the CPU the API's processes used (the parent
and its workers, user + system from ``/proc``), the PostgreSQL server's processes on this
host used (0 on SQLite) and this client used, in cores. Payloads are
the config's workload's reference inputs (W2 token ids for online.yaml).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import signal
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from cap_bench import scratch_queue
from online_bench import RawHttp, free_port, payload_json, project_env

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-api-workers-token-0123456789"
TICK = os.sysconf("SC_CLK_TCK")


def _tree_cpu_s(root: int) -> float:
    """CPU seconds (user + system) of ``root`` and its children, from ``/proc``."""
    total = 0.0
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(entry.name) == root or int(fields[1]) == root:
            total += (int(fields[11]) + int(fields[12])) / TICK
    return total


def _postgres_cpu_s() -> dict[int, float]:
    """CPU seconds of each PostgreSQL server process on this host, by pid."""
    found = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            name, _, rest = (entry / "stat").read_text().partition(" (")[2].rpartition(") ")
        except OSError:
            continue
        if name != "postgres":
            continue
        fields = rest.split()
        found[int(entry.name)] = (int(fields[11]) + int(fields[12])) / TICK
    return found


def _own_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def _wait_ready(base: str, api: subprocess.Popen[bytes], workers: int) -> None:
    """Until /healthz answers and every worker has started (each answers once ready)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        if api.poll() is not None:
            raise SystemExit(f"error: batching api exited with {api.returncode}")
        try:
            with urllib.request.urlopen(base + "/healthz", timeout=2):
                pass
            if workers == 1 or _started(api.pid) >= workers:
                time.sleep(2.0 if workers > 1 else 0.0)  # the last worker's imports
                return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("error: batching api did not answer /healthz within 120 s")


def _started(parent: int) -> int:
    n = 0
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes()
                ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            except OSError:
                continue
            n += ppid == parent and b"spawn_main" in cmd
    return n


async def _load(
    base: str, queue: str, payloads: list[str], seconds: float, in_flight: int, tag: str
) -> tuple[int, int, list[float]]:
    """``in_flight`` POSTs kept in flight for ``seconds``: (admitted, other, answer times)."""
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    url = f"{base}/v1/queues/{queue}/items"
    admitted = other = 0
    walls: list[float] = []
    stop_at = time.monotonic() + seconds
    counter = iter(range(10**9))

    async with RawHttp(in_flight) as http:

        async def client() -> None:
            nonlocal admitted, other
            while time.monotonic() < stop_at:
                i = next(counter)
                body = f'{{"item_key": "{tag}-{i}", "payload": {payloads[i % len(payloads)]}}}'
                start = time.perf_counter()
                r = await http.post(url, content=body, headers=headers)
                walls.append(time.perf_counter() - start)
                if r.status_code == 201:
                    admitted += 1
                else:
                    other += 1

        await asyncio.gather(*(client() for _ in range(in_flight)))
    return admitted, other, walls


def one(args: argparse.Namespace, workers: int, tag: str, payloads: list[str]) -> dict[str, float]:
    with scratch_queue(args.pg, args.queue) as scratch:  # a fresh database, migrated
        db_url = scratch.engine.url.render_as_string(hide_password=False)
        env = project_env({"BATCHING_API_TOKENS": f"{TOKEN}=bench"})
        cli = [sys.executable, "-m", "batching.cli"]
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        command = [*cli, "api", "-c", str(args.config), "--db", db_url, "--port", str(port)]
        api = subprocess.Popen(
            [*command, "--workers", str(workers)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            _wait_ready(base, api, workers)
            queue = args.queue
            server = _postgres_cpu_s()
            api_cpu, own, t0 = _tree_cpu_s(api.pid), _own_cpu_s(), time.monotonic()
            admitted, other, walls = asyncio.run(
                _load(base, queue, payloads, args.seconds, args.in_flight, tag)
            )
            elapsed = time.monotonic() - t0
            api_cpu, own = _tree_cpu_s(api.pid) - api_cpu, _own_cpu_s() - own
            after = _postgres_cpu_s()
            db_cpu = sum(after[p] - server.get(p, 0.0) for p in after)
        finally:
            api.send_signal(signal.SIGTERM)
            try:
                api.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(api.pid, signal.SIGKILL)
                api.wait()
    walls.sort()
    return {
        "workers": workers,
        "admitted_per_s": admitted / elapsed,
        "other": other,
        "p50_ms": statistics.median(walls) * 1e3,
        "p99_ms": walls[int(0.99 * (len(walls) - 1))] * 1e3,
        "api_cores": api_cpu / elapsed,
        "client_cores": own / elapsed,
        "db_cores": db_cpu / elapsed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=15.0)
    parser.add_argument("--in-flight", type=int, default=32)
    parser.add_argument("--pg", help="admin URL of a PostgreSQL server on this host")
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "deployments" / "online.yaml")
    args = parser.parse_args()
    if any(k < 1 for k in args.workers) or args.rounds < 1 or args.in_flight < 1:
        parser.error("--workers, --rounds and --in-flight take numbers of at least 1")
    import yaml

    data = yaml.safe_load(args.config.read_text())
    args.queue = data["queue"]["name"]
    payloads = payload_json("w2" if "online" in args.config.name else "w1")
    print(f"{os.cpu_count()} cores, {args.in_flight} in flight, {args.seconds:g} s a point")
    print(
        "| round | workers | admitted/s | p50 ms | p99 ms | API cores | PostgreSQL cores "
        "| client cores | other |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for r in range(args.rounds):
        for k in args.workers:
            m = one(args, k, f"r{r}k{k}", payloads)
            print(
                f"| {r} | {k} | {m['admitted_per_s']:,.1f} | {m['p50_ms']:.1f} | "
                f"{m['p99_ms']:.1f} | {m['api_cores']:.2f} | {m['db_cores']:.2f} | "
                f"{m['client_cores']:.2f} | "
                f"{m['other']} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
