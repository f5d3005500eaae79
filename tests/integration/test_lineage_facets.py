"""Facets that tell the truth: the config facet says what the run used (its database, outputs
and lineage after every override), the custom facets' schemas are the files the repository
ships at the address ``_schemaURL`` names, and the output dataset carries its version and
column lineage. Real SQLite, real Parquet and Delta read back, the real OpenLineage client."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pyarrow.dataset as pads
import pytest
import sqlalchemy as sa
from openlineage.client.serde import Serde
from referencing import Registry

import batching
from batching import naming
from batching.compose import build
from batching.evidence import lineage, lineage_log
from batching.store import database, schema
from tests import olspec
from tests.integration.test_pipeline import enqueue, load, w1_records

N_ITEMS = 40
NAMESPACE = "facets-test"


@pytest.fixture(scope="module")
def registry() -> Registry:
    """The spec's schemas and the shipped custom facet schemas, and nothing the code makes."""
    return olspec.load_registry(olspec.require_spec_dir())


# ----------------------------------------------------------------------------- shipped schemas


def test_the_shipped_facet_schemas_are_the_ones_the_code_emits() -> None:
    folder = olspec.SHIPPED_DIR / lineage.FACET_SCHEMA_VERSION
    shipped = {p.name: json.loads(p.read_text()) for p in folder.glob("*.json")}
    expected = {s["$id"].rsplit("/", 1)[-1]: s for s in lineage.custom_facet_schemas()}
    fix = (
        "regenerate them: python -c 'from pathlib import Path; from batching.evidence import "
        f'lineage; lineage.write_custom_facet_schemas(Path("{folder.relative_to(olspec.REPO)}"))\''
    )
    assert shipped == expected, fix
    for name, doc in shipped.items():
        assert doc["$id"] == olspec.shipped_url(folder / name)


@pytest.mark.parametrize("key", sorted(lineage.CUSTOM_FACETS))
def test_every_custom_facet_names_its_shipped_schema_at_a_release_address(key: str) -> None:
    url = lineage.CUSTOM_FACETS[key]._get_schema()
    document, _, fragment = url.partition("#")
    release = f"{build.PRODUCER}/blob/v{batching.__version__}/spec/facets/"
    assert document.startswith(release), url  # the producer's home, at a tag: never main
    schema_doc = olspec.shipped_schemas()[document]
    assert key in schema_doc["properties"]
    assert fragment.removeprefix("/$defs/") in schema_doc["$defs"]


# ----------------------------------------------------------------------------- every facet


def test_an_event_with_every_facet_validates_against_the_shipped_schemas(
    tmp_path: Path, registry: Registry
) -> None:
    queue = lineage.DatasetRef("sqlite", f"{tmp_path}/q.db.batching_items", build.QUEUE_FIELDS)
    fields = (("item_key", "string"), ("output", "list<float>"), ("tenant", "string"))
    out = build.column_lineage(queue, lineage.DatasetRef("file", str(tmp_path / "out"), fields))
    checked = out.with_assertions(
        [
            lineage.Assertion("lost_write", True, "error", "0", "0"),
            lineage.Assertion("stale_lease", False, "warn", "3", "0", "3 leases expired"),
        ]
    )
    run = lineage.RunContext(
        run_id=lineage.new_run_id(),
        job_name="score-tabular-reconcile",
        parent_run_id=lineage.new_run_id(),
        parent_job_name="score-tabular",
        inputs=(queue, checked),
        outputs=(out.with_version("7"),),
        model=lineage.ModelRef("m", "1", "e" * 64),
        config={"database": {"url": "sqlite:///q.db"}},
        config_hash="a" * 64,
        effective_config_hash="b" * 64,
    )
    event = json.loads(
        Serde.to_json(
            lineage.build_event(
                lineage.RunState.COMPLETE,
                run,
                producer=build.PRODUCER,
                namespace=NAMESPACE,
                event_time="2026-12-01T22:00:00+00:00",
            )
        )
    )
    olspec.assert_valid_event(event, registry)
    facets = {key for _, key, _ in olspec.iter_facets(event)}
    assert facets >= {
        "batching_config",
        "batching_model",
        "parent",
        "version",
        "columnLineage",
        "dataQualityAssertions",
    }


def test_a_run_cannot_be_its_own_parent() -> None:
    run_id = lineage.new_run_id()
    with pytest.raises(ValueError, match="its own parent"):
        lineage.RunContext(run_id=run_id, job_name="j", parent_run_id=run_id, parent_job_name="p")


# ----------------------------------------------------------------------------- the config facet


def test_the_config_facet_masks_credentials_and_names_the_run_s_database(tmp_path: Path) -> None:
    url = "postgresql+psycopg://scorer:s3cret-pw@db.internal:5432/scoring"
    config = load("tabular.yaml", tmp_path)
    res = build.resolve(config, url, str(tmp_path / "out"))
    shown, digest = build.config_facet(config, res, None)
    text = json.dumps(shown)
    assert "s3cret-pw" not in text
    assert naming.sql_dataset_id(shown["database"]["url"], "t") == naming.sql_dataset_id(url, "t")
    assert digest == hashlib.sha256(json.dumps(shown, sort_keys=True).encode()).hexdigest()
    assert digest != build.config_facet(config, build.resolve(config, None, None), None)[1]


def score_with_overrides(tmp_path: Path, sqlite_url: str, **overrides: Any) -> dict[str, Any]:
    """Score N_ITEMS on ``sqlite_url`` (``--db``; the config names another database) into
    ``tmp_path/elsewhere`` (``--output``), with ``OPENLINEAGE_NAMESPACE``; returns what the
    run left: its config, outcome and lineage events."""
    config = load("tabular.yaml", tmp_path, **overrides)
    assert config.database.url != sqlite_url
    enqueue(sqlite_url, config, w1_records(N_ITEMS, tmp_path))
    env = {"OPENLINEAGE_NAMESPACE": NAMESPACE}
    outcome = build_and_score(config, sqlite_url, tmp_path / "elsewhere", env)
    assert outcome.summary["items_committed"] == N_ITEMS
    events = lineage_log.read_events(tmp_path / "lineage" / "events.jsonl")
    return {"config": config, "outcome": outcome, "events": events}


def build_and_score(config: Any, url: str, output: Path, env: dict[str, str]) -> Any:
    from batching.compose import run as wiring

    lineage_config = lineage.config_from_env(env, config.lineage)
    return wiring.run_score(config, db_url=url, output=str(output), lineage_config=lineage_config)


def ledger_batches(url: str, run_id: str) -> list[str]:
    engine = database.create_engine(url)
    try:
        with engine.connect() as conn:
            b = schema.batches.c
            found = conn.execute(sa.select(b.batch_id).where(b.run_id == run_id)).scalars()
            return sorted(found)
    finally:
        engine.dispose()


def ledger_config_hash(url: str, run_id: str) -> str:
    engine = database.create_engine(url)
    try:
        with engine.connect() as conn:
            r = schema.runs.c
            return str(
                conn.execute(sa.select(r.config_hash).where(r.run_id == run_id)).scalar_one()
            )
    finally:
        engine.dispose()


def test_the_config_facet_says_what_the_run_used_after_every_override(
    tmp_path: Path, sqlite_url: str, registry: Registry
) -> None:
    run = score_with_overrides(tmp_path, sqlite_url)
    config, events = run["config"], run["events"]
    assert [e["eventType"] for e in events] == ["START", "COMPLETE"]
    for event in events:
        olspec.assert_valid_event(event, registry)
        facet = event["run"]["facets"]["batching_config"]
        used = facet["config"]
        (source,) = event["inputs"]
        (target,) = event["outputs"]
        db = naming.sql_dataset_id(used["database"]["url"], "batching_items")
        assert db == (source["namespace"], source["name"])
        out = naming.file_dataset_id(used["output"]["path"])
        assert out == (target["namespace"], target["name"])
        assert used["lineage"]["namespace"] == event["job"]["namespace"] == NAMESPACE
        assert used["lineage"]["path"] == str(tmp_path / "lineage" / "events.jsonl")
        canonical = json.dumps(used, sort_keys=True).encode()
        assert facet["effectiveConfigHash"] == hashlib.sha256(canonical).hexdigest()
        # the settings as loaded: the run ledger's hash, which `batching lineage` shows too
        assert facet["configHash"] == config.config_hash()
        assert facet["configHash"] == ledger_config_hash(sqlite_url, run["outcome"].run_id)


def test_the_output_carries_its_version_and_column_lineage(tmp_path: Path, sqlite_url: str) -> None:
    run = score_with_overrides(tmp_path, sqlite_url)
    start, complete = run["events"]
    (target,) = complete["outputs"]
    # Parquet: the sha256 of the ids of the batches the run committed, as the files say
    files = pads.dataset(tmp_path / "elsewhere", format="parquet", partitioning="hive")
    batch_ids = sorted(set(files.to_table(columns=["batch_id"])["batch_id"].to_pylist()))
    assert batch_ids == ledger_batches(sqlite_url, run["outcome"].run_id)
    digest = hashlib.sha256("\n".join(batch_ids).encode()).hexdigest()
    assert target["facets"]["version"]["datasetVersion"] == digest
    assert "version" not in start["outputs"][0]["facets"]  # known once the run has committed

    (source,) = complete["inputs"]
    queue_columns = {f["name"] for f in source["facets"]["schema"]["fields"]}
    lineage_facet = target["facets"]["columnLineage"]
    assert set(lineage_facet["fields"]) == {"item_key", "output", "queue", "tenant"}
    for derived in lineage_facet["fields"].values():
        for field in derived["inputFields"]:
            assert (field["namespace"], field["name"]) == (source["namespace"], source["name"])
            assert field["field"] in queue_columns
    (key_from,) = lineage_facet["fields"]["item_key"]["inputFields"]
    assert key_from["field"] == "item_key"
    assert key_from["transformations"][0]["subtype"] == "IDENTITY"
    (output_from,) = lineage_facet["fields"]["output"]["inputFields"]
    assert output_from["field"] == "payload"
    assert output_from["transformations"][0]["subtype"] == "TRANSFORMATION"


def test_a_delta_output_s_version_is_the_table_s_after_the_run(
    tmp_path: Path, sqlite_url: str, registry: Registry
) -> None:
    deltalake = pytest.importorskip("deltalake")
    run = score_with_overrides(tmp_path, sqlite_url, output={"kind": "delta"})
    complete = run["events"][-1]
    olspec.assert_valid_event(complete, registry)
    (target,) = complete["outputs"]
    table = deltalake.DeltaTable(str(tmp_path / "elsewhere"))
    assert target["facets"]["version"]["datasetVersion"] == str(table.version())
    assert table.version() >= 1  # created, then at least one commit of the run
    # its rows, and no size: the table's files are written by the roll-forward, whose bytes
    # the run does not count (it said 0 bytes for a table of ~47 KB, a review found)
    stats = target["outputFacets"]["outputStatistics"]
    assert stats["rowCount"] > 0
    assert "size" not in stats
