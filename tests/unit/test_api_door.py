"""The API's door (``batching.api.door``): a queue refused unread only while it has no room."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from batching import errors
from batching.api.door import Door, items_in
from batching.ingress import admission


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def full(room: int = 0) -> errors.QueueFull:
    return admission.queue_full("q", 10 - room, 1, 10)


def test_a_queue_with_no_room_is_refused_until_its_mark_moves() -> None:
    mark, clock = [7], Clock()
    door = Door(lambda: mark[0], hold_s=1.0, clock=clock)
    assert door.refusal("q", "a") is None
    door.close("q", "a", full(), door.mark())
    refused = door.refusal("q", "a")
    assert isinstance(refused, errors.QueueFull)
    assert "queue 'q' is at its depth cap" in str(refused)
    assert "+" not in str(refused)  # no counts of the POST that met the cap: not this one's
    assert refused.room == 0
    assert door.refusal("q", "a") is not refused  # each answer its own exception
    assert door.refusal("other", "a") is None  # only the queue found full
    assert door.refusal("q", "b") is not None  # whoever posts to it
    mark[0] = 8  # a batch committed: room, maybe
    assert door.refusal("q", "a") is None
    assert door.refusal("q", "a") is None  # open until the writer finds it full again
    assert door.refused == 3


@pytest.mark.parametrize("mark", [lambda: 1, None], ids=["mark never moves", "no mark"])
def test_the_hold_alone_reopens_a_queue_whose_mark_does_not_move(
    mark: Callable[[], object] | None,
) -> None:
    clock = Clock()
    door = Door(mark, hold_s=0.25, clock=clock)
    door.close("q", "a", full(), door.mark())
    clock.now += 0.2
    assert door.refusal("q", "a") is not None
    clock.now += 0.05
    assert door.refusal("q", "a") is None


def test_a_tenant_with_no_room_in_its_share_is_refused_alone() -> None:
    mark = [1]
    door = Door(lambda: mark[0], clock=Clock())
    with pytest.raises(errors.QueueFull) as refused_at:
        admission.over_share("q", 10, {"a": 5, "b": 1}, {"a": 1}, {}, depth=6)
    admission_refusal = refused_at.value
    assert admission_refusal.room == 0  # 5 of a share of 5
    door.close("q", "a", admission_refusal, door.mark())
    refused = door.refusal("q", "a")
    assert refused is not None
    assert refused.reason == "tenant_share"
    assert door.refusal("q", "b") is None  # the other tenant still has room
    mark[0] = 2
    assert door.refusal("q", "a") is None


@pytest.mark.parametrize(
    "refusal",
    [
        full(room=1),  # room for one: a smaller POST may fit
        errors.QueueFull("tenant 'a' is at its share", reason="tenant_share", room=2),
        errors.QueueFull("full"),  # room unknown
    ],
)
def test_only_a_queue_without_room_for_one_item_is_shut(refusal: errors.QueueFull) -> None:
    door = Door(lambda: 1)
    door.close("q", "a", refusal, door.mark())
    assert door.refusal("q", "a") is None


def test_a_mark_that_fails_opens_the_door() -> None:
    def broken() -> object:
        raise OSError("database gone")

    door = Door(broken, clock=Clock())
    door.close("q", "a", full(), door.mark())
    assert door.refusal("q", "a") is None  # the writer looks (and answers what is wrong)


def test_a_commit_while_the_writer_looked_opens_the_door_at_once() -> None:
    mark = [1]
    door = Door(lambda: mark[0], clock=Clock())
    sent = door.mark()  # the request goes to the writer ...
    mark[0] = 2  # ... a batch commits while it counts ...
    door.close("q", "a", full(), sent)  # ... and it refuses on the count made before
    assert door.refusal("q", "a") is None


def test_a_large_post_past_half_the_cap_does_not_shut_a_tenant_out_of_one_item() -> None:
    # The share rule binds past half the cap only: a POST of 10 that crosses it is refused
    # at the share, while one item, under half the cap, is admitted; the door stays open.
    with pytest.raises(errors.QueueFull) as refused_at:
        admission.over_share(
            "q", 40, {"alpha": 10, "beta": 1}, {"alpha": 10}, {"beta": 3.0}, depth=11
        )
    refusal = refused_at.value
    assert refusal.reason == "tenant_share"
    assert refusal.room is None
    door = Door(lambda: 1)
    door.close("q", "alpha", refusal, door.mark())
    assert door.refusal("q", "alpha") is None


@pytest.mark.parametrize(
    ("body", "items"),
    [
        (b'{"item_key": "a", "payload": {"x": [1]}}', 1),
        (b'{"items": [{"item_key":"a"}, {"item_key" : "b"}, {"item_key":\n"c"}]}', 3),
        (b'{"items": [{"payload": {"text": "item_key"}}]}', 1),  # a value, not a key: one at least
        (b"", 1),
    ],
)
def test_a_post_refused_unread_counts_its_items_by_their_keys(body: bytes, items: int) -> None:
    assert items_in(body) == items
