"""The fair share of claims across tenants, as pure arithmetic: splits, turns, aging, state."""

from __future__ import annotations

from collections import Counter

import pytest

from batching import tenant_share as ts


def claim(share: ts.FairShare, ready: dict[str, int], n: int, now: float = 0.0) -> Counter[str]:
    """Rank as the claim statement does (aged heads, then tag; ties by tenant here) and charge."""
    ranking = share.ranking(now)
    terms = {s.tenant: s for s in ranking.shares}
    keys = []
    for tenant, count in ready.items():
        term = terms.get(tenant, ts.TenantShare(tenant, ranking.default_start, 1.0))
        for k in range(min(count, n)):
            keys.append((0 if term.aged and k == 0 else 1, term.start + k * term.step, tenant))
    taken = Counter(t for _, _, t in sorted(keys)[:n])
    share.charge(taken, now)
    for tenant, k in taken.items():
        ready[tenant] -= k
    return taken


@pytest.mark.parametrize(
    ("ready", "n", "weights", "expected"),
    [
        ({"a": 100, "b": 100}, 10, {}, {"a": 5, "b": 5}),
        ({"a": 100, "b": 100}, 30, {"a": 2}, {"a": 20, "b": 10}),
        ({"a": 100, "b": 3}, 10, {}, {"a": 7, "b": 3}),  # b's unused share goes to a
        ({"a": 100, "b": 100, "c": 100}, 12, {"c": 2}, {"a": 3, "b": 3, "c": 6}),
        ({"a": 100}, 64, {"a": 0.1}, {"a": 64}),
        ({"a": 2, "b": 2}, 10, {}, {"a": 2, "b": 2}),
    ],
)
def test_a_claim_splits_by_weight_and_fills_unused_shares(
    ready: dict[str, int], n: int, weights: dict[str, float], expected: dict[str, int]
) -> None:
    assert ts.split(ready, n, weights) == expected
    assert claim(ts.FairShare(weights), dict(ready), n) == Counter(expected)


@pytest.mark.parametrize(
    ("weights", "per_round"), [({}, {"a": 1, "b": 1}), ({"a": 2}, {"a": 2, "b": 1})]
)
def test_claims_of_one_take_turns_by_weight(
    weights: dict[str, float], per_round: dict[str, int]
) -> None:
    share = ts.FairShare(weights)
    ready = {"a": 1000, "b": 1000}
    rounds = sum(per_round.values())
    taken = sum((claim(share, ready, 1) for _ in range(rounds * 20)), Counter[str]())
    assert taken == Counter({t: k * 20 for t, k in per_round.items()})


def test_a_late_tenant_is_served_at_once_after_a_flood() -> None:
    share = ts.FairShare()
    ready = {"a": 10_000}
    for _ in range(50):
        claim(share, ready, 8)
    ready["b"] = 100
    first = [claim(share, ready, 8)["b"] for _ in range(25)]
    assert first[0] == 4  # no debt from the flood it did not take part in
    assert sum(first) == 100  # all of b's within 100 / (8 / 2) claims


def test_an_idle_tenant_hoards_no_credit() -> None:
    share = ts.FairShare()
    ready = {"a": 1000, "b": 10}
    while ready["b"]:
        claim(share, ready, 4)
    for _ in range(100):
        claim(share, ready, 4)  # a alone; b idle
    ready["b"] = 1000
    assert claim(share, ready, 4) == Counter({"a": 2, "b": 2})


def test_aging_serves_a_tenant_past_its_share() -> None:
    share = ts.FairShare({"a": 1000}, max_tenant_wait_s=30)
    ready = {"a": 5000, "b": 10}
    assert claim(share, ready, 10, now=0)["b"] == 1  # both start together
    assert claim(share, ready, 10, now=10)["b"] == 0  # b is 1000 of a's items ahead
    aged = claim(share, ready, 10, now=31)
    assert aged == Counter({"a": 9, "b": 1})  # not served for max_tenant_wait_s
    assert claim(share, ready, 10, now=32)["b"] == 0  # and charged for it


def test_state_keeps_only_tenants_ahead() -> None:
    share = ts.FairShare()
    ready = {f"t{i}": 5 for i in range(100)}
    for _ in range(60):
        claim(share, ready, 10)
    assert sum(ready.values()) == 0
    assert set(share.served_at) == set(share.finish)
    claim(share, {"new": 5}, 10, now=61)  # the others idle for 2 x max_tenant_wait_s
    assert set(share.finish) == {"new"}


def test_virtual_time_is_renormalized() -> None:
    share = ts.FairShare()
    share.charge({"a": 3_000_000}, 0.0)
    assert share.vtime < 1  # shifted back to 0
    assert share.finish["a"] == pytest.approx(1.0)


def test_rank_sql_binds_only_what_differs() -> None:
    aged, tag, params = ts.rank_sql(ts.FairShare().ranking(0.0))
    assert (aged, tag) == ("1", ":fair_v + (rn - 1) * :fair_w")
    assert params == {"fair_v": 0.0, "fair_w": 1.0}
    share = ts.FairShare({"gold": 4.0}, max_tenant_wait_s=5)
    share.charge({"gold": 8, "x": 1}, 0.0)
    aged, tag, params = ts.rank_sql(share.ranking(6.0))
    assert "CASE tenant WHEN :fair_t0 THEN :fair_s0 ELSE :fair_v END" in tag
    assert "CASE tenant WHEN :fair_t0 THEN :fair_w0 ELSE :fair_w END" in tag
    assert aged == "CASE WHEN rn = 1 AND tenant IN (:fair_t0) THEN 0 ELSE 1 END"
    assert params["fair_t0"] == "gold"
    assert params["fair_w0"] == 0.25


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"weights": {"a": 0.0}}, "tenant 'a': weight must be > 0"),
        ({"weights": {"a": float("nan")}}, "weight must be > 0"),
        ({"max_tenant_wait_s": 0.0}, "max_tenant_wait_s must be > 0"),
    ],
)
def test_bad_terms_are_refused(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        ts.FairShare(**kwargs)  # type: ignore[arg-type]
