"""The HTTP ingress against a real SQLite file, through FastAPI's test client: tokens bound to
tenants, idempotent and batch POSTs, the size limit, the depth cap's 429, states, a long poll
that a real scorer's commit ends, and bad bodies (hypothesis) that never get a 500."""

from __future__ import annotations

import base64
import json
import shutil
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from batching.api import app as api_app
from batching.api import door, tokens
from batching.api import results as results_module
from batching.api.results import Results
from batching.cli import api as api_cli
from batching.compose import build
from batching.config import load_config
from batching.ingress import controls
from batching.ingress.done_counts import DoneCounts
from batching.ingress.queue import SqlQueue
from batching.model import workloads
from batching.store import database
from tests.conftest import REPO

TOKEN_A, TOKEN_B = "a" * 24, "b" * 24
A = {"Authorization": f"Bearer {TOKEN_A}"}
B = {"Authorization": f"Bearer {TOKEN_B}"}
ITEMS = "/v1/queues/tabular/items"


def write_config(folder: Path, db_url: str, **changes: Any) -> Path:
    """The shipped W1 config on ``db_url``, its outputs in ``folder``."""
    deployments = REPO / "deployments"
    data = yaml.safe_load((deployments / "tabular.yaml").read_text())
    data |= {"database": {"url": db_url}, "output": {"kind": "parquet", "path": "outputs"}}
    data["batching"] = {"max_batch_size": 32, "max_wait_s": 0.02}
    data["service_profile"] = str(deployments / data["service_profile"])
    data |= changes
    path = folder / "pipeline.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


@pytest.fixture
def config_path(tmp_path: Path, db_url: str) -> Path:
    return write_config(tmp_path, db_url)


def make_client(config_path: Path, **kwargs: Any) -> Iterator[TestClient]:
    cfg = load_config(config_path)
    res = build.checked(cfg, None, None)
    results = Results(database.create_engine(res.db_url), res.target)
    known = tokens.parse(f"{TOKEN_A}=alpha,{TOKEN_B}=beta", "test")
    settings_ = api_app.Settings(results, known, poll_s=0.01, **kwargs)
    with TestClient(api_app.create_app(settings_)) as client:
        yield client
    results.engine.dispose()


@pytest.fixture
def client(config_path: Path) -> Iterator[TestClient]:
    yield from make_client(config_path)


def item(key: str, **fields: Any) -> dict[str, Any]:
    return {"item_key": key, "payload": {"x": [0.5] * 64}, **fields}


def assert_error(r: Any, status: int, kind: str | None = None) -> str:
    """``r`` is a one-line JSON error of ``status`` (and ``kind``); returns its message."""
    assert r.status_code == status, r.text
    error = r.json()["error"]
    assert set(error) == {"kind", "message"}
    assert kind is None or error["kind"] == kind
    assert "\n" not in error["message"]
    return str(error["message"])


# -- auth ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": f"Basic {TOKEN_A}"},
        {"Authorization": "Bearer " + "c" * 24},
    ],
)
def test_a_request_without_a_known_token_is_401(
    client: TestClient, headers: dict[str, str]
) -> None:
    for r in (
        client.post(ITEMS, json=item("k"), headers=headers),
        client.get(f"{ITEMS}/k", headers=headers),
    ):
        assert_error(r, 401, "Unauthorized")
        assert r.headers["www-authenticate"] == "Bearer"
    assert (
        TOKEN_A
        not in client.post(ITEMS, json=item("k"), headers={"Authorization": "Bearer x"}).text
    )


def test_a_token_enqueues_and_reads_as_its_own_tenant_only(client: TestClient) -> None:
    created = client.post(ITEMS, json=item("k1"), headers=A)
    assert created.status_code == 201
    message = assert_error(client.post(ITEMS, json=item("k2", tenant="beta"), headers=A), 403)
    assert "tenant 'beta' is not this token's tenant" in message
    assert client.get(f"{ITEMS}/k2", headers=B).status_code == 404  # the 403 enqueued nothing
    assert client.post(ITEMS, json=item("k3", tenant="alpha"), headers=A).status_code == 201
    assert_error(client.get(f"{ITEMS}/k1", headers=B), 404, "NotFound")  # not told it exists
    assert_error(client.post(ITEMS, json=item("k1"), headers=B), 409, "Conflict")
    engine = database.create_engine(str(load_config_url(client)))
    with engine.connect() as conn:
        rows = conn.exec_driver_sql("SELECT item_key, tenant FROM batching_items ORDER BY id").all()
    engine.dispose()
    assert [tuple(r) for r in rows] == [("k1", "alpha"), ("k3", "alpha")]


def load_config_url(client: TestClient) -> str:
    return str(client.app.state.settings.results.engine.url)  # type: ignore[attr-defined]


# -- POST ---------------------------------------------------------------------------------------


def test_post_is_idempotent_on_item_key(client: TestClient) -> None:
    first = client.post(
        ITEMS, json=item("k", priority=3, deadline="2099-01-01T00:00:00Z"), headers=A
    )
    again = client.post(ITEMS, json=item("k", priority=9), headers=A)
    assert (first.status_code, again.status_code) == (201, 200)
    (one,), (two,) = first.json()["items"], again.json()["items"]
    assert one == {"item_key": "k", "id": one["id"], "state": "ready", "created": True}
    assert two == {**one, "created": False}


def test_a_batch_post_mixes_new_and_present_items_and_tensor_payloads(client: TestClient) -> None:
    client.post(ITEMS, json=item("old"), headers=A)
    row = np.arange(64, dtype="<f4")
    tensor = {
        "dtype": "float32",
        "shape": [64],
        "data_b64": base64.b64encode(row.tobytes()).decode(),
    }
    body = {"items": [item("old"), item("new"), {"item_key": "t", "payload": {"tensor": tensor}}]}
    r = client.post(ITEMS, json=body, headers=A)
    assert r.status_code == 201
    assert [(i["item_key"], i["created"]) for i in r.json()["items"]] == [
        ("old", False),
        ("new", True),
        ("t", True),
    ]
    engine = database.create_engine(load_config_url(client))
    with engine.connect() as conn:
        fmt, dtype, shape, cost = conn.exec_driver_sql(
            "SELECT payload_format, dtype, shape, cost FROM batching_items WHERE item_key = 't'"
        ).one()
    engine.dispose()
    assert (fmt, dtype, json.loads(shape), cost) == ("tensor", "float32", [64], 64)


@pytest.mark.parametrize(
    ("body", "status", "says"),
    [
        ({"items": []}, 422, '"items" must be a non-empty list'),
        ({"items": [item("a"), item("a")]}, 422, "repeats items[0]"),
        ({"item_key": "a"}, 422, "missing payload"),
        ({"item_key": "a", "payload": {"x": [1]}, "colour": 1}, 422, "unknown field(s) colour"),
        (
            {
                "item_key": "a",
                "payload": {"tensor": {"dtype": "float32", "shape": [2], "data_b64": "AAAA"}},
            },
            422,
            "needs 8",
        ),
        (
            {
                "item_key": "a",
                "payload": {"tensor": {"dtype": "complex64", "shape": [1], "data_b64": ""}},
            },
            422,
            "dtype must be one of",
        ),
        (
            {
                "item_key": "a",
                "payload": {"tensor": {"dtype": ["float32"], "shape": [1], "data_b64": "AAAAAA=="}},
            },
            422,
            "dtype must be one of",
        ),
        (
            {"item_key": "a", "payload": {"x": [1]}, "deadline": "soon"},
            422,
            "deadline must be epoch seconds",
        ),
        (
            {"item_key": "a", "payload": {"x": [1]}, "deadline": 10**400},
            422,
            "deadline must be a finite time",
        ),
    ],
)
def test_bad_items_get_a_one_line_422(
    client: TestClient, body: Any, status: int, says: str
) -> None:
    assert says in assert_error(client.post(ITEMS, json=body, headers=A), status, "InputError")


def test_an_item_past_the_model_limits_is_refused_as_a_file_record_is(config_path: Path) -> None:
    from batching.ingress import ingest

    for small in make_client(
        config_path, limits=ingest.ItemLimits(tokens=8, elements=8, bytes=4096)
    ):
        message = assert_error(small.post(ITEMS, json=item("big"), headers=A), 422, "InputError")
        assert (
            "body: item 'big' holds 64 numbers, over the limit of 8 (model.max_item_elements)"
            in message
        )


def test_a_payload_the_model_cannot_take_is_422_and_its_request_writes_nothing(
    config_path: Path,
) -> None:
    """The CLI binds the config's model's input (W1: 64 numbers) to the door: a payload the
    decode would fail is refused with the decode's reason, and a request holding one is
    refused whole."""
    wide = np.zeros(65, dtype="<f4")
    tensor = {
        "dtype": "float32",
        "shape": [65],
        "data_b64": base64.b64encode(wide.tobytes()).decode(),
    }
    for checked in make_client(config_path, fits=api_cli._fits(load_config(config_path))):
        short = {"item_key": "short", "payload": {"x": [0.5] * 63}}
        assert assert_error(checked.post(ITEMS, json=short, headers=A), 422, "InputError") == (
            "body: item 'short' does not fit the model: \"x\" must be a list of 64 numbers, "
            "got a list of 63; send the payload the config's model takes"
        )
        mixed = {"items": [item("fine"), {"item_key": "wide", "payload": {"tensor": tensor}}]}
        message = assert_error(checked.post(ITEMS, json=mixed, headers=A), 422, "InputError")
        assert message.startswith("items[1]: item 'wide' does not fit the model: tensor ")
        assert checked.get(f"{ITEMS}/fine", headers=A).status_code == 404
        assert checked.post(ITEMS, json=item("fine"), headers=A).status_code == 201


def build_needs_its_weights() -> Any:
    """A factory that reads a weight while it builds: it cannot build on the meta device."""
    from torch import nn

    model = nn.Linear(64, 1)
    float(model.weight.detach().sum())
    return model


def build_narrow() -> Any:
    """A dense model of 32 inputs (another version a queue may be routed to)."""
    from torch import nn

    return nn.Linear(32, 1)


def factory_version(name: str, version: str) -> dict[str, Any]:
    return {"name": f"{__name__}:{name}", "version": version, "sha256": "0" * 64}


def test_a_payload_fits_when_one_model_version_takes_it(tmp_path: Path, db_url: str) -> None:
    """A rollout may route the queue to any version of the registry: the door admits what
    one of them takes, and refuses the rest with the config's model's reason."""
    path = write_config(tmp_path, db_url, model_versions=[factory_version("build_narrow", "n1")])
    for checked in make_client(path, fits=api_cli._fits(load_config(path))):
        for key, n in (("w1", 64), ("narrow", 32)):
            body = {"item_key": key, "payload": {"x": [0.5] * n}}
            assert checked.post(ITEMS, json=body, headers=A).status_code == 201
        odd = {"item_key": "odd", "payload": {"x": [0.5] * 10}}
        message = assert_error(checked.post(ITEMS, json=odd, headers=A), 422, "InputError")
        assert '"x" must be a list of 64 numbers, got a list of 10' in message


def test_a_payload_no_version_takes_is_told_the_reason_of_its_own_kind(
    tmp_path: Path, db_url: str
) -> None:
    """W1 (numbers) with W2 (token ids) as another version: token ids past W2's vocabulary
    are told W2's reason, not that W1 wants "x"."""
    from batching.model import zoo

    w2 = {"name": "w2-text", "version": "w2", "sha256": zoo.BUILTINS["w2-text"].sha256}
    path = write_config(tmp_path, db_url, model_versions=[w2])
    for checked in make_client(path, fits=api_cli._fits(load_config(path))):
        ok = {"item_key": "ok", "payload": {"tokens": [1, 2]}}
        assert checked.post(ITEMS, json=ok, headers=A).status_code == 201
        far = {"item_key": "far", "payload": {"tokens": [1, 40000]}}
        message = assert_error(checked.post(ITEMS, json=far, headers=A), 422, "InputError")
        assert "token ids must be in [1, 30000)" in message, message


class _DeclaredFromWeight:
    """A module whose input length is read from a weight: it cannot be described on meta."""

    @staticmethod
    def build() -> Any:
        import torch
        from torch import nn

        class Model(nn.Module):
            def __init__(self) -> None:
                super().__init__()
                self.dim = nn.Parameter(torch.tensor(64.0), requires_grad=False)
                self.linear = nn.Linear(64, 1)

            @property
            def batching_input_dim(self) -> int:
                return int(self.dim.item())

        return Model()


build_declared_from_weight = _DeclaredFromWeight.build


@pytest.mark.parametrize(
    ("factory", "says"),
    [
        ("build_needs_its_weights", "cannot be called on meta tensors"),
        ("build_declared_from_weight", "cannot be described without its weights"),
    ],
)
def test_a_model_that_needs_its_weights_to_build_is_checked_at_decode_only(
    tmp_path: Path, db_url: str, capsys: pytest.CaptureFixture[str], factory: str, says: str
) -> None:
    path = write_config(tmp_path, db_url, model_versions=[factory_version(factory, "v9")])
    assert api_cli._fits(load_config(path)) is None
    said = capsys.readouterr().err
    assert "payloads are checked at decode only" in said
    assert says in said, said


def test_a_body_past_the_size_limit_is_413(config_path: Path) -> None:
    for small in make_client(config_path, max_body_bytes=2048):
        big = {"items": [item(f"k{i}") for i in range(20)]}
        assert_error(small.post(ITEMS, json=big, headers=A), 413, "PayloadTooLarge")
        assert small.post(ITEMS, json=item("ok"), headers=A).status_code == 201


def test_a_queue_at_its_depth_cap_answers_429_with_retry_after(config_path: Path) -> None:
    for capped in make_client(config_path, retry_after_s=7):
        engine = capped.app.state.settings.results.engine  # type: ignore[attr-defined]
        controls.set_max_depth(engine, "tabular", 2, actor="test", reason=None, now=time.time())
        ok = capped.post(ITEMS, json={"items": [item("a"), item("b")]}, headers=A)
        assert ok.status_code == 201
        full = capped.post(ITEMS, json=item("c"), headers=A)
        assert "depth cap" in assert_error(full, 429, "QueueFull")
        assert full.headers["retry-after"] == "7"
        # Full to the last item: the door refuses the next POSTs unread, a resend too ...
        again = capped.post(ITEMS, json=item("a"), headers=A)
        assert "queue 'tabular' is at its depth cap" in assert_error(again, 429, "QueueFull")
        assert again.headers["retry-after"] == "7"
        assert capped.app.state.door.refused == 1  # type: ignore[attr-defined]
        time.sleep(door.HOLD_S + 0.05)  # ... for a while: then the writer looks again
        assert capped.post(ITEMS, json=item("a"), headers=A).status_code == 200  # nothing new


def test_a_full_queue_refuses_posts_at_the_door_until_a_batch_commits(config_path: Path) -> None:
    # Past capacity a refusal cost the API as much CPU as an admission. Once the writer finds
    # the queue with no room, POSTs are refused before their bodies are parsed, until a
    # batch commits (a real scorer's: the SQLite ledger's last row, PostgreSQL's ack notify),
    # not on a timer: the hold here is an hour.
    from batching.compose import run as wiring
    from batching.loop import stats

    for capped in make_client(config_path):
        state = capped.app.state  # type: ignore[attr-defined]
        state.door.hold_s = 3600.0
        engine = state.settings.results.engine
        controls.set_max_depth(engine, "tabular", 2, actor="test", reason=None, now=time.time())
        assert (
            capped.post(ITEMS, json={"items": [item("a"), item("b")]}, headers=A).status_code == 201
        )
        assert_error(capped.post(ITEMS, json=item("c"), headers=A), 429, "QueueFull")
        for key in ("d", "e", "f"):
            assert_error(capped.post(ITEMS, json=item(key), headers=B), 429, "QueueFull")
        assert state.door.refused == 3
        wiring.run_score(load_config(config_path), limits=stats.RunLimits(until_empty=True))
        assert capped.post(ITEMS, json=item("c"), headers=A).status_code == 201  # room again
        assert state.door.refused == 3
        got = capped.get(f"{ITEMS}/d", headers=B)  # refused unread: never enqueued
        assert got.status_code == 404


def test_the_api_counts_what_each_post_did_on_its_own_metrics(config_path: Path) -> None:
    """``batching api``'s application (the CLI's): enqueued, duplicate and both kinds of 429
    counted by queue, tenant and outcome, served on /metrics without a token."""
    cfg = load_config(config_path)
    res = build.checked(cfg, None, None)
    results = Results(database.create_engine(res.db_url), res.target)
    known = tokens.parse(f"{TOKEN_A}=alpha,{TOKEN_B}=beta", "test")
    app = api_cli.application(api_app.Settings(results, known, poll_s=0.01), "prod")
    with TestClient(app) as served:
        controls.set_max_depth(results.engine, "tabular", 4, actor="test", reason=None, now=0.0)
        assert served.post(ITEMS, json=item("b1"), headers=B).status_code == 201
        assert (
            served.post(ITEMS, json={"items": [item("a1"), item("a2")]}, headers=A).status_code
            == 201
        )
        assert served.post(ITEMS, json=item("a1"), headers=A).status_code == 200  # present
        share = served.post(ITEMS, json=item("a3"), headers=A)  # past alpha's half of 4
        assert "share" in assert_error(share, 429, "QueueFull")
        assert served.post(ITEMS, json=item("b2"), headers=B).status_code == 201
        full = served.post(ITEMS, json={"items": [item("b3"), item("b4")]}, headers=B)
        assert "depth cap" in assert_error(full, 429, "QueueFull")
        scraped = served.get("/metrics", follow_redirects=False)  # at /metrics itself
        assert scraped.status_code == 200, scraped.headers
        assert scraped.headers["content-type"].startswith("text/plain")
        text = scraped.text
    results.engine.dispose()
    samples = [
        s
        for family in text_string_to_metric_families(text)
        for s in family.samples
        if s.name == "batching_api_items_total"
    ]
    assert {(s.labels["environment"], s.labels["queue"]) for s in samples} == {("prod", "tabular")}
    counted = {(s.labels["tenant"], s.labels["outcome"]): s.value for s in samples}
    assert counted == {
        ("beta", "enqueued"): 2.0,
        ("alpha", "enqueued"): 2.0,
        ("alpha", "duplicate"): 1.0,
        ("alpha", "shed_tenant_share"): 1.0,
        ("beta", "shed_depth_cap"): 2.0,
    }


# -- GET ----------------------------------------------------------------------------------------


def test_a_queue_other_than_the_configs_is_not_served(config_path: Path) -> None:
    """The API reads results back through its config's output and checks items against its
    config's limits: a POST to another queue once answered 201 and its result could never be
    read (the wrong dataset, a 503 naming a 'missing' file), or was never scored."""
    for served in make_client(config_path, queue="tabular"):
        other = served.post("/v1/queues/text/items", json=item("o1"), headers=A)
        message = assert_error(other, 404, "NotFound")
        assert message == (
            "queue 'text' is not served here: this API serves 'tabular' (its config's "
            "queue.name); use the API started with that queue's config"
        )
        assert_error(served.get("/v1/queues/text/items/o1", headers=A), 404, "NotFound")
        assert_error(served.get("/v1/queues/text", headers=A), 404, "NotFound")
        assert_error(served.post("/v1/queues/text/items", json=item("o1")), 401)  # token first
        assert served.post(ITEMS, json=item("t1"), headers=A).status_code == 201


def test_queue_stats_count_the_tokens_tenant_only(client: TestClient) -> None:
    client.post(ITEMS, json={"items": [item("a1"), item("a2")]}, headers=A)
    client.post(ITEMS, json=item("b1"), headers=B)
    mine = client.get("/v1/queues/tabular", headers=A).json()
    assert (mine["tenant"], mine["by_state"]["ready"], mine["paused"]) == ("alpha", 2, False)
    assert [g["tenant"] for g in mine["groups"]] == ["alpha"]
    assert client.get("/v1/queues/tabular", headers=B).json()["by_state"]["ready"] == 1
    assert_error(client.get("/v1/queues/tabular"), 401)


def test_queue_stats_count_done_items_in_the_background_not_per_request(
    config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    real = SqlQueue.done_counts

    def counted(self: SqlQueue, **kwargs: Any) -> dict[tuple[str, str, str], int]:
        calls.append(kwargs)
        return real(self, **kwargs)

    monkeypatch.setattr(SqlQueue, "done_counts", counted)
    rows = workloads.w1_inputs(3)
    body = {"items": [item(f"d{i}", payload={"x": r.tolist()}) for i, r in enumerate(rows)]}
    for client in make_client(config_path):
        first = client.get("/v1/queues/tabular", headers=A).json()
        assert first["by_state"]["done"] == 0  # the first read waits for the first count
        assert first["done_counted_at"] is not None
        assert client.post(ITEMS, json=body, headers=A).status_code == 201
        score_once_enqueued(config_path, 3).join(60)
        again = client.get("/v1/queues/tabular", headers=A).json()
        assert again["by_state"]["ready"] == 0  # the live states: read now
        assert again["by_state"]["done"] == 0  # the count of the first read, under 10 s old
        assert again["done_counted_at"] == first["done_counted_at"]
        assert calls == [{"all_queues": False}]  # one count for both reads, this queue's
    monkeypatch.setattr(results_module, "API_DONE_EVERY_S", 0.0)
    for client in make_client(config_path):  # a new API: its first read counts again
        assert client.get("/v1/queues/tabular", headers=A).json()["by_state"]["done"] == 3


def test_only_the_apis_first_reads_wait_for_the_first_done_count(
    config_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    release = threading.Event()
    real = SqlQueue.done_counts

    def blocked(self: SqlQueue, **kwargs: Any) -> dict[tuple[str, str, str], int]:
        release.wait(60)
        return real(self, **kwargs)

    waits: list[float] = []
    real_wait = DoneCounts.wait

    def recorded(self: DoneCounts, timeout_s: float) -> bool:
        waits.append(timeout_s)
        return real_wait(self, 0.0)  # the count is blocked: as if the wait ran out

    clock = [1000.0]
    monkeypatch.setattr(SqlQueue, "done_counts", blocked)
    monkeypatch.setattr(DoneCounts, "wait", recorded)
    monkeypatch.setattr(results_module, "_monotonic", lambda: clock[0])
    try:
        for client in make_client(config_path):
            first = client.get("/v1/queues/tabular", headers=A).json()
            assert "done" not in first["by_state"]  # none landed within the first wait
            assert first["done_counted_at"] is None
            clock[0] += 31.0  # past the API's first 30 s: a read no longer waits
            assert "done" not in client.get("/v1/queues/tabular", headers=A).json()["by_state"]
            assert waits == [30.0, 0.0]
            release.set()
            monkeypatch.setattr(DoneCounts, "wait", real_wait)
            for done in results_of(client).values():
                assert done.wait(30)
            assert client.get("/v1/queues/tabular", headers=A).json()["by_state"]["done"] == 0
    finally:
        release.set()


def results_of(client: TestClient) -> dict[str, DoneCounts]:
    """The API's done counts by queue."""
    return client.app.state.settings.results._done  # type: ignore[attr-defined,no-any-return]


def test_get_unknown_item_is_404_and_wait_s_is_bounded(client: TestClient) -> None:
    assert_error(client.get(f"{ITEMS}/nope", headers=A), 404, "NotFound")
    client.post(ITEMS, json=item("k"), headers=A)
    assert_error(client.get(f"{ITEMS}/k?wait_s=31", headers=A), 422, "InputError")
    says = assert_error(client.get(f"{ITEMS}/k?wait_s=nan", headers=A), 422, "InputError")
    assert "finite number" in says, says
    ready = client.get(f"{ITEMS}/k?wait_s=0.05", headers=A)  # nothing scores it: the wait ends
    assert ready.json() == {
        "item_key": "k",
        "state": "ready",
        "result": None,
        "error": None,
        "model_version": None,
    }


def test_a_long_poll_returns_the_committed_row_once_a_real_scorer_commits(
    config_path: Path, tmp_path: Path
) -> None:
    """The commit wakes the long poll: its re-read backstop (60 s) is longer than its wait
    (30 s), so only the wake-up answers it before the wait ends."""
    from batching.compose import run as wiring
    from batching.loop import stats

    clients = make_client(config_path, backstop_s=60.0)
    client = next(clients)

    rows = workloads.w1_inputs(5)
    body = {
        "items": [{"item_key": f"w{i}", "payload": {"x": r.tolist()}} for i, r in enumerate(rows)]
    }
    assert client.post(ITEMS, json=body, headers=A).status_code == 201
    got: dict[str, Any] = {}
    answered_s: list[float] = []

    def long_poll() -> None:
        started = time.monotonic()
        got.update(client.get(f"{ITEMS}/w3?wait_s=30", headers=A).json())
        answered_s.append(time.monotonic() - started)

    waiter = threading.Thread(target=long_poll)
    waiter.start()
    outcome = wiring.run_score(load_config(config_path), limits=stats.RunLimits(until_empty=True))
    waiter.join(60)
    next(clients, None)  # the client and its engine closed
    assert outcome.summary["items_committed"] == 5
    assert answered_s[0] < 20, answered_s  # woken by the commit, not at the end of its wait
    assert (got["state"], got["error"], got["model_version"]) == ("done", None, "w1-mlp-v1")
    (file,) = (tmp_path / "outputs").rglob("*.parquet")
    table = pq.read_table(file).to_pylist()
    (written,) = [r for r in table if r["item_key"] == "w3"]
    result = got["result"]
    assert result["output"] == pytest.approx(list(written["output"]), abs=0)
    assert (result["batch_id"], result["run_id"], result["tenant"]) == (
        written["batch_id"],
        written["run_id"],
        "alpha",
    )


def score_once_enqueued(config_path: Path, n: int) -> threading.Thread:
    """A real scorer, started once ``n`` items are in the queue, run until it is empty."""
    from batching.compose import run as wiring
    from batching.loop import stats

    def run() -> None:
        cfg = load_config(config_path)
        engine = database.create_engine(build.checked(cfg, None, None).db_url)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            with engine.connect() as conn:
                if conn.exec_driver_sql("SELECT count(*) FROM batching_items").scalar_one() >= n:
                    break
            time.sleep(0.05)
        engine.dispose()
        wiring.run_score(cfg, limits=stats.RunLimits(until_empty=True))

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def test_a_post_with_wait_s_answers_with_each_items_committed_result(
    config_path: Path, tmp_path: Path
) -> None:
    rows = workloads.w1_inputs(3)
    body = {"items": [item(f"p{i}", payload={"x": r.tolist()}) for i, r in enumerate(rows)]}
    for client in make_client(config_path, backstop_s=60.0):
        scorer = score_once_enqueued(config_path, 3)
        r = client.post(f"{ITEMS}?wait_s=30", json=body, headers=A)
        scorer.join(60)
        again = client.post(f"{ITEMS}?wait_s=30", json=body, headers=A)  # done: at once
    assert r.status_code == 201, r.text
    assert again.status_code == 200
    written = {
        row["item_key"]: row
        for f in (tmp_path / "outputs").rglob("*.parquet")
        for row in pq.read_table(f).to_pylist()
    }
    for answer in (r.json(), again.json()):
        assert [i["item_key"] for i in answer["items"]] == ["p0", "p1", "p2"]
        for doc in answer["items"]:
            assert (doc["state"], doc["error"], doc["model_version"]) == ("done", None, "w1-mlp-v1")
            row = written[doc["item_key"]]
            assert doc["result"]["output"] == pytest.approx(list(row["output"]), abs=0)
            assert doc["result"]["batch_id"] == row["batch_id"]
    assert [i["created"] for i in r.json()["items"]] == [True] * 3
    assert [i["created"] for i in again.json()["items"]] == [False] * 3


def test_many_long_polls_are_answered_by_reads_per_commit_not_per_request(
    config_path: Path,
) -> None:
    n = 24
    rows = workloads.w1_inputs(n)
    body = {"items": [item(f"m{i}", payload={"x": r.tolist()}) for i, r in enumerate(rows)]}
    got: dict[str, dict[str, Any]] = {}
    for client in make_client(config_path, backstop_s=60.0):
        waiters = client.app.state.waiters  # type: ignore[attr-defined]
        assert client.post(ITEMS, json=body, headers=A).status_code == 201

        def poll(http: TestClient, key: str) -> None:
            got[key] = http.get(f"{ITEMS}/{key}?wait_s=30", headers=A).json()

        polls = [threading.Thread(target=poll, args=(client, f"m{i}")) for i in range(n)]
        for t in polls:
            t.start()
        while sum(len(f) for f in waiters._waiting.values()) < n:  # all registered
            time.sleep(0.01)
        score_once_enqueued(config_path, n).join(60)
        for t in polls:
            t.join(60)
        passes = waiters.passes
    assert {k: v["state"] for k, v in got.items()} == {f"m{i}": "done" for i in range(n)}
    assert all(v["result"]["item_key"] == k for k, v in got.items())
    # One read of the waiting keys a commit (the scorer's batches of 32: one or two), not
    # one a waiting request.
    assert 1 <= passes < n / 4, passes


@pytest.mark.parametrize("kind", ["sql", "delta"])
def test_a_done_item_reads_its_row_from_a_sql_or_delta_output(
    tmp_path: Path, sqlite_url: str, kind: str
) -> None:
    from batching.compose import run as wiring
    from batching.loop import stats
    from tests.integration import outputs_read

    output = {"kind": kind, "path": str(tmp_path / "delta"), "table": "api_results"}
    config_path = write_config(tmp_path, sqlite_url, output=output)
    for client in make_client(config_path):
        rows = workloads.w1_inputs(3)
        body = {
            "items": [
                {"item_key": f"w{i}", "payload": {"x": r.tolist()}} for i, r in enumerate(rows)
            ]
        }
        assert client.post(ITEMS, json=body, headers=A).status_code == 201
        wiring.run_score(load_config(config_path), limits=stats.RunLimits(until_empty=True))
        got = client.get(f"{ITEMS}/w1?wait_s=30", headers=A).json()
    if kind == "sql":
        written = outputs_read.sql_rows(sqlite_url, "api_results")
    else:
        written = outputs_read.delta_rows(str(tmp_path / "delta"))
    (row,) = [r for r in written if r["item_key"] == "w1"]
    result = got["result"]
    assert (got["state"], got["model_version"]) == ("done", "w1-mlp-v1")
    assert (result["item_key"], result["batch_id"]) == ("w1", row["batch_id"])
    assert result["output"] == list(row["output"])


def test_a_batch_not_rolled_forward_yet_is_read_from_the_outbox(
    tmp_path: Path, sqlite_url: str
) -> None:
    import pyarrow as pa
    import sqlalchemy as sa

    from batching.compose import run as wiring
    from batching.loop import stats
    from batching.outputs import outbox
    from batching.store import schema

    config_path = write_config(tmp_path, sqlite_url, output={"kind": "delta", "path": "delta"})
    for client in make_client(config_path):
        body = {"item_key": "w0", "payload": {"x": workloads.w1_inputs(1)[0].tolist()}}
        assert client.post(ITEMS, json=body, headers=A).status_code == 201
        wiring.run_score(load_config(config_path), limits=stats.RunLimits(until_empty=True))
        done = client.get(f"{ITEMS}/w0", headers=A).json()["result"]
        # As a crash between the commit and the roll-forward leaves it: the ledger row
        # committed, the rows in the outbox; the table is not read (here: it is gone).
        rows = {k: [v] for k, v in done.items() if k not in ("model_version", "output_dim")}
        rows["output"] = [[2.0 * x for x in done["output"]]]
        engine = client.app.state.settings.results.engine  # type: ignore[attr-defined]
        with engine.begin() as conn:
            conn.execute(
                schema.outbox.insert().values(
                    batch_id=done["batch_id"], body=outbox.encode(pa.table(rows))
                )
            )
            conn.execute(
                sa.update(schema.batches)
                .where(schema.batches.c.batch_id == done["batch_id"])
                .values(state="committed")
            )
        shutil.rmtree(tmp_path / "delta")
    for client in make_client(config_path):  # a fresh server: nothing of the batch cached
        pending = client.get(f"{ITEMS}/w0", headers=A).json()["result"]
    assert pending["output"] == [2.0 * x for x in done["output"]]
    assert pending["batch_id"] == done["batch_id"]


def test_health_readiness_and_the_openapi_schema(client: TestClient, tmp_path: Path) -> None:
    assert client.get("/healthz").json() == {"ok": True}
    assert client.get("/readyz").json() == {"ok": True}
    schema = client.get("/openapi.json").json()
    assert {
        "/v1/queues/{queue}/items",
        "/v1/queues/{queue}/items/{item_key}",
        "/healthz",
        "/readyz",
    } <= set(schema["paths"])
    post = schema["paths"]["/v1/queues/{queue}/items"]["post"]
    assert "oneOf" in post["requestBody"]["content"]["application/json"]["schema"]
    # the token as a bearer scheme (what a generated client sends), not a header parameter
    assert schema["components"]["securitySchemes"]["HTTPBearer"]["scheme"] == "bearer"
    assert post["security"] == [{"HTTPBearer": []}]
    assert "authorization" not in {p["name"].lower() for p in post.get("parameters", [])}
    for path, verb in (
        ("/v1/queues/{queue}/items", "post"),
        ("/v1/queues/{queue}", "get"),
        ("/v1/queues/{queue}/items/{item_key}", "get"),
    ):  # a queue other than the config's is a 404: a generated client knows it
        assert "does not serve" in schema["paths"][path][verb]["responses"]["404"]["description"]


def test_an_output_that_cannot_be_read_fails_its_own_polls_only_without_server_paths(
    config_path: Path, tmp_path: Path
) -> None:
    """A done item whose file is gone answers 503, saying nothing of the server's files (the
    API's log has them); another tenant's long poll, waiting at the same time, is answered
    by its own item, not by that failure."""
    rows = workloads.w1_inputs(1)
    clients = make_client(config_path)
    client = next(clients)
    scorer = score_once_enqueued(config_path, 1)
    assert client.post(ITEMS, json=item("gone", payload={"x": rows[0].tolist()}), headers=A)
    scorer.join(60)
    (file,) = (tmp_path / "outputs").rglob("*.parquet")
    file.unlink()
    assert client.post(ITEMS, json=item("theirs"), headers=B).status_code == 201
    polls: dict[str, Any] = {}

    def poll(key: str, headers: dict[str, str], wait_s: float) -> None:
        polls[key] = client.get(f"{ITEMS}/{key}?wait_s={wait_s}", headers=headers)

    theirs = threading.Thread(target=poll, args=("theirs", B, 1.0))
    theirs.start()
    poll("gone", A, 0.5)
    theirs.join()
    next(clients, None)  # the client and its engine closed
    message = assert_error(polls["gone"], 503, "SinkError")
    assert str(tmp_path) not in message
    assert ".parquet" not in message
    assert (polls["theirs"].status_code, polls["theirs"].json()["state"]) == (200, "ready")


def test_readyz_is_503_once_the_sqlite_file_is_gone(tmp_path: Path, sqlite_url: str) -> None:
    """A pooled connection still reads a file deleted under it; ready must not say so."""
    for c in make_client(write_config(tmp_path, sqlite_url)):
        assert c.get("/readyz").json() == {"ok": True}
        for name in ("queue.db", "queue.db-wal", "queue.db-shm"):
            (tmp_path / name).unlink(missing_ok=True)
        message = assert_error(c.get("/readyz"), 503, "QueueError")
        # the server's file is named in its log, not to a client (nor its database's host)
        assert message == "the queue database is unavailable now (the API's log says why)"
        # and an enqueue is not acknowledged: it went to the unlinked file, lost with the
        # process; the client retries (idempotent on item_key) once the file is back
        lost = c.post(ITEMS, json=item("unlinked"), headers=A)
        assert assert_error(lost, 503, "QueueError") == message


def test_a_restored_sqlite_file_is_the_one_written_after_it(
    tmp_path: Path, sqlite_url: str
) -> None:
    """A backup restored over the file under a running API (as the 503 above asks): the
    API's pooled connections kept the replaced file, a POST answered 201 went into it and
    was lost, and a GET answered from the gone file's rows (found by a review)."""
    import sqlite3

    db = tmp_path / "queue.db"
    for c in make_client(write_config(tmp_path, sqlite_url)):
        assert c.post(ITEMS, json=item("before"), headers=A).status_code == 201
        with sqlite3.connect(db) as src, sqlite3.connect(tmp_path / "backup.db") as dst:
            src.backup(dst)
        assert c.post(ITEMS, json=item("after-backup"), headers=A).status_code == 201
        for name in ("queue.db", "queue.db-wal", "queue.db-shm"):
            (tmp_path / name).unlink(missing_ok=True)
        assert_error(c.get(f"{ITEMS}/before", headers=A), 503, "QueueError")  # not the old rows
        assert_error(c.get(ITEMS.rsplit("/", 1)[0], headers=A), 503, "QueueError")  # its counts
        (tmp_path / "backup.db").rename(db)  # the restore
        assert c.get("/readyz").json() == {"ok": True}
        assert c.post(ITEMS, json=item("restored"), headers=A).status_code == 201
        assert c.get(f"{ITEMS}/after-backup", headers=A).status_code == 404  # not in the backup
        with sqlite3.connect(db) as conn:
            keys = {k for (k,) in conn.execute("SELECT item_key FROM batching_items")}
        assert keys == {"before", "restored"}


def test_a_key_with_a_slash_reads_back(client: TestClient) -> None:
    assert client.post(ITEMS, json=item("tenant/a/b"), headers=A).status_code == 201
    got = client.get(f"{ITEMS}/tenant%2Fa%2Fb?wait_s=0", headers=A)
    assert (got.status_code, got.json()["item_key"]) == (200, "tenant/a/b")
    assert client.get(f"{ITEMS}/tenant/a/b", headers=A).json()["item_key"] == "tenant/a/b"


def test_readyz_is_503_when_the_schema_is_not_current(config_path: Path) -> None:
    for c in make_client(config_path):
        engine = c.app.state.settings.results.engine  # type: ignore[attr-defined]
        with engine.begin() as conn:
            conn.exec_driver_sql("DELETE FROM batching_schema_version")
        message = assert_error(c.get("/readyz"), 503, "SchemaError")
        assert message == (
            "the queue database's schema is not this API's version (the API's log says why)"
        )


# -- bad input, property-based ------------------------------------------------------------------

JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: (
        st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4)
    ),
    max_leaves=12,
)
FIELD = st.sampled_from(
    ["item_key", "payload", "tenant", "priority", "deadline", "cost", "lane", "tensor", "items"]
)
ITEMISH = st.dictionaries(
    FIELD,
    JSON | st.just({"tensor": {"dtype": "int8", "shape": [1], "data_b64": "AA=="}}),
    max_size=6,
)
BODIES = (
    JSON.map(lambda v: json.dumps(v).encode())
    | ITEMISH.map(lambda v: json.dumps(v).encode())
    | st.lists(ITEMISH, max_size=3).map(lambda v: json.dumps({"items": v}).encode())
    | st.binary(max_size=64)
)


# A path segment "." or ".." is resolved away by the client, and a "/" splits the segment:
# those name other routes (a 405), not a bad queue; a key may hold "/".
SEGMENT = st.text(min_size=1, max_size=12).filter(lambda s: s not in {".", ".."} and "/" not in s)
KEY = st.text(min_size=1, max_size=12).filter(lambda s: s not in {".", ".."})  # "/" is a key's


@settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(body=BODIES, queue=SEGMENT, key=KEY)
def test_no_body_or_path_gets_a_500_and_every_error_is_one_json_line(
    client: TestClient, body: bytes, queue: str, key: str
) -> None:
    from urllib.parse import quote

    q = quote(queue, safe="")
    r = client.post(f"/v1/queues/{q}/items", content=body, headers=A)
    assert r.status_code in {200, 201, 400, 403, 404, 409, 422}, r.text
    if r.status_code >= 400:
        assert_error(r, r.status_code)
    g = client.get(f"/v1/queues/{q}/items/{quote(key, safe='')}?wait_s=0", headers=A)
    assert g.status_code in {200, 404, 422}, g.text
    if g.status_code >= 400:
        assert_error(g, g.status_code)


def test_large_bodies_are_read_one_at_a_time(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 16 MiB body of tiny JSON values peaks at ~1 GB as objects; six at once took 2.5 GB
    and held another tenant's GET for 17.6 s (a security review)."""
    real = api_app._records
    inside, most, lock = [0], [0], threading.Lock()

    def slow(settings_: Any, tenant: str, body: Any) -> Any:
        if len(body.get("items", ())) > 1:  # the large ones
            with lock:
                inside[0] += 1
                most[0] = max(most[0], inside[0])
            time.sleep(0.3)
            with lock:
                inside[0] -= 1
        return real(settings_, tenant, body)

    monkeypatch.setattr(api_app, "_records", slow)
    monkeypatch.setattr(api_app, "LARGE_BYTES", 80 * 1024)
    large = [json.dumps({"items": [item(f"big{i}-{k}") for k in range(250)]}) for i in range(4)]
    assert min(map(len, large)) > api_app.LARGE_BYTES
    answers: list[int] = []

    def post(body: str) -> None:
        headers = {**A, "content-type": "application/json"}
        answers.append(client.post(ITEMS, content=body, headers=headers).status_code)

    threads = [threading.Thread(target=post, args=(body,)) for body in large]
    for t in threads:
        t.start()
    small = client.post(ITEMS, json=item("small"), headers=B)  # read inline, not behind them
    for t in threads:
        t.join()
    assert answers == [201] * 4
    assert most[0] == 1
    assert small.status_code == 201
