"""Lineage with the real OpenLineage client transports: events written to an append-mode JSONL
file (or POSTed to a loopback HTTP server), read back and validated against the vendored spec;
a dead or silent backend costs little and never raises."""

from __future__ import annotations

import base64
import copy
import json
import logging
import socket
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar

import pytest
from referencing import Registry

from batching import config, naming
from batching.evidence import lineage, lineage_log
from tests import olspec

PRODUCER = "https://github.com/acme/batching/tree/0.1.0"
FLOW_RUN = "0190f6a1-0000-7000-8000-00000000f10a"
TASK_RUN = "0190f6a1-0000-7000-8000-000000007a5c"
DB_URL = "postgresql+psycopg://scorer:secret@db.internal:5432/scoring"
SQLITE_URL = "sqlite:///queue.db"


@pytest.fixture(scope="module")
def registry() -> Registry:
    return olspec.load_registry(olspec.require_spec_dir(), lineage.custom_facet_schemas())


def datasets(base: Path) -> tuple[lineage.DatasetRef, lineage.DatasetRef, lineage.DatasetRef]:
    items = lineage.DatasetRef(
        *naming.sql_dataset_id(DB_URL, "batching_items"),
        fields=(("id", "BIGINT"), ("payload", "BYTEA")),
    )
    sqlite_items = lineage.DatasetRef(
        *naming.sql_dataset_id(SQLITE_URL, "batching_items", base_dir=base)
    )
    results = lineage.DatasetRef(
        *naming.file_dataset_id("outputs/results", base_dir=base),
        fields=(("item_key", "STRING"), ("score", "FLOAT")),
    )
    return items, sqlite_items, results


def contexts(base: Path) -> tuple[lineage.RunContext, lineage.RunContext]:
    items, sqlite_items, results = datasets(base)
    settings = {"database": {"url": DB_URL}, "batching": {"max_batch_size": 64}}
    flow = lineage.RunContext(
        run_id=FLOW_RUN,
        job_name="score",
        job_type="FLOW",
        inputs=(items, sqlite_items),
        outputs=(results,),
        model=lineage.ModelRef("tiny-mlp", "3", "c" * 64),
        config=settings,
        config_hash="d" * 64,
    )
    task = lineage.RunContext(
        run_id=TASK_RUN,
        job_name="score.score_batch",
        job_type="TASK",
        parent_run_id=FLOW_RUN,
        parent_job_name="score",
        inputs=(items,),
        outputs=(results,),
    )
    return flow, task


def file_emitter(base: Path) -> lineage.LineageEmitter:
    return lineage.LineageEmitter(config.LineageConfig(), base_dir=base, producer=PRODUCER)


def raised(exc: BaseException) -> BaseException:
    """``exc`` after a real raise, so it carries a traceback."""
    try:
        raise exc
    except BaseException as caught:
        return caught


def emit_flow_with_a_failed_task(base: Path) -> lineage.LineageEmitter:
    flow, task = contexts(base)
    results = flow.outputs[0]
    emitter = file_emitter(base)
    assert emitter.start(flow)
    assert emitter.start(task)
    assert emitter.fail(
        task, raised(ConnectionError(f"lost {DB_URL}")), [results.with_stats(128, 4096)]
    )
    assert emitter.complete(flow, [results.with_stats(640, 20_480)])
    emitter.close()
    return emitter


def test_file_transport_events_validate_against_the_spec(
    tmp_path: Path, registry: Registry
) -> None:
    emitter = emit_flow_with_a_failed_task(tmp_path)
    assert emitter.events_path == tmp_path / "outputs" / "lineage" / "events.jsonl"
    events = lineage_log.read_events(emitter.events_path)
    assert [(e["run"]["runId"], e["eventType"]) for e in events] == [
        (FLOW_RUN, "START"),
        (TASK_RUN, "START"),
        (TASK_RUN, "FAIL"),
        (FLOW_RUN, "COMPLETE"),
    ]
    for event in events:
        olspec.assert_valid_event(event, registry)
    assert (emitter.emitted, emitter.failures) == (4, 0)


def test_events_carry_statistics_schema_parent_and_error(tmp_path: Path) -> None:
    emitter = emit_flow_with_a_failed_task(tmp_path)
    assert emitter.events_path is not None
    start, _, fail, complete = lineage_log.read_events(emitter.events_path)
    out = complete["outputs"][0]
    assert (out["namespace"], out["name"]) == ("file", str(tmp_path / "outputs" / "results"))
    assert out["outputFacets"]["outputStatistics"] == {
        "_producer": PRODUCER,
        "_schemaURL": out["outputFacets"]["outputStatistics"]["_schemaURL"],
        "rowCount": 640,
        "size": 20_480,
    }
    assert [f["name"] for f in out["facets"]["schema"]["fields"]] == ["item_key", "score"]
    assert [(d["namespace"], d["name"]) for d in start["inputs"]] == [
        ("postgres://db.internal:5432", "scoring.public.batching_items"),
        ("sqlite", f"{tmp_path / 'queue.db'}.batching_items"),
    ]
    parent = fail["run"]["facets"]["parent"]
    assert parent["run"]["runId"] == FLOW_RUN
    assert (parent["job"]["namespace"], parent["job"]["name"]) == ("batching", "score")
    error = fail["run"]["facets"]["errorMessage"]
    assert error["message"].startswith("ConnectionError: lost postgresql+psycopg://scorer:***@")
    assert "Traceback" in error["stackTrace"]


def test_no_credential_anywhere_in_the_events_file(tmp_path: Path) -> None:
    emitter = emit_flow_with_a_failed_task(tmp_path)
    assert emitter.events_path is not None
    text = emitter.events_path.read_text(encoding="utf-8")
    assert "secret" not in text
    assert "scorer:***@" in text  # the user stays, for debugging


def test_append_mode_writes_one_json_object_per_line_across_emitters(tmp_path: Path) -> None:
    emit_flow_with_a_failed_task(tmp_path)
    emit_flow_with_a_failed_task(tmp_path)
    lines = (
        (tmp_path / "outputs" / "lineage" / "events.jsonl").read_text(encoding="utf-8").splitlines()
    )
    assert len(lines) == 8
    assert all(isinstance(json.loads(line), dict) for line in lines)


def test_summarize_the_events_read_back(tmp_path: Path) -> None:
    emitter = emit_flow_with_a_failed_task(tmp_path)
    assert emitter.events_path is not None
    events = lineage_log.read_events(emitter.events_path)
    latest = lineage_log.summarize_run(events)
    task = lineage_log.summarize_run(events, TASK_RUN)
    assert latest is not None
    assert task is not None
    assert (latest["run_id"], latest["state"], latest["model"]) == (
        FLOW_RUN,
        "COMPLETE",
        {"name": "tiny-mlp", "version": "3", "sha256": "c" * 64},
    )
    assert latest["outputs"][0]["row_count"] == 640
    assert (task["state"], task["parent"]["run_id"]) == ("FAIL", FLOW_RUN)
    assert task["error"].startswith("ConnectionError")


def test_a_torn_line_is_skipped_when_reading(tmp_path: Path) -> None:
    emitter = emit_flow_with_a_failed_task(tmp_path)
    assert emitter.events_path is not None
    with emitter.events_path.open("a", encoding="utf-8") as f:
        f.write('{"eventType": "START", "run"\n')
    assert len(lineage_log.read_events(emitter.events_path)) == 4
    assert lineage_log.read_events(tmp_path / "missing.jsonl") == []


# ----------------------------------------------------------------------------- the validator


def valid_event(tmp_path: Path) -> dict[str, Any]:
    emitter = emit_flow_with_a_failed_task(tmp_path)
    assert emitter.events_path is not None
    return lineage_log.read_events(emitter.events_path)[2]  # the FAIL event: most facets


@pytest.mark.parametrize(
    ("break_it", "expected"),
    [
        (lambda e: e.update(eventType="DONE"), "'DONE' is not one of"),
        (lambda e: e["run"].update(runId="not-a-uuid"), "is not a 'uuid'"),
        (lambda e: e["job"].pop("name"), "'name' is a required property"),
        (
            lambda e: e["run"]["facets"].update(
                processingEngine=e["run"]["facets"]["processing_engine"]
            ),
            "processingEngine: key is not one of",
        ),
        (lambda e: e["run"]["facets"]["errorMessage"].pop("message"), "'message' is a required"),
        (lambda e: e["run"]["facets"]["parent"]["run"].update(runId="x"), "is not a 'uuid'"),
        (lambda e: e["run"]["facets"]["batching_model"].update(sha256="short"), "does not match"),
        (
            lambda e: e["run"]["facets"]["batching_model"].update(_producer="no uri"),
            "is not a 'uri'",
        ),
    ],
)
def test_the_validator_catches_broken_events(
    tmp_path: Path, registry: Registry, break_it: Any, expected: str
) -> None:
    event = copy.deepcopy(valid_event(tmp_path))
    event["run"]["facets"]["batching_model"] = {
        "_producer": PRODUCER,
        "_schemaURL": lineage.BatchingModelRunFacet._get_schema(),
        "name": "m",
        "version": "1",
        "sha256": "e" * 64,
    }
    assert olspec.validate_event(event, registry) == []
    break_it(event)
    found = olspec.validate_event(event, registry)
    assert any(expected in message for message in found), found


def test_custom_facets_without_a_registered_schema_fail_only_in_strict_mode(
    tmp_path: Path,
) -> None:
    bare = olspec.load_registry(olspec.require_spec_dir(), shipped=False)
    event = lineage_log.read_events(emit_flow_with_a_failed_task(tmp_path).events_path or Path())[0]
    found = olspec.validate_event(event, bare)
    assert any("no schema registered" in m and "batching_model" in m for m in found), found
    assert olspec.validate_event(event, bare, strict=False) == []


# ----------------------------------------------------------------------------- http


def run_context(base: Path) -> lineage.RunContext:
    return contexts(base)[0]


def http_emitter(url: str, base: Path, **kw: Any) -> lineage.LineageEmitter:
    cfg = config.LineageConfig(transport="http", url=url, **kw)
    return lineage.LineageEmitter(cfg, base_dir=base, producer=PRODUCER)


def test_a_dead_http_backend_costs_little_never_raises_and_counts(tmp_path: Path) -> None:
    emitter = http_emitter("http://127.0.0.1:9", tmp_path, timeout_s=1.0, retries=1)
    run = run_context(tmp_path)
    started = time.monotonic()
    assert emitter.start(run) is False
    assert emitter.complete(run) is False  # dropped: the backend is cooling down
    assert emitter.fail(run, RuntimeError("boom")) is False
    elapsed = time.monotonic() - started
    emitter.close()
    assert elapsed < 3.0
    assert (emitter.failures, emitter.emitted) == (3, 0)


@pytest.fixture
def silent_port() -> Iterator[int]:
    """A loopback port that accepts connections (kernel backlog) but never answers."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)
        yield server.getsockname()[1]


def test_a_silent_http_backend_is_cut_off_by_the_timeout(tmp_path: Path, silent_port: int) -> None:
    emitter = http_emitter(f"http://127.0.0.1:{silent_port}", tmp_path, timeout_s=0.3, retries=0)
    run = run_context(tmp_path)
    started = time.monotonic()
    assert emitter.start(run) is False
    assert emitter.complete(run) is False
    elapsed = time.monotonic() - started
    emitter.close()
    assert elapsed < 2.0
    assert emitter.failures == 2


class _RetryLater(BaseHTTPRequestHandler):
    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(503)
        self.send_header("Retry-After", "3600")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


class _Drip(BaseHTTPRequestHandler):
    """Answers a byte at a time, never finishing: each read is inside the socket timeout."""

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers["Content-Length"]))
        self.wfile.write(b"HTTP/1.1 201 Created\r\nX-Slow: ")
        try:
            for _ in range(600):
                self.wfile.write(b"x")
                self.wfile.flush()
                time.sleep(0.1)
        except OSError:  # the client gave up
            pass

    def log_message(self, format: str, *args: Any) -> None:
        pass


def _serve(handler: type[BaseHTTPRequestHandler]) -> Iterator[int]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_address[1]
    server.shutdown()
    server.server_close()


@pytest.mark.parametrize("handler", [_RetryLater, _Drip], ids=["retry-after-1h", "drip"])
def test_a_backend_that_holds_the_request_does_not_hold_the_run(
    tmp_path: Path, handler: type[BaseHTTPRequestHandler]
) -> None:
    """Before: Retry-After was honoured (up to 6 h), and a reply trickling in within each
    socket timeout never timed out."""
    port = next(serve := _serve(handler))
    try:
        emitter = http_emitter(f"http://127.0.0.1:{port}", tmp_path, timeout_s=0.5, retries=1)
        run = run_context(tmp_path)
        started = time.monotonic()
        assert emitter.start(run) is False
        assert emitter.complete(run) is False  # dropped while the first is still going
        elapsed = time.monotonic() - started
        emitter.close()
    finally:
        next(serve, None)
    assert elapsed < 10.0  # the deadline is (0.5 + 0.5) x 2 = 2 s
    assert emitter.failures == 2


class _Recorder(BaseHTTPRequestHandler):
    received: ClassVar[list[tuple[str, str, dict[str, Any]]]]

    def do_POST(self) -> None:
        body = self.rfile.read(int(self.headers["Content-Length"]))
        auth = self.headers.get("Authorization", "")
        self.received.append((self.path, auth, json.loads(body)))
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def marquez_stub() -> Iterator[tuple[int, list[tuple[str, str, dict[str, Any]]]]]:
    received: list[tuple[str, str, dict[str, Any]]] = []
    handler = type("Recorder", (_Recorder,), {"received": received})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    yield server.server_address[1], received
    server.shutdown()
    server.server_close()
    thread.join()


def send_start_and_complete(
    cfg: config.LineageConfig, base: Path, caplog: pytest.LogCaptureFixture
) -> lineage.LineageEmitter:
    """A run's START and COMPLETE through ``cfg``'s transport, with DEBUG logs captured."""
    run = run_context(base)
    with caplog.at_level(logging.DEBUG):
        emitter = lineage.LineageEmitter(cfg, base_dir=base, producer=PRODUCER)
        assert emitter.start(run)
        assert emitter.complete(run, [run.outputs[0].with_stats(5)])
        emitter.close()
    return emitter


def assert_kept_out(
    secret: str,
    received: list[tuple[str, str, dict[str, Any]]],
    registry: Registry,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Every event posted is valid and holds no ``secret``; no log record holds it."""
    for _, _, event in received:
        olspec.assert_valid_event(event, registry)
        assert secret not in json.dumps(event)
    assert not [r for r in caplog.records if secret in r.getMessage()]


def test_http_transport_posts_valid_events_to_url_plus_endpoint(
    tmp_path: Path,
    registry: Registry,
    marquez_stub: tuple[int, list[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    port, received = marquez_stub
    cfg = config.LineageConfig(transport="http", url=f"http://user:secret@127.0.0.1:{port}/marquez")
    emitter = send_start_and_complete(cfg, tmp_path, caplog)
    assert [path for path, _, _ in received] == ["/marquez/api/v1/lineage"] * 2
    basic = "Basic " + base64.b64encode(b"user:secret").decode()
    assert [auth for _, auth, _ in received] == [basic] * 2  # credentials still reach Marquez
    assert_kept_out("secret", received, registry, caplog)
    assert (emitter.emitted, emitter.failures) == (2, 0)


def test_an_api_key_from_the_environment_is_sent_as_a_bearer_token_and_never_logged(
    tmp_path: Path,
    registry: Registry,
    marquez_stub: tuple[int, list[Any]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    port, received = marquez_stub
    env = {"OPENLINEAGE_URL": f"http://127.0.0.1:{port}", "OPENLINEAGE_API_KEY": "k-s3cret"}
    cfg = lineage.config_from_env(env, config.LineageConfig())
    send_start_and_complete(cfg, tmp_path, caplog)
    assert [auth for _, auth, _ in received] == ["Bearer k-s3cret"] * 2
    assert_kept_out("s3cret", received, registry, caplog)
