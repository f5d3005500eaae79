"""`batching ARGS` whose process dies whenever the model is handed one chosen item:

    python die_on.py KEY HOW -- ARGS

HOW ``exit``: ``os._exit(3)`` in the model, as a native library that gives up would; ``segv``:
a real segmentation fault (a read of address 0), the kernel's doing; ``kill``: SIGKILL, as an
OOM kill takes a process. None of them runs a ``finally``: the lease is simply left to expire.
The death comes in ``decode``, when the batch holding KEY is on its way to the forward pass.
HOW ``hang``: the process lives, but the forward pass of a batch holding KEY (or the row
``x0=V``) never returns, waiting in native code as a stuck kernel would (the model's own
probe input, which holds neither, still scores).
KEY ``x0=V``: the batch holding a dense row whose first value is V (rows scored in place
have no key of their own).
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import Any


def die(how: str) -> None:
    if how == "exit":
        os._exit(3)
    if how == "segv":
        ctypes.string_at(0)
    os.kill(os.getpid(), signal.SIGKILL)


def hang_on(key: str) -> None:
    """The forward pass of any batch holding item ``key`` loops forever (a model caught in
    its own loop by one input); the ids are marked at decode, where keys are known."""
    from batching import models
    from batching.model import runner

    decode, forward = runner.TorchRunner.decode, runner.TorchRunner.forward
    marked: set[int] = set()

    def marking_decode(self: runner.TorchRunner, items: Sequence[Any]) -> Any:
        keys = models.item_column(items, "item_key")
        marked.update(
            i for i, k in zip(models.item_column(items, "id"), keys, strict=True) if k == key
        )
        return decode(self, items)

    def hanging_forward(self: runner.TorchRunner, decoded: Any) -> Any:
        if key.startswith("x0="):  # a dense row whose first value is this (rows in place)
            hangs = bool((decoded.inputs[:, 0] == float(key[3:])).any())
        else:
            hangs = bool(marked.intersection(decoded.ids))
        if hangs:  # in native code (a lock never released), where no interrupt lands
            threading.Event().wait()
        return forward(self, decoded)

    runner.TorchRunner.decode = marking_decode  # type: ignore[method-assign]
    runner.TorchRunner.forward = hanging_forward  # type: ignore[method-assign]


def main() -> None:
    sep = sys.argv.index("--")
    key, how = sys.argv[1:sep]
    from batching import models
    from batching.model import runner

    decode = runner.TorchRunner.decode

    def dying_decode(self: runner.TorchRunner, items: Sequence[Any]) -> Any:
        if key.startswith("x0="):  # a dense row whose first value is this (rows in place)
            decoded = decode(self, items)
            if bool((decoded.inputs[:, 0] == float(key[3:])).any()):
                die(how)
            return decoded
        if key in models.item_column(items, "item_key"):
            die(how)
        return decode(self, items)

    if how == "hang":
        hang_on(key)
    else:
        runner.TorchRunner.decode = dying_decode  # type: ignore[method-assign]
    from batching.cli import main as batching

    sys.argv = ["batching", *sys.argv[sep + 1 :]]
    batching()


if __name__ == "__main__":
    main()
