"""``batching check | profile``: the plan-time commands of the CLI (a config checked against
its latency objective before merge; the forward times it is checked with)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer
from rich.table import Table

from batching import errors
from batching.cli.common import (
    ConfigOption,
    DbOverride,
    JsonOption,
    app,
    emit_json,
    err,
    flag,
    handle_errors,
    load,
    out,
    plain,
)


@app.command()
@handle_errors
def check(config: ConfigOption, db: DbOverride = None, as_json: JsonOption = False) -> None:
    """Plan-time policy check: worst-case wait + full-batch service time vs the latency objective.

    Exit 1 with the numbers when the config would break its objective or not fit the device.
    Every version in model / model_versions is checked against its pinned sha256; when the
    queue's database exists (--db, else the config's), its model route must name only listed
    versions.

    --json prints one document: ok, config, latency_slo_s, adaptive, max_wait_s (not counted
    when adaptive: the rule has no wait window), commit_interval_s,
    worst_case_latency_s, predicted_service_s, worst_batch {n_items, length},
    estimated_memory_bytes, largest_item (null when not known), errors, warnings (lists of
    one-line messages). The exit code is the same as without --json.
    """
    from batching.compose import checks

    cfg = load(config)
    path = cfg.resolve(cfg.service_profile)
    if path is not None and not path.is_file():
        raise errors.ConfigError(
            f"{path}: service profile not found (service_profile in {config}); "
            f"run `batching profile -c {config}` to create it"
        )
    report = checks.check_config(cfg, db)
    if as_json:
        emit_json(check_doc(config, cfg, report))
        if not report.ok:
            raise typer.Exit(1)
        return
    for w in report.warnings:
        err.print(f"warning: {w}", highlight=False)
    worst = report.worst_batch
    adaptive = cfg.batching.adaptive
    window = "adaptive (no wait window)" if adaptive else f"max_wait_s {cfg.batching.max_wait_s:g}"
    if report.worst_case_latency_s is not None and worst is not None:
        out.print(
            f"{config}: worst case {report.worst_case_latency_s:.3f}s = {window}"
            f" + service {report.predicted_service_s:.3f}s for {worst.n_items} x {worst.length}"
            + (
                f" + commit_interval_s {cfg.output.commit_interval_s:g}"
                if cfg.output.commit_interval_s
                else ""
            )
            + f"; objective {cfg.latency_slo_s:g}s",
            highlight=False,
        )
    if report.largest_item is not None:
        out.print(f"{config}: largest item: {report.largest_item}", highlight=False)
    if not report.ok:
        for e in report.errors:
            flag(err, "fail", str(e))
        raise typer.Exit(1)
    out.print(f"{config}: ok")


def check_doc(config: Path, cfg: Any, report: Any) -> dict[str, Any]:
    """``batching check --json``'s document (its keys are listed in ``check``'s help)."""
    worst = report.worst_batch
    return {
        "ok": report.ok,
        "config": str(config),
        "latency_slo_s": cfg.latency_slo_s,
        "adaptive": cfg.batching.adaptive,
        "max_wait_s": cfg.batching.max_wait_s,
        "commit_interval_s": cfg.output.commit_interval_s,
        "worst_case_latency_s": report.worst_case_latency_s,
        "predicted_service_s": report.predicted_service_s,
        "worst_batch": None
        if worst is None
        else {"n_items": worst.n_items, "length": worst.length},
        "estimated_memory_bytes": report.estimated_memory_bytes,
        "largest_item": report.largest_item,
        "errors": list(report.errors),
        "warnings": list(report.warnings),
    }


@app.command()
@handle_errors
def profile(
    config: ConfigOption,
    batch_sizes: Annotated[str, typer.Option(help="Comma-separated batch sizes.")] = "1,8,32,64",
    lengths: Annotated[
        str, typer.Option(help="Comma-separated lengths (token models).")
    ] = "16,64,128",
    repeats: Annotated[int, typer.Option(min=1, help="Timed runs per point (median).")] = 3,
    write: Annotated[
        Path | None,
        typer.Option("--out", help="Where to save; default: the config's service_profile."),
    ] = None,
) -> None:
    """Measure forward time per batch size and length on this device; save it for `batching check`."""
    from batching.model.runner import TorchRunner, measure_profile

    cfg = load(config)
    sizes = _ints(batch_sizes, "--batch-sizes", MAX_PROFILE_BATCH)
    lens = _ints(lengths, "--lengths", MAX_PROFILE_LENGTH)
    target = write or cfg.resolve(cfg.service_profile)
    if target is None:
        raise errors.ConfigError(f"{config}: no service_profile path; set it or pass --out")
    _check_writable(target)
    runner = TorchRunner.load(cfg.model, base_dir=cfg.base_dir)
    with err.status(plain(f"profiling {cfg.model.name} on {runner.device_name}")):
        prof = measure_profile(runner, sizes, lens, repeats)
    prof.save(target)
    table = Table(
        "batch size",
        "length",
        "seconds",
        "items/s",
        title=plain(f"{cfg.model.name} on {prof.device}"),
    )
    for p in prof.points:
        table.add_row(
            str(p.batch_size), str(p.length), f"{p.seconds:.4f}", f"{p.batch_size / p.seconds:.0f}"
        )
    out.print(table)
    out.print(f"saved {target}")


# The largest batch a config may set (batching.max_batch_size), and a matching length cap: a
# profile point is one synthetic batch in memory, so larger values only exhaust it.
MAX_PROFILE_BATCH = 65536
MAX_PROFILE_LENGTH = 65536


def _ints(text: str, name: str, most: int) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise errors.ConfigError(f"{name} must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise errors.ConfigError(f"{name} must list positive integers, got {text!r}")
    if max(values) > most:
        raise errors.ConfigError(f"{name} must be at most {most}, got {max(values)}")
    repeated = sorted({v for v in values if values.count(v) > 1})
    if repeated:
        raise errors.ConfigError(
            f"{name} lists {', '.join(map(str, repeated))} twice; give each value once"
        )
    return values


def _check_writable(target: Path) -> None:
    """Raise ``ConfigError`` unless ``target`` can be written (before minutes of measuring)."""
    existed = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with target.open("a"):
            pass
    except OSError as exc:
        raise errors.ConfigError(
            f"{target}: cannot write the service profile there ({exc.strerror}); "
            "pass --out a file path in a writable folder"
        ) from None
    if not existed:
        target.unlink()
