"""Credentials of flow runs: Prefect Secret blocks named in parameters, never values.

A flow-run parameter is stored in plain text by the Prefect API (shown in the UI, kept with
the run) and copied into the runs its events trigger; so is a deployment's job variable. So:

* the database URL, password included, comes from the Secret block that ``db_url_secret``
  names (``Secret(value=URL).save(NAME)``, or UI: Blocks, Secret), else from the worker's
  environment (``BATCHING_DB_URL`` without a password plus ``PGPASSWORD`` or ``~/.pgpass``);
* the lineage API key from the Secret block that ``lineage_api_key_secret`` names, else
  ``OPENLINEAGE_API_KEY`` on the worker;
* the HTTP ingress's bearer tokens (``TOKEN=TENANT`` pairs) from the Secret block
  ``batching-api-tokens`` (:func:`api_tokens`), as ``batching api`` takes them from
  ``BATCHING_API_TOKENS``;
* a run whose parameters hold a password (``db_url``, ``output``, any string under
  ``overrides``) is refused when it starts: :func:`refuse_passwords`;
* a ``prefect.yaml`` that would store one is refused before ``prefect deploy``:
  ``python -m flows.credentials deployments/prefect.yaml`` (:func:`check_prefect_yaml`).
"""

from __future__ import annotations

import argparse
import os
import re
import sys
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any, cast

import yaml
from pydantic import SecretStr

from batching import config, errors
from batching.redaction import redact_url

FIX = (
    "name a Prefect Secret block instead (db_url_secret / lineage_api_key_secret), or give "
    "the password to the worker (PGPASSWORD or ~/.pgpass)"
)
_SECRET_KEY = re.compile(
    r"(?i)(?<!_)(passw(or)?d|pwd|secret|tokens?|api_?key)$|_(passw(or)?d|pwd|tokens?|api_?key)$"
)
"""A key whose value is a credential; ``*_secret`` keys name a Secret block, not a value."""
_BLOCK_REF = re.compile(r"\{\{\s*prefect\.blocks\.secret\.")
_ENV_REF = re.compile(r"\{\{\s*\$(\w+)\s*\}\}")


def has_password(text: str) -> bool:
    """Whether ``text`` holds a credential: a URL's password, a ``password=`` or ``api_key=``
    value (what :func:`batching.redaction.redact_url` masks)."""
    return redact_url(text) != text


def _strings(value: Any, path: str) -> Iterator[tuple[str, str, Any]]:
    """``(path, key, value)`` of every leaf under ``value``; paths like ``overrides.database.url``."""
    if isinstance(value, Mapping):
        for key, inner in value.items():
            yield from _strings(inner, f"{path}.{key}")
    elif isinstance(value, list | tuple):
        for i, inner in enumerate(value):
            yield from _strings(inner, f"{path}[{i}]")
    else:
        yield path, path.rpartition(".")[2], value


def secret_leaves(value: Any, path: str) -> list[str]:
    """Paths of the leaves under ``value`` that hold a credential: a string with a password,
    or a non-empty value under a key like ``password`` or ``api_key``."""
    found = []
    for where, key, leaf in _strings(value, path):
        if (isinstance(leaf, str) and has_password(leaf)) or (
            _SECRET_KEY.search(key) and leaf not in (None, "")
        ):
            found.append(where)
    return found


def refuse_passwords(**parameters: Any) -> None:
    """Refuse flow parameters that hold a password, before the run does anything.

    Raises:
        ConfigError: one line naming the first such parameter and the fix.
    """
    for name, value in parameters.items():
        if found := secret_leaves(value, name):
            raise errors.ConfigError(
                f"flow parameter {found[0]} holds a password, which the Prefect API would "
                f"store in plain text: {FIX}"
            )


def read_secret(name: str, parameter: str) -> str:
    """The string held by the Prefect Secret block ``name``.

    Raises:
        ConfigError: no such block, or it holds no string (the message names ``parameter``).
    """
    from prefect.blocks.system import Secret

    try:
        block = cast("Secret[Any]", Secret.load(name, _sync=True))  # type: ignore[call-arg]
    except ValueError:
        raise errors.ConfigError(
            f"{parameter}: no Prefect Secret block named {name!r}; create it with "
            f"`Secret(value=...).save({name!r})` or in the UI (Blocks, Secret)"
        ) from None
    value = block.get()
    if not isinstance(value, str) or not value:
        raise errors.ConfigError(f"{parameter}: the Secret block {name!r} holds no string")
    return value


API_TOKENS_SECRET = "batching-api-tokens"
"""The Secret block of the HTTP ingress's tokens: ``TOKEN=TENANT`` pairs, comma-separated."""


def api_tokens(secret: str = API_TOKENS_SECRET) -> Any:
    """The HTTP ingress's tokens (``batching.api.tokens.Tokens``) held by the Secret block
    ``secret``, for a flow that serves the API.

    Raises:
        ConfigError: no such block, it holds no string, or an entry is malformed (the
            message names the entry, never a token).
    """
    from batching.api import tokens

    return tokens.parse(read_secret(secret, "api_tokens_secret"), f"Secret block {secret!r}")


def db_url(db_url: str | None, db_url_secret: str | None) -> str | None:
    """The database URL a run names: the ``db_url_secret`` block's, else ``db_url`` (None:
    ``$BATCHING_DB_URL``, else the config's).

    Raises:
        ConfigError: both are given, or the block cannot be read.
    """
    if db_url_secret and db_url:
        raise errors.ConfigError(
            "flow parameters db_url and db_url_secret both given: keep one (db_url_secret when "
            "the URL has a password)"
        )
    return read_secret(db_url_secret, "db_url_secret") if db_url_secret else db_url


def with_lineage_api_key(
    cfg: config.PipelineConfig, lineage_api_key_secret: str | None
) -> config.PipelineConfig:
    """``cfg`` with the lineage API key of the ``lineage_api_key_secret`` block, if named
    (``OPENLINEAGE_API_KEY`` on the worker still wins, as for a key in the config)."""
    if not lineage_api_key_secret:
        return cfg
    key = SecretStr(read_secret(lineage_api_key_secret, "lineage_api_key_secret"))
    return cfg.model_copy(update={"lineage": cfg.lineage.model_copy(update={"api_key": key})})


def check_prefect_yaml(path: Path, env: Mapping[str, str] = os.environ) -> list[str]:
    """What in a ``prefect.yaml`` would put a credential into the Prefect API: a value with a
    password (after ``{{ $VAR }}`` is filled from ``env``, as ``prefect deploy`` does), or a
    ``{{ prefect.blocks.secret.* }}`` reference (``prefect deploy`` stores its value in the
    deployment). Returns one line per finding; empty when clean.

    Raises:
        ConfigError: the file is missing or not YAML.
    """
    try:
        spec = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, yaml.YAMLError) as exc:
        raise errors.ConfigError(f"{path}: not a readable prefect.yaml ({exc})") from None
    problems = []
    for where, key, leaf in _strings(spec, "prefect.yaml"):
        if not isinstance(leaf, str):
            if _SECRET_KEY.search(key) and leaf is not None:
                problems.append(f"{where}: a credential value; {FIX}")
            continue
        if _BLOCK_REF.search(leaf):
            problems.append(
                f"{where}: `prefect deploy` stores the Secret block's value in the deployment; "
                "pass its name as a flow parameter (db_url_secret / lineage_api_key_secret)"
            )
            continue
        filled = _ENV_REF.sub(lambda m: env.get(m.group(1), ""), leaf)
        if _SECRET_KEY.search(key) and filled:  # the value itself: never shown
            written = f" ({leaf.strip()!r} as filled here)" if _ENV_REF.search(leaf) else ""
            problems.append(f"{where}: a credential value{written}; {FIX}")
        elif has_password(filled):
            problems.append(f"{where}: {redact_url(filled)!r} holds a password; {FIX}")
    return problems


def main(argv: list[str] | None = None) -> None:
    """Command line: ``python -m flows.credentials [PREFECT_YAML]``; exit 1 when a finding."""
    parser = argparse.ArgumentParser(
        prog="python -m flows.credentials",
        description="Check a prefect.yaml for credentials before `prefect deploy` stores them.",
    )
    parser.add_argument(
        "prefect_yaml", nargs="?", default="deployments/prefect.yaml", type=Path,
        help="the file to check (default deployments/prefect.yaml)",
    )  # fmt: skip
    args = parser.parse_args(argv)
    try:
        problems = check_prefect_yaml(args.prefect_yaml)
    except errors.ConfigError as exc:
        sys.stderr.write(f"{exc}\n")
        sys.exit(2)
    for line in problems:
        sys.stderr.write(f"{args.prefect_yaml}: {line}\n")
    if problems:
        sys.exit(1)
    print(f"{args.prefect_yaml}: no credentials found")


if __name__ == "__main__":
    main()
