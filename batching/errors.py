"""The exception tree. Each leaf's docstring is its default message.

BatchingError
├── ConfigError            bad configuration (file, field, URL, identifier)
├── InputError             bad input record or file (enqueue)
├── SchemaError            database schema missing, too old or too new
├── QueueError             the queue database failed (connection, statement)
│   ├── Disconnected       its connection was lost; a new one may succeed
│   └── QueueFull          an enqueue would pass the queue's depth cap (backpressure)
├── LeaseLost              a write needed a lease that is no longer held
├── CheckpointError        a checkpoint is missing, has the wrong checksum or is unsafe
├── ModelError             the model broke its contract (output count, shape)
├── RetryStorm             batch after batch failed in the model: the run stopped (breaker)
├── SinkError              an output could not be written or committed
└── PolicyError            a config breaks the latency objective or the device budget
"""

from __future__ import annotations

import re
from typing import Literal


class BatchingError(Exception):
    """A batching operation failed."""

    def __init__(self, message: str | None = None) -> None:
        super().__init__(message or (self.__doc__ or "").strip())


class ConfigError(BatchingError):
    """The configuration is invalid."""


class InputError(BatchingError):
    """An input record is invalid."""


class KeyTaken(InputError):
    """An item key another tenant holds in the queue (the HTTP ingress answers 409)."""

    def __init__(self, key: str, queue: str) -> None:
        super().__init__(f"item_key {key!r} is taken in queue {queue!r}; use another key")
        self.key = key


class SchemaError(BatchingError):
    """The database schema is not at the expected version; run `batching init`."""


class QueueError(BatchingError):
    """The queue database failed."""

    disconnect: bool = False
    """The connection was lost (a server restart, ``pg_terminate_backend``, a failover): a
    new connection may succeed where this one failed."""


class Disconnected(QueueError):
    """The connection to the queue database was lost, or the server refused a new one (down,
    restarting, failing over): a later try may get through, unlike a refused login."""

    disconnect = True


class QueueFull(QueueError):
    """The queue is at its depth cap; retry later or raise the cap (`batching queue cap`)."""

    def __init__(
        self,
        message: str | None = None,
        *,
        reason: Literal["depth_cap", "tenant_share"] = "depth_cap",
        room: int | None = None,
    ) -> None:
        """``reason``: ``"depth_cap"`` (the queue is full) or ``"tenant_share"`` (the tenant
        holds its share of the cap while others wait). ``room``: new items the cap had room
        for when it refused (0 or less: none at all; None: not known)."""
        super().__init__(message)
        self.reason = reason
        self.room = room


class LeaseLost(BatchingError):
    """The lease is no longer held; the batch's results are discarded."""


class CheckpointError(BatchingError):
    """The model checkpoint cannot be trusted."""


class ModelError(BatchingError):
    """The model broke its contract."""


class RetryStorm(BatchingError):
    """Batch after batch failed in the model with no single poison item found: the run
    stopped, released its items without using an attempt and paused the queue."""


class ForwardHung(BatchingError):
    """A forward pass ran past `queue.forward_timeout_s`: the run stopped and left its batch to
    the crash rule; restart the scorer (a hung pass cannot be cancelled in its process)."""


class SinkError(BatchingError):
    """The output could not be committed."""


class PolicyError(BatchingError):
    """The batching policy breaks the latency objective or the device budget."""


class Busy(BatchingError):
    """Refused for now, nothing changed: what it must not run beside is still running (live
    scorers during an upgrade); the message says what to stop, or how long to wait."""


class NothingSucceeded(BatchingError):
    """A scoring run failed items and committed none (each dead with its reason, or retried
    later): a run to look at, not a green one; the message says where the reasons are."""


class Incomplete(BatchingError):
    """A bulk run over a dataset ended with rows still without output (dead, leased,
    waiting out a backoff): the dataset is not scored whole; the message says why and what
    to do."""


# Bad input rather than a failure: the CLI exits 2 for these, 1 for every other BatchingError.
USAGE_ERRORS: tuple[type[BatchingError], ...] = (
    ConfigError,
    InputError,
    CheckpointError,
    PolicyError,
    SchemaError,  # a database not (yet) at this version: like a missing file, run init
    QueueFull,  # refused, not failed: nothing was enqueued; retry later or raise the cap
    Busy,  # refused, not failed: nothing was changed; stop what runs, or wait
)


def one_line(exc: BaseException, limit: int = 300) -> str:
    """``Type: message`` on one line (whitespace collapsed), cut to ``limit`` characters."""
    text = f"{type(exc).__name__}: {' '.join(str(exc).split())}"
    return text if len(text) <= limit else text[: limit - 3] + "..."


_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# A Rust backtrace frame as RUST_BACKTRACE=1 appends it to delta-rs's messages: "  12: name"
# and its "at file:line" continuation.
_FRAME = re.compile(r"^\s+(\d+: |at \S)")


def native_text(exc: BaseException) -> str:
    """A native library's message (delta-rs, object-store, Arrow) as one plain line: without
    the Rust backtrace ``RUST_BACKTRACE`` adds (18 lines on a message that was one), terminal
    colours, or object-store's "↳" arrows between its causes."""
    lines = [line for line in str(exc).splitlines() if not _FRAME.match(line)]
    return " ".join(_ANSI.sub("", " ".join(lines)).replace("↳", "").split())
