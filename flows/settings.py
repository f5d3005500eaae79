"""The edge: turn flow parameters and the environment into library config.

The library never reads environment variables; the flows do, here and only here:

* ``BATCHING_DB_URL``: database URL when a flow run names none (as the CLI's ``--db``).
* ``OPENLINEAGE_CONFIG`` / ``openlineage.yml``, ``OPENLINEAGE_URL``, ``OPENLINEAGE__TRANSPORT__*``,
  ``OPENLINEAGE_DISABLED``, ...: where lineage goes, as the OpenLineage client reads them (see
  :mod:`batching.evidence.ol_config`).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from batching import config
from batching.compose import build
from batching.evidence import ol_config

REPO = Path(__file__).resolve().parents[1]
ONLINE = "deployments/online.yaml"
BULK = "deployments/bulk.yaml"
DB_ENV = "BATCHING_DB_URL"


def config_path(path: str) -> Path:
    """Resolve a config path: absolute, relative to the working directory, else to the repo."""
    p = Path(path).expanduser()
    if p.is_absolute() or p.exists():
        return p
    return REPO / p


def load(path: str, overrides: Mapping[str, Any] | None = None) -> config.PipelineConfig:
    """Load a pipeline config; ``overrides`` (nested mappings) win over the file.

    The OpenLineage sources (``openlineage.yml``, ``OPENLINEAGE*``) are checked too, so that a
    malformed ``OPENLINEAGE_URL`` fails a run here, before any task, and not after its
    preconditions loaded the model.

    Raises:
        ConfigError: the file is missing, a setting is invalid, or the lineage environment is
            (the message names it).
    """
    cfg = config.load_config(config_path(path), dict(overrides) if overrides else None)
    lineage_config(cfg)
    return cfg


def db_url(override: str | None, env: Mapping[str, str] = os.environ) -> str | None:
    """The database URL a run uses instead of the config's: the parameter, else ``$BATCHING_DB_URL``."""
    return override or env.get(DB_ENV) or None


def locations(cfg: config.PipelineConfig, db: str | None, output: str | None) -> build.Resolved:
    """Where a run reads and writes, after the parameter and environment overrides."""
    return build.resolve(cfg, db_url(db), output)


def lineage_config(
    cfg: config.PipelineConfig, env: Mapping[str, str] = os.environ
) -> config.LineageConfig:
    """The config's lineage settings under the OpenLineage client's own sources (its config
    file, then the ``OPENLINEAGE*`` environment; see :mod:`batching.evidence.ol_config`)."""
    return ol_config.lineage_config(cfg.lineage, env)


def artifact_key(*parts: str) -> str:
    """A Prefect artifact key (lowercase letters, digits, dashes) made from ``parts``."""
    text = "-".join(parts).lower()
    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")
