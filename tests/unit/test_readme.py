"""The README's facts that the code can check: they drifted before (schema v8 after migration 9)."""

from __future__ import annotations

from pathlib import Path

from batching.store import schema

README = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")


def test_the_readme_names_the_current_schema_version() -> None:
    version = schema.SCHEMA_VERSION
    assert f"(schema v{version})" in README
    assert f"applies them; {version} so far" in README
