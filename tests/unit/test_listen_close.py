"""A LISTEN connection that fails after it connects is closed at once, not left for the
collector: psycopg warns (ResourceWarning) when it collects an open connection, and the
warning fails whichever test then runs (a one-time CI failure, a PostgreSQL restart caught
between the connect and the LISTEN)."""

from __future__ import annotations

from typing import Any

import psycopg
import pytest
import sqlalchemy as sa

from batching.ingress import queue as q
from batching.ingress import watch


class _Refusing:
    """A psycopg connection whose LISTEN fails: the server went away just after it."""

    def __init__(self) -> None:
        self.closed = False

    def execute(self, sql: str) -> None:
        raise psycopg.OperationalError("the connection is lost")

    def close(self) -> None:
        self.closed = True


@pytest.fixture
def refusing(monkeypatch: pytest.MonkeyPatch) -> list[_Refusing]:
    made: list[_Refusing] = []

    def connect(*_args: Any, **_kwargs: Any) -> _Refusing:
        made.append(_Refusing())
        return made[-1]

    monkeypatch.setattr(psycopg, "connect", connect)
    return made


def _engine() -> sa.Engine:
    return sa.create_engine("postgresql+psycopg://u@127.0.0.1:1/none")


def test_the_commit_watch_closes_a_listener_whose_listen_failed(refusing: list[_Refusing]) -> None:
    with pytest.raises(psycopg.OperationalError):
        watch.CommitWatch(_engine(), "q")._listen()
    assert [c.closed for c in refusing] == [True]


def test_the_scorers_waiter_closes_a_listener_whose_listen_failed(
    refusing: list[_Refusing],
) -> None:
    waiter = q.Waiter(_engine(), "q")
    assert waiter.wait(0.01) is False  # polls instead, and listens again next time
    assert [c.closed for c in refusing] == [True]
