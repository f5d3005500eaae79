"""Tenants, queues and item keys that look like Rich markup or emoji codes, through the real
``batching`` command: every command exits as it should, prints no traceback, and shows the
values as they are (before, ``[/]`` raised a MarkupError after the work was committed, and
``:smile:`` printed a face).
"""

from __future__ import annotations

import json
from pathlib import Path

from batching.model import workloads
from tests.e2e.test_cli import DB, batching, write_config

QUEUE = "[/red]"
TENANTS = ("[/]", "[bold]t", ":smile:", "a\\[b]\\")
GOOD_KEYS = ("[link=x]y[/link]", ":thumbs_up:", "k[/red]2", "k\\")
BAD_KEY = "[/]dead"  # a payload the model refuses: dead after its one attempt


def _records(folder: Path) -> Path:
    rows = [json.loads(line) for line in workloads.w1_json_lines(len(GOOD_KEYS))]
    lines = [
        {**row, "item_key": key, "tenant": TENANTS[i % len(TENANTS)]}
        for i, (row, key) in enumerate(zip(rows, GOOD_KEYS, strict=True))
    ]
    lines.append({"item_key": BAD_KEY, "payload": {"x": "bad"}, "tenant": TENANTS[0]})
    path = folder / "items.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in lines))
    return path


def test_markup_in_tenants_queues_and_keys_is_shown_as_it_is(tmp_path: Path) -> None:
    items = _records(tmp_path)
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    enq = ("enqueue", str(items), "--db", DB, "-q", QUEUE, "--max-attempts", "1")
    first = batching(*enq, cwd=tmp_path)
    assert first.rc == 0, first.err
    assert f"committed {len(GOOD_KEYS) + 1} new item(s) to queue '{QUEUE}'" in first.out
    again = batching(*enq, cwd=tmp_path)
    assert again.rc == 0, again.err
    assert f"duplicates: {', '.join((*GOOD_KEYS, BAD_KEY)[:5])}" in again.out

    for args in (("-q", QUEUE), ("--all",)):
        shown = batching("status", "--db", DB, *args, cwd=tmp_path)
        assert shown.rc == 0, shown.err
        for tenant in TENANTS:
            assert tenant in shown.out, shown.out
    assert QUEUE in shown.out

    config = write_config(tmp_path, queue={"name": QUEUE}, name="score-[/]")
    scored = batching("score", "-c", str(config), "--quiet", cwd=tmp_path)
    assert scored.rc == 0, scored.err
    assert f"queue: {QUEUE} in " in scored.out

    checked = batching("reconcile", "-c", str(config), cwd=tmp_path)
    assert checked.rc == 0, checked.out + checked.err
    assert BAD_KEY in checked.out, checked.out

    lineage = batching("lineage", "-c", str(config), cwd=tmp_path)
    assert lineage.rc == 0, lineage.err
    assert "job batching/score-[/]" in lineage.out


def test_a_control_character_in_a_tenant_is_shown_as_its_escape(tmp_path: Path) -> None:
    # An ESC from the data reaching the terminal would be obeyed (colours, cursor, title).
    items = tmp_path / "items.jsonl"
    items.write_text(json.dumps({"item_key": "k", "payload": {}, "tenant": "t\x1b[31m\n"}) + "\n")
    assert batching("init", "--db", DB, cwd=tmp_path).rc == 0
    assert batching("enqueue", str(items), "--db", DB, cwd=tmp_path).rc == 0
    shown = batching("status", "--db", DB, cwd=tmp_path)
    assert shown.rc == 0, shown.err
    assert "t\\x1b[31m\\n" in shown.out
    assert "\x1b" not in shown.out
