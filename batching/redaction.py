"""Masking credentials in URLs and free text (standard library only): whatever is logged,
printed or emitted as lineage passes through here first."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

_USERINFO = re.compile(r"(?P<head>[A-Za-z][\w+.\-]*://[^\s:/]*):\S*@")
_BARE_USERINFO = re.compile(r"(?<![\w.+\-:%])(?P<head>[\w.\-%]+):(?!//)\S*@")  # user:pass@host
_SECRET_WORD = r"(?:passw(?:or)?d|pwd|secret|token|api_?key)"
_SECRET_PAIR = re.compile(
    rf"(?i)(?<![\w-])(?P<key>[\w-]*{_SECRET_WORD})(?P<sep>[\"']?\s*[=:]\s*[\"']?)"
    r"(?P<value>[^\s&;,\"'}]+)"
)
_SECRET_KEY = re.compile(rf"(?i)^.*{_SECRET_WORD}$")


def redact_url(url: str) -> str:
    """Return ``url`` with its password and secret query values replaced by ``***``.

    The user name is kept: ``postgresql+psycopg://user:secret@host/db`` gives
    ``postgresql+psycopg://user:***@host/db``. Also safe on free text (error messages, DSNs):
    every ``scheme://user:pass@`` and ``password=...`` / ``token: ...`` in it is masked. When in
    doubt (a raw ``@`` in a password or query) it masks more, never less.
    """
    masked = _BARE_USERINFO.sub(r"\g<head>:***@", _USERINFO.sub(r"\g<head>:***@", url))
    return _SECRET_PAIR.sub(r"\g<key>\g<sep>***", masked)


def redact_mapping(value: Any) -> Any:
    """Copy ``value`` (nested mappings/lists) masking secret-named keys and redacting strings."""
    if isinstance(value, Mapping):
        return {
            str(k): "***" if _SECRET_KEY.match(str(k)) else redact_mapping(v)
            for k, v in value.items()
        }
    if isinstance(value, list | tuple):
        return [redact_mapping(v) for v in value]
    return redact_url(value) if isinstance(value, str) else value
