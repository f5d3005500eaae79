"""End-to-end fixtures: a Prefect server for the tests that need one."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.e2e.prefect_stack import Stack


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    stack = Stack(tmp_path)
    try:
        stack.start_server()
        yield stack
    finally:
        stack.close()
