"""Reading lineage back: the local JSONL events file and a summary of one run (``batching
lineage``). Standard library only, so inspecting events never imports ``openlineage``; the
events are written by :mod:`batching.evidence.lineage`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from datetime import datetime
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


def read_events(path: str | Path) -> list[dict[str, Any]]:
    """Read a JSONL events file in file order; ``[]`` when it does not exist.

    A line that is not a JSON object (e.g. torn by a crash), or an event without a run id (not a
    run event, so nothing to summarize) is skipped with a warning naming the file and line: the
    first five, then a count. A file with no event at all gets no warnings (it is not an events
    file; the caller says so once).
    """
    p = Path(path)
    if not p.exists():
        return []
    events: list[dict[str, Any]] = []
    skipped: list[tuple[int, str]] = []
    with p.open("rb") as lines:
        for number, line in enumerate(lines, start=1):
            reason = _append_event(events, line) if line.strip() else None
            if reason is not None:
                skipped.append((number, reason))
    if events:
        for number, reason in skipped[:5]:
            extra = {"action": "lineage_event_unreadable", "file": str(p), "line_number": number}
            logger.warning("%s:%d: lineage event skipped (%s)", p, number, reason, extra=extra)
        if len(skipped) > 5:  # not a wall of warnings
            logger.warning("%s: %d more lines skipped (not lineage events)", p, len(skipped) - 5)
    return events


def _append_event(events: list[dict[str, Any]], line: bytes) -> str | None:
    """Append the line's event; else why it is none."""
    try:
        event = json.loads(line)  # UTF-8 (or -16/-32) JSON text
    except (json.JSONDecodeError, UnicodeDecodeError):
        event = None
    if not isinstance(event, dict):
        return "not a JSON object"
    if not isinstance(event.get("run"), dict) or not isinstance(event["run"].get("runId"), str):
        return "no run.runId"
    if not isinstance(event.get("eventType"), str) or not isinstance(event.get("job"), dict):
        return "no eventType or job"
    events.append(event)
    return None


def summarize_run(
    events: Iterable[Mapping[str, Any]], run_id: str | None = None
) -> dict[str, Any] | None:
    """Summarize one run's events: job, parent, state, event types, times, datasets, facets.

    ``run_id`` ``None`` picks the run with the latest event. Returns ``None`` when the run has no
    events. ``duration_s`` is from the first event to the last terminal one (COMPLETE/FAIL/ABORT).
    """
    runs: dict[str, list[Mapping[str, Any]]] = {}
    for event in events:
        runs.setdefault(str(_obj(event.get("run")).get("runId")), []).append(event)
    if run_id is None and runs:
        run_id = max(runs, key=lambda r: max(_event_ts(e) for e in runs[r]))
    chosen = sorted(runs.get(run_id or "", []), key=_event_ts)
    return _summary(chosen) if chosen else None


def _event_ts(event: Mapping[str, Any]) -> float:
    try:
        return datetime.fromisoformat(str(event.get("eventTime"))).timestamp()
    except ValueError:
        return float("-inf")


def _summary(events: list[Mapping[str, Any]]) -> dict[str, Any]:
    last = events[-1]
    job = _obj(last.get("job"))
    run_facets = _merged(_obj(e.get("run")).get("facets") for e in events)
    ends = [e for e in events if e.get("eventType") in ("COMPLETE", "FAIL", "ABORT")]
    started, ended = events[0].get("eventTime"), ends[-1].get("eventTime") if ends else None
    return {
        "run_id": last["run"]["runId"],
        "job": {"namespace": job.get("namespace"), "name": job.get("name")},
        "parent": _parent(_obj(run_facets.get("parent"))),
        "state": last.get("eventType"),
        "event_types": [e.get("eventType") for e in events],
        "started_at": started,
        "ended_at": ended,
        "duration_s": _event_ts(ends[-1]) - _event_ts(events[0]) if ends else None,
        "inputs": _datasets(events, "inputs", "inputFacets", "inputStatistics"),
        "outputs": _datasets(events, "outputs", "outputFacets", "outputStatistics"),
        "run_facets": sorted(run_facets),
        "job_facets": sorted(_merged(_obj(e.get("job")).get("facets") for e in events)),
        "error": _obj(run_facets.get("errorMessage")).get("message"),
        "model": _strip_base(_obj(run_facets.get("batching_model"))),
        "config_hash": _obj(run_facets.get("batching_config")).get("configHash"),
    }


def _obj(value: Any) -> Mapping[str, Any]:
    """``value`` if it is a JSON object, else an empty one: a facet, or a part of one, of
    another shape (a hand-edited or foreign log) reads as absent, never as a crash."""
    return value if isinstance(value, dict) else {}


def _merged(facet_maps: Iterable[Any]) -> dict[str, Any]:
    merged: dict[str, Any] = {}
    for facets in facet_maps:
        merged |= facets if isinstance(facets, dict) else {}
    return merged


def _parent(facet: Mapping[str, Any]) -> dict[str, Any] | None:
    if not facet:
        return None
    job = _obj(facet.get("job"))
    return {
        "run_id": _obj(facet.get("run")).get("runId"),
        "job": f"{job.get('namespace')}/{job.get('name')}",
    }


def _strip_base(facet: Mapping[str, Any]) -> dict[str, Any] | None:
    return {k: v for k, v in facet.items() if not k.startswith("_")} if facet else None


def _datasets(
    events: list[Mapping[str, Any]], kind: str, io_key: str, stats_key: str
) -> list[dict[str, Any]]:
    found: dict[tuple[Any, Any], dict[str, Any]] = {}
    for event in events:
        for ds in event.get(kind) or []:
            if not isinstance(ds, dict):
                continue
            entry = found.setdefault((ds.get("namespace"), ds.get("name")), {"facets": set()})
            entry["facets"] |= set(_obj(ds.get("facets"))) | set(_obj(ds.get(io_key)))
            stats = _obj(_obj(ds.get(io_key)).get(stats_key))
            pairs = (("row_count", stats.get("rowCount")), ("size_bytes", stats.get("size")))
            entry |= {k: v for k, v in pairs if v is not None}
    return [
        {"namespace": ns, "name": name, **entry, "facets": sorted(entry["facets"])}
        for (ns, name), entry in found.items()
    ]
