"""The OpenLineage client's configuration conventions, applied over the pipeline's ``lineage:``.

Where the openlineage-python client (``OpenLineageClient``) looks, and in its precedence,
highest first:

1. ``OPENLINEAGE_DISABLED=true``: transport ``none``, whatever else says.
2. The client's config: the first of ``$OPENLINEAGE_CONFIG``, ``./openlineage.yml`` (the
   working folder), ``~/.openlineage/openlineage.yml``, with the dynamic variables
   ``OPENLINEAGE__TRANSPORT__*`` over it (``OPENLINEAGE__TRANSPORT__URL`` is ``transport.url``;
   a value is read as JSON when it is JSON). Its ``transport`` settings win over step 3.
3. ``OPENLINEAGE_URL`` (switches to http), ``OPENLINEAGE_ENDPOINT``, ``OPENLINEAGE_API_KEY``.
4. The pipeline config's ``lineage:`` section, then its defaults.

``OPENLINEAGE_NAMESPACE`` sets the job namespace. A setting no OpenLineage source gives keeps the
pipeline config's value: an ``openlineage.yml`` naming the http transport and its url leaves
``namespace``, the spool settings, and ``timeout_s`` / ``retries`` unless it sets ``timeout`` /
``retry``, as the config says. A relative ``log_file_path`` starts from the config's folder,
like ``lineage.path``. Transport keys batching cannot honour (another ``type``, ``compression``,
``custom_headers``, another ``auth`` type ...) are refused, naming the source; the client's other
sections (``facets``, ``filters``, ``tags``, ``dataset``) are not used and listed as such.

Unlike the client, a file that ``$OPENLINEAGE_CONFIG`` names and that is missing, unreadable or
not a YAML mapping is refused (the client goes on silently without it).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from batching import config, errors
from batching.redaction import redact_url

CONFIG_ENV = "OPENLINEAGE_CONFIG"
FILE_NAME = "openlineage.yml"
_DYNAMIC = "OPENLINEAGE__"
_ENV_TRANSPORT = "OPENLINEAGE__TRANSPORT__"
_TYPES = {"http": "http", "file": "file", "console": "console", "noop": "none", "none": "none"}
# The client's transport keys batching honours, and the LineageConfig field each sets.
_FIELDS = {
    "type": "transport",
    "url": "url",
    "endpoint": "endpoint",
    "timeout": "timeout_s",
    "retry": "retries",
    "log_file_path": "path",
    "auth": "api_key",
}
_ACCEPTED = {*_FIELDS, "append"}  # append: batching's file transport always appends


@dataclass(frozen=True)
class Resolved:
    """The effective lineage settings, where each came from, the ``openlineage.yml`` read
    (if any) and what of the client's config batching does not use."""

    config: config.LineageConfig
    sources: Mapping[str, str]
    file: Path | None = None
    unused: tuple[str, ...] = field(default=())


def find_file(
    env: Mapping[str, str], *, cwd: Path | None = None, home: Path | None = None
) -> Path | None:
    """The client's config file: ``$OPENLINEAGE_CONFIG``, else ``openlineage.yml`` in ``cwd``,
    else in ``~/.openlineage``; ``None`` when there is none.

    Raises:
        ConfigError: ``$OPENLINEAGE_CONFIG`` names a file that is missing or unreadable.
    """
    named = env.get(CONFIG_ENV, "").strip()
    if named:
        path = Path(named).expanduser()
        if not path.is_file() or not os.access(path, os.R_OK):
            raise errors.ConfigError(
                f"{CONFIG_ENV}={named}: no readable file there; fix the path or unset it"
            )
        return path
    home_dir = home if home is not None else Path.home()
    for path in ((cwd or Path.cwd()) / FILE_NAME, home_dir / ".openlineage" / FILE_NAME):
        if path.is_file() and os.access(path, os.R_OK):
            return path
    return None


def lineage_config(base: config.LineageConfig, env: Mapping[str, str]) -> config.LineageConfig:
    """``base`` (the pipeline config's ``lineage:``) under the OpenLineage client's sources
    (``env``: the process environment, which only the edges read).

    Raises:
        ConfigError: a source holds an invalid or unsupported setting (named in the message).
    """
    return resolve(base, env).config


def resolve(
    base: config.LineageConfig,
    env: Mapping[str, str],
    *,
    files: bool = True,
    cwd: Path | None = None,
    home: Path | None = None,
) -> Resolved:
    """The effective lineage settings and each one's source (see the module docstring).

    ``files``: look for ``openlineage.yml`` too (``False``: the environment alone).

    Raises:
        ConfigError: a source holds an invalid or unsupported setting (named in the message).
    """
    upper = {k.upper(): v for k, v in env.items() if k.upper().startswith("OPENLINEAGE")}
    sources = {name: _base_source(base, name) for name in type(base).model_fields}
    updates: dict[str, Any] = {}

    def put(name: str, value: Any, source: str) -> None:
        updates[name] = value
        sources[name] = source

    for var, name in (("URL", "url"), ("ENDPOINT", "endpoint"), ("API_KEY", "api_key")):
        if upper.get(f"OPENLINEAGE_{var}"):
            put(name, upper[f"OPENLINEAGE_{var}"], f"OPENLINEAGE_{var}")
    if "url" in updates:
        put("transport", "http", "OPENLINEAGE_URL")
    if upper.get("OPENLINEAGE_NAMESPACE"):
        put("namespace", upper["OPENLINEAGE_NAMESPACE"], "OPENLINEAGE_NAMESPACE")
    path = find_file(upper, cwd=cwd, home=home) if files else None
    doc = _read_file(path) if path is not None else {}
    unused = [f"{path}: {k}" for k in doc if k != "transport"]
    dynamic, dynamic_unused = _dynamic(upper)
    unused += dynamic_unused
    for key, (value, source) in _transport(doc.get("transport"), path, dynamic).items():
        put(_FIELDS[key], _value(key, value, source), source)
    disabled = upper.get("OPENLINEAGE_DISABLED", "").strip().lower()
    if disabled not in ("", "true", "false"):
        raise errors.ConfigError(
            f"OPENLINEAGE_DISABLED={upper['OPENLINEAGE_DISABLED']!r}: use true or false"
        )
    if disabled == "true":
        put("transport", "none", "OPENLINEAGE_DISABLED")
    kept = {"api_key": base.api_key}  # not in a dump
    try:
        effective = config.LineageConfig.model_validate({**base.model_dump(), **kept, **updates})
    except ValueError as exc:
        raise errors.ConfigError(_describe(exc, sources)) from None
    return Resolved(effective, sources, path, tuple(unused))


def _base_source(base: config.LineageConfig, name: str) -> str:
    if name == "api_key":
        return "unset" if base.api_key is None else "given"
    return f"pipeline config (lineage.{name})" if name in base.model_fields_set else "default"


def _read_file(path: Path) -> dict[str, Any]:
    try:
        doc = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise errors.ConfigError(
            f"{path}: not a readable OpenLineage config ({reason}); fix or remove it"
        ) from None
    if doc is None:
        return {}
    if not isinstance(doc, dict):
        raise errors.ConfigError(
            f"{path}: an OpenLineage config is a YAML mapping (transport: ...); fix or remove it"
        )
    return {str(k).lower(): v for k, v in doc.items()}


def _dynamic(upper: Mapping[str, str]) -> tuple[dict[str, tuple[Any, str]], list[str]]:
    """``OPENLINEAGE__TRANSPORT__<KEY>[__<SUB>]`` as ``{key: (value, variable)}`` (values
    read as JSON when they are JSON, as the client does); other dynamic variables unused."""
    found: dict[str, tuple[Any, str]] = {}
    unused = []
    for name in sorted(upper):
        if not name.startswith(_DYNAMIC) or not upper[name].strip():
            continue  # an empty variable is an unset one
        if not name.startswith(_ENV_TRANSPORT):
            unused.append(name)
            continue
        keys = name.removeprefix(_ENV_TRANSPORT).lower().split("__")
        value = _json_or_text(upper[name])
        for sub in reversed(keys[1:]):
            value = {sub: value}
        prior = found.get(keys[0], (None, name))[0]
        if isinstance(prior, dict) and isinstance(value, dict):
            value = {**prior, **value}
        found[keys[0]] = (value, name)
    return found, unused


def _json_or_text(raw: str) -> Any:
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


def _transport(
    section: Any, path: Path | None, dynamic: Mapping[str, tuple[Any, str]]
) -> dict[str, tuple[Any, str]]:
    """The client's transport settings: the file's, the variables' over them, by key."""
    if section is not None and not isinstance(section, dict):
        raise errors.ConfigError(
            f"{path}: transport must be a mapping (type: http, url: ...); fix or remove it"
        )
    merged = {str(k).lower(): (v, f"{FILE_NAME} ({path})") for k, v in (section or {}).items()}
    for key, (value, name) in dynamic.items():
        prior = merged.get(key, (None, ""))[0]
        both = isinstance(prior, dict) and isinstance(value, dict)
        merged[key] = ({**prior, **value} if both else value, name)
    for key, (_, source) in merged.items():
        if key not in _ACCEPTED:
            raise errors.ConfigError(
                f"{source}: transport setting {key!r} is not supported by batching (it honours "
                "type, url, endpoint, timeout, retry, auth with an api_key, log_file_path); "
                "remove it"
            )
    return {k: v for k, v in merged.items() if k in _FIELDS}


def _value(key: str, value: Any, source: str) -> Any:
    """A client transport value as the LineageConfig field it sets."""
    if key == "type":
        kind = str(value).strip().lower()
        if kind not in _TYPES:
            raise errors.ConfigError(
                f"{source}: lineage transport type {value!r} is not supported; use http, file, "
                "console or noop"
            )
        return _TYPES[kind]
    if key == "retry":
        total = value.get("total", 0) if isinstance(value, dict) else value
        if isinstance(total, bool) or not isinstance(total, int | float):
            what = source if source.startswith(_DYNAMIC) else f"{source}: transport.retry"
            raise errors.ConfigError(
                f'{what} must be JSON like {{"total": 1}} or a number, got {value!r}'
            )
        return total
    if key == "auth":
        return _api_key(value, source)
    return value


def _api_key(auth: Any, source: str) -> str:
    if isinstance(auth, dict):
        keyed = {str(k).lower().replace("_", ""): v for k, v in auth.items()}
        if keyed.get("type", "api_key") in ("api_key", "apikey") and keyed.get("apikey"):
            return str(keyed["apikey"])
    raise errors.ConfigError(
        f"{source}: lineage auth must be an api_key (type: api_key, apiKey: ...); batching "
        "sends no other kind"
    )


def _describe(exc: ValueError, sources: Mapping[str, str]) -> str:
    details = getattr(exc, "errors", None)
    if not callable(details):
        return redact_url(str(exc))
    parts = []
    for e in details():
        loc = ".".join(map(str, e["loc"]))
        msg = e["msg"].removeprefix("Value error, ")
        where = f" (from {sources[loc]})" if loc in sources else ""
        parts.append(f"{loc}{where}: {msg}" if loc else msg)
    given = sorted({s for n, s in sources.items() if s.startswith(("OPENLINEAGE", FILE_NAME))})
    tail = f" [OpenLineage sources: {', '.join(given)}]" if given else ""
    return redact_url("lineage settings: " + "; ".join(parts) + tail)


__all__ = ["CONFIG_ENV", "FILE_NAME", "Resolved", "find_file", "lineage_config", "resolve"]
