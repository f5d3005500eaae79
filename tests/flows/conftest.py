"""The real Prefect test harness, once per session, for every flow test.

Heartbeats are off (each sync flow run would otherwise wait ~1 s for the heartbeat thread), the
server keeps no telemetry, and its event persister flushes every 0.5 s so tests can read back
the events a flow emitted.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from prefect.settings import (
    PREFECT_FLOWS_HEARTBEAT_FREQUENCY,
    PREFECT_RESULTS_LOCAL_STORAGE_PATH,
    PREFECT_SERVER_ANALYTICS_ENABLED,
    PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL,
    temporary_settings,
)
from prefect.testing.utilities import prefect_test_harness


@pytest.fixture(autouse=True, scope="session")
def prefect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """A temporary Prefect server (subprocess, temp SQLite) for the whole session."""
    updates = {
        PREFECT_FLOWS_HEARTBEAT_FREQUENCY: None,  # only settable here: the env var needs >= 30
        PREFECT_SERVER_ANALYTICS_ENABLED: False,
        PREFECT_SERVER_SERVICES_EVENT_PERSISTER_FLUSH_INTERVAL: 0.5,
        PREFECT_RESULTS_LOCAL_STORAGE_PATH: tmp_path_factory.mktemp("prefect-results"),
    }
    with temporary_settings(updates=updates), prefect_test_harness(server_startup_timeout=90):
        yield
