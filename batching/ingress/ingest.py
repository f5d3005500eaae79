"""Read enqueue files (JSONL, Parquet) into ``EnqueueRecord``s; the whole file or nothing.

Each record: ``item_key`` (required), ``payload`` (required), optional ``tenant``, ``priority``,
``deadline`` (epoch seconds or ISO 8601; naive times are UTC), ``cost`` (defaults to the token
count of a ``tokens`` payload, the length of a list payload, else 1) and ``lane``.

Parquet ``payload`` columns may be JSON strings, structs, or numeric list / fixed-size-list
columns; the latter become binary tensor payloads (dtype, shape, raw bytes) without a
per-value Python loop.

Files are streamed: :func:`iter_records` holds one line (JSON lines) or one record batch
(Parquet) at a time, so enqueue's memory does not grow with the file (it held ~2.75x a 200 MB
file); the all-or-nothing is the queue's one transaction, which a bad record rolls back.
Every item is held to :class:`ItemLimits` (the model section's ``max_item_*``).

Why it stays one module: JSON lines and Parquet rows become the same record through the
same field checks and limits, and the messages of both name the file and the line or row.
"""

from __future__ import annotations

import datetime as dt
import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from batching import config, errors, models

_FIELDS = {"item_key", "payload", "tenant", "priority", "deadline", "cost", "lane"}
_MAX_KEY = 500
PROGRESS_EVERY = 10_000
"""``read_records`` reports its progress after this many records (and at the end)."""


PARQUET_BATCH_ROWS = 8192
"""Parquet rows read at a time (one record batch)."""


@dataclass(frozen=True, slots=True)
class ItemLimits:
    """The most one item may hold: token ids, numbers, stored payload bytes (see
    ``config.ModelSpec.max_item_*``); an item past one refuses the whole file."""

    tokens: int = config.ModelSpec.model_fields["max_item_tokens"].default
    elements: int = config.ModelSpec.model_fields["max_item_elements"].default
    bytes: int = config.ModelSpec.model_fields["max_item_bytes"].default

    @classmethod
    def of(cls, spec: config.ModelSpec) -> ItemLimits:
        """The limits of a config's model section."""
        return cls(spec.max_item_tokens, spec.max_item_elements, spec.max_item_bytes)

    @property
    def line_bytes(self) -> int:
        """The longest JSON line read whole: room for the payload twice (spaces, escapes)."""
        return 2 * self.bytes + 65536


def read_records(
    path: str | Path,
    on_progress: Callable[[int], None] | None = None,
    limits: ItemLimits | None = None,
) -> list[models.EnqueueRecord]:
    """Every record of a ``.jsonl``/``.json`` or ``.parquet`` file, as a list (small files and
    tests; :func:`iter_records` streams). Raises ``InputError`` naming file and line.

    ``on_progress`` is called with the number of records read so far, every
    :data:`PROGRESS_EVERY` records and once at the end.
    """
    out: list[models.EnqueueRecord] = []
    for record in iter_records(path, limits):
        out.append(record)
        if on_progress is not None and len(out) % PROGRESS_EVERY == 0:
            on_progress(len(out))
    if on_progress is not None:
        on_progress(len(out))
    return out


def iter_records(
    path: str | Path, limits: ItemLimits | None = None
) -> Iterator[models.EnqueueRecord]:
    """Stream the records of a file, checked one by one (fields, a key repeated within the
    file, :class:`ItemLimits`, default ones when None); raises ``InputError`` naming file and
    line at the first bad one, so a consumer inside one transaction enqueues all or nothing."""
    p = Path(path)
    if p.is_dir():
        raise errors.InputError(f"{p}: is a folder; give a .jsonl or .parquet file")
    if not p.is_file():
        what = "not a file (a pipe or a device)" if p.exists() else "no such file"
        if str(path) == "-":
            what = "standard input is not read (a file is enqueued whole, or not at all)"
        raise errors.InputError(f"{p}: {what}; give a .jsonl or .parquet file")
    limits = limits or ItemLimits()
    suffix = p.suffix.lower()
    if suffix in (".jsonl", ".json", ".ndjson"):
        placed, unit, prefix = _read_jsonl(p, limits), "line", f"{p}:"
    elif suffix == ".parquet":
        placed, unit, prefix = _read_parquet(p), "row", f"{p}:row "
    else:
        raise errors.InputError(f"{p}: unknown file type {suffix!r}; use .jsonl or .parquet")
    first: dict[str, int] = {}
    for place, record in placed:
        check_limits(record, limits, f"{prefix}{place}")
        _check_unique_key(record, place, first, prefix, unit)
        yield record


def _check_unique_key(
    record: models.EnqueueRecord, place: int, first: dict[str, int], prefix: str, unit: str
) -> None:
    """A key twice in one file is two requests under one idempotency key: the second would be
    dropped as "already present" with its payload. Refuse the file instead, naming both."""
    seen = first.setdefault(record.item_key, place)
    if seen != place:
        raise errors.InputError(
            f"{prefix}{place}: item_key {record.item_key!r} repeats {unit} {seen}; give "
            "each request its own key (a key already in the queue is skipped, not within a "
            "file)"
        )


def check_limits(record: models.EnqueueRecord, limits: ItemLimits, where: str) -> None:
    """Raise ``InputError`` (prefixed ``where``) when ``record`` is past one of ``limits``
    (the HTTP ingress holds a request's items to the same limits as a file's)."""
    payload = record.payload
    if len(payload.data) > limits.bytes:
        tokens = elements = 0  # the bytes' message below
    elif payload.format == models.PayloadFormat.JSON and len(payload.data) < 2 * min(
        limits.tokens, limits.elements
    ):
        return  # compact JSON spends 2 bytes a number at least: not past either count
    else:
        tokens, elements = _counts(payload)
    for name, n, most in (
        ("bytes", len(payload.data), limits.bytes),
        ("token ids", tokens, limits.tokens),
        ("numbers", elements, limits.elements),
    ):
        if n > most:
            setting = {"bytes": "bytes", "token ids": "tokens", "numbers": "elements"}[name]
            raise errors.InputError(
                f"{where}: item {record.item_key!r} holds {n} {name}, over the limit of {most} "
                f"(model.max_item_{setting}); split the item, or raise the limit in the "
                "config's model section (read by `batching enqueue --config` and "
                "`batching api`) if the model and the latency objective allow it"
            )


def _counts(payload: models.Payload) -> tuple[int, int]:
    """(token ids, numbers) of a payload: a tensor's elements (token ids if integers), or a
    JSON payload's list lengths (``tokens`` counted as token ids)."""
    if payload.format == models.PayloadFormat.TENSOR:
        n = math.prod(payload.shape or (0,))
        return (n if payload.integer_tensor else 0), n
    doc = json.loads(payload.data)
    if isinstance(doc, list):
        return 0, len(doc)
    tokens = doc.get("tokens")
    n_tokens = len(tokens) if isinstance(tokens, list) else 0
    return n_tokens, sum(len(v) for v in doc.values() if isinstance(v, list))


def _read_jsonl(p: Path, limits: ItemLimits) -> Iterator[tuple[int, models.EnqueueRecord]]:
    longest = limits.line_bytes
    with p.open("rb") as fh:
        for lineno, raw in enumerate(iter(lambda: fh.readline(longest + 1), b""), start=1):
            where = f"{p}:{lineno}"
            if len(raw) > longest:  # refused before it is read whole
                raise errors.InputError(
                    f"{where}: the line is over {longest} bytes, more than an item of "
                    f"model.max_item_bytes {limits.bytes} can take; split the item, or raise "
                    "the limit in the config's model section and pass `--config FILE`"
                )
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
                record = record_from_mapping(obj, where)
            except (json.JSONDecodeError, UnicodeDecodeError) as exc:
                raise errors.InputError(f"{where}: not valid JSON ({exc}); fix the line") from None
            except RecursionError:
                raise errors.InputError(
                    f"{where}: nested too deeply; flatten the payload"
                ) from None
            yield lineno, record


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


def _as_json(value: Any) -> str:
    """``value`` as the JSON a request or a line would spell it (``true``, not ``True``);
    else as Python writes it. At most 80 characters."""
    try:
        shown = json.dumps(value, allow_nan=False)
    except (TypeError, ValueError):
        shown = repr(value)
    return shown if len(shown) <= 80 else shown[:77] + "..."


def _int(value: Any, name: str, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise errors.InputError(f"{where}: {name} must be an integer, got {_as_json(value)}")
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
        try:
            seconds = float(value)  # an int too large for a float overflows
        except OverflowError:
            seconds = math.inf
        if not math.isfinite(seconds):
            raise errors.InputError(
                f"{where}: deadline must be a finite time (epoch seconds), got {str(value)[:40]}"
            )
        return seconds
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
        f"{where}: deadline must be epoch seconds or ISO 8601 (2026-01-31T12:00:00Z), got"
        f" {_as_json(value)}"
    )


# -- Parquet ------------------------------------------------------------------------------


def _read_parquet(p: Path) -> Iterator[tuple[int, models.EnqueueRecord]]:
    """Rows by record batch (:data:`PARQUET_BATCH_ROWS`), each with its row number."""
    try:
        file = pq.ParquetFile(p)
        names = file.schema_arrow.names
    except (pa.ArrowInvalid, OSError) as exc:
        raise errors.InputError(f"{p}: not a readable Parquet file ({exc})") from None
    missing = {"item_key", "payload"} - set(names)
    if missing:
        raise errors.InputError(
            f"{p}: missing column(s) {', '.join(sorted(missing))}; every file needs item_key "
            "(text) and payload (JSON text, a struct, or a list of numbers)"
        )
    unknown = set(names) - _FIELDS
    if unknown:
        raise errors.InputError(
            f"{p}: unknown column(s) {', '.join(sorted(unknown))}; "
            f"allowed: {', '.join(sorted(_FIELDS))}"
        )
    done = 0
    with file:
        batches = file.iter_batches(batch_size=PARQUET_BATCH_ROWS)
        while True:
            try:
                batch = next(batches)
            except StopIteration:
                return
            except (pa.ArrowInvalid, OSError) as exc:
                raise errors.InputError(f"{p}: not a readable Parquet file ({exc})") from None
            yield from _parquet_rows(p, batch, done)
            done += batch.num_rows


def _parquet_rows(
    p: Path, batch: pa.RecordBatch, done: int
) -> Iterator[tuple[int, models.EnqueueRecord]]:
    """The records of one record batch; ``done`` rows came before it."""
    col = batch.column("payload")
    tensor = (
        pa.types.is_list(col.type)
        or pa.types.is_fixed_size_list(col.type)
        or pa.types.is_large_list(col.type)
    )
    if tensor:
        payloads, lengths = _tensor_payloads(p, col, done)
    else:
        payloads, lengths = _json_payloads(p, col, done), None
    rest = {c: batch.column(c).to_pylist() for c in batch.schema.names if c != "payload"}
    for i, payload in enumerate(payloads):
        where = f"{p}:row {done + i + 1}"
        obj = {k: v[i] for k, v in rest.items() if v[i] is not None}
        cost = obj.pop("cost", None)
        key = _key(obj.get("item_key"), where)
        yield (
            done + i + 1,
            models.EnqueueRecord(
                item_key=key,
                payload=payload,
                tenant=_str(obj.get("tenant", "default"), "tenant", where),
                priority=_int(obj.get("priority", 0), "priority", where),
                deadline_at=_deadline(_deadline_value(obj.get("deadline")), where),
                cost=_given_cost(cost, where)
                if cost is not None
                else (max(1, int(lengths[i])) if lengths is not None else 1),
                lane=_str(obj.get("lane", ""), "lane", where),
            ),
        )


def _deadline_value(value: Any) -> Any:
    if isinstance(value, dt.datetime):
        return (value if value.tzinfo else value.replace(tzinfo=dt.UTC)).isoformat()
    return value


def _tensor_payloads(p: Path, col: pa.Array, done: int) -> tuple[list[models.Payload], np.ndarray]:
    if col.null_count:
        first = done + col.is_null().to_pylist().index(True) + 1
        raise errors.InputError(
            f"{p}:row {first}: payload is null ({col.null_count} null row(s) in all); "
            "every row needs a payload"
        )
    values = col.flatten()
    if values.null_count:
        first = done + next(i for i, v in enumerate(col.to_pylist()) if None in v) + 1
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


def _json_payloads(p: Path, col: pa.Array, done: int) -> list[models.Payload]:
    out = []
    for i, value in enumerate(col.to_pylist(), start=done):
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
