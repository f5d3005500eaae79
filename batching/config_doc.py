"""The configuration reference, generated from the pydantic models so it cannot drift:
``python -m batching.config_doc > docs/config.md`` (a test compares the two).

One table per section of :class:`~batching.config.PipelineConfig`: each setting's name, type,
default and meaning (its ``Field(description=...)``; a unit is in the name: ``_s`` seconds).
"""

from __future__ import annotations

import sys
import typing
from collections.abc import Iterator

from pydantic import BaseModel
from pydantic.fields import FieldInfo

from batching import config

HEADER = """# Configuration reference

One YAML file per environment (`deployments/*.yaml`), validated when it is loaded: an unknown
setting gets the nearest known name, a value out of range names the field and the fix, and a
setting given twice in one section, an empty path or an empty section is refused. Relative
paths (`output.path`, `model.checkpoint`, `lineage.path`, `service_profile`) start from the
YAML's folder; a relative SQLite `database.url`, like `--db`, from the current folder.
Durations are in seconds (`_s`).

Generated from `batching/config.py` by `python -m batching.config_doc`; do not edit by hand.
"""


def _section(name: str, model: type[BaseModel]) -> Iterator[str]:
    doc = (model.__doc__ or "").strip().splitlines()[0].replace("``", "`")
    yield f"\n## `{name}`\n" if name else "\n## Top level\n"
    yield f"{doc}\n"
    yield "| setting | type | default | meaning |"
    yield "|---|---|---|---|"
    for field_name, info in model.model_fields.items():
        if info.exclude or _nested(info) is not None:
            continue
        setting = f"{name}.{field_name}" if name else field_name
        meaning = (info.description or "").replace("|", "\\|")
        yield f"| `{setting}` | {_type(info)} | {_default(info)} | {meaning} |"


def _nested(info: FieldInfo) -> type[BaseModel] | None:
    kinds = (info.annotation, *typing.get_args(info.annotation))
    found = [t for t in kinds if isinstance(t, type) and issubclass(t, BaseModel)]
    return found[0] if found else None


def _type(info: FieldInfo) -> str:
    args = typing.get_args(info.annotation)
    optional = type(None) in args
    kinds = [a for a in args if a is not type(None)] if optional else [info.annotation]
    if len(kinds) == 1 and typing.get_origin(kinds[0]) is typing.Literal:
        text = " / ".join(f"`{v}`" for v in typing.get_args(kinds[0]))
    else:
        text = " or ".join(_name(k) for k in kinds)
    return f"{text} (optional)" if optional else text


def _name(kind: object) -> str:
    if typing.get_origin(kind) is not None:  # tuple[int, ...], dict[str, str]
        return str(kind).replace("typing.", "")
    return getattr(kind, "__name__", str(kind))


def _default(info: FieldInfo) -> str:
    if info.is_required():
        return "required"
    value = info.get_default(call_default_factory=True)
    if value is None:
        return "none"
    if isinstance(value, tuple | list | dict) and not value:
        return "empty"
    return f"`{value}`"


def reference() -> str:
    """The whole reference, as Markdown."""
    lines = [HEADER]
    lines += _section("", config.PipelineConfig)
    for name, info in config.PipelineConfig.model_fields.items():
        nested = _nested(info)
        if nested is not None:
            lines += _section(name, nested)
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(reference())
