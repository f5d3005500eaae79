"""The API's CPU a request, admitted and refused at the depth cap. Not a test.

    python bench/api_cost.py [--requests 1500] [--rounds 2] [-c deployments/online.yaml]

Starts ``batching api`` on a fresh SQLite queue (no scorer), then per round POSTs
``--requests`` one-item requests one at a time over one keep-alive connection, first with no
cap (each one enqueued: 201), then with the queue closed (``batching queue cap --max-depth 0``:
each one refused: 429), and reads the API process's CPU (user + system, ``/proc``) around
each. Payloads are the config's workload's reference inputs (W2 token ids for online.yaml,
W1 vectors for tabular.yaml). One request at a time pays a group commit each: the cost of a
request on its own, not under a load that groups them. Each round ends with as many GETs of
``/healthz`` and of an item that does not exist (a 404 after the token check): the
framework's own cost a request, with the API's CPU and the median wall time of each.
"""

from __future__ import annotations

import argparse
import http.client
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from online_bench import free_port  # bench/ is on the path (this script's folder)

from batching.config import load_config
from batching.model import workloads

ROOT = Path(__file__).resolve().parents[1]
TOKEN = "bench-api-cost-token-0123456789"
TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(pid: int) -> float:
    text = Path(f"/proc/{pid}/stat").read_text()
    rest = text[text.rindex(")") + 2 :].split()
    return (int(rest[11]) + int(rest[12])) / TICK


def _payloads(model: str) -> list[str]:
    if model.startswith("w2"):
        return [json.dumps({"tokens": s.tolist()}) for s in workloads.w2_inputs()]
    return [json.dumps({"x": row.tolist()}) for row in workloads.w1_inputs(256)]


def _wait_ready(port: int, api: subprocess.Popen[bytes]) -> None:
    for _ in range(300):
        if api.poll() is not None:
            raise SystemExit(f"error: batching api exited with {api.returncode} before it served")
        try:
            conn = http.client.HTTPConnection("127.0.0.1", port, timeout=1)
            conn.request("GET", "/healthz")
            conn.getresponse().read()
            return
        except OSError:
            time.sleep(0.1)
    raise SystemExit("error: batching api did not answer /healthz within 30 s")


def burst(
    port: int, pid: int, queue: str, payloads: list[str], tag: str, n: int
) -> tuple[dict[int, int], float]:
    """POST ``n`` one-item requests; returns the status counts and the API's CPU ms a request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"}
    codes: dict[int, int] = {}
    cpu = _cpu_s(pid)
    for i in range(n):
        body = f'{{"item_key": "{tag}-{i}", "payload": {payloads[i % len(payloads)]}}}'
        conn.request("POST", f"/v1/queues/{queue}/items", body=body, headers=headers)
        response = conn.getresponse()
        response.read()
        codes[response.status] = codes.get(response.status, 0) + 1
    return codes, (_cpu_s(pid) - cpu) / n * 1e3


def gets(port: int, pid: int, path: str, n: int) -> tuple[int, float, float]:
    """GET ``path`` ``n`` times; the last status, the API's CPU ms and the median ms a request."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
    headers = {"Authorization": f"Bearer {TOKEN}"}
    walls, status = [], 0
    cpu = _cpu_s(pid)
    for _ in range(n):
        start = time.perf_counter()
        conn.request("GET", path, headers=headers)
        response = conn.getresponse()
        response.read()
        walls.append(time.perf_counter() - start)
        status = response.status
    return status, (_cpu_s(pid) - cpu) / n * 1e3, sorted(walls)[n // 2] * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=1500, help="requests a burst")
    parser.add_argument("--rounds", type=int, default=2, help="admitted/refused pairs")
    parser.add_argument("-c", "--config", type=Path, default=ROOT / "deployments" / "online.yaml")
    args = parser.parse_args()
    if args.requests < 1 or args.rounds < 1:
        parser.error("--requests and --rounds must be at least 1")
    cfg = load_config(args.config)
    cli = [sys.executable, "-m", "batching.cli"]
    env = dict(os.environ, BATCHING_API_TOKENS=f"{TOKEN}=bench")
    with tempfile.TemporaryDirectory() as tmp:
        db = f"sqlite:///{Path(tmp) / 'api.db'}"
        subprocess.run([*cli, "init", "--db", db], check=True, capture_output=True)
        port = free_port()
        api = subprocess.Popen(
            [*cli, "api", "-c", str(args.config), "--db", db, "--port", str(port)],
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cap = [*cli, "queue", "cap", cfg.queue.name, "-c", str(args.config), "--db", db]
        try:
            _wait_ready(port, api)
            payloads = _payloads(cfg.model.name)
            burst(port, api.pid, cfg.queue.name, payloads, "warm", 200)
            for r in range(args.rounds):
                for tag, opt in (("admitted", ["--no-cap"]), ("refused", ["--max-depth", "0"])):
                    subprocess.run([*cap, *opt], check=True, capture_output=True)
                    codes, ms = burst(
                        port, api.pid, cfg.queue.name, payloads, f"{tag}{r}", args.requests
                    )
                    print(f"round {r} {tag}: statuses {codes}, API CPU {ms:.2f} ms a request")
                for path in ("/healthz", f"/v1/queues/{cfg.queue.name}/items/absent"):
                    status, ms, wall = gets(port, api.pid, path, args.requests)
                    print(
                        f"round {r} GET {path}: {status}, API CPU {ms:.2f} ms, median {wall:.2f} ms"
                    )
        finally:
            api.send_signal(signal.SIGINT)
            api.wait(30)


if __name__ == "__main__":
    main()
