"""Durations on the command line (purge --older-than, reconcile --since)."""

from __future__ import annotations

import pytest

from batching import errors
from batching.cli.common import parse_duration
from batching.store import retention


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("90s", 90), ("30m", 1800), ("12h", 43200), ("7d", 604800), ("2.5s", 2.5), (" 1d ", 86400)],
)
def test_a_duration_in_seconds(text: str, seconds: float) -> None:
    assert parse_duration(text, "--older-than") == seconds


@pytest.mark.parametrize("text", ["nan", "inf", "infd", "-inf", "NaNh", "soon", "", "d"])
def test_what_is_not_a_finite_duration_is_refused(text: str) -> None:
    """`--older-than nan` compared as older than everything: PostgreSQL purged every item."""
    with pytest.raises(errors.ConfigError, match="must be a duration like 90s"):
        parse_duration(text, "--older-than")


def test_a_negative_duration_is_refused() -> None:
    with pytest.raises(errors.ConfigError, match="must not be negative"):
        parse_duration("-1d", "--older-than")


@pytest.mark.parametrize("text", ["7", "0", "2.5", " 30 "])
def test_a_number_without_its_unit_is_refused(text: str) -> None:
    """`purge --older-than 7` meant days to its operator and purged everything older than
    seven seconds."""
    with pytest.raises(errors.ConfigError, match=r"--older-than .* needs a unit: write .*s, .*d"):
        parse_duration(text, "--older-than")


@pytest.mark.parametrize("text", ["36501d", "99999999999d", "1e300s"])
def test_a_duration_past_a_century_is_refused(text: str) -> None:
    """`purge --older-than 99999999999d --ledger` purged items, then failed turning its
    cutoff into a date (a review): no cutoff that far back is meant."""
    with pytest.raises(errors.ConfigError, match="must be at most 36500d"):
        parse_duration(text, "--older-than")
    assert parse_duration("36500d", "--older-than") == retention.MAX_AGE_S  # the flows' cap
