"""Bearer tokens, each bound to one tenant: parsed from ``token=tenant`` text, looked up in
constant time. The CLI (``BATCHING_API_TOKENS`` / ``BATCHING_API_TOKENS_FILE``) and the flows
(a Prefect Secret block) hand the text over; this module never reads the environment, and
never puts a token in a message or a log.
"""

from __future__ import annotations

import hmac
from dataclasses import dataclass, field

from batching import errors

_MAX_TENANT = 200
MIN_TOKEN_CHARS = 16
"""A shorter token is refused: it could be guessed."""


@dataclass(frozen=True)
class Tokens:
    """Tokens and the tenant each is bound to; :meth:`tenant_of` is the only look-up."""

    _pairs: tuple[tuple[bytes, str], ...] = field(repr=False)  # a repr never shows a token

    def __len__(self) -> int:
        return len(self._pairs)

    def tenant_of(self, token: str) -> str | None:
        """The tenant ``token`` is bound to, or None. Every known token is compared, each in
        constant time (``hmac.compare_digest``), so the time taken says nothing of a match."""
        given = token.encode("utf-8", "surrogateescape")
        found: str | None = None
        for known, tenant in self._pairs:
            if hmac.compare_digest(known, given):
                found = tenant
        return found


def parse(text: str, source: str) -> Tokens:
    """Tokens from ``token=tenant`` entries separated by commas or new lines (blank entries
    and ``#`` comment lines skipped). The tenant follows the LAST ``=``: a base64 token ends
    in ``=`` padding (split at the first, such a token was refused and a shorter one bound to
    a tenant named ``==acme``, without a word); so a tenant cannot hold ``=``, and an entry
    with ``=`` inside its token part (``tok=team=a``) is refused, not read one way or another.

    Args:
        text: the entries.
        source: where they came from, for messages (``BATCHING_API_TOKENS``, a file name).

    Raises:
        ConfigError: an entry is malformed, a token is too short or given twice, or there is
            none; the message names the entry by its position, never the token.
    """
    pairs: dict[str, str] = {}
    lines = text.splitlines()
    entries = [(k, e.strip()) for k, line in enumerate(lines, 1) for e in line.split(",")]
    kept = ((k, e) for k, e in entries if e and not e.startswith("#"))
    for n, (line, entry) in enumerate(kept, start=1):
        token, sep, tenant = entry.rpartition("=")
        token, tenant = token.strip(), tenant.strip()
        where = f"{source}: entry {n}" + (f" (line {line})" if len(lines) > 1 else "")
        if not sep or not token or not tenant:
            raise errors.ConfigError(f"{where} is not token=tenant; write each as TOKEN=TENANT")
        if "=" in token.rstrip("="):  # tok=team=a: token "tok" of tenant "team=a", or not?
            raise errors.ConfigError(
                f"{where} has '=' inside its token (only a token's trailing padding may be "
                "'='); a tenant cannot hold '=': rename it"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise errors.ConfigError(
                f"{where}: the token is shorter than {MIN_TOKEN_CHARS} characters; use a "
                "random one (python -c 'import secrets; print(secrets.token_urlsafe(32))')"
            )
        if len(tenant) > _MAX_TENANT or "\x00" in tenant:
            raise errors.ConfigError(
                f"{where}: the tenant must be at most {_MAX_TENANT} characters"
            )
        if token in pairs:
            raise errors.ConfigError(f"{where}: the token repeats an earlier entry; give one each")
        pairs[token] = tenant
    if not pairs:
        raise errors.ConfigError(
            f"{source}: no tokens; give at least one TOKEN=TENANT (comma-separated)"
        )
    return Tokens(tuple((t.encode("utf-8", "surrogateescape"), v) for t, v in pairs.items()))
