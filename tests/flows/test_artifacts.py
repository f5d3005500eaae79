"""The progress artifact against the real Prefect test server."""

from __future__ import annotations

import threading
from typing import Any

import pytest
from prefect import flow
from prefect.client.orchestration import SyncPrefectClient

from batching.compose import build
from flows import artifacts


def test_a_slow_api_never_holds_the_caller_and_the_latest_share_is_sent(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The commit thread calls ``counts``: with the API slow (the client retrying for
    minutes), it waited on every update."""
    release = threading.Event()
    sent: list[float] = []
    update = SyncPrefectClient.update_artifact

    def slow(self: SyncPrefectClient, artifact_id: Any, artifact: Any) -> None:
        release.wait(30)
        sent.append(artifact.data)
        update(self, artifact_id, artifact)

    monkeypatch.setattr(SyncPrefectClient, "update_artifact", slow)

    @flow
    def scoring() -> None:
        with artifacts.Progress("slow-api", 100, interval_s=0) as progress:
            for done in range(1, 51):
                progress.counts(done, 0, done)  # returns while the first update hangs
            assert sent == []
            release.set()

    scoring()
    assert sent[-1] == 50.0  # the final share; the stale ones in between were skipped
    assert len(sent) < 50


def test_a_backlog_check_that_cannot_read_the_queue_does_not_fail_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """It runs after scoring: a database hiccup there failed a run that had scored."""
    from batching import errors
    from flows import score, settings

    cfg = settings.load(settings.ONLINE).model_copy(update={"backlog_alert_depth": 1})

    def down(*_args: Any) -> Any:
        raise errors.QueueError("database postgresql://u:***@db/x failed: connection refused")

    monkeypatch.setattr(build, "open_queue", down)

    @flow
    def after_scoring() -> Any:
        return score.check_backlog(cfg, None)

    assert after_scoring() is None


def test_a_paused_queue_s_backlog_starts_no_run(sqlite_url: str) -> None:
    """A backlog event starts another score run; on a paused queue it would claim nothing and
    report the same backlog again, run after run."""
    from batching import models
    from batching.ingress import controls
    from flows import score, settings

    db_url = sqlite_url
    cfg = settings.load(settings.ONLINE).model_copy(update={"backlog_alert_depth": 1})
    queue = build.open_queue(cfg, db_url)
    queue.enqueue(
        [
            models.EnqueueRecord(item_key=f"k{i}", payload=models.Payload(b'{"tokens": [1]}'))
            for i in range(3)
        ]
    )

    @flow
    def after_scoring() -> Any:
        return score.check_backlog(cfg, db_url)

    assert after_scoring() is not None  # over its depth: the event would be sent
    controls.pause(queue.engine, cfg.queue.name, actor="test", reason="incident", now=1.0)
    assert after_scoring() is None
    queue.engine.dispose()
