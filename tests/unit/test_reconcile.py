"""Unit tests for reconcile's pure classification: hand-made facts, no database, no files."""

from __future__ import annotations

import json
from typing import Any

import pytest

from batching.evidence import reconcile as rc
from batching.evidence.findings import PUBLISH_GRACE_S as GRACE_S
from batching.evidence.reconcile import Kind, Severity


def batch(batch_id: str, keys: set[str] | None = None, /, **kw: Any) -> rc.BatchFacts:
    """A live, published, readable Parquet batch unless overridden (``keys`` None: not read)."""
    fields: dict[str, Any] = {
        "model_version": "v1",
        "state": "published",
        "committed_at": 100.0,
        "where": "dataset",
        "file": f"/out/part-{batch_id}.parquet",
        "keys": None if keys is None else frozenset(keys),
    }
    return rc.BatchFacts(batch_id, **(fields | kw))  # kw may override keys (None: unreadable)


def facts(**kw: Any) -> rc.Facts:
    return rc.Facts(kw.pop("output_kind", "parquet"), **kw)


def kinds(findings: list[rc.Finding]) -> list[tuple[Kind, Severity]]:
    return [(f.kind, f.severity) for f in findings]


def test_consistent_facts_have_no_findings() -> None:
    f = facts(
        batches=(batch("b1", {"a", "b"}),),
        done=(rc.DoneItem("a", "b1"), rc.DoneItem("b", "b1")),
        visible={"/out/part-b1.parquet": "published"},
    )
    assert rc.classify(f) == []


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"where": "missing", "keys": None}, (Kind.MISSING_FILE, Severity.CRITICAL)),
        (
            {"problem": "3 rows, ledger says 2", "keys": None},
            (Kind.TRUNCATED_OR_CORRUPT, Severity.CRITICAL),
        ),
        # Acked, and readers do not see it: critical (see the grace below).
        ({"state": "committed", "where": "staging"}, (Kind.UNPUBLISHED, Severity.CRITICAL)),
        ({"state": "committed", "where": "pending"}, (Kind.UNPUBLISHED, Severity.CRITICAL)),
        # A scorer's deferred publish mark: readers see the file; no page for it.
        ({"state": "committed", "where": "dataset"}, (Kind.UNPUBLISHED, Severity.INFO)),
        ({"state": "published", "where": "staging"}, (Kind.UNPUBLISHED, Severity.CRITICAL)),
    ],
)
def test_batch_file_faults(overrides: dict[str, Any], expected: tuple[Kind, Severity]) -> None:
    f = facts(batches=(batch("b1", {"a"}, **overrides),), done=(rc.DoneItem("a", "b1"),))
    (finding,) = rc.classify(f)
    assert (finding.kind, finding.severity) == expected
    assert finding.batch_ids == ("b1",)
    assert finding.item_keys == ("a",), "the items that depend on the file are named"


@pytest.mark.parametrize(
    ("age_s", "expected"),
    [(GRACE_S - 1, Severity.WARNING), (GRACE_S + 1, Severity.CRITICAL)],
)
def test_an_unpublished_batch_is_critical_once_past_the_grace(
    age_s: float, expected: Severity
) -> None:
    """A live scorer publishes right after its commit: only then is "not visible" a fault."""
    b = batch("b1", {"a"}, state="committed", where="staging")
    f = facts(batches=(b,), done=(rc.DoneItem("a", "b1"),), now=b.committed_at + age_s)
    (finding,) = rc.classify(f)
    assert (finding.kind, finding.severity) == (Kind.UNPUBLISHED, expected)


@pytest.mark.parametrize("state", ["quarantined", "superseded"])
def test_retired_batches_are_not_checked_but_their_done_items_are_lost(state: str) -> None:
    f = facts(
        batches=(batch("b1", None, state=state, where="retired"),), done=(rc.DoneItem("a", "b1"),)
    )
    (finding,) = rc.classify(f)
    assert (finding.kind, finding.item_keys) == (Kind.LOST_WRITE, ("a",))
    assert state in finding.message


@pytest.mark.parametrize(
    ("item", "reason"),
    [
        (rc.DoneItem("a", None), "acked without a batch"),
        (rc.DoneItem("a", "nope"), "no ledger row"),
        (rc.DoneItem("z", "b1"), "not in its batch's file"),
    ],
)
def test_lost_write_reasons(item: rc.DoneItem, reason: str) -> None:
    (finding,) = rc.classify(facts(batches=(batch("b1", {"a"}),), done=(item,)))
    assert (finding.kind, finding.severity) == (Kind.LOST_WRITE, Severity.CRITICAL)
    assert reason in finding.message
    assert finding.item_keys == (item.item_key,)


def test_lost_writes_are_grouped_per_batch_and_reason() -> None:
    done = (rc.DoneItem("x", None), rc.DoneItem("y", None), rc.DoneItem("z", "b1"))
    findings = rc.classify(facts(batches=(batch("b1", {"a"}),), done=done))
    assert [(f.batch_ids, f.item_keys, f.count) for f in findings] == [
        ((), ("x", "y"), 2),
        (("b1",), ("z",), 1),
    ]


def test_sql_lost_write_is_a_missing_result_row() -> None:
    b = batch("b1", None, where="table", file="results")
    done = (rc.DoneItem("a", "b1", has_output=True), rc.DoneItem("b", "b1", has_output=False))
    (finding,) = rc.classify(facts(output_kind="sql", batches=(b,), done=done))
    assert (finding.kind, finding.item_keys) == (Kind.LOST_WRITE, ("b",))


def test_items_of_another_sink_or_of_a_faulty_file_are_not_lost_writes() -> None:
    missing = batch("b1", None, where="missing")
    done = (rc.DoneItem("a", "b1"), rc.DoneItem("f", "foreign"))
    f = facts(batches=(missing,), done=done, foreign_batches=frozenset({"foreign"}))
    assert kinds(rc.classify(f)) == [(Kind.MISSING_FILE, Severity.CRITICAL)]


def test_duplicate_keeps_the_first_committed_copy() -> None:
    first = batch("b1", {"a", "b"}, committed_at=100.0)
    later = batch("b2", {"a", "c"}, committed_at=200.0)
    other_model = batch("b3", {"a"}, model_version="v2", committed_at=50.0)
    (dup,) = rc.classify(facts(batches=(later, first, other_model)))
    assert (dup.kind, dup.severity, dup.count) == (Kind.DUPLICATE, Severity.CRITICAL, 1)
    assert dup.batch_ids == ("b2", "b1")
    assert dup.item_keys == ("a",)
    assert dup.details == {"winner_by_key": {"a": "b1"}}


def test_visible_file_without_live_ledger_row_is_a_critical_orphan() -> None:
    visible = {
        "/out/x.parquet": None,
        "/out/old.parquet": "superseded",
        "/out/ok.parquet": "published",
    }
    findings = rc.classify(facts(visible=visible))
    assert [(f.files, f.severity) for f in findings] == [
        (("/out/old.parquet",), Severity.CRITICAL),
        (("/out/x.parquet",), Severity.CRITICAL),
    ]
    assert "superseded" in findings[0].message


@pytest.mark.parametrize(
    ("staging", "orphan"),
    [
        (rc.StagingFile("/s/b.l.parquet.tmp", "b", None, lease_held=True), False),
        (rc.StagingFile("/s/b.l.parquet.tmp", "b", "committed", lease_held=False), False),
        (rc.StagingFile("/s/b.l.parquet.tmp", "b", None, lease_held=False), True),
        (rc.StagingFile("/s/b.l.parquet.tmp", "b", "quarantined", lease_held=False), True),
        (rc.StagingFile("/s/notes.txt", None, None, lease_held=False), True),
    ],
)
def test_staging_leftovers(staging: rc.StagingFile, orphan: bool) -> None:
    findings = rc.classify(facts(staging=(staging,)))
    assert kinds(findings) == ([(Kind.ORPHAN_FILE, Severity.WARNING)] if orphan else [])


def test_queue_health_findings() -> None:
    f = facts(
        stale_leases=("s1",),
        dead=rc.ItemTally(3, {"boom": 2, "lease expired (worker lost)": 1}, ("d1", "d2", "d3")),
        expired=rc.ItemTally(1, {"deadline passed before scoring": 1}, ("e1",)),
        late=rc.ItemTally(2, {}, ("l1", "l2")),
    )
    findings = {f.kind: f for f in rc.classify(f)}
    assert findings[Kind.STALE_LEASE].severity is Severity.WARNING
    assert (findings[Kind.SLA_MISS].count, findings[Kind.SLA_MISS].severity) == (
        3,
        Severity.WARNING,
    )
    assert findings[Kind.SLA_MISS].item_keys == ("l1", "l2", "e1")
    assert findings[Kind.DEAD].details == {"reasons": {"boom": 2, "lease expired (worker lost)": 1}}
    assert (findings[Kind.DEAD].severity, findings[Kind.EXPIRED].severity) == (
        Severity.INFO,
        Severity.INFO,
    )


def test_report_ok_clean_counts_and_json() -> None:
    findings = rc.classify(
        facts(
            batches=(batch("b1", None, where="missing"),),
            done=(rc.DoneItem("x", None),),
            dead=rc.ItemTally(2, {"boom": 2}, ("d1", "d2")),
            stale_leases=("s1", "s2"),
        )
    )
    report = rc.Report("parquet", "/out", 10.0, None, None, tuple(findings))
    assert not report.ok
    assert not report.clean
    assert report.counts == {"missing_file": 1, "lost_write": 1, "stale_lease": 2, "dead": 2}
    data = json.loads(json.dumps(report.to_dict()))
    assert data["ok"] is False
    assert {f["class"] for f in data["findings"]} == set(report.counts)
    info_only = rc.Report("sql", "t", 10.0, None, None, tuple(report.by_kind(Kind.DEAD)))
    assert info_only.ok
    assert info_only.clean
