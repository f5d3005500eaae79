"""Which database failures a reconnecting verb tries again (``database.translate_errors``): a
server restarting (refused, starting up, shutting down) may answer the next try; a refused
login fails at once, with its fix. The drills (tests/drills/) run both against a real server."""

from __future__ import annotations

import pytest
from sqlalchemy import exc

from batching import errors
from batching.store import database

URL = "postgresql://scorer:s3cret@127.0.0.1:5432/queue"


def _raised(reason: str) -> errors.QueueError:
    with pytest.raises(errors.QueueError) as info, database.translate_errors(URL):
        raise exc.OperationalError("SELECT 1", None, Exception(reason))
    return info.value


@pytest.mark.parametrize(
    "reason",
    [
        'connection to server at "127.0.0.1", port 5432 failed: Connection refused',
        "FATAL:  the database system is starting up",
        "FATAL:  the database system is shutting down",
        "server closed the connection unexpectedly",
        # a chaos review: each ended a run that a retry would have carried through
        "FATAL:  the database system is not yet accepting connections",
        "FATAL:  terminating connection due to administrator command",
    ],
)
def test_a_restarting_server_is_a_lost_connection(reason: str) -> None:
    error = _raised(reason)
    assert isinstance(error, errors.Disconnected)
    assert "s3cret" not in str(error)


@pytest.mark.parametrize(
    "reason",
    [
        'FATAL:  role "scorer" is not permitted to log in',
        'FATAL:  password authentication failed for user "scorer"',
        'FATAL:  database "queue" does not exist',
    ],
)
def test_a_refused_login_is_not_retried(reason: str) -> None:
    assert not isinstance(_raised(reason), errors.Disconnected)


def test_each_keeps_its_hint() -> None:
    assert "is the server running?" in str(_raised("failed: Connection refused"))
    assert "ALTER ROLE NAME LOGIN" in str(_raised('role "s" is not permitted to log in'))
