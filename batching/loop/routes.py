"""The scoring loop's side of a rollout: the queue's route as the last claim read it, each
released batch split by the version that scores it, and that version's runner.

Every claim reads the queue's route in its own transaction (``models.Claim.route``); the
route a batch is split by is the newest one read, so a change of routing takes effect at a
scorer's next claim. A batch already split keeps its version to the commit: its output, its
ledger row and its lineage name the version that scored it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import replace
from typing import Generic

from batching import models, ports
from batching.loop.stages import D
from batching.routing import Route

logger = logging.getLogger(__name__)


class Router(Generic[D]):
    """Splits batches by version and finds each version's runner.

    Args:
        runner: the run's own model (its configured version).
        runners: the runner of a version by name (a routed run's models, loaded on first
            use and pinned by sha256); None: the run scores with ``runner`` alone and
            ignores routes.
    """

    def __init__(
        self,
        runner: ports.RunnerPort[D],
        runners: Callable[[str], ports.RunnerPort[D]] | None = None,
    ) -> None:
        self.runner = runner
        self._runners = runners
        self._route: Route | None = None
        self._seen: str | None = None
        self._lock = threading.Lock()

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
        if route is None:
            return [batch]
        return [
            replace(batch, items=items, model_version=version)
            for version, items in route.split(batch.items)
            if len(items)
        ]

    def runner_for(self, batch: models.Batch) -> ports.RunnerPort[D]:
        """The runner of the batch's version (the run's own when it has none)."""
        if batch.model_version is None or self._runners is None:
            return self.runner
        return self._runners(batch.model_version)
