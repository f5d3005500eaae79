"""Read enqueue files (JSONL, Parquet) into ``EnqueueRecord``s; the whole file or nothing.

Each record: ``item_key`` (required), ``payload`` (required), optional ``tenant``, ``priority``,
``deadline`` (epoch seconds or ISO 8601; naive times are UTC), ``cost`` (defaults to the token
count of a ``tokens`` payload, the length of a list payload, else 1) and ``lane``.

Parquet ``payload`` columns may be JSON strings, structs, or numeric list / fixed-size-list
columns; the latter become binary tensor payloads (dtype, shape, raw bytes) without a
per-value Python loop.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batching import errors, models

_FIELDS = {"item_key", "payload", "tenant", "priority", "deadline", "cost", "lane"}
_MAX_KEY = 500
PROGRESS_EVERY = 10_000
"""``read_records`` reports its progress after this many records (and at the end)."""


def read_records(
    path: str | Path, on_progress: Callable[[int], None] | None = None
) -> list[models.EnqueueRecord]:
    """Parse a ``.jsonl``/``.json`` or ``.parquet`` file; raises ``InputError`` naming file and line.

    ``on_progress`` is called with the number of records read so far, every
    :data:`PROGRESS_EVERY` records and once at the end.
    """
    p = Path(path)
    if p.is_dir():
        raise errors.InputError(f"{p}: is a folder; give a .jsonl or .parquet file")
    if not p.is_file():
        raise errors.InputError(f"{p}: no such file; give a .jsonl or .parquet file")
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        placed = _counted(((n, record) for n, record in _read_jsonl(p)), on_progress)
        unit, prefix = "line", f"{p}:"
    elif suffix == ".parquet":
        placed = _counted(enumerate(_read_parquet(p), start=1), on_progress)
        unit, prefix = "row", f"{p}:row "
    else:
        raise errors.InputError(f"{p}: unknown file type {suffix!r}; use .jsonl or .parquet")
    _check_unique_keys(placed, prefix, unit)
    return [record for _, record in placed]


def _counted(
    placed: Iterable[tuple[int, models.EnqueueRecord]], on_progress: Callable[[int], None] | None
) -> list[tuple[int, models.EnqueueRecord]]:
    out: list[tuple[int, models.EnqueueRecord]] = []
    for pair in placed:
        out.append(pair)
        if on_progress is not None and len(out) % PROGRESS_EVERY == 0:
            on_progress(len(out))
    if on_progress is not None:
        on_progress(len(out))
    return out


def _check_unique_keys(
    placed: list[tuple[int, models.EnqueueRecord]], prefix: str, unit: str
) -> None:
    """A key twice in one file is two requests under one idempotency key: the second would be
    dropped as "already present" with its payload. Refuse the file instead, naming both."""
    first: dict[str, int] = {}
    for place, record in placed:
        seen = first.setdefault(record.item_key, place)
        if seen != place:
            raise errors.InputError(
                f"{prefix}{place}: item_key {record.item_key!r} repeats {unit} {seen}; give "
                "each request its own key (a key already in the queue is skipped, not within a "
                "file)"
            )


def _read_jsonl(p: Path) -> Iterator[tuple[int, models.EnqueueRecord]]:
    with p.open("rb") as fh:
        for lineno, raw in enumerate(fh, start=1):
            if not raw.strip():
                continue
            where = f"{p}:{lineno}"
            try:
                obj = json.loads(raw)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise errors.InputError(f"{where}: not valid JSON ({exc}); fix the line") from None
            yield lineno, record_from_mapping(obj, where)


def record_from_mapping(obj: Any, where: str) -> models.EnqueueRecord:
    """Validate one JSON record; ``where`` (file:line) prefixes every error."""
    if not isinstance(obj, dict):
        raise errors.InputError(f"{where}: expected a JSON object with item_key and payload")
    unknown = set(obj) - _FIELDS
    if unknown:
        raise errors.InputError(
            f"{where}: unknown field(s) {', '.join(sorted(unknown))}; allowed: {', '.join(sorted(_FIELDS))}"
        )
    key = _key(obj.get("item_key"), where)
    if "payload" not in obj:
        raise errors.InputError(f"{where}: missing payload")
    payload = obj["payload"]
    if not isinstance(payload, (dict, list)):
        raise errors.InputError(f"{where}: payload must be a JSON object or array")
    return models.EnqueueRecord(
        item_key=key,
        payload=models.Payload(_json_bytes(payload, where)),
        tenant=_str(obj.get("tenant", "default"), "tenant", where),
        priority=_int(obj.get("priority", 0), "priority", where),
        deadline_at=_deadline(obj.get("deadline"), where),
        cost=_cost(obj.get("cost"), payload, where),
        lane=_str(obj.get("lane", ""), "lane", where),
    )


def _key(value: Any, where: str) -> str:
    if not isinstance(value, str) or not value:
        raise errors.InputError(f"{where}: item_key must be a non-empty string")
    if len(value) > _MAX_KEY:
        raise errors.InputError(f"{where}: item_key longer than {_MAX_KEY} characters")
    return _text(value, "item_key", where)


def _str(value: Any, name: str, where: str) -> str:
    if not isinstance(value, str) or len(value) > 200:
        raise errors.InputError(f"{where}: {name} must be a string of at most 200 characters")
    return _text(value, name, where)


def _text(value: str, name: str, where: str) -> str:
    """Text both databases store: no NUL (PostgreSQL refuses it), no lone surrogate."""
    if "\x00" in value:
        raise errors.InputError(f"{where}: {name} contains a NUL character; remove it")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise errors.InputError(
            f"{where}: {name} is not valid Unicode text (a lone surrogate escape); fix it"
        ) from None
    return value


def _int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.InputError(f"{where}: {name} must be an integer, got {value!r}")
    if abs(value) > 2**31 - 1:
        raise errors.InputError(
            f"{where}: {name} {value} is out of range; give an integer of at most {2**31 - 1}"
        )
    return value


def _json_bytes(payload: Any, where: str) -> bytes:
    """The payload as compact JSON; NaN and infinities (which Python's JSON reads, 1e400
    included, and writes back as NaN/Infinity) are refused: no JSON parser reads them."""
    try:
        return json.dumps(payload, separators=(",", ":"), allow_nan=False).encode()
    except ValueError:
        raise errors.InputError(
            f"{where}: payload holds NaN or an infinite number (NaN, Infinity or one as large "
            "as 1e400); JSON payloads take finite numbers only"
        ) from None


def _cost(value: Any, payload: Any, where: str) -> int:
    if value is None:
        if isinstance(payload, dict) and isinstance(payload.get("tokens"), list):
            return max(1, len(payload["tokens"]))
        return max(1, len(payload)) if isinstance(payload, list) else 1
    return _given_cost(value, where)


def _given_cost(value: Any, where: str) -> int:
    cost = _int(value, "cost", where)
    if cost < 1:
        raise errors.InputError(f"{where}: cost must be >= 1, got {cost}")
    return cost


def _deadline(value: Any, where: str) -> float | None:
    if value is None:
        return None
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if not math.isfinite(value):
            raise errors.InputError(f"{where}: deadline must be a finite time, got {value!r}")
        return float(value)
    if isinstance(value, str):
        try:
            parsed = dt.datetime.fromisoformat(value.replace("Z", "+00:00"))
        except ValueError:
            pass
        else:
            if parsed.tzinfo is None:
                parsed = parsed.replace(tzinfo=dt.UTC)
            return parsed.timestamp()
    raise errors.InputError(
        f"{where}: deadline must be epoch seconds or ISO 8601 (2026-01-31T12:00:00Z), got {value!r}"
    )


# -- Parquet ------------------------------------------------------------------------------


def _read_parquet(p: Path) -> Iterator[models.EnqueueRecord]:
    try:
        table = pq.read_table(p)
    except (pa.ArrowInvalid, OSError) as exc:
        raise errors.InputError(f"{p}: not a readable Parquet file ({exc})") from None
    missing = {"item_key", "payload"} - set(table.column_names)
    if missing:
        raise errors.InputError(
            f"{p}: missing column(s) {', '.join(sorted(missing))}; every file needs item_key "
            "(text) and payload (JSON text, a struct, or a list of numbers)"
        )
    unknown = set(table.column_names) - _FIELDS
    if unknown:
        raise errors.InputError(
            f"{p}: unknown column(s) {', '.join(sorted(unknown))}; "
            f"allowed: {', '.join(sorted(_FIELDS))}"
        )
    col = table.column("payload").combine_chunks()
    tensor = (
        pa.types.is_list(col.type)
        or pa.types.is_fixed_size_list(col.type)
        or pa.types.is_large_list(col.type)
    )
    if tensor:
        payloads, lengths = _tensor_payloads(p, col)
    else:
        payloads, lengths = _json_payloads(p, col), None
    rest = {c: table.column(c).to_pylist() for c in table.column_names if c != "payload"}
    for i, payload in enumerate(payloads):
        where = f"{p}:row {i + 1}"
        obj = {k: v[i] for k, v in rest.items() if v[i] is not None}
        cost = obj.pop("cost", None)
        key = _key(obj.get("item_key"), where)
        yield models.EnqueueRecord(
            item_key=key,
            payload=payload,
            tenant=_str(obj.get("tenant", "default"), "tenant", where),
            priority=_int(obj.get("priority", 0), "priority", where),
            deadline_at=_deadline(_deadline_value(obj.get("deadline")), where),
            cost=_given_cost(cost, where)
            if cost is not None
            else (max(1, int(lengths[i])) if lengths is not None else 1),
            lane=_str(obj.get("lane", ""), "lane", where),
        )


def _deadline_value(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).isoformat()
    return value


def _tensor_payloads(p: Path, col: pa.Array) -> tuple[list[models.Payload], np.ndarray]:
    if col.null_count:
        first = col.is_null().to_pylist().index(True) + 1
        raise errors.InputError(
            f"{p}:row {first}: payload is null ({col.null_count} null row(s) in all); "
            "every row needs a payload"
        )
    values = col.flatten()
    if values.null_count:
        first = next(i for i, v in enumerate(col.to_pylist()) if None in v) + 1
        raise errors.InputError(
            f"{p}:row {first}: payload has a null element ({values.null_count} in all); "
            "every element of a tensor payload must be a number"
        )
    if not (pa.types.is_integer(values.type) or pa.types.is_floating(values.type)):
        raise errors.InputError(f"{p}: tensor payload column must hold numbers, got {values.type}")
    flat = values.to_numpy(zero_copy_only=False)
    flat = np.ascontiguousarray(flat, dtype=flat.dtype.newbyteorder("<"))
    if pa.types.is_fixed_size_list(col.type):
        width = col.type.list_size
        offsets = np.arange(len(col) + 1, dtype=np.int64) * width
    else:
        offsets = col.offsets.to_numpy().astype(np.int64)
        offsets = offsets - offsets[0]
    buf, size, dtype = flat.tobytes(), flat.dtype.itemsize, flat.dtype.name
    lengths = np.diff(offsets)
    payloads = [
        models.Payload(buf[a * size : b * size], models.PayloadFormat.TENSOR, dtype, (int(b - a),))
        for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
    ]
    return payloads, lengths


def _json_payloads(p: Path, col: pa.Array) -> list[models.Payload]:
    out = []
    for i, value in enumerate(col.to_pylist()):
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise errors.InputError(
                    f"{p}:row {i + 1}: payload is not valid JSON ({exc})"
                ) from None
        if not isinstance(value, (dict, list)):
            raise errors.InputError(f"{p}:row {i + 1}: payload must be a JSON object or array")
        out.append(models.Payload(_json_bytes(value, f"{p}:row {i + 1}")))
    return out
