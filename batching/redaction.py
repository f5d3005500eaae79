"""Masking credentials in URLs and free text (standard library only): whatever is logged,
printed or emitted as lineage passes through here first.

Found by parsing as the drivers do, not by guessing where a password ends: SQLAlchemy takes
everything after ``scheme://USER:`` up to the ``@`` before the host as the password, spaces,
``/``, ``?``, ``#`` and line breaks included, so a password here runs from the first ``:``
after the user to the last ``@`` of the text. A query's ``password=`` runs to the next ``&``
(or the line's end), a libpq ``password='...'`` to its closing quote. Free text holding such
a URL may lose more than the password (up to a later ``@``), never less.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

# scheme://USER:PASSWORD@ with the user as SQLAlchemy reads it (no ':' or '/'; '@' allowed) and
# the password up to the last '@' of the text.
_USERINFO = re.compile(r"(?P<head>[A-Za-z][\w+.\-]*://[^:/]*):[\s\S]*@")
_BARE_USERINFO = re.compile(r"(?<![\w.+\-:%])(?P<head>[\w.\-%]+):(?!//)\S*@")  # user:pass@host
_SPACE = r"[ \t\n\r\f\v]"  # what libpq takes for a space (C isspace)
# signature, sig: a presigned S3 URL's X-Amz-Signature, an Azure SAS token's sig; the keys
# object stores take (an Azure connection string's AccountKey=, azure_storage_master_key)
_SECRET_WORD = (
    r"(?:passw(?:or)?d|pwd|secret|token|api_?key|signature|sig"
    r"|(?:access|account|master|private)_?key|client_?certificate|connection_?string)"
)
_SECRET_PAIR = re.compile(
    # a URL query's pair: the value runs to the next '&' (a raw space is part of it)
    rf"(?i)(?<=[?&])(?P<qkey>[\w-]*{_SECRET_WORD})=(?P<qvalue>[^&\n]*)"
    # key=value, key: value, "key": "value", key='value' (libpq): a quoted value to its
    # closing quote (backslash escapes), else to the next space (a libpq '\ ' included)
    rf"|(?<![\w-])(?P<key>[\w-]*{_SECRET_WORD})(?P<sep>[\"']?{_SPACE}*[=:]{_SPACE}*)"
    r"(?:(?P<quote>[\"'])(?:\\[\s\S]|(?!(?P=quote))[^\\])*(?P=quote)?"
    rf"|(?:\\[\s\S]|[^\\{_SPACE[1:-1]}])+)"
)
_SECRET_KEY = re.compile(rf"(?i)^.*{_SECRET_WORD}$")


def redact_url(url: object) -> str:
    """Return ``url`` with its password and secret query values replaced by ``***``.

    The user name is kept: ``postgresql+psycopg://user:secret@host/db`` gives
    ``postgresql+psycopg://user:***@host/db``. Also safe on free text (error messages, DSNs,
    stack traces): every ``scheme://user:pass@``, ``?password=...`` and ``password='...'`` /
    ``token: ...`` in it is masked. A SQLAlchemy ``URL`` (or anything else) is redacted as its
    ``str``. When in doubt it masks more, never less.
    """
    text = url if isinstance(url, str) else str(url)
    masked = _BARE_USERINFO.sub(r"\g<head>:***@", _USERINFO.sub(r"\g<head>:***@", text))
    return _SECRET_PAIR.sub(_mask_pair, masked)


def _mask_pair(match: re.Match[str]) -> str:
    if match["qkey"] is not None:
        return f"{match['qkey']}=***"
    quote = match["quote"] or ""
    return f"{match['key']}{match['sep']}{quote}***{quote}"


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
