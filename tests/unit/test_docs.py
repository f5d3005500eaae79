"""The docs' facts that the code can check: they drifted before (schema v8 after migration 9).

The README stays the page a new user reads (at most 12,000 characters: measurement history and
design reasoning live in docs/), the config reference is the one the models generate, and
every relative link in the README and docs/ resolves.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from batching import config_doc
from batching.store import schema

REPO = Path(__file__).resolve().parents[2]
README = (REPO / "README.md").read_text(encoding="utf-8")
PAGES = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LINK = re.compile(r"\]\(([^)#\s]+)(#[^)\s]*)?\)")


def test_the_readme_names_the_current_schema_version() -> None:
    assert f"(schema v{schema.SCHEMA_VERSION})" in README


def test_the_readme_stays_short() -> None:
    assert len(README) <= 12_000, f"README.md is {len(README)} characters; move detail to docs/"


def test_the_config_reference_is_generated_from_the_models() -> None:
    written = (REPO / "docs" / "config.md").read_text(encoding="utf-8")
    assert written == config_doc.reference(), "run: python -m batching.config_doc > docs/config.md"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(REPO)))
def test_every_relative_link_resolves(page: Path) -> None:
    text = page.read_text(encoding="utf-8")
    broken = [
        target
        for target, _ in LINK.findall(text)
        if "://" not in target and not (page.parent / target).exists()
    ]
    assert broken == []
