"""Credentials as Prefect Secret blocks: a run names blocks, and no password reaches the API.

The database here is real PostgreSQL reached with a password in its URL (trust auth ignores
it where the test server has no password), kept in a Secret block; the lineage API key is
another block, and a loopback HTTP lineage backend proves it was used.
"""

from __future__ import annotations

import json
import logging
import threading
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any, ClassVar, cast
from uuid import UUID

import pytest
from prefect.blocks.system import Secret
from prefect.client.orchestration import get_client
from sqlalchemy.engine import make_url

from batching import errors
from batching.compose import build
from batching.config import load_config
from batching.ingress import ingest, run_ledger
from batching.model import workloads
from flows import credentials, deployments, events
from flows.bulk import bulk
from flows.maintain import maintain
from flows.reconcile import reconcile
from flows.score import score
from tests.conftest import wait_for
from tests.flows.support import REPO, TABULAR, events_named, run_id_of

PREFECT_YAML = REPO / "deployments" / "prefect.yaml"


def with_password(url: str) -> tuple[str, str]:
    """``url`` with a password (its own if it has one), and that password."""
    parsed = make_url(url)
    password = parsed.password or f"pw-{uuid.uuid4().hex[:12]}"
    return parsed.set(password=password).render_as_string(hide_password=False), str(password)


def save_secret(value: str) -> str:
    """Save ``value`` in a new Secret block; returns its name."""
    name = f"test-{uuid.uuid4().hex[:12]}"
    Secret(value=value).save(name)
    return name


class _Lineage(BaseHTTPRequestHandler):
    """Records each request's Authorization header; answers 200."""

    seen: ClassVar[list[str]] = []

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.seen.append(self.headers.get("Authorization", ""))
        self.send_response(200)
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def lineage_url() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Lineage)
    _Lineage.seen = []
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def _unreconciled(url: str) -> list[str]:
    queue = build.open_queue(load_config(TABULAR), url)
    try:
        return run_ledger.RunLedger(queue).unreconciled("score-tabular", 0.0, limit=10)
    finally:
        queue.engine.dispose()


def _parameters(run_id: str) -> dict[str, Any]:
    with get_client(sync_client=True) as client:
        return dict(client.read_flow_run(UUID(run_id)).parameters)


@pytest.mark.postgres
def test_secret_blocks_keep_the_password_out_of_the_api_and_the_triggered_reconcile(
    tmp_path: Path, pg_url: str, lineage_url: str
) -> None:
    url, password = with_password(pg_url)
    db_block = save_secret(url)
    api_key = f"key-{uuid.uuid4().hex}"
    key_block = save_secret(api_key)
    overrides: dict[str, Any] = {
        "output": {"path": str(tmp_path / "scores")},
        "lineage": {"transport": "http", "url": lineage_url},
        "batching": {"max_wait_s": 0.01},
    }
    queue = build.open_queue(load_config(TABULAR, overrides), url)
    try:
        file = workloads.write_w1_parquet(tmp_path / "w1.parquet", 40)
        queue.enqueue(ingest.read_records(file))
    finally:
        queue.engine.dispose()
    reconcile_id = cast(UUID, deployments.reconcile_deployment().apply())  # sync here
    try:
        state = score(
            config=TABULAR,
            overrides=overrides,
            db_url_secret=db_block,
            lineage_api_key_secret=key_block,
            return_state=True,
        )
        assert state.is_completed(), state.message
        assert state.result()["items_committed"] == 40
        upstream = run_id_of(state)
        params = _parameters(upstream)
        assert params["db_url_secret"] == db_block
        assert password not in json.dumps(params)
        assert api_key not in json.dumps(params)
        assert f"Bearer {api_key}" in _Lineage.seen, "the key from the block reached lineage"

        def triggered() -> list[Any]:
            with get_client(sync_client=True) as client:
                runs = client.read_flow_runs()
            return [r for r in runs if r.parameters.get("upstream_flow_run_id") == upstream]

        (run,) = wait_for(triggered, what="the reconcile run")
        assert run.deployment_id == reconcile_id
        assert run.parameters["db_url_secret"] == db_block
        assert run.parameters["lineage_api_key_secret"] == key_block
        assert run.parameters["db_url"] is None
        assert password not in json.dumps(run.parameters)
        (event,) = wait_for(
            lambda: [
                e
                for e in events_named(events.RUN_ENDED, 0)
                if e.resource.id == events.run_resource(upstream)
            ],
            what="the run's batching.run.ended event",
        )
        assert password not in event.model_dump_json()
        assert api_key not in event.model_dump_json()

        assert _unreconciled(url) == [upstream]  # the run ledger's query, on PostgreSQL
        done = reconcile(**run.parameters, return_state=True)  # what the worker would run
        assert done.is_completed(), done.message
        assert _unreconciled(url) == []
        assert password not in json.dumps(_parameters(run_id_of(done)))
    finally:
        with get_client(sync_client=True) as client:
            client.delete_deployment(reconcile_id)
            for automation in client.read_automations_by_name("reconcile-after-scoring"):
                client.delete_automation(automation.id)


@pytest.mark.parametrize(
    ("params", "named"),
    [
        ({"db_url": "postgresql+psycopg://scorer:s3cret@db:5432/scoring"}, "db_url"),
        (
            {"overrides": {"database": {"url": "postgresql://scorer:s3cret@db/scoring"}}},
            "overrides.database.url",
        ),
        ({"db_url": "postgresql://scorer@db/scoring?password=s3cret"}, "db_url"),
    ],
)
@pytest.mark.parametrize("flow", ["score", "bulk", "reconcile", "maintain"])
def test_a_password_in_a_parameter_is_refused_before_anything_runs(
    params: dict[str, Any], named: str, flow: str, caplog: pytest.LogCaptureFixture
) -> None:
    run: Any = {"score": score, "bulk": bulk, "reconcile": reconcile, "maintain": maintain}[flow]
    extra = {"input_path": "nowhere.parquet"} if flow == "bulk" else {}
    with caplog.at_level(logging.INFO):
        state = run(config=TABULAR, **params, **extra, return_state=True)
    said = [r.getMessage() for r in caplog.records]
    # the run-end hook of score and bulk: not "its ledger could not be read" (a review)
    assert not any("ledger could not be read" in m for m in said), said
    if flow in ("score", "bulk"):
        assert "the run was refused before it started: nothing to reconcile" in said
    assert state.is_failed()
    message = state.message or ""
    assert f"flow parameter {named} holds a password" in message
    assert "Secret block" in message
    assert "PGPASSWORD or ~/.pgpass" in message
    assert "\n" not in message
    assert "s3cret" not in message


def test_a_missing_secret_block_is_named_in_a_one_line_failure() -> None:
    state = score(config=TABULAR, db_url_secret="no-such-block-xyz", return_state=True)
    assert state.is_failed()
    assert "db_url_secret: no Prefect Secret block named 'no-such-block-xyz'" in (
        state.message or ""
    )


def test_db_url_and_db_url_secret_together_are_refused() -> None:
    state = score(config=TABULAR, db_url="sqlite:///x.db", db_url_secret="b", return_state=True)
    assert state.is_failed()
    assert "db_url and db_url_secret both given" in (state.message or "")


def test_the_shipped_prefect_yaml_holds_no_credential(capsys: pytest.CaptureFixture[str]) -> None:
    assert credentials.check_prefect_yaml(PREFECT_YAML, env={}) == []
    credentials.main([str(PREFECT_YAML)])
    assert "no credentials found" in capsys.readouterr().out


def refused(
    tmp_path: Path,
    line: str,
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> str:
    """``python -m flows.credentials`` on the shipped prefect.yaml with ``line`` in place of its
    commented BATCHING_DB_URL and ``env`` set: it exits 1; returns what it printed."""
    text = PREFECT_YAML.read_text(encoding="utf-8").replace(
        "        # BATCHING_DB_URL: postgresql+psycopg://scorer@db:5432/scoring", f"        {line}"
    )
    assert text != PREFECT_YAML.read_text(encoding="utf-8")
    path = tmp_path / "prefect.yaml"
    path.write_text(text, encoding="utf-8")
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(SystemExit) as exited:
        credentials.main([str(path)])
    assert exited.value.code == 1
    return capsys.readouterr().err


@pytest.mark.parametrize(
    ("env_value", "env"),
    [
        ("postgresql+psycopg://scorer:s3cret@db:5432/scoring", {}),
        ("{{ prefect.blocks.secret.scoring-db }}", {}),
        ("{{ $SCORING_DB }}", {"SCORING_DB": "postgresql://scorer:s3cret@db/scoring"}),
    ],
)
def test_a_prefect_yaml_that_would_store_a_password_is_refused(
    tmp_path: Path,
    env_value: str,
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    line = f'BATCHING_DB_URL: "{env_value}"'
    err = refused(tmp_path, line, env, capsys, monkeypatch)
    assert "prefect.yaml.definitions.work_pool.job_variables.env.BATCHING_DB_URL" in err
    assert "s3cret" not in err


@pytest.mark.parametrize(
    ("key", "value", "env"),
    [
        ("PGPASSWORD", "hunter2", {}),
        ("OPENLINEAGE_API_KEY", "olkey123456", {}),
        ("PGPASSWORD", "{{ $PGPASSWORD }}", {"PGPASSWORD": "hunter2"}),
        ("BATCHING_API_TOKENS", "olkey123456-0123456789=acme", {}),
    ],
)
def test_a_credential_under_its_own_key_is_refused_and_never_printed(
    tmp_path: Path,
    key: str,
    value: str,
    env: dict[str, str],
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    err = refused(tmp_path, f'{key}: "{value}"', env, capsys, monkeypatch)
    assert f"job_variables.env.{key}: a credential value" in err
    assert "hunter2" not in err
    assert "olkey123456" not in err


def test_a_prefect_yaml_that_cannot_be_read_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exited:
        credentials.main([str(tmp_path / "missing.yaml")])
    assert exited.value.code == 2
    assert "not a readable prefect.yaml" in capsys.readouterr().err


def test_api_tokens_come_from_a_secret_block_bound_to_their_tenants() -> None:
    token = f"tok-{uuid.uuid4().hex}"
    name = save_secret(f"{token}=acme, {'z' * 20}=globex")
    known = credentials.api_tokens(name)
    assert (known.tenant_of(token), known.tenant_of("z" * 20), len(known)) == ("acme", "globex", 2)
    with pytest.raises(errors.ConfigError, match="api_tokens_secret: no Prefect Secret block"):
        credentials.api_tokens(f"missing-{uuid.uuid4().hex[:8]}")
    bad = save_secret("short=acme")
    with pytest.raises(errors.ConfigError, match="entry 1: the token is shorter") as caught:
        credentials.api_tokens(bad)
    assert "short=" not in str(caught.value)
