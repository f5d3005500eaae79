"""GPU slots: one scorer per GPU, whichever deployment starts it.

A *slot* is a Prefect global concurrency limit of 1 named for one GPU of one host (say
``gpu-a100-host1-0``), created once by the operator::

    prefect gcl create gpu-host1-0 --limit 1

A score or bulk flow run given ``gpu_slot`` holds that limit while it scores (not while it
checks preconditions or reports), so an online deployment and the nightly bulk one that name
the same slot take turns on the GPU instead of sharing it by accident; the run waits for the
slot (``gpu_slot_wait_s``, else without end) and says so in its log. The slot's GPU is the
deployment's ``CUDA_VISIBLE_DEVICES`` job variable (``deployments/prefect-gpu.yaml``):
Prefect cannot tell which device a name stands for, so the two go side by side in the
deployment. The hold is a lease Prefect renews while the run lives: a worker killed with its
run frees the slot when the lease runs out (five minutes).

A slot that was never created fails the run at once with the command that creates it: a
missing limit would otherwise let every run through (Prefect's non-strict default).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

from batching import errors

logger = logging.getLogger("batching.flows.slots")

LEASE_S = 300.0  # a dead holder's slot comes back after this long


def require_one_scorer(name: str | None, workers: int) -> None:
    """A GPU slot is one GPU, for one scorer process: ``workers`` > 1 under a slot put two
    scorers on one GPU without a word (found by a walk-through).

    Raises:
        ConfigError: a slot and more than one worker.
    """
    if name is not None and workers > 1:
        raise errors.ConfigError(
            f"workers {workers} with gpu_slot {name!r}: a GPU slot is one GPU, for one scorer "
            "process; give each GPU its own slot and deployment (workers: 1)"
        )


@contextlib.contextmanager
def gpu_slot(name: str | None, wait_s: float | None = None) -> Iterator[None]:
    """Hold the Prefect global concurrency limit ``name`` (one slot) for the block; nothing
    when ``name`` is None.

    Raises:
        ConfigError: ``name`` is empty or no global concurrency limit, ``wait_s`` is not
            above 0, or the slot stayed taken for ``wait_s`` seconds.
    """
    if name is None:
        yield
        return
    if not name.strip():  # Prefect answered an empty name with a raw 405
        raise errors.ConfigError(
            "gpu_slot is empty; name a Prefect global concurrency limit, or leave it unset"
        )
    if wait_s is not None and not wait_s > 0:  # 0 timed out even with the slot free
        raise errors.ConfigError(f"gpu_slot_wait_s must be > 0 (or none), got {wait_s!r}")
    from prefect.concurrency._asyncio import ConcurrencySlotAcquisitionError
    from prefect.concurrency.sync import concurrency

    require_slot(name)
    if not os.environ.get("CUDA_VISIBLE_DEVICES"):
        logger.warning(
            "gpu_slot is set but CUDA_VISIBLE_DEVICES is not: the slot does not choose a device",
            extra={"action": "gpu_slot_without_device", "gpu_slot": name},
        )
    logger.info("taking GPU slot %s", name, extra={"action": "gpu_slot_wait", "gpu_slot": name})
    with contextlib.ExitStack() as held:
        try:
            held.enter_context(
                concurrency(
                    name, occupy=1, timeout_seconds=wait_s, lease_duration=LEASE_S, strict=True
                )
            )
        except TimeoutError:
            raise errors.ConfigError(
                f"gpu_slot {name!r} stayed taken for {wait_s:g} s (gpu_slot_wait_s): another"
                f" run holds it (`prefect gcl inspect {name}`: active_slots); a holder that was"
                f" killed frees it when its lease runs out, {LEASE_S / 60:g} min after its last"
                " renewal"
            ) from None
        except ConcurrencySlotAcquisitionError:
            require_slot(name)  # deleted since the check: say so, with the fix
            raise
        logger.info(
            "holding GPU slot %s", name, extra={"action": "gpu_slot_held", "gpu_slot": name}
        )
        _warn_without_cuda(name)
        held.callback(
            logger.info,
            "GPU slot %s released",
            name,
            extra={"action": "gpu_slot_released", "gpu_slot": name},
        )
        yield


def require_slot(name: str) -> None:
    """Raise ``ConfigError`` naming the fix unless the limit ``name`` exists with limit 1."""
    from prefect.client.orchestration import get_client
    from prefect.exceptions import ObjectNotFound

    with get_client(sync_client=True) as client:
        try:
            limit = client.read_global_concurrency_limit_by_name(name)
        except ObjectNotFound:
            raise errors.ConfigError(_missing(name)) from None
    if limit.limit != 1:
        raise errors.ConfigError(
            f"gpu_slot {name!r} allows {limit.limit} runs at once; a GPU slot holds one:"
            f" `prefect gcl update {name} --limit 1`"
        )
    if not limit.active:
        raise errors.ConfigError(
            f"gpu_slot {name!r} is inactive, so it would not hold anyone back:"
            f" `prefect gcl update {name} --enable`"
        )


def _missing(name: str) -> str:
    return (
        f"gpu_slot {name!r} is not a Prefect global concurrency limit;"
        f" create it once: `prefect gcl create {name} --limit 1`"
    )


def _warn_without_cuda(name: str) -> None:
    """A slot held on a host where torch sees no CUDA device: a model with ``device: auto``
    scores on the CPU, and nothing said so (found by a review)."""
    import torch

    if not torch.cuda.is_available():
        logger.warning(
            "holding GPU slot %s but no CUDA device visible (CUDA_VISIBLE_DEVICES=%s): a model "
            "with device auto scores on the CPU; device cuda makes the run fail instead",
            name,
            os.environ.get("CUDA_VISIBLE_DEVICES", ""),
            extra={"action": "gpu_slot_without_cuda", "gpu_slot": name},
        )
