"""Config validation: field-level messages that say what to change."""

from __future__ import annotations

from pathlib import Path

import pytest

from batching import config, errors
from tests.conftest import REPO

SHA = "0" * 64
MODEL = {"name": "w1-mlp", "version": "v1", "sha256": SHA}


@pytest.mark.parametrize("name", ["online.yaml", "bulk.yaml", "tabular.yaml"])
def test_shipped_configs_load(name: str) -> None:
    cfg = config.load_config(REPO / "deployments" / name)
    assert cfg.model.sha256
    assert cfg.latency_slo_s > cfg.batching.max_wait_s


@pytest.mark.parametrize(
    ("data", "message"),
    [
        (
            {"model": MODEL, "batching": {"max_wait_s": 2.0}, "latency_slo_s": 1.0},
            "batching.max_wait_s must be < latency_slo_s (1), got 2",
        ),
        ({"model": {**MODEL, "sha256": "abc"}}, "model.sha256: sha256 must be 64 hex digits"),
        (
            {"model": {**MODEL, "name": "bad:factory:x"}},
            "factory must look like package.module:function",
        ),
        (
            {"model": MODEL, "queue": {"backoff_base_s": 100, "backoff_max_s": 1}},
            "queue: backoff_base_s (100) must be <= backoff_max_s (1)",
        ),
        (
            {"model": MODEL, "queue": {"lease_s": 30, "heartbeat_s": 20}},
            "heartbeat_s must be <= lease_s / 3 (10)",
        ),
        (  # past what a database integer or a thread's wait takes: refused at load
            {"model": MODEL, "batching": {"claim_size": 10**20}},
            "batching.claim_size: Input should be less than or equal to 1048576",
        ),
        (
            {"model": MODEL, "queue": {"lease_s": 1e11}},
            "queue.lease_s: Input should be less than or equal to 604800",
        ),
        (
            {"model": MODEL, "queue": {"poll_s": 1e300}},
            "queue.poll_s: Input should be less than or equal to 3600",
        ),
        (
            {"model": MODEL, "output": {"table": "x; drop table y"}},
            "output.table: Value error, table must be a SQL identifier",
        ),
        (
            {"model": MODEL, "output": {"table": "batching_items"}},
            "output.table: Value error, table batching_items is one of the queue's own tables",
        ),
        (
            {"model": MODEL, "metrics": {"pushgateway_url": "http://u:s3cr3t@h:9091/ extra"}},
            "metrics.pushgateway_url: pushgateway_url 'http://u:***@h:9091/ extra' is not a URL",
        ),
        (  # passed every check and failed the run as a bug (a security review)
            {"model": MODEL, "output": {"table": "pg_class"}},
            "output.table: Value error, table pg_class: names starting with pg_ or sqlite_ are",
        ),
        (
            {"model": MODEL, "batching": {"length_buckets": [32, 16]}},
            "length_buckets must be strictly increasing",
        ),
        ({"model": MODEL, "lineage": {"transport": "http"}}, "transport http needs url"),
        ({"model": MODEL, "bogus": 1}, "bogus: unknown setting; known here: name, profile,"),
        (
            {"model": MODEL, "batching": {"max_wiat_s": 1}},
            "batching.max_wiat_s: unknown setting; did you mean max_wait_s?",
        ),
        ({"model": {**MODEL, "devise": "cpu"}}, "model.devise: unknown setting; did you mean devi"),
        (  # several in one section: each named, the section's settings listed once
            {"model": MODEL, "batching": {"max_wiat_s": 1, "foo": 2, "bar": 3}},
            "batching.max_wiat_s (did you mean max_wait_s?), batching.foo, batching.bar: unknown"
            " settings; known here: max_batch_size, max_batch_cost, max_wait_s,",
        ),
        (
            {"prefect-version": "3.4.0", "deployments": [{"name": "score"}]},
            "a Prefect deployment file (it lists deployments), not a scoring config; give a"
            " scoring config such as deployments/tabular.yaml",
        ),
        # YAML reads all-digit text as a number, true as a boolean, .inf as infinity.
        ({"model": {**MODEL, "sha256": 10**63}}, 'sha256: "<64 hex digits>"'),
        ({"model": MODEL, "batching": {"max_batch_size": True}}, "max_batch_size must be a num"),
        ({"model": MODEL, "queue": {"lease_s": False}}, "queue: lease_s must be a number, got"),
        ({"model": MODEL, "latency_slo_s": float("inf")}, "latency_slo_s: Input should be a fin"),
        ({"model": MODEL, "output": {"commit_interval_s": float("nan")}}, "should be a finite"),
        (
            {"model": MODEL, "database": {"url": "mysql://u:pw@h/db"}},
            "must be sqlite:///FILE or postgresql://USER@HOST:PORT/DB, got 'mysql://u:***@h/db'",
        ),
        ({}, "model: Field required"),
        ({"model": MODEL, "queue": None}, "queue: an empty section; give its settings or remove"),
        ({"model": "w2-text"}, "model: a section of settings, not 'w2-text'; indent its"),
        ({"model": {**MODEL, "checkpoint": ""}}, "model.checkpoint: String should have at least 1"),
        ({"model": MODEL, "output": {"path": ""}}, "output.path: String should have at least 1"),
        ({"model": MODEL, "lineage": {"path": ""}}, "lineage.path: String should have at least 1"),
    ],
)
def test_invalid_configs_name_the_field(data: dict[str, object], message: str) -> None:
    with pytest.raises(errors.ConfigError) as info:
        config.parse_config(data, source="cfg.yaml")
    text = str(info.value)
    assert text.startswith("cfg.yaml: ")
    assert message.replace("Value error, ", "") in text


def test_bad_yaml_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("model: [unclosed\n")
    with pytest.raises(errors.ConfigError, match="is not valid YAML"):
        config.load_config(tmp_path / "c.yaml")
    with pytest.raises(errors.ConfigError, match="cannot read config"):
        config.load_config(tmp_path / "none.yaml")
    (tmp_path / "twice.yaml").write_text("name: a\nbatching: {}\nname: b\n")
    with pytest.raises(errors.ConfigError, match=r"twice\.yaml: line 3: 'name' is given twice"):
        config.load_config(tmp_path / "twice.yaml")
    (tmp_path / "deep.yaml").write_text("name: " + "[" * 20_000 + "]" * 20_000 + "\n")
    with pytest.raises(errors.ConfigError, match=r"deep\.yaml: nested too deeply"):
        config.load_config(tmp_path / "deep.yaml")
    (tmp_path / "key.yaml").write_text("? [1, 2]\n: x\n")
    with pytest.raises(errors.ConfigError, match=r"key\.yaml: a key that is a list or a mapping"):
        config.load_config(tmp_path / "key.yaml")
    (tmp_path / "u16.yaml").write_text("name: x\n", encoding="utf-16")  # a Windows editor's
    with pytest.raises(errors.ConfigError, match=r"u16\.yaml: not UTF-8 text; save the config"):
        config.load_config(tmp_path / "u16.yaml")


def test_overrides_and_relative_paths(tmp_path: Path) -> None:
    (tmp_path / "c.yaml").write_text("model: {name: w1-mlp, version: v, sha256: '" + SHA + "'}\n")
    cfg = config.load_config(
        tmp_path / "c.yaml", {"output": {"path": "out"}, "queue": {"name": "q"}}
    )
    assert cfg.queue.name == "q"
    assert cfg.resolve(cfg.output.path) == tmp_path.resolve() / "out"
    assert (
        cfg.config_hash()
        == config.load_config(
            tmp_path / "c.yaml", {"output": {"path": "out"}, "queue": {"name": "q"}}
        ).config_hash()
    )


def test_identifier_check() -> None:
    assert config.check_identifier("batching_results", "t") == "batching_results"
    with pytest.raises(errors.ConfigError, match="t must be a SQL identifier"):
        config.check_identifier("1bad", "t")


@pytest.mark.parametrize(
    ("output", "message"),
    [
        (
            {"kind": "delta", "storage_options": {"AWS_SECRET_ACCESS_KEY": "x", "AWS_REGION": "y"}},
            "AWS_SECRET_ACCESS_KEY: a credential does not belong in a config file",
        ),
        ({"kind": "parquet", "storage_options": {"AWS_REGION": "y"}}, "a setting of kind delta"),
        ({"kind": "parquet", "url": "sqlite:///w.db"}, "url is a setting of kind sql"),
        ({"kind": "sql", "url": "mysql://h/db"}, "url must be sqlite:///FILE or postgresql://"),
        ({"kind": "iceberg"}, "output.kind"),
        (
            {"kind": "delta", "path": "s3://AKIA:s3cr3t@bucket/t"},
            "output: path 's3://AKIA:\\*\\*\\*@bucket/t' carries credentials or a query string; "
            "give s3://bucket/path",
        ),
        ({"kind": "delta", "path": "az://box/t?sig=s3cr3t"}, r"'az://box/t\?\.\.\.' carries"),
        (  # in a value too (a review: an endpoint URL with a password passed check)
            {
                "kind": "delta",
                "storage_options": {"AWS_ENDPOINT_URL": "http://u:s3cr3t@minio:9000"},
            },
            "AWS_ENDPOINT_URL: a credential does not belong in a config file",
        ),
        (  # Azure's account key, by name and inside a connection string (a security review)
            {"kind": "delta", "storage_options": {"azure_storage_master_key": "s3cr3t"}},
            "azure_storage_master_key: a credential does not belong",
        ),
        (
            {
                "kind": "delta",
                "storage_options": {"AZURE_STORAGE_CONN": "AccountName=a;AccountKey=s3cr3t"},
            },
            "AZURE_STORAGE_CONN: a credential does not belong",
        ),
    ],
)
def test_output_settings_of_another_kind_or_secrets_are_refused(
    output: dict[str, object], message: str
) -> None:
    with pytest.raises(errors.ConfigError, match=message) as info:
        config.parse_config({"model": MODEL, "output": output})
    assert "s3cr3t" not in str(info.value)


def test_a_delta_output_keeps_storage_options_that_are_not_credentials() -> None:
    """ALLOW_INVALID_CERTIFICATES (MinIO, self-signed) is a switch, not a certificate."""
    output = {
        "kind": "delta",
        "path": "s3://b/t",
        "storage_options": {"ALLOW_INVALID_CERTIFICATES": "true", "AWS_REGION": "eu-west-1"},
    }
    cfg = config.parse_config({"model": MODEL, "output": output})
    assert cfg.output.storage_options["ALLOW_INVALID_CERTIFICATES"] == "true"


def test_a_delta_output_keeps_its_storage_options() -> None:
    cfg = config.parse_config(
        {
            "model": MODEL,
            "output": {
                "kind": "delta",
                "path": "s3://b/t",
                "storage_options": {"AWS_REGION": "eu-west-1"},
            },
        }
    )
    assert cfg.output.storage_options == {"AWS_REGION": "eu-west-1"}


def test_the_queue_tables_a_config_may_not_write_are_the_schemas() -> None:
    from batching.store import schema

    assert set(schema.metadata.tables) - {"batching_results"} == config.QUEUE_TABLES


def test_the_config_hash_cannot_test_a_guess_of_a_password() -> None:
    """``configHash`` goes out in lineage beside the masked settings: a hash of the unmasked
    ones let anyone holding an event test password guesses offline (a security review)."""

    def hashed(password: str) -> str:
        url = f"postgresql://scorer:{password}@db:5432/scoring"
        return config.parse_config({"model": MODEL, "database": {"url": url}}).config_hash()

    assert (
        hashed("s3cretPW")
        == hashed("another")
        != config.parse_config(
            {"model": MODEL, "database": {"url": "postgresql://scorer@db:5432/other"}}
        ).config_hash()
    )


def test_a_bad_key_in_the_overrides_is_not_blamed_on_the_file_alone() -> None:
    """A flow's ``overrides`` parameter with a typo was reported as the YAML file's line (a
    Prefect review): the message says the overrides were merged in."""
    path = REPO / "deployments" / "bulk.yaml"
    with pytest.raises(
        errors.ConfigError, match=r"bulk\.yaml with its overrides: .*max_batch_sizee"
    ):
        config.load_config(path, {"batching": {"max_batch_sizee": 8}})


@pytest.mark.parametrize("text", ["", "\n", "# only a comment\n", "---\n"])
def test_an_empty_config_file_says_it_is_empty(tmp_path: Path, text: str) -> None:
    path = tmp_path / "empty.yaml"
    path.write_text(text)
    with pytest.raises(errors.ConfigError, match=r"empty\.yaml: the file is empty; a config"):
        config.load_config(path)
