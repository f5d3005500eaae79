"""Unit tests for the pure parts of ``batching.evidence.lineage``: naming, redaction, env overrides, event
building, the never-raise emitter (with an in-memory transport and a fake clock), summaries."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest
from openlineage.client.serde import Serde
from openlineage.client.transport import Transport

from batching import config, errors, naming
from batching.evidence import lineage, lineage_log
from batching.testing import FakeClock

RUN_ID = "0190f6a1-0000-7000-8000-000000000001"
PARENT_ID = "0190f6a1-0000-7000-8000-000000000002"
PRODUCER = "https://github.com/acme/batching/tree/0.1.0"
SECRET_URL = "postgresql+psycopg://user:secret@host:5432/db"


# ----------------------------------------------------------------------------- redaction


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (SECRET_URL, "postgresql+psycopg://user:***@host:5432/db"),
        ("postgresql://user@host/db", "postgresql://user@host/db"),
        ("postgresql://host:5432/db", "postgresql://host:5432/db"),
        ("sqlite:////abs/path/batching.db", "sqlite:////abs/path/batching.db"),
        ("sqlite:///batching.db", "sqlite:///batching.db"),
        ("http://marquez:5000", "http://marquez:5000"),
        ("https://u:p%40ss@marquez:5000/api", "https://u:***@marquez:5000/api"),
        (
            "postgresql://host/db?password=secret&sslmode=require",
            "postgresql://host/db?password=***&sslmode=require",
        ),
        ("http://h/api?api_key=secret", "http://h/api?api_key=***"),
        ("host=h dbname=db user=u password=secret", "host=h dbname=db user=u password=***"),
    ],
)
def test_redact_url_masks_passwords_and_keeps_the_user(url: str, expected: str) -> None:
    assert lineage.redact_url(url) == expected


@pytest.mark.parametrize(
    "url",
    [
        SECRET_URL,
        "postgresql://user:se@cret@host/db",  # raw @ in the password
        "postgresql://user:se/cr?et@host/db",  # raw / and ? in the password
        "postgresql://us@er:secret@host/db",  # raw @ in the user
        "postgresql://user:secret@host/db?application_name=a@b",
        "connect failed: 'postgresql+psycopg://user:secret@host:5432/db' (timeout)",
        'settings {"password": "secret", "client_secret": "secret"}',
        "PGPASSWORD=secret psql",
        "token: secret",
        "postgresql//user:secret@host:5432/db",  # malformed: no ':' after the scheme
        "user:secret@host:5432/db",  # no scheme at all
        " postgresql://user:secret@host/db",  # leading space
        "postgresql://user:secret@host:notaport/db",
    ],
)
def test_redact_url_never_leaks_the_secret(url: str) -> None:
    redacted = lineage.redact_url(url)
    assert "secret" not in redacted.replace("client_secret", "")
    assert "cret" not in redacted.replace("client_secret", "")


def test_redact_mapping_masks_secret_keys_and_urls_but_keeps_other_values() -> None:
    settings = {
        "database": {"url": SECRET_URL, "password": "hunter2"},
        "batching": {"max_batch_tokens": 64, "max_wait_s": 0.01},
        "auth": [{"api_key": "k"}, "http://u:p@h"],
    }
    assert lineage.redact_mapping(settings) == {
        "database": {"url": "postgresql+psycopg://user:***@host:5432/db", "password": "***"},
        "batching": {"max_batch_tokens": 64, "max_wait_s": 0.01},
        "auth": [{"api_key": "***"}, "http://u:***@h"],
    }


# ----------------------------------------------------------------------------- naming


@pytest.mark.parametrize(
    ("url", "table", "schema", "expected"),
    [
        (SECRET_URL, "batching_items", None, ("postgres://host:5432", "db.public.batching_items")),
        (
            "postgresql://u@DB.example:6543/scores",
            "t",
            "ml",
            ("postgres://db.example:6543", "scores.ml.t"),
        ),
        ("postgresql://u:p@[::1]/d", "t", None, ("postgres://[::1]:5432", "d.public.t")),
        (
            "postgresql:///d?host=pg.internal&port=5433",
            "t",
            None,
            ("postgres://pg.internal:5433", "d.public.t"),
        ),
        ("postgres://scorer@h/", "t", None, ("postgres://h:5432", "scorer.public.t")),
        (
            "sqlite:////srv/data/batching.db",
            "batching_items",
            None,
            ("sqlite", "/srv/data/batching.db.batching_items"),
        ),
        ("sqlite+pysqlite:///rel/q.db?mode=ro", "t", None, ("sqlite", "/base/rel/q.db.t")),
        ("sqlite:///../up.db", "t", None, ("sqlite", "/up.db.t")),
        ("sqlite://", "t", None, ("sqlite", "memory.t")),
    ],
)
def test_sql_dataset_id_follows_the_naming_spec(
    url: str, table: str, schema: str | None, expected: tuple[str, str]
) -> None:
    assert naming.sql_dataset_id(url, table, schema=schema, base_dir=Path("/base")) == expected


@pytest.mark.parametrize(
    ("url", "fix"),
    [
        ("mysql://u:secret@h/db", "use sqlite or postgresql"),
        ("not a url", "is not a URL"),
        ("postgresql://h:5432", "add /DBNAME"),
    ],
)
def test_sql_dataset_id_rejects_bad_urls_without_showing_the_password(url: str, fix: str) -> None:
    with pytest.raises(errors.ConfigError, match=fix) as info:
        naming.sql_dataset_id(url, "t")
    assert "secret" not in str(info.value)


@pytest.mark.parametrize(
    ("path", "expected"),
    [
        ("outputs/results", ("file", "/base/outputs/results")),
        ("/data/results/", ("file", "/data/results")),
        ("file:///data/results", ("file", "/data/results")),
        ("s3://bucket/prefix/results", ("s3://bucket", "prefix/results")),
        ("s3://AKIA:s3cr3t@bucket/t", ("s3://bucket", "t")),  # never the credentials
        ("az://box/t?sig=s3cr3t", ("az://box", "t")),
    ],
)
def test_file_dataset_id(path: str, expected: tuple[str, str]) -> None:
    assert naming.file_dataset_id(path, base_dir=Path("/base")) == expected


@pytest.mark.parametrize(
    ("path", "output_dir", "expected"),
    [
        (None, "outputs", "/cfg/outputs/lineage/events.jsonl"),
        (None, "/srv/out", "/srv/out/lineage/events.jsonl"),
        ("ol/events.jsonl", "outputs", "/cfg/ol/events.jsonl"),
        ("/var/log/ol.jsonl", "outputs", "/var/log/ol.jsonl"),
    ],
)
def test_events_path(path: str | None, output_dir: str, expected: str) -> None:
    cfg = config.LineageConfig(path=path)
    assert lineage.events_path(cfg, base_dir=Path("/cfg"), output_dir=output_dir) == Path(expected)


# ----------------------------------------------------------------------------- env overrides

BASE = config.LineageConfig()


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, {}),
        (
            {"OPENLINEAGE_URL": "http://marquez:5000"},
            {"transport": "http", "url": "http://marquez:5000"},
        ),
        (
            {"OPENLINEAGE_URL": "http://m:5000", "OPENLINEAGE_ENDPOINT": "api/v2/lineage"},
            {"transport": "http", "url": "http://m:5000", "endpoint": "api/v2/lineage"},
        ),
        (
            {
                "OPENLINEAGE__TRANSPORT__TYPE": "file",
                "OPENLINEAGE__TRANSPORT__LOG_FILE_PATH": "ol.jsonl",
                "OPENLINEAGE_URL": "http://ignored:5000",
            },
            {"transport": "file", "path": "ol.jsonl", "url": "http://ignored:5000"},
        ),
        (
            {
                "OPENLINEAGE__TRANSPORT__TYPE": "http",
                "OPENLINEAGE__TRANSPORT__URL": "http://m:5000",
                "OPENLINEAGE__TRANSPORT__TIMEOUT": "0.5",
                "OPENLINEAGE__TRANSPORT__RETRY": '{"total": 0, "backoff_factor": 0.1}',
            },
            {"transport": "http", "url": "http://m:5000", "timeout_s": 0.5, "retries": 0},
        ),
        ({"OPENLINEAGE__TRANSPORT__TYPE": "noop"}, {"transport": "none"}),
        ({"OPENLINEAGE__TRANSPORT__TYPE": "Console"}, {"transport": "console"}),
        (
            {"OPENLINEAGE_DISABLED": "true", "OPENLINEAGE_URL": "http://m"},
            {"transport": "none", "url": "http://m"},
        ),
        ({"OPENLINEAGE_NAMESPACE": "scoring-prod"}, {"namespace": "scoring-prod"}),
        ({"UNRELATED": "x"}, {}),
    ],
)
def test_config_from_env(env: dict[str, str], expected: dict[str, Any]) -> None:
    got = lineage.config_from_env(env, BASE)
    assert got == BASE.model_copy(update=expected)


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"OPENLINEAGE__TRANSPORT__TYPE": "kafka"}, "transport"),
        ({"OPENLINEAGE__TRANSPORT__TYPE": "http"}, "needs url"),
        ({"OPENLINEAGE__TRANSPORT__RETRY": "lots"}, "RETRY must be JSON"),
        ({"OPENLINEAGE__TRANSPORT__TIMEOUT": "-1"}, "timeout_s"),
        ({"OPENLINEAGE_DISABLED": "maybe"}, "OPENLINEAGE_DISABLED='maybe': use true or false"),
    ],
)
def test_config_from_env_rejects_bad_values(env: dict[str, str], message: str) -> None:
    with pytest.raises(errors.ConfigError, match=message):
        lineage.config_from_env(env, BASE)


@pytest.mark.parametrize(
    "url",
    ["localhost:5000", "marquez", "http://", "ftp://marquez", "http://[::1", "http://m:port"],
)
def test_a_malformed_lineage_url_is_refused_in_the_environment_and_in_a_config(url: str) -> None:
    with pytest.raises(errors.ConfigError, match="is not a URL like http://marquez:5000"):
        lineage.config_from_env({"OPENLINEAGE_URL": url}, BASE)
    with pytest.raises(ValueError, match="is not a URL like http://marquez:5000"):
        config.LineageConfig(transport="http", url=url)
    disabled = {"OPENLINEAGE_URL": url, "OPENLINEAGE_DISABLED": "true"}
    assert lineage.config_from_env(disabled, BASE).transport == "none"


def test_a_refused_lineage_url_keeps_its_password_out_of_the_message() -> None:
    with pytest.raises(errors.ConfigError) as caught:
        lineage.config_from_env({"OPENLINEAGE_URL": "http://ol:s3cret@m:99999"}, BASE)
    assert "s3cret" not in str(caught.value)
    assert "http://ol:***@m:99999" in str(caught.value)


@pytest.mark.parametrize(
    "url", ["http://m", "https://m/api", "http://ol:pw@m:5000", "http://[::1]:5000/x"]
)
def test_http_lineage_urls_with_a_host_are_accepted(url: str) -> None:
    assert lineage.config_from_env({"OPENLINEAGE_URL": url}, BASE).url == url


@pytest.mark.parametrize(
    "name",
    [
        "OPENLINEAGE_API_KEY",
        "OPENLINEAGE__TRANSPORT__AUTH__APIKEY",  # the OpenLineage client's spelling
        "OPENLINEAGE__TRANSPORT__AUTH__API_KEY",
    ],
)
def test_an_api_key_comes_from_the_environment_and_stays_out_of_every_dump(name: str) -> None:
    env = {"OPENLINEAGE_URL": "http://m:5000", name: "k-s3cret"}
    got = lineage.config_from_env(env, BASE)
    assert got.api_key is not None
    assert got.api_key.get_secret_value() == "k-s3cret"
    assert "s3cret" not in repr(got) + str(got.model_dump()) + got.model_dump_json()
    # Another override keeps it: the key is not in the dump the overrides start from.
    again = lineage.config_from_env({"OPENLINEAGE_NAMESPACE": "prod"}, got)
    assert again.api_key == got.api_key
    pipeline = config.parse_config(
        {"model": {"name": "w1-mlp", "version": "v", "sha256": "0" * 64}}
    )
    with_key = pipeline.model_copy(update={"lineage": got})
    assert (
        with_key.config_hash()
        == pipeline.model_copy(
            update={"lineage": got.model_copy(update={"api_key": None})}
        ).config_hash()
    )
    assert "s3cret" not in json.dumps(with_key.model_dump(mode="json"))


def test_an_api_key_beside_credentials_in_the_url_is_refused() -> None:
    """requests applies the URL's Basic auth over the bearer header: the key was dropped."""
    env = {"OPENLINEAGE_URL": "http://u:pw@m:5000", "OPENLINEAGE_API_KEY": "k-s3cret"}
    with pytest.raises(errors.ConfigError, match="use one") as caught:
        lineage.config_from_env(env, BASE)
    assert "s3cret" not in str(caught.value)
    assert "pw" not in str(caught.value)


def test_an_api_key_in_a_config_file_is_refused_with_where_it_goes() -> None:
    data = {
        "model": {"name": "w1-mlp", "version": "v", "sha256": "0" * 64},
        "lineage": {"transport": "http", "url": "http://m", "api_key": "k-s3cret"},
    }
    with pytest.raises(errors.ConfigError, match="set OPENLINEAGE_API_KEY") as caught:
        config.parse_config(data, source="prod.yaml")
    assert "s3cret" not in str(caught.value)
    assert str(caught.value).startswith("prod.yaml: lineage.api_key:")


# ----------------------------------------------------------------------------- events

ITEMS = lineage.DatasetRef(
    *naming.sql_dataset_id(SECRET_URL, "batching_items"), fields=(("id", "BIGINT"),)
)
RESULTS = lineage.DatasetRef("file", "/srv/outputs/results", fields=(("item_key", "STRING"),))


def run_context(**kw: Any) -> lineage.RunContext:
    values: dict[str, Any] = {
        "run_id": RUN_ID,
        "job_name": "score.score_batch",
        "parent_run_id": PARENT_ID,
        "parent_job_name": "score",
        "inputs": (ITEMS,),
        "outputs": (RESULTS,),
        "model": lineage.ModelRef("tiny-mlp", "1", "a" * 64),
        "config": {"database": {"url": SECRET_URL}, "batching": {"max_batch_size": 64}},
        "config_hash": "b" * 64,
    }
    return lineage.RunContext(**(values | kw))


def event_dict(state: lineage.RunState, run: lineage.RunContext, **kw: Any) -> dict[str, Any]:
    event = lineage.build_event(
        state,
        run,
        producer=PRODUCER,
        namespace="batching",
        event_time="2030-01-01T00:00:00+00:00",
        **kw,
    )
    return Serde.to_dict(event)


def test_build_event_carries_job_parent_datasets_and_custom_facets() -> None:
    ev = event_dict(lineage.RunState.START, run_context())
    assert ev["eventType"] == "START"
    assert ev["producer"] == PRODUCER
    assert ev["job"]["namespace"] == "batching"
    assert ev["job"]["name"] == "score.score_batch"
    assert ev["job"]["facets"]["jobType"]["processingType"] == "BATCH"
    facets = ev["run"]["facets"]
    assert facets["parent"]["run"]["runId"] == PARENT_ID
    assert facets["parent"]["job"] == {"namespace": "batching", "name": "score", "facets": {}}
    assert facets["batching_model"]["sha256"] == "a" * 64
    assert facets["batching_config"]["configHash"] == "b" * 64
    assert facets["processing_engine"]["name"] == "batching"
    assert all(f["_producer"] == PRODUCER for f in facets.values())
    assert [(d["namespace"], d["name"]) for d in ev["inputs"]] == [
        ("postgres://host:5432", "db.public.batching_items")
    ]
    assert ev["outputs"][0]["facets"]["schema"]["fields"][0]["name"] == "item_key"
    assert "outputStatistics" not in ev["outputs"][0]["outputFacets"]
    assert "secret" not in json.dumps(ev)


def test_complete_outputs_replace_the_run_outputs_and_carry_statistics() -> None:
    ev = event_dict(
        lineage.RunState.COMPLETE, run_context(), outputs=[RESULTS.with_stats(640, 20_480)]
    )
    stats = ev["outputs"][0]["outputFacets"]["outputStatistics"]
    assert (stats["rowCount"], stats["size"]) == (640, 20_480)


def test_fail_event_has_a_redacted_error_message_and_stack_trace() -> None:
    try:
        raise ConnectionError(f"could not connect to {SECRET_URL}")
    except ConnectionError as exc:
        ev = event_dict(lineage.RunState.FAIL, run_context(), error=exc)
    facet = ev["run"]["facets"]["errorMessage"]
    assert (
        facet["message"]
        == "ConnectionError: could not connect to postgresql+psycopg://user:***@host:5432/db"
    )
    assert facet["programmingLanguage"] == "python"
    assert "test_fail_event_has_a_redacted" in facet["stackTrace"]
    assert "secret" not in json.dumps(ev)


def test_job_namespace_and_parent_namespace_can_be_set_per_run() -> None:
    run = run_context(job_namespace="other", parent_job_namespace="prefect-prod")
    ev = event_dict(lineage.RunState.START, run)
    assert ev["job"]["namespace"] == "other"
    assert ev["run"]["facets"]["parent"]["job"]["namespace"] == "prefect-prod"


def test_run_without_parent_model_or_config_has_only_the_engine_facet() -> None:
    run = lineage.RunContext(run_id=RUN_ID, job_name="score")
    ev = event_dict(lineage.RunState.START, run)
    assert set(ev["run"]["facets"]) == {"processing_engine"}
    assert ev["inputs"] == ev["outputs"] == []


@pytest.mark.parametrize(
    ("kw", "message"),
    [
        ({"run_id": "not-a-uuid"}, "run_id must be a UUID"),
        ({"parent_run_id": None}, "together"),
        ({"parent_run_id": "nope"}, "parent_run_id must be a UUID"),
    ],
)
def test_run_context_checks_its_ids(kw: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        run_context(**kw)


def test_new_run_id_is_a_uuid() -> None:
    lineage.RunContext(run_id=lineage.new_run_id(), job_name="score")


def test_custom_facet_schema_ids_match_the_schema_urls() -> None:
    ids = {schema["$id"] for schema in lineage.custom_facet_schemas()}
    change = {"action": "promote", "queue": "q", "actor": "ops", "reason": "r", "to": {}}
    replay, cost = {"originalRunId": RUN_ID}, {"deviceSeconds": 1.5}
    ev = event_dict(lineage.RunState.START, run_context(rollout=change, replay=replay, cost=cost))
    urls = {ev["run"]["facets"][k]["_schemaURL"].partition("#")[0] for k in lineage.CUSTOM_FACETS}
    assert urls == ids


# ----------------------------------------------------------------------------- emitter


class ListTransport(Transport):
    """Keeps events in memory; fails the next ``fail_next`` emits."""

    kind = "list"

    def __init__(self, fail_next: int = 0) -> None:
        self.events: list[dict[str, Any]] = []
        self.fail_next = fail_next

    def emit(self, event: Any) -> None:
        if self.fail_next:
            self.fail_next -= 1
            raise ConnectionError(f"backend down at {SECRET_URL}")
        self.events.append(Serde.to_dict(event))


def emitter(
    transport: Transport, clock: FakeClock, cooldown_s: float = 30.0
) -> lineage.LineageEmitter:
    return lineage.LineageEmitter(
        config.LineageConfig(),
        base_dir=Path("/cfg"),
        producer=PRODUCER,
        transport=transport,
        clock=clock,
        cooldown_s=cooldown_s,
    )


def test_emitter_emits_start_complete_and_fail_with_the_clock_time(clock: FakeClock) -> None:
    transport = ListTransport()
    em = emitter(transport, clock)
    run = run_context()
    assert em.start(run)
    clock.advance(2.5)
    assert em.complete(run, [RESULTS.with_stats(10)])
    assert em.fail(run, RuntimeError("boom"))
    assert [e["eventType"] for e in transport.events] == ["START", "COMPLETE", "FAIL"]
    assert transport.events[0]["eventTime"] == "2027-01-15T08:00:00+00:00"
    assert (em.emitted, em.failures) == (3, 0)
    assert em.events_path is None


def test_emitter_never_raises_logs_a_constant_warning_and_counts(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    em = emitter(ListTransport(fail_next=1), clock)
    with caplog.at_level(logging.WARNING, logger="batching.evidence.lineage"):
        assert em.start(run_context()) is False
    assert em.failures == 1
    (record,) = caplog.records
    assert record.getMessage() == "lineage emit failed"
    assert record.__dict__["action"] == "lineage_emit_failed"
    assert record.__dict__["error_type"] == "ConnectionError"
    assert "secret" not in record.__dict__["error"]


def test_after_a_failure_events_are_dropped_until_the_cooldown_ends(clock: FakeClock) -> None:
    transport = ListTransport(fail_next=1)
    em = emitter(transport, clock, cooldown_s=30.0)
    run = run_context()
    assert em.start(run) is False
    clock.advance(29.0)
    assert em.complete(run) is False  # dropped without touching the backend
    assert (em.failures, transport.events) == (2, [])
    clock.advance(1.0)
    assert em.complete(run)
    assert (em.failures, em.emitted) == (2, 1)


def test_a_bug_while_building_the_event_is_contained_too(clock: FakeClock) -> None:
    em = emitter(ListTransport(), clock)
    bad = lineage.DatasetRef("file", "/x", fields=(("only-a-name",),))  # type: ignore[arg-type]
    assert em.complete(run_context(), [bad]) is False
    assert em.failures == 1


def test_transport_none_emits_nothing_and_counts_nothing(clock: FakeClock) -> None:
    em = lineage.LineageEmitter(
        config.LineageConfig(transport="none"),
        base_dir=Path("/cfg"),
        producer=PRODUCER,
        clock=clock,
    )
    assert em.start(run_context()) is False
    assert (em.emitted, em.failures, em.events_path) == (0, 0, None)


def test_console_transport_logs_the_event_json(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    em = lineage.LineageEmitter(
        config.LineageConfig(transport="console"),
        base_dir=Path("/cfg"),
        producer=PRODUCER,
        clock=clock,
    )
    with caplog.at_level(logging.INFO, logger="openlineage.client.transport.console"):
        assert em.start(run_context())
    (record,) = caplog.records
    assert json.loads(record.getMessage())["run"]["runId"] == RUN_ID
    assert "secret" not in record.getMessage()


def test_invalid_http_url_is_a_config_error_without_the_password() -> None:
    url = "marquez-user:secret@nohost"
    with pytest.raises(errors.ConfigError, match="is not a URL") as refused:
        config.parse_config(
            {
                "model": {"name": "w1-mlp", "sha256": "a" * 64},
                "lineage": {"transport": "http", "url": url},
            }
        )
    assert "secret" not in str(refused.value)
    unchecked = config.LineageConfig.model_construct(transport="http", url=url)
    with pytest.raises(errors.ConfigError, match="is not a URL") as info:
        lineage.LineageEmitter(unchecked, base_dir=Path("/cfg"), producer=PRODUCER)
    assert "secret" not in str(info.value)


# ----------------------------------------------------------------------------- summaries


def ev(run_id: str, state: str, time: str, **extra: Any) -> dict[str, Any]:
    return {
        "eventType": state,
        "eventTime": time,
        "run": {"runId": run_id, "facets": extra.pop("run_facets", {})},
        "job": {
            "namespace": "batching",
            "name": extra.pop("job", "score"),
            "facets": {"jobType": {}},
        },
        "inputs": extra.pop("inputs", []),
        "outputs": extra.pop("outputs", []),
    }


OUT = {"namespace": "file", "name": "/o", "facets": {"schema": {}}, "outputFacets": {}}
OUT_DONE = OUT | {"outputFacets": {"outputStatistics": {"rowCount": 640, "size": 99}}}
EVENTS = [
    ev(
        RUN_ID,
        "START",
        "2030-01-01T00:00:00+00:00",
        outputs=[OUT],
        run_facets={
            "batching_model": {"_producer": "p", "_schemaURL": "s", "name": "m", "version": "1"}
        },
    ),
    ev(PARENT_ID, "START", "2030-01-01T00:00:05+00:00"),
    ev(
        RUN_ID,
        "COMPLETE",
        "2030-01-01T00:00:03.5+00:00",
        outputs=[OUT_DONE],
        inputs=[{"namespace": "sqlite", "name": "/q.db.batching_items"}],
        run_facets={
            "parent": {
                "run": {"runId": PARENT_ID},
                "job": {"namespace": "batching", "name": "score"},
            },
            "batching_config": {"configHash": "h"},
        },
    ),
    ev(
        PARENT_ID,
        "FAIL",
        "2030-01-01T00:00:09+00:00",
        run_facets={"errorMessage": {"message": "RuntimeError: boom"}},
    ),
]


@pytest.mark.parametrize("bad", ["a string", ["a", "list"], 7, None])
def test_summarize_run_reads_a_facet_of_another_shape_as_absent(bad: object) -> None:
    """A hand-edited or foreign log: ``batching lineage --events`` crashed with "unexpected
    AttributeError" on a facet, or a part of one, that is not a JSON object (a sweep)."""
    odd = ev(
        RUN_ID,
        "COMPLETE",
        "2030-01-01T00:00:01+00:00",
        outputs=[{"namespace": "file", "name": "/o", "facets": bad, "outputFacets": bad}],
        run_facets={
            "batching_model": bad,
            "batching_config": bad,
            "errorMessage": bad,
            "parent": {"run": bad, "job": bad},
        },
    )
    summary = lineage_log.summarize_run([odd], RUN_ID)
    assert summary is not None
    assert (summary["model"], summary["config_hash"], summary["error"]) == (None, None, None)
    assert summary["parent"] == {"run_id": None, "job": "None/None"}
    assert summary["outputs"] == [{"namespace": "file", "name": "/o", "facets": []}]


def test_summarize_run_by_id() -> None:
    summary = lineage_log.summarize_run(EVENTS, RUN_ID)
    assert summary == {
        "run_id": RUN_ID,
        "job": {"namespace": "batching", "name": "score"},
        "parent": {"run_id": PARENT_ID, "job": "batching/score"},
        "state": "COMPLETE",
        "event_types": ["START", "COMPLETE"],
        "started_at": "2030-01-01T00:00:00+00:00",
        "ended_at": "2030-01-01T00:00:03.5+00:00",
        "duration_s": 3.5,
        "inputs": [{"namespace": "sqlite", "name": "/q.db.batching_items", "facets": []}],
        "outputs": [
            {
                "namespace": "file",
                "name": "/o",
                "facets": ["outputStatistics", "schema"],
                "row_count": 640,
                "size_bytes": 99,
            }
        ],
        "run_facets": ["batching_config", "batching_model", "parent"],
        "job_facets": ["jobType"],
        "error": None,
        "model": {"name": "m", "version": "1"},
        "config_hash": "h",
    }


def test_summarize_latest_run_by_event_time_and_reports_the_error() -> None:
    summary = lineage_log.summarize_run(list(reversed(EVENTS)))
    assert summary is not None
    assert (summary["run_id"], summary["state"], summary["error"]) == (
        PARENT_ID,
        "FAIL",
        "RuntimeError: boom",
    )
    assert summary["event_types"] == ["START", "FAIL"]


def test_summarize_an_unfinished_run() -> None:
    summary = lineage_log.summarize_run(EVENTS[:1])
    assert summary is not None
    assert (summary["ended_at"], summary["duration_s"], summary["parent"]) == (None, None, None)


@pytest.mark.parametrize(("events", "run_id"), [([], None), (EVENTS, "unknown-run")])
def test_summarize_nothing_gives_none(events: list[dict[str, Any]], run_id: str | None) -> None:
    assert lineage_log.summarize_run(events, run_id) is None


def test_the_command_line_shows_why_an_event_was_not_delivered(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    """Before, the CLI printed "lineage emit failed" and nothing of the cause, which the
    record carries (masked) for structured logs."""
    from batching.logs import OneLine

    em = emitter(ListTransport(fail_next=1), clock)
    with caplog.at_level(logging.WARNING, logger="batching.evidence.lineage"):
        em.start(run_context())
    (record,) = caplog.records
    line = OneLine("%(levelname)s %(name)s: %(message)s").format(record)
    assert line.startswith(
        "WARNING batching.evidence.lineage: lineage emit failed (ConnectionError: "
    )
    assert "secret" not in line
    assert "\n" not in line


@pytest.mark.parametrize("namespace", ["has space", "my team!", "", "ns#1"])
def test_a_namespace_marquez_would_refuse_is_refused_here(namespace: str) -> None:
    """Marquez's NamespaceName rule; before, it was sent, and only delivery failures showed."""
    with pytest.raises(errors.ConfigError, match="is not one Marquez accepts"):
        lineage.config_from_env({"OPENLINEAGE_NAMESPACE": namespace or " "}, BASE)
    if namespace:
        with pytest.raises(errors.ConfigError, match="is not one Marquez accepts"):
            config.parse_config(
                {
                    "model": {"name": "w1-mlp", "sha256": "a" * 64},
                    "lineage": {"namespace": namespace},
                }
            )
