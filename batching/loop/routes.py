"""The scoring loop's side of a rollout: the queue's route as the last claim read it, each
released batch split by the version that scores it, that version's runner, and the shadow
sample of the stable batches scored by the candidate too, aside.

Every claim reads the queue's route in its own transaction (``models.Claim.route``); the
route a batch is split by is the newest one read, so a change of routing takes effect at a
scorer's next claim. A batch already split keeps its version to the commit: its output, its
ledger row and its lineage name the version that scored it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Generic

import numpy as np
import numpy.typing as npt

from batching import models, outcomes, ports
from batching.loop.stages import D
from batching.policy.batcher import batch_stats
from batching.routing import Route

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ShadowRows:
    """The shadowed items of one stable batch: each item's stable output (what was committed)
    and the candidate's output for the same input, kept aside."""

    stable: str
    candidate: str
    keys: list[str]
    stable_outputs: list[npt.NDArray[np.float32]]
    candidate_outputs: list[npt.NDArray[np.float32]]
    candidate_s: float  # the candidate's forward seconds


class Router(Generic[D]):
    """Splits batches by version, finds each version's runner, and shadows a sample.

    Args:
        runner: the run's own model (its configured version).
        runners: the runner of a version by name (a routed run's models, loaded on first
            use and pinned by sha256); None: the run scores with ``runner`` alone and
            ignores routes.
        shadow_out: where the shadow outputs go (``ShadowRows``); None: nothing is shadowed.
        version: the run's own model version (``runner``'s), for what it reports.
        pinned: the run serves ``version`` alone (``routing.Pin``): its claims took only the
            items the route sent to it then, so every batch is that version's, whatever
            the route says by the time it is released; nothing is shadowed.
    """

    def __init__(
        self,
        runner: ports.RunnerPort[D],
        runners: Callable[[str], ports.RunnerPort[D]] | None = None,
        shadow_out: Callable[[ShadowRows], object] | None = None,
        version: str = "",
        *,
        pinned: bool = False,
    ) -> None:
        self.runner = runner
        self.version = version  # the run's own model version
        self.pinned = pinned  # it claims only ``version``'s items: scores all with it
        self._runners = runners
        self._shadow_out = shadow_out
        self._route: Route | None = None
        self._seen: str | None = None
        self._lock = threading.Lock()
        self.shadowed = 0  # items scored aside by the candidate
        self.shadow_failures = 0  # shadowed items the candidate failed (never the run's failure)

    @property
    def route(self) -> Route | None:
        """The route of the last claim (None: the queue has none, or routes are ignored)."""
        return self._route

    def observe(self, route_json: str | None) -> None:
        """A claim read this route (``models.Claim.route``); logged once per change."""
        if route_json == self._seen or self._runners is None:
            return
        route = None if route_json is None else Route.from_json(route_json)
        with self._lock:
            self._route, self._seen = route, route_json
        logger.info(
            "model route: %s",
            "none" if route is None else route.describe(),
            extra={"action": "route_changed", "epoch": route.epoch if route else None},
        )

    def split(self, batch: models.Batch) -> list[models.Batch]:
        """``batch`` as one batch per version that scores some of its items (each tagged with
        its ``model_version``); without a route, ``batch`` itself."""
        route = self._route
        if self.pinned:
            return [replace(batch, model_version=self.version)]
        if route is None:
            return [batch]
        parts = [(v, items) for v, items in route.split(batch.items) if len(items)]
        if len(parts) == 1:
            return [replace(batch, model_version=parts[0][0])]
        size = round(len(batch) / batch.stats.fill) if batch.stats.fill else len(batch)
        return [  # each part described as the batch it is (its size, cost, fill, waits)
            replace(
                batch,
                items=items,
                model_version=version,
                stats=batch_stats(items, batch.formed_at, max(size, 1)),
            )
            for version, items in parts
        ]

    def is_candidate(self, batch: models.Batch) -> bool:
        """Whether the route's candidate scored ``batch``."""
        route = self._route
        return (
            route is not None
            and route.candidate is not None
            and (batch.model_version == route.candidate)
        )

    def version_of(self, batch: models.Batch) -> str:
        """The version that scores ``batch`` (the run's own when the route set none)."""
        return batch.model_version or self.version

    def runner_for(self, batch: models.Batch) -> ports.RunnerPort[D]:
        """The runner of the batch's version (the run's own when it has none)."""
        if batch.model_version is None or self._runners is None:
            return self.runner
        return self._runners(batch.model_version)

    def shadows(self, batch: models.Batch) -> bool:
        """Whether the route shadows ``batch`` (a stable batch of a rollout in shadow mode)."""
        route = self._route
        return not (
            self.pinned
            or self._shadow_out is None
            or self._runners is None
            or route is None
            or route.candidate is None
            or not route.shadow
            or batch.model_version != route.stable
        )

    def shadow(
        self, batch: models.Batch, result: outcomes.ScoreResult
    ) -> tuple[Sequence[models.WorkItem], str, float] | None:
        """Score the shadow sample of a stable batch with the candidate too (the forward
        stage's thread, after the batch's own pass) and hand both outputs on; returns what
        the candidate's pass used of the device (items, version, seconds), None when there
        was none. A failure here is logged and counted; the batch commits as scored either
        way."""
        route, runners, shadow_out = self._route, self._runners, self._shadow_out
        if route is None or route.candidate is None or runners is None or shadow_out is None:
            return None
        if not self.shadows(batch):
            return None
        outputs = result.outputs
        items = tuple(i for i in batch.items if i.id in outputs and route.shadowed(i.item_key))
        if not items:
            return None
        took = 0.0
        try:
            runner = runners(route.candidate)
            scored = runner.forward(runner.decode(items))
            took = scored.service_s
            both = [i for i in items if i.id in scored.outputs]
            self.shadow_failures += len(items) - len(both)
            if both:
                shadow_out(
                    ShadowRows(
                        route.stable,
                        route.candidate,
                        [i.item_key for i in both],
                        [outputs[i.id] for i in both],
                        [scored.outputs[i.id] for i in both],
                        took,
                    )
                )
            self.shadowed += len(both)
        except Exception:  # the candidate's or the side dataset's trouble, not the batch's
            self.shadow_failures += len(items)
            logger.warning(
                "shadow pass failed; the batch commits as scored",
                extra={"action": "shadow_failed", "model_version": route.candidate},
                exc_info=True,
            )
        return items, route.candidate, took
