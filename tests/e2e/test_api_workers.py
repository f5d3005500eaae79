"""``batching api --workers 2`` as real processes on one SQLite file: both workers serve the
one port (each is made to, by stopping the other with SIGSTOP), every scrape of /metrics sums
both workers' counts whichever answers it, a worker SIGKILLed is replaced and its counts still
count, and SIGTERM to the parent stops every worker and removes the metrics folder."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import threading
import time
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.conftest import wait_for
from tests.e2e.test_api import TOKEN, _up, call, free_port, start
from tests.e2e.test_cli import BATCHING, DB, batching, write_config

pytestmark = pytest.mark.slow


def workers_of(parent: int) -> list[int]:
    """The spawned workers of ``parent`` (not multiprocessing's resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes()
        except OSError:
            continue
        ppid = int(stat.rsplit(")", 1)[1].split()[1])
        if ppid == parent and b"spawn_main" in cmdline:
            found.append(int(entry.name))
    return sorted(found)


@contextmanager
def stopped(pid: int) -> Iterator[None]:
    """``pid`` stopped (SIGSTOP): the other worker accepts every connection meanwhile."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(pid, signal.SIGCONT)


def enqueued(base: str) -> float:
    """The items /metrics says were enqueued (``batching_api_items_total``)."""
    with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
        return enqueued_in(r.read().decode())


def enqueued_in(text: str) -> float:
    found = re.findall(
        r'^batching_api_items_total\{[^}]*outcome="enqueued"[^}]*\} (\S+)$', text, re.M
    )
    return sum(map(float, found))


def post(base: str, keys: range) -> None:
    for k in keys:
        item = {"item_key": f"w-{k}", "payload": {"x": [0.5] * 64}}
        status, doc = call(base, "POST", "/v1/queues/tabular/items", item)
        assert status == 201, doc


def start_two_workers(folder: Path, **env_extra: str) -> tuple[subprocess.Popen[str], str]:
    """``batching api --workers 2`` on a new queue in ``folder``, both workers up; the
    process and its base URL."""
    assert batching("init", "--db", DB, cwd=folder).rc == 0
    config = write_config(folder)
    env = {**os.environ, "BATCHING_API_TOKENS": f"{TOKEN}=acme", **env_extra}
    env.pop("BATCHING_DB_URL", None)
    env.pop("PROMETHEUS_MULTIPROC_DIR", None)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [BATCHING, "api", "-c", str(config), "--port", str(port), "--workers", "2"]
    api = start([*args, "--no-check-payloads"], folder, env)
    try:
        wait_for(lambda: _up(base, api), 90, "the API to answer /healthz")
        wait_for(lambda: len(workers_of(api.pid)) == 2 or None, 30, "two workers")
    except BaseException:
        os.killpg(api.pid, signal.SIGKILL)
        api.communicate()
        raise
    return api, base


def test_two_workers_serve_one_port_sum_their_metrics_and_are_replaced(tmp_path: Path) -> None:
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    api, base = start_two_workers(tmp_path, TMPDIR=str(scratch))
    try:
        first, second = workers_of(api.pid)
        assert len(list(scratch.glob("batching-api-metrics-*"))) == 1
        wait_for(lambda: _answers_without(base, first), 60, "the second worker to serve")

        with stopped(second):  # every request to the first worker
            post(base, range(0, 5))
        with stopped(first):  # and now to the second
            post(base, range(5, 10))
            assert enqueued(base) == 10  # the second answers: both workers' counts
        with stopped(second):
            assert enqueued(base) == 10  # the first answers: the same sum

        os.kill(first, signal.SIGKILL)
        wait_for(
            lambda: (len(w := workers_of(api.pid)) == 2 and first not in w) or None,
            60,
            "the killed worker replaced",
        )
        replacement = next(w for w in workers_of(api.pid) if w != second)
        wait_for(lambda: _answers_without(base, second), 60, "the replacement to serve")
        with stopped(second):  # the replacement answers: the dead worker's 5 still count
            assert enqueued(base) == 10
            post(base, range(10, 11))
        assert enqueued(base) == 11

        api.send_signal(signal.SIGTERM)
        assert api.wait(60) == 0
        _, err = api.communicate()
    finally:
        if api.poll() is None:
            os.killpg(api.pid, signal.SIGKILL)
            api.communicate()
    assert f"API worker 0 (pid {first}) exited with signal SIGKILL; starting another" in err
    assert not any(os.path.exists(f"/proc/{pid}") for pid in (second, replacement))
    assert not list(scratch.glob("batching-api-metrics-*"))  # gone with the server
    with sqlite3.connect(tmp_path / "queue.db") as db:
        keys = {k for (k,) in db.execute("SELECT item_key FROM batching_items")}
    assert keys == {f"w-{k}" for k in range(11)}


def _answers_without(base: str, pid: int) -> bool | None:
    """Whether the API answers /healthz with ``pid`` stopped (the other worker is up)."""
    with stopped(pid):
        try:
            status, _ = call(base, "GET", "/healthz")
        except OSError:
            return None
    return status == 200 or None


def test_workers_out_of_range_exit_2(tmp_path: Path) -> None:
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    env = {"BATCHING_API_TOKENS": f"{TOKEN}=acme"}
    for bad in ("0", "65"):
        r = batching("api", "-c", str(config), "--workers", bad, cwd=tmp_path, env=env)
        assert r.rc == 2
        assert "--workers" in r.err


def test_workers_stop_when_their_parent_is_killed(tmp_path: Path) -> None:
    """A supervisor killed outright (SIGKILL, an OOM kill) leaves no worker serving its port."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    api, _ = start_two_workers(tmp_path, TMPDIR=str(scratch))
    try:
        workers = workers_of(api.pid)
        api.kill()
        api.wait(30)
        wait_for(lambda: not any(_alive(pid) for pid in workers) or None, 30, "the workers to stop")
    finally:
        with contextlib.suppress(ProcessLookupError):  # the group: the parent and its workers
            os.killpg(api.pid, signal.SIGKILL)
        api.communicate()


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, reaped by nobody yet, does not)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_ctrl_c_drains_quietly_refusing_new_connections_and_exits_130(tmp_path: Path) -> None:
    """Ctrl-C reaches the whole process group. Each worker printed a traceback and the parent
    exited 0, and while the workers drained, a new connection was held unanswered (the
    parent kept its copy of the socket) instead of refused (a review)."""
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    api, base = start_two_workers(tmp_path, TMPDIR=str(scratch))
    port = int(base.rsplit(":", 1)[1])
    answers: list[tuple[int, Any]] = []
    try:
        post(base, range(1))  # no scorer: its long poll waits out wait_s
        waiting = threading.Thread(
            target=lambda: answers.append(
                call(base, "GET", "/v1/queues/tabular/items/w-0?wait_s=6")
            )
        )
        waiting.start()
        time.sleep(1.0)
        os.killpg(api.pid, signal.SIGINT)
        wait_for(lambda: _refused(port), 5, "new connections to be refused while draining")
        assert waiting.is_alive()  # the long poll in flight is still being answered
        waiting.join(30)
        assert api.wait(60) == 130
        _, err = api.communicate()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(api.pid, signal.SIGKILL)
        if api.returncode is None:
            api.communicate()
    assert len(answers) == 1
    assert answers[0][0] == 200, answers
    assert answers[0][1]["state"] == "ready"
    assert "Traceback" not in err, err
    assert "KeyboardInterrupt" not in err, err
    assert not list(scratch.glob("batching-api-metrics-*"))


def _refused(port: int) -> bool | None:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return None
    except ConnectionRefusedError:
        return True
    except OSError:
        return None


def test_one_process_serves_its_own_counts_beside_a_users_multiprocess_folder(
    tmp_path: Path,
) -> None:
    """``PROMETHEUS_MULTIPROC_DIR`` set for other processes: a single ``batching api`` summed
    that folder into its /metrics, the other app's series included (a review)."""
    folder = tmp_path / "prom"
    folder.mkdir()
    other = "from prometheus_client import Counter; Counter('other_app_requests', 'x').inc(5)"
    env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": str(folder)}
    subprocess.run([sys.executable, "-c", other], env=env, check=True)
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    config = write_config(tmp_path)
    env |= {"BATCHING_API_TOKENS": f"{TOKEN}=acme"}
    env.pop("BATCHING_DB_URL", None)
    port = free_port()
    base = f"http://127.0.0.1:{port}"
    args = [BATCHING, "api", "-c", str(config), "--port", str(port), "--no-check-payloads"]
    api = start(args, tmp_path, env)
    try:
        wait_for(lambda: _up(base, api), 90, "the API to answer /healthz")
        post(base, range(2))
        with urllib.request.urlopen(base + "/metrics", timeout=30) as r:
            text = r.read().decode()
    finally:
        os.killpg(api.pid, signal.SIGKILL)
        api.communicate()
    assert "other_app_requests" not in text
    assert enqueued_in(text) == 2
