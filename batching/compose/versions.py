"""The models of a routed run: the run's own version, loaded before it starts, and the other
versions of the config's registry (``model_versions``), each loaded (pinned by its sha256)
the first time the queue's route sends it a batch (``batching.loop.routes``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from batching import config as cfg
from batching import errors

if TYPE_CHECKING:
    from batching.model.runner import TorchRunner

logger = logging.getLogger(__name__)


RETRY_LOAD_S = 60.0
"""A version that failed to load is not read again for this long: its checkpoint would be
read and hashed again for every batch routed to it (a large one, on the forward's thread)."""


class ModelSet:
    """A runner per model version, by name (the scoring loop's ``runners``).

    A version that cannot be loaded raises, for this call and, without another read, for calls
    in the next ``RETRY_LOAD_S`` seconds: :class:`~batching.errors.CheckpointError` (not the
    pinned file, or another identity than its outputs were labelled with: ``pin``), :class:`~batching.errors.ModelError` naming the version (its factory or its
    warm-up raised), :class:`~batching.errors.ConfigError` (the config does not list it).
    """

    def __init__(
        self,
        config: cfg.PipelineConfig,
        first: TorchRunner | None = None,
        *,
        hint: str = "or, if it is a rollout's candidate, roll it back with `batching rollout "
        "rollback`",
        clock: Callable[[], float] = time.monotonic,
        pin: Callable[[cfg.ModelSpec], None] | None = None,
    ) -> None:
        self.config = config
        self._pin = pin
        self._loaded: dict[str, TorchRunner] = {}
        if first is not None:  # the run's own, loaded already
            self._loaded[config.model.version] = first
        self._failed: dict[str, tuple[float, errors.BatchingError]] = {}
        self._hint = hint
        self._clock = clock
        self._lock = threading.Lock()

    def __call__(self, version: str) -> TorchRunner:
        runner = self._loaded.get(version)
        if runner is not None:
            return runner
        with self._lock:  # one load of a version, whoever asks first
            runner = self._loaded.get(version)
            if runner is not None:
                return runner
            failed = self._failed.get(version)
            if failed is not None and self._clock() - failed[0] < RETRY_LOAD_S:
                raise failed[1]
            try:
                runner = self._loaded[version] = self._load(version)
            except errors.BatchingError as exc:
                self._failed[version] = (self._clock(), exc)
                raise
            self._failed.pop(version, None)
        return runner

    @property
    def checksums(self) -> dict[str, str]:
        """The sha256 of each loaded version's checkpoint."""
        return {v: r.checksum for v, r in self._loaded.items()}

    def _load(self, version: str) -> TorchRunner:
        from batching.model.runner import TorchRunner

        spec = self.config.registry().get(version)
        if spec is None:
            listed = ", ".join(sorted(self.config.registry()))
            raise errors.ConfigError(
                f"queue {self.config.queue.name!r} routes items to model version {version!r}, "
                f"which this config does not list (it has {listed}); add it under "
                f"model_versions (a version promoted since: make it the config's model), "
                f"{self._hint}"
            )
        if self._pin is not None:  # the version's identity, as its outputs were labelled
            self._pin(spec)
        try:
            runner = TorchRunner.load(spec, base_dir=self.config.base_dir)
            runner.warmup()
        except errors.CheckpointError:
            raise
        except Exception as exc:  # its factory's, its warm-up's: the version's own fault
            why = " ".join(str(exc).split())
            if not isinstance(exc, errors.BatchingError):
                why = errors.one_line(exc)
            raise errors.ModelError(f"model version {version!r} cannot be loaded: {why}") from exc
        logger.info(
            "model version loaded",
            extra={"action": "model_loaded", "model_version": version, "sha256": runner.checksum},
        )
        return runner


def describe(config: cfg.PipelineConfig) -> list[dict[str, Any]]:
    """The registry as ``batching rollout status`` shows it: version, model, checkpoint."""
    return [
        {"version": v, "model": s.name, "checkpoint": s.checkpoint, "sha256": s.sha256}
        for v, s in config.registry().items()
    ]
