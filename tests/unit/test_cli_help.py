"""Every command's summary in ``batching --help`` is one sentence on one line."""

from __future__ import annotations

from typing import Any

import typer

from batching import cli


def _commands(group: Any, prefix: str = "") -> list[tuple[str, Any]]:
    """Every command under ``group`` (Typer's own click: a group is what has ``commands``)."""
    found: list[tuple[str, Any]] = []
    for name, command in getattr(group, "commands", {}).items():
        found += [(prefix + name, command), *_commands(command, f"{prefix}{name} ")]
    return found


def test_every_command_summary_is_one_line() -> None:
    """The command list prints a docstring's first paragraph with its own line breaks, so a
    summary wrapped in the source showed in ``--help`` as broken lines ("a" / "pause ...")."""
    commands = _commands(typer.main.get_command(cli.register()))
    assert {"status", "queue pause", "rollout guard", "metrics serve"} <= dict(commands).keys()
    broken = {
        name: summary
        for name, command in commands
        if "\n" in (summary := (command.help or "").strip().split("\n\n")[0])
    }
    assert broken == {}
