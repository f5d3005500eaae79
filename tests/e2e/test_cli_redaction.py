"""A database password with a raw space (or an '@') never shows: not in the lineage events a
failed run emits, not in a config error, not in a connection error. Real commands on an
unreachable PostgreSQL (a closed port on 127.0.0.1: refused at once). Before the fix the
masking stopped at the space: ``postgresql://scorer:PW hotel@...`` printed ``hotel``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.e2e.test_cli import batching, write_config

SECRET = "PW hotel"
URL = f"postgresql://scorer:{SECRET}@127.0.0.1:1/scores"  # port 1: nothing listens


def _clean(text: str) -> None:
    for part in ("PW hotel", "hotel", "se@cret", "cret word"):
        assert part not in text, text


def test_a_failed_runs_lineage_events_mask_a_password_with_a_space(tmp_path: Path) -> None:
    config = write_config(tmp_path, database={"url": URL})
    r = batching("score", "-c", str(config), "--quiet", cwd=tmp_path)
    assert r.rc == 1
    _clean(r.out + r.err)
    assert "scorer:***@127.0.0.1:1/scores" in r.err
    events = (tmp_path / "lineage" / "events.jsonl").read_text()
    assert '"eventType": "FAIL"' in events or '"eventType":"FAIL"' in events
    _clean(events)
    assert "postgresql://scorer:***@127.0.0.1:1/scores" in events  # the config facet


@pytest.mark.parametrize(
    ("command", "says"),
    [
        (("check", "-c", "CONFIG"), "database.url: must be sqlite:///FILE or postgresql://"),
        (("status", "--db", "postgresql://scorer:se@cret word@127.0.0.1:1/scores"), "'@'"),
        (("status", "--db", URL), "connection failed"),
    ],
)
def test_errors_mask_a_password_with_a_space(
    tmp_path: Path, command: tuple[str, ...], says: str
) -> None:
    # A mistyped scheme is a config error that quotes the URL.
    config = write_config(tmp_path, database={"url": URL.replace("postgresql", "postgresq")})
    r = batching(*(str(config) if a == "CONFIG" else a for a in command), cwd=tmp_path)
    assert r.rc in (1, 2)
    assert says in r.err, r.err
    assert "scorer:***@" in r.err, r.err
    _clean(r.out + r.err)
