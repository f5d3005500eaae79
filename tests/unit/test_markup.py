"""What the CLI prints from data (tenants, queues, item keys, paths) is that data: never read
as Rich markup (``[/]`` raised ``MarkupError``, ``[red]`` vanished), never as emoji codes
(``:smile:`` became a face), and a control character in it is shown as its escape instead of
being sent to the terminal. A property over arbitrary text, through the CLI's own consoles
and render functions."""

from __future__ import annotations

import io
import unicodedata

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from rich.console import Console

from batching.cli import common, evidence, findings_view
from batching.cli.status import status_table
from batching.evidence.findings import Finding, Kind, Repair, Report, Severity
from batching.models import LaneStats, QueueStats

# Markup, emoji codes, escapes and control characters, mixed into arbitrary unicode.
TRICKY = ("[/]", "[/red]", "[link=x]y[/link]", "[bold]", "\\", "\\[b]", ":smile:", "\x1b[31m")
values = st.one_of(
    st.text(max_size=40),
    st.lists(st.sampled_from(TRICKY) | st.text(max_size=5), max_size=6).map("".join),
).filter(bool)

WIDE = 4000  # no row wraps: a value is found whole


def console() -> tuple[common.DataConsole, io.StringIO]:
    buffer = io.StringIO()
    return common.DataConsole(file=buffer, width=WIDE, soft_wrap=True), buffer


def one_line(value: str) -> str:
    """What a table cell shows for ``value``: controls as escapes (a cell is one line)."""
    return common.shown(value)


def test_shown_leaves_printable_text_alone_and_escapes_control_characters() -> None:
    assert (
        common.shown("[/red] :smile: \\[b] tenant ü 日本") == "[/red] :smile: \\[b] tenant ü 日本"
    )
    assert common.shown("a\x1b[31mb\nc\u2028") == "a\\x1b[31mb\\nc\\u2028"
    assert common.shown("a\nb\tc", keep_newlines=True) == "a\nb\\tc"


@given(values)
def test_shown_changes_only_control_characters(value: str) -> None:
    text = common.shown(value)
    assert all(unicodedata.category(c) not in ("Cc", "Zl", "Zp") for c in text)
    if all(unicodedata.category(c) not in ("Cc", "Zl", "Zp") for c in value):
        assert text == value


@settings(max_examples=200)
@given(values)
def test_a_message_prints_its_value_as_it_is(value: str) -> None:
    con, buffer = console()
    con.print(f"committed 1 item(s) to queue {value}; tenant {value}")
    assert common.shown(value, keep_newlines=True) in buffer.getvalue()


@settings(max_examples=200)
@given(values, values, values)
def test_status_table_shows_queue_lane_and_tenant_as_they_are(
    queue: str, lane: str, tenant: str
) -> None:
    group = LaneStats(queue=queue, lane=lane, tenant=tenant, ready=3)
    stats = QueueStats.of((group,))
    for shown_queue in (queue, None):  # `status -q QUEUE` and `status --all`
        con, buffer = console()
        con.print(status_table(stats, shown_queue))
        printed = buffer.getvalue()
        for value in (queue, lane, tenant) if shown_queue is None else (lane, tenant):
            assert one_line(value) in printed


@given(values)
def test_a_cell_shows_its_value_on_any_console(value: str) -> None:
    # Markup and emoji on (Rich's defaults): ``plain`` still keeps the value whole.
    buffer = io.StringIO()
    stats = QueueStats.of((LaneStats(queue=value, lane=value, tenant=value),))
    Console(file=buffer, width=WIDE).print(status_table(stats, None))
    assert buffer.getvalue().count(one_line(value)) >= 3


@settings(max_examples=100)
@given(values, values)
@example("\\[", "0")  # rich's escape() left it, and its markup printed "[" (found by hypothesis)
def test_lineage_summary_shows_names_as_they_are(name: str, job: str) -> None:
    con, buffer = console()
    summary = {
        "run_id": "r1",
        "state": "FAIL",
        "config_hash": "h",
        "job": {"namespace": "batching", "name": job},
        "event_types": ["START", "COMPLETE"],
        "started_at": "t",
        "duration_s": 1.0,
        "model": None,
        "error": f"cannot write {name}",
        "inputs": [{"namespace": "sqlite", "name": name, "facets": ["schema"]}],
        "outputs": [],
        "run_facets": [],
    }
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(evidence, "out", con)
        evidence._print_summary(summary)
    printed = buffer.getvalue()
    assert one_line(name) in printed
    assert f"error: {common.shown(f'cannot write {name}', keep_newlines=True)}" in printed
    assert common.shown(job, keep_newlines=True) in printed


@settings(max_examples=100)
@given(values)
def test_reconcile_report_shows_item_keys_as_they_are(key: str) -> None:
    con, buffer = console()
    finding = Finding(Kind.DEAD, Severity.INFO, f"dead {key}", item_keys=(key,), count=1)
    report = Report(
        output_kind="parquet",
        location="/out",
        now=0.0,
        since=None,
        run_id=None,
        findings=(finding,),
        repairs=(Repair("requeue", key, 1),),
    )
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(findings_view, "out", con)
        findings_view.print_report(report)
    printed = buffer.getvalue()
    assert one_line(key) in printed
    assert one_line(f"dead {key}") in printed
