"""``errors.native_text``: a native library's message as one plain line. With
``RUST_BACKTRACE=1`` (set on some hosts) delta-rs appends its backtrace, and a bad Delta input
was refused with an 18-line message (a sweep)."""

from __future__ import annotations

from pathlib import Path

import pytest

from batching import errors
from batching.ingress import shards

BACKTRACE = (
    "Kernel error: Json error: Encountered unexpected 'g' whilst parsing value\n"
    "   0: <unknown>\n   1: <unknown>\n  12: start_thread\n"
    "             at ./nptl/pthread_create.c:442:8\n"
    "  13: clone3\n             at ./misc/../sysdeps/unix/sysv/linux/x86_64/clone3.S:81:0\n"
)


def test_a_rust_backtrace_colours_and_arrows_are_left_out() -> None:
    assert errors.native_text(RuntimeError(BACKTRACE)) == (
        "Kernel error: Json error: Encountered unexpected 'g' whilst parsing value"
    )
    coloured = "Generic error\n\x1b[31m↳\x1b[0m Connection refused (os error 111)"
    assert errors.native_text(OSError(coloured)) == (
        "Generic error Connection refused (os error 111)"
    )
    assert errors.native_text(ValueError("fetch failed\n404: not found")) == (
        "fetch failed 404: not found"
    )


def test_a_corrupt_delta_log_is_refused_in_one_line_with_rust_backtrace_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("RUST_BACKTRACE", "1")
    log = tmp_path / "t" / "_delta_log"
    log.mkdir(parents=True)
    (log / "00000000000000000000.json").write_text("garbage\n")
    with pytest.raises(errors.InputError) as raised:
        shards.plan(tmp_path / "t", 65_536)
    message = str(raised.value)
    assert "\n" not in message
    assert "not a readable Delta table (" in message
    assert "<unknown>" not in message
    assert "clone3" not in message
