"""Command-line arguments that are not text, refused before any command runs.

Bytes the OS could not decode as UTF-8 arrive in ``sys.argv`` as lone surrogates. A name,
reason, actor or key holding one failed only where it was written: ``unexpected
UnicodeEncodeError``, exit 1, and ``purge --actor`` had deleted its items before its audit
row failed (found by a review). A path opens as it is, so an argument naming a file or
folder that exists passes (a second review: ``enqueue recs-\\xe9.jsonl`` had worked).
"""

from __future__ import annotations

import os
from collections.abc import Sequence


def not_text(args: Sequence[str]) -> str | None:
    """The one-line refusal of the first argument that is neither UTF-8 text nor an existing
    path (named as typed, ``\\xff``); None when every argument is fine."""
    for arg in args:
        if not _fine(arg):
            shown = os.fsencode(arg).decode("utf-8", "backslashreplace")
            return (
                f"the argument '{shown}' holds bytes that are not UTF-8 text; "
                "give names, keys, reasons and paths as UTF-8"
            )
    return None


def _fine(arg: str) -> bool:
    try:
        arg.encode("utf-8")
    except UnicodeEncodeError:
        value = arg.partition("=")[2] if arg.startswith("--") else arg
        return bool(value) and os.path.exists(value)
    return True
