"""Payload decoding: JSON or binary-tensor request bodies into numpy arrays (numpy, orjson).

Each function returns what it decoded plus a reason for every payload it could not decode, so a
bad payload fails alone. No per-value Python loops: JSON documents are parsed with orjson and
converted a block at a time; tensor bytes are joined and viewed with one ``frombuffer`` per
dtype.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
import typing
from collections.abc import Sequence
from typing import Any

import numpy as np
import numpy.typing as npt
import orjson

from batching import errors, models

FloatArray = npt.NDArray[np.float32]
IntArray = npt.NDArray[np.int64]
NOT_FINITE = (
    "tensor payload holds a value that is not finite as float32 (NaN, inf, or beyond "
    "+-3.4e38); send finite numbers"
)
"""A dense row that is not finite: its item's failure at decode (JSON values are refused
as they are read, each with its own reason)."""


def dense_rows(
    items: Sequence[models.WorkItem], dim: int
) -> tuple[list[tuple[list[int], FloatArray]], dict[int, str]]:
    """Blocks of decoded rows ``(item positions, float32 [k, dim])`` and failures by item id."""
    block = _uniform_tensors(items, dim)
    if block is not None:
        return [block], {}
    failures: dict[int, str] = {}
    json_rows: list[tuple[int, object]] = []
    tensors: dict[str, list[tuple[int, bytes]]] = {}
    # A batch's tensors mostly share one (dtype, shape): check that once, then only lengths.
    headers: dict[tuple[str | None, tuple[int, ...] | None], _Header] = {}
    for pos, item in enumerate(items):
        payload = item.payload
        if payload.format == models.PayloadFormat.JSON:
            value, reason = _json_field(payload.data, "x")
            if reason is None and not (isinstance(value, list) and len(value) == dim):
                reason = f'"x" must be a list of {dim} numbers, got {_describe(value)}'
            if reason is None:  # its values are checked with the batch's (_json_blocks)
                json_rows.append((pos, value))
        else:
            key = (payload.dtype, payload.shape)
            header = headers.get(key)
            if header is None:
                header = headers[key] = _tensor_header(payload, "fiu", (dim,))
            dtype, n_bytes, reason = header
            if reason is None and len(payload.data) != n_bytes:
                reason = _size_reason(payload, n_bytes)
            if reason is None:
                tensors.setdefault(dtype, []).append((pos, payload.data))
        if reason is not None:
            failures[item.id] = reason
    blocks = _json_blocks(items, json_rows, dim, failures)
    for dtype, entries in tensors.items():
        raw = np.frombuffer(b"".join(data for _, data in entries), dtype=np.dtype(dtype))
        blocks.append(([pos for pos, _ in entries], _as_float32(raw.reshape(-1, dim))))
    return blocks, failures


_DATA, _FORMAT, _DTYPE, _SHAPE = (operator.itemgetter(i) for i in range(4))  # of a Payload


def _uniform_tensors(
    items: Sequence[models.WorkItem], dim: int
) -> tuple[list[int], FloatArray] | None:
    """The common batch, decoded without a Python step per item: every payload a tensor of
    one valid (dtype, shape) and of its byte length. None for anything else (the item by item
    path then blames each bad payload). Saved 1.5 us a row of GIL time on W1 (py-spy --gil).
    """
    payloads = list(map(models.ITEM_PAYLOAD, items))
    kinds = set(
        zip(map(_FORMAT, payloads), map(_DTYPE, payloads), map(_SHAPE, payloads), strict=True)
    )
    if len(kinds) != 1:  # none, or mixed formats, dtypes or shapes
        return None
    ((fmt, _, _),) = kinds
    if fmt != models.PayloadFormat.TENSOR:
        return None
    dtype, n_bytes, reason = _tensor_header(payloads[0], "fiu", (dim,))
    data = list(map(_DATA, payloads))
    if reason is not None or set(map(len, data)) != {n_bytes}:
        return None
    raw = np.frombuffer(b"".join(data), dtype=np.dtype(dtype))
    return list(range(len(items))), _as_float32(raw.reshape(-1, dim))


def _as_float32(raw: npt.NDArray[Any]) -> FloatArray:
    """``raw`` as float32; a value past its range becomes inf without numpy's warning (the
    runner fails the row, naming why)."""
    with np.errstate(over="ignore", invalid="ignore"):
        return raw.astype(np.float32)


def block_rows(block: models.ItemBlock, dim: int) -> FloatArray | None:
    """An ItemBlock's payloads as float32 ``[n, dim]``: one ``frombuffer`` over its bytes once
    its first item passes the checks every item would (they share dtype, shape and length).
    None when that item fails them (the item path then blames each)."""
    first = block[0]
    dtype, n_bytes, reason = _tensor_header(first.payload, "fiu", (dim,))
    if reason is not None or len(first.payload.data) != n_bytes:
        return None
    raw = np.frombuffer(block.data, dtype=np.dtype(dtype))
    return _as_float32(raw.reshape(len(block), dim))


def _json_blocks(
    items: Sequence[models.WorkItem],
    rows: list[tuple[int, object]],
    dim: int,
    failures: dict[int, str],
) -> list[tuple[list[int], FloatArray]]:
    """Convert JSON rows in one numpy call, then refuse the rows a value of which is past
    float32 in one vectorised pass; on a bad value, row by row to blame the item."""
    if not rows:
        return []
    values = [value for _, value in rows]
    # numpy would read null as NaN, true as 1 and "1.5" as 1.5: every value must be a number
    # (one C pass over the batch), and none past float32 (inf after the cast).
    numbers = set(map(type, itertools.chain.from_iterable(values))) <= {int, float}  # type: ignore[arg-type]
    try:
        with np.errstate(over="ignore"):
            matrix = np.array(values, dtype=np.float32)
        if numbers and matrix.shape == (len(rows), dim) and np.isfinite(matrix).all():
            return [([pos for pos, _ in rows], matrix)]
    except (ValueError, TypeError, OverflowError):
        pass
    good: list[tuple[int, FloatArray]] = []
    for pos, value in rows:
        reason = number_list_error(typing.cast(list[object], value), "x")
        try:
            row = np.array(value, dtype=np.float32) if reason is None else None
        except (ValueError, TypeError, OverflowError):
            row = None
        if reason is not None or row is None or row.shape != (dim,):
            failures[items[pos].id] = reason or f'"x" must be a list of {dim} numbers'
        else:
            good.append((pos, row))
    if not good:
        return []
    return [([pos for pos, _ in good], np.stack([row for _, row in good]))]


def token_seq(payload: models.Payload) -> tuple[IntArray | None, str | None]:
    """One item's token ids as int64, or a reason."""
    if payload.format == models.PayloadFormat.JSON:
        value, reason = _json_field(payload.data, "tokens")
        if reason is not None:
            return None, reason
        if not isinstance(value, list) or not value:
            return None, f'"tokens" must be a non-empty list of integers, got {_describe(value)}'
        reason = int_list_error(value, "tokens")
        arr = _int_array(value) if reason is None else None
        if arr is None or arr.ndim != 1 or arr.dtype.kind not in "iu":
            return None, reason or f'"tokens" must be a list of integers, got {_describe(value)}'
        return arr.astype(np.int64), None
    dtype, reason = _tensor_dtype(payload, "iu", None)
    if dtype is None:
        return None, reason
    arr = np.frombuffer(payload.data, dtype=np.dtype(dtype)).astype(np.int64)
    if arr.size == 0:
        return None, "token tensor is empty"
    return arr, None


def _int_array(value: object) -> npt.NDArray[Any] | None:
    if not isinstance(value, list):
        return None
    try:
        return np.array(value)
    except (ValueError, TypeError, OverflowError):  # ragged or unconvertible
        return None


def fit_error(
    payload: models.Payload, kind: str, input_dim: int | None, vocab_size: int | None
) -> str | None:
    """Why the runner's decode would fail ``payload`` for a model of input ``kind`` (``dense``
    of ``input_dim`` numbers, ``tokens`` below ``vocab_size``), or None: the decode's own
    checks and words, so an item refused at the HTTP door reads as one failed at decode.
    (Item limits, such as ``model.max_item_tokens``, are the ingress's own check.)"""
    if kind == "dense":
        assert input_dim is not None  # dense models always know it (zoo.describe)
        blocks, failures = dense_rows([models.WorkItem(0, "", payload, 0.0)], input_dim)
        if failures:
            return failures[0]
        return None if all(np.isfinite(rows).all() for _, rows in blocks) else NOT_FINITE
    seq, reason = token_seq(payload)
    if seq is None:
        return reason or "payload has no tokens"
    return reason or token_range_error(seq, vocab_size)


Contract = tuple[str, int | None, int | None]
"""How a model is fed: (input kind, input_dim, vocab_size), as ``fit_error`` takes them."""


def fit_any_error(payload: models.Payload, contracts: Sequence[Contract]) -> str | None:
    """None when ``payload`` fits one of ``contracts`` (the versions a queue may be routed
    to), else why it does not fit: the first contract's reason among those of the kind the
    payload looks meant for (token ids, or numbers), else the first's."""
    reasons: list[tuple[str, str]] = []
    for kind, input_dim, vocab_size in contracts:
        reason = fit_error(payload, kind, input_dim, vocab_size)
        if reason is None:
            return None
        reasons.append((kind, reason))
    meant = _meant_kind(payload)
    return next((r for k, r in reasons if k == meant), reasons[0][1] if reasons else None)


def _meant_kind(payload: models.Payload) -> str:
    """``tokens`` for a JSON object with ``tokens`` or an integer tensor, else ``dense``."""
    if payload.format == models.PayloadFormat.TENSOR:
        return "tokens" if payload.integer_tensor else "dense"
    try:
        doc = orjson.loads(payload.data)
    except ValueError:
        return "dense"
    return "tokens" if isinstance(doc, dict) and "tokens" in doc else "dense"


def token_range_error(seq: IntArray, vocab_size: int | None) -> str | None:
    low, high = int(seq.min()), int(seq.max())
    if low < 1 or (vocab_size is not None and high >= vocab_size):
        bound = f"[1, {vocab_size})" if vocab_size is not None else ">= 1"
        return f"token ids must be in {bound} (0 is padding), got min {low} max {high}"
    return None


def _json_field(data: bytes, key: str) -> tuple[object, str | None]:
    try:
        doc = orjson.loads(data)
    except ValueError as exc:
        return None, f"payload is not valid JSON ({errors.one_line(exc, 120)})"
    if doc is None:  # a null row of a dataset's payload column, too
        return None, f'payload is null: give it a value ({{"{key}": ...}}, or a list)'
    if not isinstance(doc, dict):
        return None, f'payload must be a JSON object with "{key}", got {_describe(doc)}'
    if key not in doc:
        keys = ", ".join(sorted(map(str, doc))[:5]) or "none"
        return None, f'payload has no "{key}" (its keys: {keys}); is it meant for another model?'
    return doc[key], None


@functools.lru_cache(maxsize=64)
def _le_dtype(name: str) -> np.dtype[Any] | None:
    """Little-endian numpy dtype for a payload's dtype name (cached: called per item)."""
    try:
        return np.dtype(name).newbyteorder("<")
    except (TypeError, ValueError):
        return None


_Header = tuple[str, int, None] | tuple[str, int, str]


def _tensor_dtype(
    payload: models.Payload, kinds: str, shape: tuple[int] | None
) -> tuple[str | None, str | None]:
    """Validate a tensor payload: returns its little-endian dtype string, or a reason.

    ``shape`` None accepts any 1-D length; tensors may also be ``(1, n)``.
    """
    dtype, n_bytes, reason = _tensor_header(payload, kinds, shape)
    if reason is None and len(payload.data) != n_bytes:
        reason = _size_reason(payload, n_bytes)
    return (None, reason) if reason is not None else (dtype, None)


def _tensor_header(payload: models.Payload, kinds: str, shape: tuple[int] | None) -> _Header:
    """Check a tensor payload's dtype and shape (not its data): ``(dtype string, expected
    byte length, None)``, or ``("", 0, reason)``."""
    if payload.dtype is None or payload.shape is None:
        return "", 0, "tensor payload needs dtype and shape"
    dtype = _le_dtype(payload.dtype)
    if dtype is None:
        return "", 0, f"unknown tensor dtype {payload.dtype!r}"
    if dtype.kind not in kinds:
        return "", 0, f"tensor dtype {payload.dtype} not accepted here (kinds {kinds!r})"
    dims = tuple(payload.shape)
    flat = dims[1:] if len(dims) == 2 and dims[0] == 1 else dims
    if len(flat) != 1 or (shape is not None and flat != shape):
        want = f"({shape[0]},)" if shape is not None else "(n,)"
        return "", 0, f"tensor shape {dims} does not match {want}"
    return dtype.str, math.prod(flat) * dtype.itemsize, None


def _size_reason(payload: models.Payload, n_bytes: int) -> str:
    return (
        f"tensor has {len(payload.data)} bytes, expected {n_bytes}"
        f" ({payload.dtype}, shape {payload.shape})"
    )


FLOAT32_MAX = float(np.finfo(np.float32).max)
_INT64 = (-(2**63), 2**63 - 1)


def _not_numbers(values: list[object], field: str) -> str | None:
    """Why ``values`` holds something other than numbers (``null``, ``true``, a string), or
    None: the per-row part of :func:`number_list_error`, one pass of ``type``."""
    if set(map(type, values)) <= {int, float}:
        return None
    pos, bad = next((i, v) for i, v in enumerate(values) if type(v) not in (int, float))
    return f'"{field}"[{pos}] is {_value(bad)}, not a number'


def number_list_error(values: list[object], field: str) -> str | None:
    """Why ``values`` is not a list of float32 numbers, naming the first bad one, or None.

    orjson already refuses NaN and Infinity literals (not JSON) and numbers past float64; what
    it reads and numpy would still take is refused here, since numpy reads ``null`` as NaN,
    ``true`` as 1, ``"1.5"`` as 1.5 and turns 1e39 into an infinite float32, and a retry cannot
    make any of them a number. One pass of ``type`` over the values, a scan only on failure.
    """
    not_numbers = _not_numbers(values, field)
    if not_numbers is not None:
        return not_numbers
    try:
        over = np.abs(np.array(values, dtype=np.float64)) > FLOAT32_MAX
    except OverflowError:  # an integer past float64 (Python's json reads one; orjson does not)
        over = np.array([abs(v) > FLOAT32_MAX for v in values])  # type: ignore[arg-type]
    if over.any():
        pos = int(np.argmax(over))
        return (
            f'"{field}"[{pos}] = {values[pos]!r} is beyond float32 '
            f"(|v| <= {FLOAT32_MAX:.8g}); give a finite float32 number"
        )
    return None


def int_list_error(values: list[object], field: str) -> str | None:
    """Why ``values`` is not a list of int64 integers (``true`` and ``1.0`` are not), or None."""
    if set(map(type, values)) != {int}:
        pos, bad = next((i, v) for i, v in enumerate(values) if type(v) is not int)
        return f'"{field}"[{pos}] is {_value(bad)}, not an integer'
    ints = typing.cast(list[int], values)
    if min(ints) < _INT64[0] or max(ints) > _INT64[1]:
        pos = next(i for i, v in enumerate(ints) if not _INT64[0] <= v <= _INT64[1])
        return f'"{field}"[{pos}] = {ints[pos]} is out of range for a token id'
    return None


def _value(value: object) -> str:
    """A JSON value as a reason shows it: ``null``, ``true``, a string, a list, ..."""
    if value is None or isinstance(value, bool):
        return orjson.dumps(value).decode()
    if isinstance(value, str):
        shown = value if len(value) <= 40 else value[:37] + "..."
        return f"the string {orjson.dumps(shown).decode()}"
    if isinstance(value, list | dict):
        return f"a {'list' if isinstance(value, list) else 'JSON object'}"
    return repr(value)


def _describe(value: object) -> str:
    if isinstance(value, list):
        return f"a list of {len(value)}"
    return type(value).__name__
