"""Request bodies into ``EnqueueRecord``s, through the checks ``batching enqueue`` makes of a
file's records (:func:`batching.ingress.ingest.record_from_mapping`, ``check_limits``): the
same fields, messages and item limits, whichever way an item comes in.

A body is one item, or ``{"items": [...]}``. A payload is a JSON object or array, or a
binary tensor written ``{"tensor": {"dtype", "shape", "data_b64"}}`` (little-endian bytes,
base64), stored as the tensor payload a Parquet list column becomes.
"""

from __future__ import annotations

import base64
import binascii
import dataclasses
import math
from collections.abc import Callable
from typing import Any

from batching import errors, models
from batching.ingress import ingest

MAX_ITEMS = 10_000
"""The most items one request may hold."""
TENSOR_DTYPES = frozenset(
    [
        "float16",
        "float32",
        "float64",
        "int8",
        "int16",
        "int32",
        "int64",
        "uint8",
        "uint16",
        "uint32",
        "uint64",
    ]
)
_ITEMSIZE = {name: int(name.lstrip("floatuin")) // 8 for name in TENSOR_DTYPES}
_MAX_DIMS = 8


class TenantMismatch(errors.InputError):
    """An item names a tenant other than its token's: a client enqueues as its own tenant."""


Fits = Callable[[models.Payload], str | None]
"""Why the model's decode would fail a payload, or None (``payloads.fit_any_error`` of the
config's model versions, bound by the CLI)."""


def records(
    body: Any, tenant: str, limits: ingest.ItemLimits, fits: Fits | None = None
) -> list[models.EnqueueRecord]:
    """The records of a request body, each bound to ``tenant`` (the token's).

    Args:
        body: the parsed JSON document.
        tenant: the token's tenant: an item without ``tenant`` gets it.
        limits: the model's item limits (``ingest.ItemLimits``).
        fits: refuses a payload the model cannot take (its input length, its vocabulary),
            with the reason its decode would give; None: such an item is accepted and fails
            dead at decode.

    Returns:
        At least one record, keys distinct, in the body's order.

    Raises:
        InputError: the body, an item or a payload is malformed, or past a limit; the
            message names the item (``items[3]``) and the fix.
        TenantMismatch: an item names another tenant.
    """
    if isinstance(body, dict) and "items" in body:
        if set(body) != {"items"}:
            raise errors.InputError('body: give either one item or {"items": [...]}, not both')
        items = body["items"]
        if not isinstance(items, list) or not items:
            raise errors.InputError('body: "items" must be a non-empty list of items')
        if len(items) > MAX_ITEMS:
            raise errors.InputError(
                f"body: {len(items)} items, more than {MAX_ITEMS} in one request; split it"
            )
        found = [_record(obj, tenant, limits, fits, f"items[{n}]") for n, obj in enumerate(items)]
    else:
        found = [_record(body, tenant, limits, fits, "body")]
    _check_unique(found)
    return found


def _record(
    obj: Any, tenant: str, limits: ingest.ItemLimits, fits: Fits | None, where: str
) -> models.EnqueueRecord:
    if not isinstance(obj, dict):
        raise errors.InputError(f"{where}: expected a JSON object with item_key and payload")
    given = obj.get("tenant", tenant)
    if isinstance(given, str) and given != tenant:
        raise TenantMismatch(
            f"{where}: tenant {given[:200]!r} is not this token's tenant; leave tenant out "
            "(the token's is used) or use that tenant's token"
        )
    tensor = _tensor(obj.get("payload"), where)
    fields = {**obj, "tenant": given}  # a tenant that is not text: ingest's message
    if tensor is not None:
        fields["payload"] = {}  # checked below; the other fields as a JSON item's
    record = ingest.record_from_mapping(fields, where)
    if tensor is not None:
        cost = record.cost if "cost" in obj else max(1, math.prod(tensor.shape or (1,)))
        record = dataclasses.replace(record, payload=tensor, cost=cost)
    ingest.check_limits(record, limits, where)
    if fits is not None and (reason := fits(record.payload)) is not None:
        raise errors.InputError(
            f"{where}: item {record.item_key!r} does not fit the model: {reason}; "
            "send the payload the config's model takes"
        )
    return record


def _tensor(payload: Any, where: str) -> models.Payload | None:
    """The tensor payload ``{"tensor": {...}}``, or None for any other payload."""
    if not (isinstance(payload, dict) and set(payload) == {"tensor"}):
        return None
    spec, at = payload["tensor"], f"{where}: payload.tensor"
    if not isinstance(spec, dict) or set(spec) != {"dtype", "shape", "data_b64"}:
        raise errors.InputError(f"{at} must be an object of dtype, shape and data_b64")
    dtype, shape, data = spec["dtype"], spec["shape"], spec["data_b64"]
    if not isinstance(dtype, str) or dtype not in TENSOR_DTYPES:
        raise errors.InputError(
            f"{at}.dtype must be one of {', '.join(sorted(TENSOR_DTYPES))}, got {str(dtype)[:40]!r}"
        )
    if not (
        isinstance(shape, list)
        and 1 <= len(shape) <= _MAX_DIMS
        and all(type(d) is int and 0 <= d < 2**31 for d in shape)
    ):
        raise errors.InputError(
            f"{at}.shape must be a list of 1 to {_MAX_DIMS} non-negative integers"
        )
    raw = _base64(data, at)
    want = math.prod(shape) * _ITEMSIZE[dtype]
    if len(raw) != want:
        raise errors.InputError(
            f"{at}: data_b64 holds {len(raw)} bytes; shape {shape} of {dtype} needs {want}"
        )
    return models.Payload(raw, models.PayloadFormat.TENSOR, dtype, tuple(shape))


def _base64(data: Any, at: str) -> bytes:
    if not isinstance(data, str):
        raise errors.InputError(f"{at}.data_b64 must be a base64 string")
    try:
        return base64.b64decode(data.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        raise errors.InputError(
            f"{at}.data_b64 is not valid base64 (standard alphabet, padded)"
        ) from None


def _check_unique(found: list[models.EnqueueRecord]) -> None:
    first: dict[str, int] = {}
    for n, record in enumerate(found):
        seen = first.setdefault(record.item_key, n)
        if seen != n:
            raise errors.InputError(
                f"items[{n}]: item_key {record.item_key!r} repeats items[{seen}]; give each "
                "item its own key"
            )


# -- the OpenAPI schema of a POST body (the checks above are what enforce it) -----------

ITEM_SCHEMA: dict[str, Any] = {
    "type": "object",
    "required": ["item_key", "payload"],
    "properties": {
        "item_key": {"type": "string", "maxLength": 500},
        "payload": {
            "description": 'a JSON object or array, or {"tensor": {"dtype", "shape", "data_b64"}}',
            "oneOf": [{"type": "object"}, {"type": "array"}],
        },
        "tenant": {"type": "string", "description": "the token's tenant (the default)"},
        "priority": {"type": "integer"},
        "deadline": {"oneOf": [{"type": "number"}, {"type": "string", "format": "date-time"}]},
        "cost": {"type": "integer", "minimum": 1},
        "lane": {"type": "string"},
    },
    "additionalProperties": False,
}
BODY_SCHEMA: dict[str, Any] = {
    "oneOf": [
        ITEM_SCHEMA,
        {
            "type": "object",
            "required": ["items"],
            "properties": {"items": {"type": "array", "items": ITEM_SCHEMA, "minItems": 1}},
            "additionalProperties": False,
        },
    ]
}
