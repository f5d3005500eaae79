"""Import hygiene: `import batching` loads the standard library only; flows/ alone imports prefect."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import REPO

HEAVY = ("torch", "sqlalchemy", "pyarrow", "openlineage", "prefect", "numpy", "pydantic")


def test_payload_decoding_needs_numpy_but_not_torch() -> None:
    assert "torch" not in _loaded_after("import batching.model.payloads")


def test_reconcile_and_the_wiring_load_no_torch() -> None:
    """`batching reconcile` loads no model: with torch loaded it took 1.9 s instead of 0.8,
    and a crash-fuzz run saw it abort at interpreter exit (SIGABRT after a clean report)."""
    assert "torch" not in _loaded_after("import batching.compose.run, batching.evidence.reconcile")


def _loaded_after(statement: str) -> set[str]:
    code = f"import sys; {statement}; print(' '.join(sorted(m.split('.')[0] for m in sys.modules)))"
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout
    return set(out.split())


@pytest.mark.parametrize(
    "statement",
    [
        "import batching",
        "import batching.errors, batching.models, batching.ports, batching.policy.batcher",
        "import batching.plan.profile",
        "import batching.evidence.lineage_log",  # `batching lineage` reads events without openlineage
    ],
)
def test_light_modules_load_no_heavy_library(statement: str) -> None:
    assert _loaded_after(statement).isdisjoint(HEAVY)


def test_only_flows_import_prefect() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in (REPO / "batching").rglob("*.py")
        if any(
            line.startswith(("import prefect", "from prefect"))
            for line in p.read_text().splitlines()
        )
    ]
    assert offenders == []


def test_library_reads_no_environment() -> None:
    offenders = [
        str(p.relative_to(REPO))
        for p in Path(REPO / "batching").rglob("*.py")
        if p.relative_to(REPO / "batching").parts[0] != "cli"  # the CLI is an edge
        and ("os.environ" in p.read_text() or "getenv(" in p.read_text())
    ]
    assert offenders == []
