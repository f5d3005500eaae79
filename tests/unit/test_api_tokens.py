"""Bearer tokens bound to tenants (``batching.api.tokens``) and request bodies bound to the
token's tenant (``batching.api.requests``): parsed, looked up, refused with one line that
never holds a token."""

from __future__ import annotations

import asyncio
import base64
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from batching import errors, models
from batching.api import requests, tokens
from batching.ingress import ingest

T1, T2 = "t" * 20, "u" * 32


def test_tokens_parse_commas_and_lines_and_each_is_bound_to_its_tenant() -> None:
    known = tokens.parse(f"{T1}=acme, {T2}=globex\n# a comment\n\n", "BATCHING_API_TOKENS")
    assert len(known) == 2
    assert (known.tenant_of(T1), known.tenant_of(T2)) == ("acme", "globex")
    assert known.tenant_of("t" * 19) is None
    assert known.tenant_of(T1 + "x") is None
    assert known.tenant_of("") is None


def test_a_repr_of_the_tokens_shows_none() -> None:
    known = tokens.parse(f"{T1}=acme", "BATCHING_API_TOKENS")
    assert T1 not in repr(known)
    assert T1 not in str(known)


def test_a_client_that_leaves_mid_body_is_its_own_400_not_a_bug() -> None:
    """A client that hung up before its body was sent went to the "(a bug)" handler, with a
    traceback in the log (found by a review)."""
    from starlette.requests import ClientDisconnect

    from batching.api import app

    class Leaving:
        def __init__(self) -> None:
            self.headers = {"content-length": "1000"}

        async def stream(self) -> Any:
            yield b"x" * 11
            raise ClientDisconnect()

    with pytest.raises(app.ApiError) as info:
        asyncio.run(app._read_body(Leaving(), 10_000))  # type: ignore[arg-type]
    assert info.value.status == 400


def test_a_body_that_stops_coming_is_refused_with_408(monkeypatch: pytest.MonkeyPatch) -> None:
    """A client that sent part of its body and then nothing held its connection open for
    as long as it liked, and a SIGTERM'd API with it (found by a review)."""
    from batching.api import app

    monkeypatch.setattr(app, "BODY_STALL_S", 0.5)

    class Slow:
        def __init__(self, stall_s: float) -> None:
            self.headers = {"content-length": "1000"}
            self.stall_s = stall_s

        async def stream(self) -> Any:
            for _ in range(4):  # bytes keep coming, 0.8 s in all: each starts the wait again
                await asyncio.sleep(0.2)
                yield b"x"
            await asyncio.sleep(self.stall_s)
            yield b"y"

    assert asyncio.run(app._read_body(Slow(0.0), 10_000)) == b"xxxxy"  # type: ignore[arg-type]
    with pytest.raises(app.ApiError) as info:
        asyncio.run(app._read_body(Slow(10.0), 10_000))  # type: ignore[arg-type]
    assert (info.value.status, info.value.kind) == (408, "RequestTimeout")


def test_a_base64_token_keeps_its_padding() -> None:
    """The tenant follows the last ``=`` (a review: split at the first, the real token was
    refused and a shorter one bound to a tenant named ``==acme``)."""
    token = base64.b64encode(b"A" * 16).decode()  # ends in "=="
    known = tokens.parse(f"{token}=acme", "BATCHING_API_TOKENS")
    assert known.tenant_of(token) == "acme"
    assert known.tenant_of(token.rstrip("=")) is None
    with pytest.raises(errors.ConfigError, match="has '=' inside its token") as info:
        tokens.parse(f"{T1}=team=a", "BATCHING_API_TOKENS")  # read as tenant "team=a" before
    assert T1 not in str(info.value)


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("", "no tokens"),
        (f"{T1}", "entry 1 is not token=tenant"),
        (f"{T1}=", "entry 1 is not token=tenant"),
        ("short=acme", "shorter than 16 characters"),
        (f"{T1}=a,{T1}=b", "entry 2: the token repeats an earlier entry"),
        (f"# tokens\n{T1}", "entry 1 (line 2) is not token=tenant"),  # a file: by its line
        (f"{T1}={'x' * 201}", "the tenant must be at most 200 characters"),
    ],
)
def test_bad_token_text_is_one_line_that_never_shows_a_token(text: str, says: str) -> None:
    with pytest.raises(errors.ConfigError) as caught:
        tokens.parse(text, "ENV")
    message = str(caught.value)
    assert says in message
    assert T1 not in message
    assert "short" not in message.replace("shorter", "")


LIMITS = ingest.ItemLimits()


def test_an_item_without_tenant_gets_the_tokens_and_another_tenant_is_refused() -> None:
    (record,) = requests.records({"item_key": "k", "payload": {"x": [1.0]}}, "acme", LIMITS)
    assert (record.tenant, record.cost) == ("acme", 1)
    same = {"item_key": "k", "payload": [1, 2], "tenant": "acme"}
    assert requests.records(same, "acme", LIMITS)[0].cost == 2
    other = {"items": [same, {"item_key": "j", "payload": {}, "tenant": "globex"}]}
    with pytest.raises(requests.TenantMismatch, match=r"items\[1\]: tenant 'globex'"):
        requests.records(other, "acme", LIMITS)
    with pytest.raises(errors.InputError, match="tenant must be a string"):
        requests.records({"item_key": "k", "payload": {}, "tenant": 7}, "acme", LIMITS)


def test_a_tensor_payload_becomes_the_tensor_a_parquet_list_column_would() -> None:
    row = np.arange(6, dtype="<i8")
    spec = {"dtype": "int64", "shape": [1, 6], "data_b64": base64.b64encode(row.tobytes()).decode()}
    (record,) = requests.records({"item_key": "k", "payload": {"tensor": spec}}, "a", LIMITS)
    assert record.payload == models.Payload(
        row.tobytes(), models.PayloadFormat.TENSOR, "int64", (1, 6)
    )
    assert record.cost == 6
    with_cost = {"item_key": "k", "payload": {"tensor": spec}, "cost": 2}
    assert requests.records(with_cost, "a", LIMITS)[0].cost == 2


@pytest.mark.parametrize(
    ("tensor", "says"),
    [
        ({"dtype": "float32", "shape": [2]}, "must be an object of dtype, shape and data_b64"),
        ({"dtype": "object", "shape": [1], "data_b64": ""}, "dtype must be one of"),
        ({"dtype": "int8", "shape": [], "data_b64": ""}, "shape must be a list of 1 to 8"),
        ({"dtype": "int8", "shape": [-1], "data_b64": ""}, "non-negative integers"),
        ({"dtype": "int8", "shape": [True], "data_b64": "AA=="}, "non-negative integers"),
        ({"dtype": "int8", "shape": [1], "data_b64": "***"}, "not valid base64"),
        (
            {"dtype": "int16", "shape": [2], "data_b64": "AAA="},
            "holds 2 bytes; shape [2] of int16 needs 4",
        ),
    ],
)
def test_a_bad_tensor_says_which_part_is_wrong(tensor: object, says: str) -> None:
    with pytest.raises(errors.InputError, match=r"^items\[0\]: payload\.tensor") as caught:
        requests.records({"items": [{"item_key": "k", "payload": {"tensor": tensor}}]}, "a", LIMITS)
    assert says in str(caught.value)


def test_an_item_past_the_limits_is_refused_with_the_files_message() -> None:
    small = ingest.ItemLimits(tokens=4, elements=4, bytes=1024)
    with pytest.raises(
        errors.InputError, match=r"body: item 'k' holds 5 numbers, over the limit of 4"
    ):
        requests.records({"item_key": "k", "payload": {"x": [1, 2, 3, 4, 5]}}, "a", small)


def test_a_tokens_file_others_can_read_is_warned_of(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from batching.cli import api

    file = tmp_path / "tokens.txt"
    file.write_text(f"{T1}=acme\n")
    file.chmod(0o644)
    assert api.tokens_from_env({"BATCHING_API_TOKENS_FILE": str(file)}).tenant_of(T1) == "acme"
    assert "can be read by other users (mode 644)" in capsys.readouterr().err
    file.chmod(0o600)
    api.tokens_from_env({"BATCHING_API_TOKENS_FILE": str(file)})
    assert capsys.readouterr().err == ""
