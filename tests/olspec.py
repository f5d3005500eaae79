"""Validate OpenLineage events offline against the vendored spec (JSON Schema draft 2020-12).

Approach (see ``/work/shared/openlineage-spec/README.md``):

1. Every ``*.json`` under the spec folder is registered with ``referencing`` under its ``$id``,
   plus any extra schema documents the caller passes, then this project's custom facet schemas
   as the repository ships them (``spec/facets/<version>/*.json``), each under the address its
   ``_schemaURL`` names (:func:`shipped_url`: the file's path at the release tag), so a
   custom facet is validated against the shipped file, resolved locally, never the network.
2. The event is validated against ``.../2-0-2/OpenLineage.json#/$defs/RunEvent`` (or the
   ``DatasetEvent`` / ``JobEvent`` its ``schemaURL`` names): the root ``oneOf`` only says "not
   valid under any of the given schemas". The core schema checks every facet's ``_producer`` and
   ``_schemaURL`` but not its contents, because facets are open objects.
3. So each facet (run, job, dataset, input and output facets) is then validated against the
   document its ``_schemaURL`` names: the facet key must be one of that document's
   ``properties`` (catches ``processingEngine`` vs ``processing_engine``) and ``{key: facet}``
   must validate against it.
4. Custom facets: validated exactly like standard ones when their schema is registered (step 1).
   A facet whose schema is not registered can only be checked by step 2 (``_producer`` and
   ``_schemaURL`` are URIs, as Marquez requires); with ``strict=True`` (the default) that is
   reported as an error, so a new custom facet cannot slip in unchecked.

Formats: ``uuid`` and ``date-time`` are checked by jsonschema's ``FormatChecker``; ``uri`` gets a
minimal check here (a scheme and something after it) because ``rfc3987`` is not installed.

The spec folder is ``$BATCHING_OL_SPEC``, else ``../shared/openlineage-spec`` next to the repo
root. :func:`require_spec_dir` skips a test when it is absent, except under ``CI``, where it fails.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
from jsonschema import Draft202012Validator, FormatChecker
from referencing import Registry, Resource
from referencing.exceptions import NoSuchResource
from referencing.jsonschema import DRAFT202012

SPEC_ENV = "BATCHING_OL_SPEC"
REPO = Path(__file__).resolve().parents[1]
DEFAULT_SPEC_DIR = REPO.parent / "shared" / "openlineage-spec"
CORE = "https://openlineage.io/spec/2-0-2/OpenLineage.json"

_DATASET_FACET_GROUPS = ("facets", "inputFacets", "outputFacets")


def _candidate(env: Mapping[str, str]) -> Path:
    return Path(env[SPEC_ENV]) if env.get(SPEC_ENV) else DEFAULT_SPEC_DIR


def find_spec_dir(env: Mapping[str, str] = os.environ) -> Path | None:
    """Return the spec folder (``$BATCHING_OL_SPEC`` or the default) if it holds the core schema."""
    candidate = _candidate(env)
    return candidate if (candidate / "2-0-2" / "OpenLineage.json").is_file() else None


def require_spec_dir() -> Path:
    """Return the spec folder; skip the calling test when it is absent (fail under ``CI``)."""
    found = find_spec_dir()
    if found is not None:
        return found
    reason = (
        f"OpenLineage spec schemas not found at {_candidate(os.environ)} "
        f"(set {SPEC_ENV} to a folder holding 2-0-2/OpenLineage.json)"
    )
    if os.environ.get("CI"):
        pytest.fail(f"{reason}; CI must validate lineage events")
    pytest.skip(reason)


SHIPPED_DIR = REPO / "spec" / "facets"
"""The custom facet schemas the repository ships (``<version>/<Facet>.json``)."""


def shipped_url(path: Path) -> str:
    """The address of a shipped schema file: the project's home, the release tag of this
    version, the file's path in the repository (where ``_schemaURL`` points)."""
    from batching.evidence import lineage

    tag = lineage.FACET_SCHEMA_BASE.removeprefix(lineage.PROJECT_URL).split("/")[2]
    return f"{lineage.PROJECT_URL}/blob/{tag}/{path.relative_to(REPO).as_posix()}"


def shipped_schemas() -> dict[str, dict[str, Any]]:
    """The shipped custom facet schemas, by :func:`shipped_url`."""
    return {
        shipped_url(p): json.loads(p.read_text(encoding="utf-8"))
        for p in sorted(SHIPPED_DIR.rglob("*.json"))
    }


def load_registry(
    spec_dir: Path, extra: Iterable[Mapping[str, Any]] = (), *, shipped: bool = True
) -> Registry:
    """Register every JSON schema under ``spec_dir`` and ``extra`` documents by ``$id``, then
    (``shipped``) the shipped custom facet schemas by their address (replacing an ``extra`` of
    the same)."""
    docs = [json.loads(p.read_text(encoding="utf-8")) for p in sorted(spec_dir.rglob("*.json"))]
    docs += [dict(d) for d in extra]
    resources = {
        d["$id"]: Resource.from_contents(d, default_specification=DRAFT202012)
        for d in docs
        if "$id" in d
    }
    for url, doc in shipped_schemas().items() if shipped else ():
        resources[url] = Resource.from_contents(doc, default_specification=DRAFT202012)
    return Registry().with_resources(resources.items())


def _is_uri(value: object) -> bool:
    if not isinstance(value, str):
        return True
    parts = urlsplit(value)
    return bool(parts.scheme) and bool(parts.netloc or parts.path)


def _format_checker() -> FormatChecker:
    checker = FormatChecker()
    if "uri" not in checker.checkers:
        checker.checks("uri")(_is_uri)
    return checker


_FORMATS = _format_checker()


def _errors(schema: Mapping[str, Any], instance: Any, registry: Registry, where: str) -> list[str]:
    validator = Draft202012Validator(schema, registry=registry, format_checker=_FORMATS)
    return [
        f"{where}/{'/'.join(map(str, e.absolute_path))}: {e.message}"
        for e in validator.iter_errors(instance)
    ]


def iter_facets(event: Mapping[str, Any]) -> Iterator[tuple[str, str, Mapping[str, Any]]]:
    """Yield ``(where, key, facet)`` for every facet of a run event."""
    for part in ("run", "job"):
        for key, facet in ((event.get(part) or {}).get("facets") or {}).items():
            yield f"{part}.facets", key, facet
    for side in ("inputs", "outputs"):
        for i, dataset in enumerate(event.get(side) or []):
            for group in _DATASET_FACET_GROUPS:
                for key, facet in (dataset.get(group) or {}).items():
                    yield f"{side}[{i}].{group}", key, facet


def _facet_errors(
    where: str, key: str, facet: Mapping[str, Any], registry: Registry, strict: bool
) -> list[str]:
    url = str(facet.get("_schemaURL", ""))
    document = url.partition("#")[0]
    if document == CORE:
        return []  # a bare base facet: the core schema already checked it
    try:
        schema = registry.contents(document)
    except NoSuchResource:
        return [f"{where}.{key}: no schema registered for _schemaURL {url}"] if strict else []
    if key not in schema.get("properties", {}):
        return [f"{where}.{key}: key is not one of {sorted(schema.get('properties', {}))}"]
    return _errors(schema, {key: facet}, registry, f"{where}.{key}")


def validate_event(
    event: Mapping[str, Any], registry: Registry, *, strict: bool = True
) -> list[str]:
    """Return every schema error of ``event`` (core schema, then each facet); ``[]`` if valid."""
    kind = str(event.get("schemaURL", "#/$defs/RunEvent")).rsplit("/", 1)[-1]
    found = _errors({"$ref": f"{CORE}#/$defs/{kind}"}, event, registry, kind)
    for where, key, facet in iter_facets(event):
        found += _facet_errors(where, key, facet, registry, strict)
    return found


def assert_valid_event(
    event: Mapping[str, Any], registry: Registry, *, strict: bool = True
) -> None:
    """Fail the test with every schema error of ``event``."""
    found = validate_event(event, registry, strict=strict)
    assert not found, "OpenLineage event is invalid:\n  " + "\n  ".join(found)
