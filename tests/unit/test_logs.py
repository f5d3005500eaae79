"""The numbers of a ``batching`` record on the line a person reads (``batching.logs``): real
``LogRecord``s made by a real logger with ``extra``, through real handlers. The records keep
their constant message and their fields (structured handlers read those)."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator
from typing import Any

import pytest

from batching.logs import OneLine, WithFields, detail

COMMITTED: dict[str, Any] = {
    "action": "batch_committed",
    "sink": "parquet",
    "batch_id": "b-42",
    "n_items": 64,
    "n_replayed": 0,
    "n_bytes": 12345,
    "published": True,
    "duration_s": 0.0123456,
}


class Kept(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def kept() -> Iterator[Kept]:
    logger = logging.getLogger("batching.outputs.contract")
    handler = Kept()
    logger.addHandler(handler)
    level = logger.level
    logger.setLevel(logging.DEBUG)  # not `logger.level =`: that leaves isEnabledFor's cache stale
    try:
        yield handler
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)


def record(kept: Kept, message: str = "", **extra: object) -> logging.LogRecord:
    logging.getLogger("batching.outputs.contract").info(message or "batch committed", extra=extra)
    return kept.records[-1]


def test_the_tail_names_ids_then_counts_then_seconds(kept: Kept) -> None:
    assert detail(record(kept, **COMMITTED)) == (
        " batch_id=b-42 sink=parquet n_items=64 n_bytes=12345 n_replayed=0 published=true"
        " duration_s=0.012"
    )


def test_other_counts_follow_and_the_rest_is_left_off(kept: Kept) -> None:
    r = record(
        kept,
        "sink recovered",
        action="sink_recover",
        n_rolled_forward=2,
        n_in_flight=1,
        path="/data/out",
        payload={"x": [1, 2]},
        run_id=None,
    )
    assert detail(r) == " n_in_flight=1 n_rolled_forward=2"
    assert detail(record(kept, "no extras")) == ""


def test_the_cli_line_carries_the_numbers_and_the_cause(kept: Kept) -> None:
    line = OneLine("%(levelname)s %(name)s: %(message)s", fields=True)
    assert line.format(record(kept, **COMMITTED)) == (
        "INFO batching.outputs.contract: batch committed batch_id=b-42 sink=parquet n_items=64"
        " n_bytes=12345 n_replayed=0 published=true duration_s=0.012"
    )
    lost = record(kept, "lease lost", lease_id="L1", error="postgresql://u:pw@h/db gone")
    assert line.format(lost) == (
        "INFO batching.outputs.contract: lease lost lease_id=L1 (postgresql://u:***@h/db gone)"
    )
    # A worker's records are formatted without it (the parent's formatter adds it once).
    assert OneLine("%(message)s").format(record(kept, **COMMITTED)) == "batch committed"


def test_prefects_handler_gets_the_numbers_and_the_record_is_unchanged(kept: Kept) -> None:
    """What Prefect's ``APILogHandler`` sends is ``handler.format(record)``: its default
    formatter gave the message alone."""
    r = record(kept, **COMMITTED)
    handler = logging.StreamHandler(io.StringIO())
    assert handler.format(r) == "batch committed"  # before
    handler.setFormatter(WithFields(handler.formatter))
    assert handler.format(r) == (
        "batch committed batch_id=b-42 sink=parquet n_items=64 n_bytes=12345 n_replayed=0"
        " published=true duration_s=0.012"
    )
    assert (r.msg, r.getMessage(), r.__dict__["n_items"]) == (
        "batch committed",
        "batch committed",
        64,
    )


def test_with_fields_keeps_the_inner_format_and_leaves_other_loggers_alone() -> None:
    inner = logging.Formatter("%(levelname)s | %(message)s")
    fmt = WithFields(inner)
    mine = logging.makeLogRecord(
        {"name": "batching.x", "msg": "took %d", "args": (3,), "levelname": "INFO", "n_items": 2}
    )
    theirs = logging.makeLogRecord(
        {"name": "prefect.flow_runs", "msg": "done", "levelname": "INFO", "n_items": 2}
    )
    assert fmt.format(mine) == "INFO | took 3 n_items=2"
    assert fmt.format(theirs) == "INFO | done"


def test_a_workers_record_gets_its_cause_once(kept: Kept) -> None:
    """A worker sends its record with the cause already on its message (``ToParent``)."""
    r = record(kept, "lineage emit failed", error="boom", error_type="ConnectionError")
    r.msg, r.args = OneLine("%(message)s").format(r), None
    assert r.msg == "lineage emit failed (ConnectionError: boom)"
    r.worker = 1
    assert WithFields().format(r) == "lineage emit failed (ConnectionError: boom) worker=1"
    cli = OneLine("%(message)s", fields=True)
    assert cli.format(r) == "lineage emit failed (ConnectionError: boom) worker=1"


def test_a_json_handler_still_sees_the_constant_message_and_the_fields(kept: Kept) -> None:
    """What structured logging relies on: ``extra`` stays fields, the message stays constant."""
    r = record(kept, **COMMITTED)
    doc = json.loads(json.dumps({"message": r.getMessage(), "n_items": r.__dict__["n_items"]}))
    assert doc == {"message": "batch committed", "n_items": 64}
