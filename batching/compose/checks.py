"""The plan-time check of a config (``batching check``, the score flow's preconditions): the
pinned checkpoint of every version its registry lists, the latency objective and device memory
against its measured service profile (:mod:`batching.plan.check`), the route its queue holds
against the registry, and whether a rollout's two versions fit the device.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

from batching import config as cfg
from batching import errors
from batching.compose.build import load_profile, open_queue
from batching.plan import check as policy


def check_config(config: cfg.PipelineConfig, db_url: str | None = None) -> policy.PolicyReport:
    """Plan-time policy check against the config's measured service profile, after the pinned
    checkpoint of every version the registry lists (``model`` and ``model_versions``: its file
    and sha256, read as a scorer reads it, never unpickling code, and fitted to the model
    built on the meta device, which holds no weights; a wrong digest, a file that does not
    load or does not fit fails here, before merge, not at the first score or the first batch
    a rollout routes to it).

    The queue's route is read from ``db_url`` (else the config's database) when it exists.

    Raises:
        ConfigError: ``model.name`` is neither built in nor a factory (before, the check
            blamed the service profile and advised ``batching profile``, which failed too).
        CheckpointError: no checkpoint for a factory, a missing file, another sha256, a
            file that does not deserialize, or one whose names or shapes are not the model's.
    """
    from batching.model import zoo

    not_fitted: list[str] = []
    for version, spec in config.registry().items():  # every version that may run
        try:
            path = zoo.checkpoint_path(spec.name, spec.checkpoint, Path(config.base_dir))
            if not zoo.check_fits(spec.name, zoo.load_checkpoint(path, spec.sha256), path):
                not_fitted.append(
                    f"version {version!r}: factory {spec.name} could not be built without "
                    "weights (it computes on them, or raises), so its checkpoint's fit is not "
                    "checked here; a scorer's load will (`batching profile` loads it now)"
                )
        except (errors.ConfigError, errors.CheckpointError) as exc:
            if version == config.model.version:
                raise
            said = str(exc).replace("model.checkpoint", "its checkpoint")  # not `model`'s
            raise type(exc)(f"model_versions {version!r}: {said}") from None
        own_profile = config.resolve(spec.service_profile)
        if own_profile is not None and not own_profile.is_file():
            raise errors.ConfigError(
                f"model_versions {version!r}: service profile {own_profile} not found; run "
                "`batching profile` with that version as model, or leave service_profile out"
            )
    profile = load_profile(config)
    report = policy.check_policy(config, profile)
    routed, unchecked = _route_problems(config, db_url or config.database.url)
    found = [*report.errors, *routed]
    if config.rollout.shadow_path is not None:
        from batching.compose import shadow

        try:
            shadow.folder(config)
        except errors.ConfigError as exc:
            found.append(str(exc))
    warned = [
        *report.warnings,
        *not_fitted,
        *unchecked,
        *_ignored_output_settings(config.output),
        *_unwritable_metrics_file(config),
        *_slow_heartbeat(config),
    ]
    held = _largest_checkpoints(config, 3)
    device = profile.device_memory_bytes if profile is not None else None
    if held and device and held + (report.estimated_memory_bytes or 0) > device:
        found.append(
            f"the three largest listed versions ({held / 2**20:.0f} MiB of checkpoints) and a "
            f"full batch ({(report.estimated_memory_bytes or 0) / 2**20:.0f} MiB) do not fit "
            f"the device ({device / 2**20:.0f} MiB): a scorer in a rollout holds its own "
            "version and the route's two; list fewer versions or smaller ones"
        )
    return replace(report, errors=tuple(found), warnings=tuple(warned))


HEARTBEAT_ALERT_S = 300.0
"""BatchingRunNoHeartbeat's silence (deployments/monitoring/alerts.yml; a test binds them)."""


def _slow_heartbeat(config: cfg.PipelineConfig) -> list[str]:
    """A beat as slow as the heartbeat alert's 5 min: an idle, healthy scorer pages (a
    review: ``lease_s`` of 900 s and more, no ``heartbeat_s``)."""
    beat = config.queue.effective_heartbeat_s
    if beat < HEARTBEAT_ALERT_S:
        return []
    return [
        f"queue.heartbeat_s: a run beats every {beat:g} s, and BatchingRunNoHeartbeat pages "
        f"after {HEARTBEAT_ALERT_S:g} s without one: an idle scorer would page; set "
        "queue.heartbeat_s under 300"
    ]


def _unwritable_metrics_file(config: cfg.PipelineConfig) -> list[str]:
    """``metrics.textfile_path`` in a folder that does not exist: every run would end with a
    warning and write nothing (node_exporter's collector reads a folder, made by its owner)."""
    path = config.resolve(config.metrics.textfile_path)
    if path is None or path.parent.is_dir():
        return []
    return [
        f"metrics.textfile_path: folder {path.parent} does not exist, so no run can write its "
        "metrics there; create it (node_exporter's --collector.textfile.directory)"
    ]


def _ignored_output_settings(output: cfg.OutputConfig) -> list[str]:
    """Settings of another output kind the config sets, which this kind ignores (a config
    copied from another kind's: the rows go elsewhere than it says)."""
    ignored = {
        "path": output.kind == "sql",
        "table": output.kind != "sql",
    }
    return [
        f"output.{name} is ignored by kind {output.kind} (rows go to "
        f"{output.table if output.kind == 'sql' else output.path}); remove it"
        for name, ignored_here in ignored.items()
        if ignored_here and name in output.model_fields_set
    ]


def _route_problems(config: cfg.PipelineConfig, db_url: str) -> tuple[list[str], list[str]]:
    """The queue's current route and its pinned versions (``version_pins``) against the
    registry: errors, and a warning when the database cannot be read (at plan time there may
    be none yet: nothing is routed or pinned then)."""
    from batching.ingress import rollout, version_pins

    try:
        queue = open_queue(config, db_url)
    except errors.ConfigError:  # no database file yet
        return [], []
    listed = config.registry()
    try:
        route = rollout.current(queue.engine, queue.queue)
        queue.check_schema()
        with queue.engine.connect() as conn:
            relabelled = version_pins.conflicts(conn, queue.queue, listed)
    except (errors.QueueError, errors.SchemaError) as exc:  # unreachable, or not migrated
        return [], [f"the queue's model route and versions not checked: {errors.one_line(exc)}"]
    finally:
        queue.engine.dispose()
    if route is None:
        return relabelled, []
    return [
        *relabelled,
        *(
            f"queue {queue.queue!r} routes items to model version {version!r} ({role}), which "
            "model and model_versions do not list: a scorer with this config would fail at "
            "its first such batch; list it, or roll the rollout back"
            for version, role in zip(route.versions, ("stable", "candidate"), strict=False)
            if version not in listed
        ),
    ], []


def _largest_checkpoints(config: cfg.PipelineConfig, n: int) -> int:
    """Bytes of the ``n`` largest checkpoints the registry lists, 0 with a single version."""
    from batching.model import zoo

    if not config.model_versions:
        return 0
    sizes = sorted(
        zoo.checkpoint_path(s.name, s.checkpoint, Path(config.base_dir)).stat().st_size
        for s in config.registry().values()
    )
    return sum(sizes[-n:])
