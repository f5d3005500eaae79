"""Lineage that is never lost: events the backend did not take wait in the queue database's
spool and arrive later, in order per run, byte for byte, each once (a duplicate only after a
lost reply). A real loopback HTTP server stands in for Marquez; real SQLite and PostgreSQL.
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import Counter
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from referencing import Registry

from batching import config, errors
from batching.compose import build
from batching.compose import run as wiring
from batching.evidence import lineage, ol_config, spool
from batching.ingress import ingest
from batching.model import workloads
from batching.store import database
from tests import olspec
from tests.conftest import REPO, KeptRecords

PRODUCER = "https://github.com/batching/batching"


class Marquez:
    """A loopback stand-in for Marquez: keeps each POST's raw body. ``down``: answers 503;
    ``lose``: takes that many POSTs (kept: the backend has them) and drops the connection
    before answering, as a reply lost on the way back."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.down = False
        self.lose = 0
        self._lock = threading.Lock()
        marquez = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers["Content-Length"]))
                with marquez._lock:
                    if marquez.down:
                        status = 503
                    elif marquez.lose:
                        marquez.lose -= 1
                        marquez.bodies.append(body)
                        self.close_connection = True
                        return  # no answer: the client sees the connection closed
                    else:
                        marquez.bodies.append(body)
                        status = 201
                self.send_response(status)
                self.send_header("Content-Length", "0")
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def events(self) -> list[dict[str, Any]]:
        return [json.loads(b) for b in self.bodies]

    def by_run(self) -> dict[str, list[str]]:
        """Each run's event types, in the order they arrived."""
        runs: dict[str, list[str]] = {}
        for e in self.events():
            runs.setdefault(e["run"]["runId"], []).append(e["eventType"])
        return runs


@pytest.fixture
def marquez() -> Iterator[Marquez]:
    stub = Marquez()
    thread = threading.Thread(target=stub.server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield stub
    stub.server.shutdown()
    stub.server.server_close()
    thread.join()


_ENGINES: list[Any] = []


@pytest.fixture(autouse=True)
def _dispose_engines() -> Iterator[None]:
    """The emitters' engines, closed after each test (a connection left to the GC warns)."""
    yield
    while _ENGINES:
        _ENGINES.pop().dispose()


@pytest.fixture(scope="module")
def registry() -> Registry:
    return olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())


def http(url: str, **kw: Any) -> config.LineageConfig:
    return config.LineageConfig(transport="http", url=url, timeout_s=1.0, retries=0, **kw)


def run_ctx(name: str = "score") -> lineage.RunContext:
    queue = lineage.DatasetRef("sqlite", "/tmp/queue.db.batching_items", (("item_key", "string"),))
    out = lineage.DatasetRef("file", "/tmp/outputs", (("output", "string"),))
    return lineage.RunContext(
        run_id=lineage.new_run_id(),
        job_name=name,
        inputs=(queue,),
        outputs=(out,),
        model=lineage.ModelRef("w1-mlp", "v1", "0" * 64),
        config={"name": name},
        config_hash="1" * 64,
    )


def emitter(
    cfg: config.LineageConfig, url: str, base: Path, cooldown_s: float = 0.0
) -> lineage.LineageEmitter:
    """An emitter spooling into the database at ``url`` (no cooldown: the stub is back at once)."""
    kept = spool.Spool(database.create_engine(url))
    _ENGINES.append(kept.engine)
    return lineage.LineageEmitter(
        cfg, base_dir=base, producer=PRODUCER, spool=kept, cooldown_s=cooldown_s
    )


def flush(cfg: config.LineageConfig, url: str, base: Path) -> spool.Flushed:
    """One flush of ``url``'s spool, with its own engine and sender (as a second process)."""
    engine = database.create_engine(url)
    sender = lineage.EventSender(cfg, base_dir=base)
    try:
        return spool.Spool(engine).flush(sender.send, send_s=sender.deadline_s)
    finally:
        sender.close()
        engine.dispose()


def emit_run(emit: lineage.LineageEmitter, run: lineage.RunContext) -> None:
    """START, RUNNING, COMPLETE: three events in an order that must hold."""
    emit.start(run)
    emit.running(run)
    emit.complete(run, [run.outputs[0].with_stats(7)])


# ----------------------------------------------------------------------------- down, then up


def test_events_of_runs_while_lineage_is_down_all_arrive_in_order_once_it_is_up(
    db_url: str, tmp_path: Path, marquez: Marquez, registry: Registry
) -> None:
    cfg = http(marquez.url)
    emit = emitter(cfg, db_url, tmp_path)
    marquez.down = True
    runs = [run_ctx("a"), run_ctx("b")]
    for run in runs:
        emit_run(emit, run)
    assert (emit.emitted, emit.failures, emit.spooled, emit.lost) == (0, 6, 6, 0)
    assert spool.backlog(emit.spool.engine).events == 6  # type: ignore[union-attr]

    marquez.down = False
    late = run_ctx("c")
    emit.start(late)  # a run with nothing spooled is sent at once
    done = flush(cfg, db_url, tmp_path)
    emit.complete(late)
    assert (done.sent, done.failed_runs, done.left.events) == (6, 0, 0)
    by_run = marquez.by_run()
    assert by_run == {
        runs[0].run_id: ["START", "RUNNING", "COMPLETE"],
        runs[1].run_id: ["START", "RUNNING", "COMPLETE"],
        late.run_id: ["START", "COMPLETE"],
    }
    assert len(set(marquez.bodies)) == len(marquez.bodies) == 8  # nothing twice
    for event in marquez.events():
        olspec.assert_valid_event(event, registry)


def test_a_later_event_of_a_run_with_spooled_events_waits_behind_them(
    sqlite_url: str, tmp_path: Path, marquez: Marquez
) -> None:
    """The backend is back for COMPLETE, but START still waits: COMPLETE must not overtake it."""
    emit = emitter(http(marquez.url), sqlite_url, tmp_path)
    run = run_ctx()
    marquez.down = True
    assert emit.start(run) is False
    marquez.down = False
    assert emit.complete(run) is False
    assert marquez.bodies == []
    assert flush(http(marquez.url), sqlite_url, tmp_path).sent == 2
    assert marquez.by_run() == {run.run_id: ["START", "COMPLETE"]}


def test_a_run_stops_at_its_first_failure_and_a_later_flush_resumes_it(
    sqlite_url: str, tmp_path: Path, marquez: Marquez
) -> None:
    cfg = http(marquez.url)
    emit = emitter(cfg, sqlite_url, tmp_path)
    run = run_ctx()
    marquez.down = True
    emit_run(emit, run)
    failed = flush(cfg, sqlite_url, tmp_path)
    assert (failed.sent, failed.failed_runs, failed.left.events) == (0, 1, 3)
    assert failed.error is not None
    assert "503" in failed.error
    marquez.down = False
    assert flush(cfg, sqlite_url, tmp_path).sent == 3
    assert marquez.by_run() == {run.run_id: ["START", "RUNNING", "COMPLETE"]}


def test_a_second_run_re_sends_what_the_first_run_spooled(
    sqlite_url: str, tmp_path: Path, marquez: Marquez, registry: Registry
) -> None:
    """The whole scoring run: lineage down for the first, up for the second, whose start
    flushes the first run's events (in the background) beside its own."""
    overrides = {
        "output": {"path": str(tmp_path / "outputs")},
        "lineage": {"transport": "http", "url": marquez.url, "timeout_s": 1.0, "retries": 0},
        "service_profile": str(REPO / "deployments" / "profiles" / "w1-mlp-cpu.json"),
    }
    pipeline = config.load_config(REPO / "deployments" / "tabular.yaml", overrides)
    queue = build.open_queue(pipeline, sqlite_url)
    records = ingest.read_records(workloads.write_w1_parquet(tmp_path / "w1.parquet", 40))
    queue.enqueue(records[:20])
    marquez.down = True
    first = wiring.run_score(pipeline, db_url=sqlite_url)
    assert first.summary["items_committed"] == 20
    assert first.lineage_failures >= 2  # START and COMPLETE, spooled
    assert spool.backlog(queue.engine).events == first.lineage_failures
    marquez.down = False
    queue.enqueue(records[20:])
    second = wiring.run_score(pipeline, db_url=sqlite_url)
    assert second.lineage_failures == 0
    by_run = marquez.by_run()
    assert by_run[first.run_id] == ["START", "COMPLETE"]
    assert by_run[second.run_id] == ["START", "COMPLETE"]
    assert spool.backlog(queue.engine).events == 0
    queue.engine.dispose()
    for event in marquez.events():
        olspec.assert_valid_event(event, registry)


# ----------------------------------------------------------------------------- duplicates


def test_only_an_event_whose_reply_was_lost_arrives_twice_byte_for_byte(
    sqlite_url: str, tmp_path: Path, marquez: Marquez
) -> None:
    cfg = http(marquez.url)
    emit = emitter(cfg, sqlite_url, tmp_path)
    run, other = run_ctx("a"), run_ctx("b")
    marquez.lose = 1
    assert emit.start(run) is False  # Marquez has it; the reply never came
    emit.start(other)
    emit.complete(run)  # behind the spooled START
    emit.complete(other)
    assert flush(cfg, sqlite_url, tmp_path).sent == 2
    counts = Counter(marquez.bodies)
    assert sorted(counts.values()) == [1, 1, 1, 2]
    twice = next(b for b, n in counts.items() if n == 2)
    assert marquez.bodies[0] == twice  # the lost one, then its re-send: the same bytes
    assert json.loads(twice)["eventType"] == "START"
    assert marquez.by_run() == {
        run.run_id: ["START", "START", "COMPLETE"],
        other.run_id: ["START", "COMPLETE"],
    }


# ----------------------------------------------------------------------------- two flushers


def test_two_flushers_at_once_send_each_event_exactly_once_in_order(
    db_url: str, tmp_path: Path, marquez: Marquez
) -> None:
    cfg = http(marquez.url)
    emit = emitter(cfg, db_url, tmp_path)
    marquez.down = True
    runs = [run_ctx(f"job-{i}") for i in range(12)]
    for run in runs:
        emit_run(emit, run)
    spooled = spool.backlog(emit.spool.engine)  # type: ignore[union-attr]
    assert (spooled.events, spooled.runs) == (36, 12)
    marquez.down = False
    start = threading.Barrier(2)
    results: list[spool.Flushed] = []
    failed: list[BaseException] = []

    def flusher() -> None:
        try:
            start.wait()
            results.append(flush(cfg, db_url, tmp_path))
        except BaseException as exc:
            failed.append(exc)

    threads = [threading.Thread(target=flusher) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not failed
    assert sum(r.sent for r in results) == 36
    assert len(marquez.bodies) == len(set(marquez.bodies)) == 36
    assert marquez.by_run() == {r.run_id: ["START", "RUNNING", "COMPLETE"] for r in runs}
    assert spool.backlog(emit.spool.engine).events == 0  # type: ignore[union-attr]


def test_a_claim_held_by_another_flusher_is_skipped_until_it_expires(
    sqlite_url: str, tmp_path: Path, marquez: Marquez
) -> None:
    engine = database.create_engine(sqlite_url)
    now = [1000.0]
    kept = spool.Spool(engine, clock=lambda: now[0])
    run = run_ctx()
    for kind in ("START", "COMPLETE"):
        kept.add(run.run_id, kind, "2026-01-01T00:00:00+00:00", json.dumps({"eventType": kind}))
    held = kept._claim(run.run_id, "other-flusher", send_s=1.0)
    assert len(held) == 2
    sent: list[str] = []
    assert kept.flush(sent.append, send_s=1.0).sent == 0  # another flusher holds the run
    now[0] += 3600  # the other flusher died: its claim expires
    assert kept.flush(sent.append, send_s=1.0).sent == 2
    assert [json.loads(b)["eventType"] for b in sent] == ["START", "COMPLETE"]
    engine.dispose()


# ----------------------------------------------------------------------------- retention


def test_the_retention_cap_drops_the_oldest_with_a_warning_and_counts_them(
    sqlite_url: str,
) -> None:
    engine = database.create_engine(sqlite_url)
    now = [1000.0]
    kept = spool.Spool(engine, max_events=3, max_age_s=60.0, clock=lambda: now[0])
    run = run_ctx()
    records = KeptRecords()
    logging.getLogger(spool.__name__).addHandler(records)
    try:
        for i in range(5):
            kept.add(run.run_id, "RUNNING", f"t{i}", f'{{"n": {i}}}')
        assert kept.dropped == 2
        now[0] += 61  # all three left are too old now
        kept.add(run.run_id, "COMPLETE", "t5", '{"n": 5}')
    finally:
        logging.getLogger(spool.__name__).removeHandler(records)
    assert kept.dropped == 5
    sent: list[str] = []
    assert kept.flush(sent.append, send_s=1.0).sent == 1
    assert sent == ['{"n": 5}']
    warned = [r for r in records.records if r.levelno == logging.WARNING]
    assert [getattr(r, "n_events", None) for r in warned] == [1, 1, 3]
    assert all(getattr(r, "action", None) == "lineage_spool_dropped" for r in warned)
    engine.dispose()


# ----------------------------------------------------------------------------- file transport


def test_a_file_transport_that_cannot_write_spools_and_a_flush_writes_the_same_lines(
    sqlite_url: str, tmp_path: Path
) -> None:
    blocker = tmp_path / "lineage"
    blocker.write_text("a file where the events folder should be")
    cfg = config.LineageConfig(path=str(blocker / "events.jsonl"))
    emit = emitter(cfg, sqlite_url, tmp_path)
    run = run_ctx()
    emit_run(emit, run)
    assert (emit.emitted, emit.spooled) == (0, 3)
    blocker.unlink()
    assert flush(cfg, sqlite_url, tmp_path).sent == 3
    lines = (blocker / "events.jsonl").read_text().splitlines()
    assert [json.loads(line)["eventType"] for line in lines] == ["START", "RUNNING", "COMPLETE"]


# ----------------------------------------------------------------------------- openlineage.yml


def write_yml(folder: Path, url: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "openlineage.yml"
    path.write_text(f"transport:\n  type: http\n  url: {url}\n  timeout: 1.5\nfacets: {{}}\n")
    return path


@pytest.mark.parametrize("where", ["OPENLINEAGE_CONFIG", "cwd", "home"])
def test_openlineage_yml_with_an_http_transport_is_honoured(
    where: str, tmp_path: Path, marquez: Marquez
) -> None:
    """Before: only OPENLINEAGE_* variables were read; the events went to the local file."""
    cwd, home = tmp_path / "cwd", tmp_path / "home"
    cwd.mkdir()
    folder = {"OPENLINEAGE_CONFIG": tmp_path / "conf", "cwd": cwd, "home": home / ".openlineage"}
    path = write_yml(folder[where], marquez.url)
    env = {"OPENLINEAGE_CONFIG": str(path)} if where == "OPENLINEAGE_CONFIG" else {}
    resolved = ol_config.resolve(config.LineageConfig(), env, cwd=cwd, home=home)
    assert (resolved.config.transport, resolved.config.url) == ("http", marquez.url)
    assert resolved.config.timeout_s == 1.5
    assert resolved.file == path
    assert resolved.sources["url"] == f"openlineage.yml ({path})"
    assert resolved.sources["namespace"] == "default"
    assert resolved.unused == (f"{path}: facets",)
    emit = lineage.LineageEmitter(resolved.config, base_dir=tmp_path, producer=PRODUCER)
    emit_run(emit, run_ctx())
    assert len(marquez.bodies) == 3


def test_the_dynamic_variables_win_over_openlineage_yml_and_it_over_openlineage_url(
    tmp_path: Path,
) -> None:
    path = write_yml(tmp_path, "http://from-yml:5000")
    env = {"OPENLINEAGE_CONFIG": str(path), "OPENLINEAGE_URL": "http://from-url:5000"}
    base = config.LineageConfig(transport="file", retries=3)
    got = ol_config.resolve(base, env)
    assert (got.config.transport, got.config.url) == ("http", "http://from-yml:5000")
    assert got.sources["retries"] == "pipeline config (lineage.retries)"
    env["OPENLINEAGE__TRANSPORT__URL"] = "http://from-var:5000"
    got = ol_config.resolve(base, env)
    assert got.config.url == "http://from-var:5000"
    assert got.sources["url"] == "OPENLINEAGE__TRANSPORT__URL"
    env["OPENLINEAGE_DISABLED"] = "true"
    assert ol_config.resolve(base, env).config.transport == "none"


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("transport:\n  type: kafka\n", "transport type 'kafka' is not supported"),
        ("transport:\n  type: http\n  url: http://m\n  compression: gzip\n", "'compression'"),
        ("transport:\n  type: http\n  url: http://m\n  auth: {type: jwt}\n", "api_key"),
        ("transport: [http]\n", "transport must be a mapping"),
        ("- a list\n", "YAML mapping"),
        ("transport: {type: http\n", "not a readable OpenLineage config"),
        ("transport:\n  type: http\n  url: marquez:5000\n", "not a URL like"),
    ],
)
def test_a_bad_openlineage_yml_is_one_message_naming_it(
    tmp_path: Path, text: str, message: str
) -> None:
    path = tmp_path / "openlineage.yml"
    path.write_text(text)
    with pytest.raises(errors.ConfigError, match=re.escape(message)):
        ol_config.resolve(config.LineageConfig(), {"OPENLINEAGE_CONFIG": str(path)})


def test_openlineage_config_naming_no_file_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.ConfigError, match=r"OPENLINEAGE_CONFIG=.*no readable file"):
        ol_config.resolve(config.LineageConfig(), {"OPENLINEAGE_CONFIG": str(tmp_path / "x")})


def test_an_api_key_in_openlineage_yml_is_sent_and_never_shown(tmp_path: Path) -> None:
    path = tmp_path / "openlineage.yml"
    path.write_text(
        "transport:\n  type: http\n  url: http://m:5000\n  auth:\n"
        "    type: api_key\n    apiKey: k-s3cret\n"
    )
    got = ol_config.resolve(config.LineageConfig(), {"OPENLINEAGE_CONFIG": str(path)})
    assert got.config.api_key is not None
    assert got.config.api_key.get_secret_value() == "k-s3cret"
    assert "s3cret" not in got.config.model_dump_json() + repr(got)
