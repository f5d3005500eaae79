"""HTTP in, result out, the scorer SIGKILLed in between: `batching api` and `batching score`
as real processes on one SQLite file. 300 items are POSTed over HTTP (a batch of them twice)
while a scorer runs; the scorer dies by SIGKILL with a batch claimed; another takes over once
the lease expires; every item's GET (long poll) returns its committed row, and the Parquet
dataset holds each item exactly once: nothing lost, nothing doubled."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

import pyarrow.parquet as pq
import pytest

from batching.model import workloads
from tests.conftest import wait_for
from tests.e2e.test_cli import BATCHING, DB, batching, one_error_line, write_config

pytestmark = pytest.mark.slow

TOKEN = "e2e-token-0123456789abcdef"
N_ITEMS, PER_POST = 300, 30
DIE_ON = Path(__file__).parents[1] / "integration" / "die_on.py"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def call(base: str, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(
        base + path,
        data=data,
        method=method,
        headers={"Authorization": f"Bearer {TOKEN}", "Content-Type": "application/json"},
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def start(args: list[str], cwd: Path, env: dict[str, str]) -> subprocess.Popen[str]:
    return subprocess.Popen(
        args,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def test_http_in_result_out_with_the_scorer_killed_in_between(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path, queue={"lease_s": 3})
    env = {**os.environ, "BATCHING_API_TOKENS": f"{TOKEN}=acme"}
    env.pop("BATCHING_DB_URL", None)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    # not the config's output: the API reads results where the scorers were told to write
    output = ["--output", str(tmp_path / "http-out")]
    api = start([BATCHING, "api", "-c", str(config), "--port", str(port), *output], tmp_path, env)
    victim_key = f"http-{N_ITEMS * 2 // 3}"
    score = ["score", "-c", str(config), "--quiet", "--max-seconds", "240", *output]
    procs = [api]
    try:
        wait_for(lambda: _up(base, api), 60, "the API to answer /healthz")
        status, refused = call(  # W1 takes 64 numbers: refused at the door, not dead later
            base, "POST", "/v1/queues/tabular/items", {"item_key": "x", "payload": {"x": [1]}}
        )
        assert (status, refused["error"]["kind"]) == (422, "InputError"), refused
        assert "does not fit the model" in refused["error"]["message"]
        first = start(
            [sys.executable, str(DIE_ON), victim_key, "kill", "--", *score], tmp_path, env
        )
        procs.append(first)
        rows = workloads.w1_inputs(N_ITEMS)
        posted: dict[str, int] = {}
        for start_at in range(0, N_ITEMS, PER_POST):
            body = {
                "items": [
                    {"item_key": f"http-{i}", "payload": {"x": rows[i].tolist()}}
                    for i in range(start_at, start_at + PER_POST)
                ]
            }
            status, doc = call(base, "POST", "/v1/queues/tabular/items", body)
            assert status == 201, doc
            posted |= {i["item_key"]: i["id"] for i in doc["items"]}
            if start_at == 0:  # the same request again: the same items, none new
                status, again = call(base, "POST", "/v1/queues/tabular/items", body)
                assert status == 200, again
                assert {i["item_key"]: i["id"] for i in again["items"]} == posted
                assert not any(i["created"] for i in again["items"])
        assert len(posted) == N_ITEMS
        assert first.wait(120) == -signal.SIGKILL, first.communicate()[1]
        status, victim = call(base, "GET", f"/v1/queues/tabular/items/{victim_key}")
        assert (status, victim["state"]) == (200, "leased")  # claimed when its scorer died

        second = start([BATCHING, *score], tmp_path, env)
        procs.append(second)
        results = {}
        for key in posted:
            status, doc = call(base, "GET", f"/v1/queues/tabular/items/{key}?wait_s=30")
            assert (status, doc["state"], doc["error"]) == (200, "done", None), doc
            results[key] = doc["result"]
        second.send_signal(signal.SIGTERM)
        assert second.wait(60) == 0, second.communicate()[1]
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()

    assert not (tmp_path / "outputs").exists()
    files = sorted((tmp_path / "http-out").rglob("*.parquet"))
    written = [r for f in files for r in pq.read_table(f).to_pylist()]
    counts = Counter(r["item_key"] for r in written)
    assert set(counts) == set(posted)  # none lost
    assert max(counts.values()) == 1  # none doubled
    by_key = {r["item_key"]: r for r in written}
    for key, result in results.items():
        row = by_key[key]
        assert (result["batch_id"], result["tenant"]) == (row["batch_id"], "acme")
        assert result["output"] == list(row["output"])


def _up(base: str, api: subprocess.Popen[str]) -> bool | None:
    if api.poll() is not None:
        raise AssertionError(f"the API exited: {api.communicate()[1]}")
    try:
        with urllib.request.urlopen(base + "/healthz", timeout=2) as r:
            return r.status == 200 or None
    except OSError:
        return None


@pytest.mark.parametrize(
    ("env", "says"),
    [
        ({}, "no API tokens: set BATCHING_API_TOKENS"),
        (
            {"BATCHING_API_TOKENS": "short=acme"},
            "BATCHING_API_TOKENS: entry 1: the token is shorter",
        ),
        ({"BATCHING_API_TOKENS_FILE": "missing.txt"}, "cannot read missing.txt"),
    ],
)
def test_api_without_good_tokens_exits_2_with_one_line(
    tmp_path: Path, env: dict[str, str], says: str
) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith("BATCHING_API_TOKENS")}
    r = batching("api", "-c", str(config), cwd=tmp_path, env={**base, **env})
    assert r.rc == 2
    assert says in one_error_line(r)
    assert "short" not in r.err.replace("shorter", "")


def test_api_on_a_port_in_use_or_an_unknown_host_exits_2_before_saying_it_serves(
    tmp_path: Path,
) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    env = {"BATCHING_API_TOKENS": f"{'t' * 24}=acme"}
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = batching("api", "-c", str(config), "--port", str(port), cwd=tmp_path, env=env)
    assert r.rc == 2
    assert one_error_line(r) == (
        f"error: cannot serve on 127.0.0.1:{port} (Address already in use); "
        "choose a free port (--port)"
    )
    r = batching("api", "-c", str(config), "--host", "999.1.1.1", cwd=tmp_path, env=env)
    assert r.rc == 2
    assert one_error_line(r).startswith("error: cannot serve on host '999.1.1.1'")
