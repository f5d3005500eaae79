"""The models of a routed run: the run's own version, loaded before it starts, and the other
versions of the config's registry (``model_versions``), each loaded (pinned by its sha256)
the first time the queue's route sends it a batch (``batching.loop.routes``).
"""

from __future__ import annotations

import logging
import threading
from typing import TYPE_CHECKING, Any

from batching import config as cfg
from batching import errors

if TYPE_CHECKING:
    from batching.model.runner import TorchRunner

logger = logging.getLogger(__name__)


class ModelSet:
    """A runner per model version, by name (the scoring loop's ``runners``)."""

    def __init__(self, config: cfg.PipelineConfig, first: TorchRunner | None = None) -> None:
        self.config = config
        self._loaded: dict[str, TorchRunner] = {}
        if first is not None:  # the run's own, loaded already
            self._loaded[config.model.version] = first
        self._lock = threading.Lock()

    def __call__(self, version: str) -> TorchRunner:
        runner = self._loaded.get(version)
        if runner is not None:
            return runner
        with self._lock:  # one load of a version, whoever asks first
            runner = self._loaded.get(version)
            if runner is None:
                runner = self._loaded[version] = self._load(version)
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
                "model_versions, or roll back with `batching rollout rollback`"
            )
        runner = TorchRunner.load(spec, base_dir=self.config.base_dir)
        runner.warmup()
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
