"""The API's door (``batching.api.door``): a queue refused unread only while it has no room."""

from __future__ import annotations

import pytest

from batching import errors
from batching.api.door import Door
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
    door.close("q", "a", full())
    refused = door.refusal("q", "a")
    assert isinstance(refused, errors.QueueFull)
    assert str(refused) == str(full())
    assert refused.room == 0
    assert door.refusal("q", "a") is not refused  # each answer its own exception
    assert door.refusal("other", "a") is None  # only the queue found full
    assert door.refusal("q", "b") is not None  # whoever posts to it
    mark[0] = 8  # a batch committed: room, maybe
    assert door.refusal("q", "a") is None
    assert door.refusal("q", "a") is None  # open until the writer finds it full again
    assert door.refused == 3


def test_the_hold_reopens_a_queue_whose_mark_never_moves() -> None:
    clock = Clock()
    door = Door(lambda: 1, hold_s=0.25, clock=clock)
    door.close("q", "a", full())
    clock.now += 0.2
    assert door.refusal("q", "a") is not None
    clock.now += 0.05
    assert door.refusal("q", "a") is None


def test_a_tenant_with_no_room_in_its_share_is_refused_alone() -> None:
    mark = [1]
    door = Door(lambda: mark[0], clock=Clock())
    admission_refusal = None
    try:
        admission.over_share("q", 10, {"a": 5, "b": 1}, {"a": 1}, {})
    except errors.QueueFull as exc:
        admission_refusal = exc
    assert admission_refusal is not None
    assert admission_refusal.room == 0  # 5 of a share of 5
    door.close("q", "a", admission_refusal)
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
    door.close("q", "a", refusal)
    assert door.refusal("q", "a") is None


def test_a_mark_that_fails_opens_the_door() -> None:
    def broken() -> object:
        raise OSError("database gone")

    door = Door(broken, clock=Clock())
    door.close("q", "a", full())
    assert door.refusal("q", "a") is None  # the writer looks (and answers what is wrong)


def test_without_a_mark_the_hold_alone_reopens() -> None:
    clock = Clock()
    door = Door(None, hold_s=0.25, clock=clock)
    door.close("q", "a", full())
    assert door.refusal("q", "a") is not None
    clock.now += 0.25
    assert door.refusal("q", "a") is None
