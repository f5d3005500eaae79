"""The open-loop bench's connection limit: first come first served, O(1) a wait, and a
cancelled waiter neither holds nor loses a slot."""

from __future__ import annotations

import asyncio
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def _bench() -> ModuleType:
    spec = importlib.util.spec_from_file_location("online_bench", REPO / "bench/online_bench.py")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("online_bench", module)
    spec.loader.exec_module(module)
    return module


def test_slots_first_come_first_served_and_cancel_safe() -> None:
    slots_type = _bench().Slots

    async def main() -> tuple[list[int], int]:
        slots = slots_type(2)
        order: list[int] = []
        gate = asyncio.Event()

        async def user(i: int) -> None:
            async with slots:
                order.append(i)
                await gate.wait()

        tasks = [asyncio.create_task(user(i)) for i in range(6)]
        await asyncio.sleep(0)
        assert order == [0, 1]
        assert len(slots.waiters) == 4
        tasks[3].cancel()  # waiting: leaves without a slot
        await asyncio.sleep(0)
        gate.set()
        await asyncio.gather(*tasks, return_exceptions=True)
        return order, slots.free

    order, free = asyncio.run(main())
    assert order == [0, 1, 2, 4, 5]
    assert free == 2


def test_slots_handed_then_cancelled_passes_the_slot_on() -> None:
    slots_type = _bench().Slots

    async def main() -> int:
        slots = slots_type(1)
        await slots.__aenter__()
        waiter = asyncio.create_task(slots.__aenter__())
        await asyncio.sleep(0)
        await slots.__aexit__()  # handed to the waiter ...
        waiter.cancel()  # ... which is cancelled before it runs
        await asyncio.gather(waiter, return_exceptions=True)
        free: int = slots.free
        return free

    assert asyncio.run(main()) == 1
