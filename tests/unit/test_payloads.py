"""The payload decoder refuses what is not a number (or a token id), naming the field and value.

numpy would read ``null`` as NaN, ``true`` as 1, ``"1.5"`` as 1.5 and 1e39 as an infinite
float32: the model then made a non-finite output, and the item was retried as if the forward
pass had failed. Refused at decode, the item is dead at once and its batch-mates score.
"""

from __future__ import annotations

import re
from typing import Any

import orjson
import pytest

from batching import errors, models
from batching.model import payloads


def item(i: int, doc: Any) -> models.WorkItem:
    return models.WorkItem(
        id=i, item_key=f"k{i}", payload=models.Payload(orjson.dumps(doc)), enqueued_at=0.0
    )


@pytest.mark.parametrize(
    ("x", "reason"),
    [
        ([1.0, None, 3.0], '"x"[1] is null, not a number'),
        ([1.0, 2.0, True], '"x"[2] is true, not a number'),
        (["1.5", 2.0, 3.0], '"x"[0] is the string "1.5", not a number'),
        ([1.0, [2.0], 3.0], '"x"[1] is a list, not a number'),
        ([1.0, {"v": 2}, 3.0], '"x"[1] is a JSON object, not a number'),
        ([1.0, 2.0, 1e39], '"x"[2] = 1e+39 is beyond float32'),
        ([-3.5e38, 2.0, 3.0], '"x"[0] = -3.5e+38 is beyond float32'),
    ],
)
def test_a_value_that_is_not_a_float32_number_fails_its_item_alone(
    x: list[Any], reason: str
) -> None:
    blocks, failures = payloads.dense_rows([item(1, {"x": [0.5, 0.5, 0.5]}), item(2, {"x": x})], 3)
    assert list(failures) == [2]
    assert failures[2].startswith(reason), failures[2]
    assert [positions for positions, _ in blocks] == [[0]]


def test_the_largest_float32_and_integers_are_numbers() -> None:
    blocks, failures = payloads.dense_rows([item(1, {"x": [3.4028234e38, -7, 0]})], 3)
    assert failures == {}
    assert blocks[0][1].tolist() == [[pytest.approx(3.4028234e38), -7.0, 0.0]]


@pytest.mark.parametrize(
    ("tokens", "reason"),
    [
        ([5, True, 7], '"tokens"[1] is true, not an integer'),
        ([5, 6.0], '"tokens"[1] is 6.0, not an integer'),
        ([5, "6"], '"tokens"[1] is the string "6", not an integer'),
        ([5, None], '"tokens"[1] is null, not an integer'),
        ([[5, 6]], '"tokens"[0] is a list, not an integer'),
        ([], '"tokens" must be a non-empty list of integers'),
        ("5 6", '"tokens" must be a non-empty list of integers, got str'),
        ([5, 2**64 - 1], '"tokens"[1] = 18446744073709551615 is out of range'),
    ],
)
def test_a_token_that_is_not_an_integer_is_refused(tokens: Any, reason: str) -> None:
    seq, got = payloads.token_seq(models.Payload(orjson.dumps({"tokens": tokens})))
    assert seq is None
    assert got is not None
    assert got.startswith(reason), got


@pytest.mark.parametrize(
    ("tokens", "reason"),
    [([5, -1], "got min -1 max 5"), ([5, 0], "got min 0 max 5"), ([5, 100], "got min 5 max 100")],
)
def test_negative_padding_and_out_of_vocabulary_ids_are_refused(
    tokens: list[int], reason: str
) -> None:
    seq, got = payloads.token_seq(models.Payload(orjson.dumps({"tokens": tokens})))
    assert got is None
    assert seq is not None
    message = payloads.token_range_error(seq, vocab_size=100)
    assert message is not None
    assert reason in message
    assert "[1, 100)" in message


@pytest.mark.parametrize(
    ("field", "value", "says"),
    [
        ("priority", True, "priority must be an integer, got true"),
        ("priority", "high", 'priority must be an integer, got "high"'),
        ("deadline", [1], "ISO 8601 (2026-01-31T12:00:00Z), got [1]"),
    ],
)
def test_a_bad_field_is_shown_as_json_spells_it(field: str, value: object, says: str) -> None:
    from batching.ingress import ingest

    with pytest.raises(errors.InputError, match=re.escape(says)):
        ingest.record_from_mapping({"item_key": "k", "payload": {}, field: value}, "items[0]")


def test_a_null_payload_is_named_null() -> None:
    """A null row of an in-place dataset's list column read 'payload must be a JSON object
    with "x", got NoneType' (a review)."""
    _, failures = payloads.dense_rows([item(1, None)], 3)
    assert failures[1] == 'payload is null: give it a value ({"x": ...}, or a list)'


def test_an_object_store_error_is_one_plain_line() -> None:
    from batching.outputs import delta

    raw = "Generic S3 error: Error after 10 retries\n\x1b[31m↳\x1b[0m Connection refused"
    with pytest.raises(errors.SinkError) as caught, delta._translated("cannot open the table"):
        raise OSError(raw)
    assert str(caught.value) == (
        "cannot open the table: Generic S3 error: Error after 10 retries Connection refused"
    )
