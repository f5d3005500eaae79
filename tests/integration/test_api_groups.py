"""Group commit of POSTs (``batching.api.writer``) against real SQLite and PostgreSQL: requests
in flight together share one transaction, yet each keeps its own answer: created flags and ids
under duplicates, its own 429 at the depth cap, its own 422 and 409."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from fastapi.testclient import TestClient

from batching.api import door
from batching.ingress import controls
from tests.integration.test_api import (
    ITEMS,
    A,
    B,
    assert_error,
    item,
    make_client,
    write_config,
)

LINGER_S = 30.0
"""Long enough for every request of a test to arrive: a group ends when it is full."""


@pytest.fixture
def config_path(tmp_path: Path, db_url: str) -> Path:
    return write_config(tmp_path, db_url)


def post_together(client: TestClient, calls: list[tuple[Any, dict[str, str]]]) -> list[Any]:
    """POST each ``(body, headers)`` from its own thread, all at once; the responses in order."""
    barrier = threading.Barrier(len(calls))
    out: list[Any] = [None] * len(calls)

    def one(n: int, body: Any, headers: dict[str, str]) -> None:
        barrier.wait()
        out[n] = client.post(ITEMS, json=body, headers=headers)

    threads = [threading.Thread(target=one, args=(n, *c)) for n, c in enumerate(calls)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def grouped(config_path: Path, records: int, run: Callable[[TestClient], None]) -> None:
    """Run ``run`` on a client whose writer groups exactly ``records`` records."""
    for client in make_client(config_path, group_max_records=records, group_linger_s=LINGER_S):
        run(client)


def test_concurrent_posts_share_a_transaction_and_each_key_is_created_once(
    config_path: Path,
) -> None:
    n = 8

    for plain in make_client(config_path):
        assert plain.post(ITEMS, json=item("old"), headers=A).status_code == 201

    def run(client: TestClient) -> None:
        bodies = [{"items": [item(f"k{i}"), item("shared"), item("old")]} for i in range(n)]
        answers = post_together(client, [(b, A) for b in bodies])
        writer = client.app.state.writer  # type: ignore[attr-defined]
        assert writer.groups == 1  # the n requests in one transaction
        assert all(r.status_code == 201 for r in answers), [r.text for r in answers]
        docs = [{i["item_key"]: i for i in r.json()["items"]} for r in answers]
        assert all(d[f"k{i}"]["created"] for i, d in enumerate(docs))
        assert sum(d["shared"]["created"] for d in docs) == 1
        assert len({d["shared"]["id"] for d in docs}) == 1
        assert not any(d["old"]["created"] for d in docs)
        assert len({d["shared"]["state"] for d in docs}) == 1
        stats = client.get("/v1/queues/tabular", headers=A).json()
        assert sum(stats["by_state"].values()) == n + 2

    grouped(config_path, 3 * 8, run)


def test_many_concurrent_posts_without_lingering_each_enqueue_once(config_path: Path) -> None:
    for client in make_client(config_path):
        calls = [({"items": [item(f"k{i}"), item(f"k{i + 1}")]}, A) for i in range(0, 40, 2)]
        calls += [(item("k0"), A)] * 4  # duplicates of a key in flight together
        answers = post_together(client, calls)
        created: dict[str, int] = {}
        ids: dict[str, set[int]] = {}
        for r in answers:
            assert r.status_code in (200, 201), r.text
            for it in r.json()["items"]:
                created[it["item_key"]] = created.get(it["item_key"], 0) + it["created"]
                ids.setdefault(it["item_key"], set()).add(it["id"])
        assert created == {f"k{i}": 1 for i in range(40)}
        assert all(len(v) == 1 for v in ids.values())


def test_only_the_request_past_the_depth_cap_gets_429(config_path: Path) -> None:
    def run(client: TestClient) -> None:
        engine = client.app.state.settings.results.engine  # type: ignore[attr-defined]
        controls.set_max_depth(engine, "tabular", 2, actor="test", reason=None, now=time.time())
        big = {"items": [item(f"big{i}") for i in range(3)]}
        writer = client.app.state.writer  # type: ignore[attr-defined]
        for status in (201, 200):  # again: s1 and s2 present, big still past the cap
            # a full queue refuses POSTs unread (batching.api.door) for a while: wait it out,
            # so the writer answers the resend
            time.sleep(door.HOLD_S + 0.05)
            before = writer.groups
            answers = post_together(client, [(item("s1"), A), (big, A), (item("s2"), B)])
            assert writer.groups - before == 1  # one transaction: each request its savepoint
            assert "depth cap" in assert_error(answers[1], 429, "QueueFull")
            assert answers[1].headers["retry-after"] == "1"
            assert answers[0].status_code == answers[2].status_code == status

    grouped(config_path, 5, run)


def test_a_bad_request_fails_alone_and_a_taken_key_is_409_within_a_group(
    config_path: Path,
) -> None:
    def run(client: TestClient) -> None:
        bad = {"item_key": "bad", "payload": "not an object"}
        answers = post_together(
            client, [(item("a1"), A), (bad, A), (item("z"), A), (item("z"), B), (item("a2"), A)]
        )
        assert_error(answers[1], 422, "InputError")
        assert answers[0].status_code == answers[4].status_code == 201
        z = sorted([answers[2], answers[3]], key=lambda r: r.status_code)
        assert z[0].status_code == 201
        assert client.app.state.writer.groups == 1  # type: ignore[attr-defined]
        assert "taken" in assert_error(z[1], 409, "Conflict")

    grouped(config_path, 4, run)


def test_the_owner_of_a_key_gets_its_retry_whoever_posts_the_key_first_in_a_group(
    config_path: Path,
) -> None:
    """Another tenant's request for a key, ahead of the owner's retries in one group, is
    the one refused (409); the owner's retries answer 200 with the item it created."""

    for plain in make_client(config_path):  # alone in a group of 3, it would linger 30 s
        assert plain.post(ITEMS, json=item("owned"), headers=A).status_code == 201

    def run(client: TestClient) -> None:
        out: dict[str, Any] = {}

        def post(name: str, headers: dict[str, str]) -> None:
            out[name] = client.post(ITEMS, json=item("owned"), headers=headers)

        writer = client.app.state.writer  # type: ignore[attr-defined]
        submit, submitted = writer.submit, threading.Event()

        def submit_and_tell(*args: Any) -> Any:
            post = submit(*args)
            submitted.set()
            return post

        writer.submit = submit_and_tell
        first = threading.Thread(target=post, args=("intruder", B))
        first.start()
        assert submitted.wait(30)  # the intruder's request is first in the group
        retries = [threading.Thread(target=post, args=(f"owner{n}", A)) for n in range(2)]
        for t in retries:
            t.start()
        for t in (first, *retries):
            t.join()
        assert "taken" in assert_error(out["intruder"], 409, "Conflict")
        for name in ("owner0", "owner1"):
            assert out[name].status_code == 200, out[name].text
            assert out[name].json()["items"][0]["created"] is False

    grouped(config_path, 3, run)
