"""Plan-time policy check: does a config meet its latency objective and fit its device? (pure)

Worst-case batches. The batcher counts an item's ``cost`` (its token count; 1 for dense
inputs) against ``max_batch_cost`` and mixes length buckets only under the adaptive rule, then
with the padded batch (items x its longest cost) within ``max_batch_cost``: a mixed batch is
never larger than the worst batch below of its longest item's bucket. For each bucket the worst batch is
the most items the caps allow when every item has the bucket's smallest cost, all padded to the
bucket's largest length: ``n = min(max_batch_size, max_batch_cost // smallest_cost)`` (at least
1) at ``length = bucket edge``. The overflow bucket above the last edge, or the single bucket
when there are no edges, reaches ``max_length`` (default: the profile's longest measured length
when it is above the last edge, since the overflow bucket holds such items, else the last
edge; with no edges, the profile's longest measured length). Dense models have one length, 1.

Latency. ``worst_case_latency_s = max_wait_s + predicted service time of the slowest worst-case
batch + output.commit_interval_s`` must not exceed ``latency_slo_s``. Under the adaptive rule
``max_wait_s`` is no trigger (a batch goes at once to a free model, and grows only while the
model is busy, within the oldest item's budget), so it counts as 0. A warning: under full load
an item could also wait for the batch ahead (``max(max_wait_s, s) + s`` over the objective).
The watchdog's ``queue.forward_timeout_s`` must hold one such batch (a warning: under four).

Memory (kept simple on purpose). A batch's peak device memory is estimated linearly in padded
units (items x length; items for dense models): from the peak memory recorded in the service
profile when there is one (``ServiceProfile.predict_memory``), else ``bytes_per_item`` bytes per
padded unit. It must fit in ``memory_fraction`` of the device memory (``device_memory_bytes``,
else the profile's). Without a device size (CPU) memory is not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

from batching import errors
from batching.config import PipelineConfig
from batching.plan.profile import ServiceProfile

DEFAULT_MEMORY_FRACTION = 0.9


@dataclass(frozen=True, slots=True)
class WorstBatch:
    """A worst-case batch shape: ``n_items`` items padded to ``length`` (1 for dense)."""

    n_items: int
    length: int

    @property
    def units(self) -> int:
        """Padded units: items x length."""
        return self.n_items * self.length


@dataclass(frozen=True, slots=True)
class PolicyReport:
    """Outcome of :func:`check_policy`: ``ok`` is False when there is any error (one line each)."""

    errors: tuple[str, ...]
    warnings: tuple[str, ...] = ()
    worst_batch: WorstBatch | None = None
    predicted_service_s: float | None = None
    worst_case_latency_s: float | None = None
    estimated_memory_bytes: int | None = None
    largest_item: str | None = None
    """The largest item the device can take, in words (``batching check`` prints it)."""

    @property
    def ok(self) -> bool:
        """True when the config passes every check that could be made."""
        return not self.errors

    def raise_for_errors(self) -> None:
        """Raise ``PolicyError`` with every error message when the report is not ok."""
        if self.errors:
            raise errors.PolicyError("; ".join(self.errors))


def check_policy(
    config: PipelineConfig,
    profile: ServiceProfile | None,
    *,
    device_memory_bytes: int | None = None,
    bytes_per_item: int | None = None,
    max_length: int | None = None,
    memory_fraction: float = DEFAULT_MEMORY_FRACTION,
) -> PolicyReport:
    """Check ``config`` against its latency objective and its device memory (see module doc).

    Args:
        config: the pipeline config (batching policy, ``latency_slo_s``, model).
        profile: the model's measured service profile, or None (then the report is not ok).
        device_memory_bytes: device memory in bytes; default: the profile's, else unchecked.
        bytes_per_item: peak bytes per padded unit, used when the profile has no memory data.
        max_length: longest item (tokens) expected; default: last bucket edge, else profile's.
        memory_fraction: share of device memory a batch may use, in (0, 1].

    Returns:
        A report; ``report.ok`` is False with one-line messages naming the numbers.
    """
    if not 0 < memory_fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {memory_fraction!r}")
    dense = profile is not None and profile.is_dense
    found: list[str] = []
    warned: list[str] = []
    claim, size = config.batching.effective_claim_size, config.batching.max_batch_size
    if claim < size:
        warned.append(
            f"claim_size {claim} is below max_batch_size {size}: a full batch takes "
            f"{-(-size // claim)} claim transactions, each a write that waits for the others; "
            "leave claim_size unset for 4 batches' worth"
        )
    if config.queue.late_policy == "expire" and not config.batching.adaptive:
        warned.append(
            "queue.late_policy expire judges an item late by its batch's own service time "
            "alone: it still commits some items past their deadline (the forward in flight "
            "and the commit are not counted); set batching.adaptive: true, whose prediction "
            "counts both"
        )
    longest = _longest(config, profile, max_length, dense, warned)
    shapes = worst_batches(config, longest, dense=dense)
    latency = _check_latency(config, profile, shapes, found, warned)
    memory = _estimate_memory(profile, shapes, bytes_per_item)
    device_bytes = device_memory_bytes or (profile.device_memory_bytes if profile else None)
    _check_memory(memory, device_bytes, memory_fraction, found, warned)
    budget = config.model.memory_budget_bytes or (
        int(device_bytes * memory_fraction) if device_bytes else None
    )
    largest = largest_item(config, profile, budget, dense, warned)
    if not dense and profile is not None and max_length is None:
        _check_longest_item(config, profile, found, warned)
    return PolicyReport(
        errors=tuple(found),
        warnings=tuple(warned),
        worst_batch=latency[0] if latency else None,
        predicted_service_s=latency[1] if latency else None,
        worst_case_latency_s=_waits(config) + latency[1] if latency else None,
        estimated_memory_bytes=memory,
        largest_item=largest,
    )


def largest_item(
    config: PipelineConfig,
    profile: ServiceProfile | None,
    budget: int | None,
    dense: bool,
    warned: list[str],
) -> str:
    """The longest item one forward pass can take within ``budget`` bytes, by the profile's
    memory estimate (``predict_memory`` of one item), capped by ``model.max_item_tokens``; a
    warning when that limit lets in items the device cannot take (they go dead at scoring)."""
    limit = config.model.max_item_tokens
    if dense:
        return "dense items are one fixed-size row each"
    if budget is None or profile is None or profile.predict_memory(1, 1) is None:
        return (
            f"up to model.max_item_tokens {limit} tokens accepted; memory not measured (profile "
            "on the GPU, or set model.memory_budget_bytes; the scorer measures it at start)"
        )
    low, high = 0, limit
    while low < high:
        mid = (low + high + 1) // 2
        fits = (profile.predict_memory(1, mid) or 0) <= budget
        low, high = (mid, high) if fits else (low, mid - 1)
    if low < limit:
        warned.append(
            f"model.max_item_tokens {limit} lets in items the device cannot take: about {low} "
            f"tokens fit in {budget / 2**20:.1f} MiB; lower max_item_tokens to {low} so enqueue "
            "refuses them (the scorer fails them dead)"
        )
    return f"{low} tokens (memory budget {budget / 2**20:.1f} MiB; model.max_item_tokens {limit})"


def _check_longest_item(
    config: PipelineConfig, profile: ServiceProfile, found: list[str], warned: list[str]
) -> None:
    """One item as long as ``model.max_item_tokens`` lets in, alone, against the objective.

    The buckets' worst batches stop at the profile's longest measured length; an item past it
    is still accepted at enqueue and scored, and its time is not measured. Past that length it
    is estimated as growing with the square of the length (attention: W2 measured ~2 s for one
    item of 3,000 tokens on a 2-core CPU, where its 128-token time is 15 ms), an estimate on the
    cautious side. An item that cannot meet the objective even alone fails the check: lower
    ``max_item_tokens`` so enqueue refuses it, or profile up to it."""
    limit, measured = config.model.max_item_tokens, profile.lengths[-1]
    if limit <= measured:
        return
    one = profile.predict(1, measured)
    estimate = one * (limit / measured) ** 2
    budget = config.latency_slo_s - _waits(config)
    if estimate <= budget:
        warned.append(
            f"items up to model.max_item_tokens {limit} tokens are accepted, past the profile's "
            f"longest measured length {measured}: one alone is estimated at {estimate:.3g}s "
            "(the square of the length); profile up to it to know"
        )
        return
    allowed = (
        max(measured, int(measured * (max(budget, 0.0) / one) ** 0.5)) if one > 0 else measured
    )
    found.append(
        f"model.max_item_tokens {limit} lets in items that miss latency_slo_s "
        f"{config.latency_slo_s:g} alone: one of {limit} tokens is estimated at {estimate:.3g}s "
        f"({one * 1e3:.3g} ms at the profile's longest measured length {measured}, growing with "
        f"the square of the length); set model.max_item_tokens to about {allowed} (enqueue "
        f"then refuses longer ones), or profile up to {limit} tokens with `batching profile "
        "--lengths`"
    )


def worst_batches(config: PipelineConfig, longest: int, *, dense: bool) -> tuple[WorstBatch, ...]:
    """The worst-case batch of each length bucket (one shape for dense models)."""
    policy = config.batching
    if dense:
        return (WorstBatch(_cap(policy.max_batch_size, policy.max_batch_cost, 1), 1),)
    edges = [e for e in policy.length_buckets if e < longest]
    lows = [1, *(e + 1 for e in edges)]
    highs = [*edges, longest]
    return tuple(
        WorstBatch(_cap(policy.max_batch_size, policy.max_batch_cost, low), high)
        for low, high in zip(lows, highs, strict=True)
    )


def _cap(max_batch_size: int, max_batch_cost: int | None, item_cost: int) -> int:
    if max_batch_cost is None:
        return max_batch_size
    return max(1, min(max_batch_size, max_batch_cost // item_cost))


def _longest(
    config: PipelineConfig,
    profile: ServiceProfile | None,
    max_length: int | None,
    dense: bool,
    warned: list[str],
) -> int:
    if dense:
        return 1
    if max_length is not None:
        return max_length
    edges = config.batching.length_buckets
    if edges and profile is not None and profile.lengths[-1] > edges[-1]:
        # Items above the last edge fill the overflow bucket: take the longest length the
        # profile measured, not the edge, so that bucket's batches are not under-counted.
        longest = profile.lengths[-1]
        warned.append(
            f"items above the last length bucket edge ({edges[-1]}) are assumed no longer than "
            f"{longest} tokens (the profile's longest measured length); for longer ones re-run "
            "`batching profile --lengths` up to the longest length expected"
        )
        return longest
    if edges:
        return edges[-1]
    if profile is not None:
        longest = profile.lengths[-1]
        warned.append(
            f"no length_buckets and no max_length: assuming items no longer than {longest} "
            "tokens (the profile's longest measured length)"
        )
        return longest
    return 1


def _check_latency(
    config: PipelineConfig,
    profile: ServiceProfile | None,
    shapes: tuple[WorstBatch, ...],
    found: list[str],
    warned: list[str],
) -> tuple[WorstBatch, float] | None:
    if profile is None:
        found.append(
            "latency not checked: no service profile; run `batching profile` on the target "
            "device and set service_profile in the config"
        )
        return None
    model = config.model
    if (profile.model_name, profile.model_version) != (model.name, model.version):
        found.append(
            f"service profile is for {profile.model_name} {profile.model_version}, config runs "
            f"{model.name} {model.version}; re-run `batching profile`"
        )
        return None
    measured_on = profile.device.split(" ")[0].split(":")[0]  # "cuda:0 (H100)" -> "cuda"
    if model.device != "auto" and measured_on in ("cpu", "cuda") and measured_on != model.device:
        warned.append(
            f"service profile was measured on {profile.device}, the config runs on "
            f"model.device {model.device}: its times are another device's; re-run "
            "`batching profile` where the model runs"
        )
    worst, service_s = max(
        ((s, profile.predict(s.n_items, s.length)) for s in shapes), key=lambda pair: pair[1]
    )
    _judge_latency(config, profile, worst, service_s, found, warned)
    _judge_watchdog(config, service_s, found, warned)
    return worst, service_s


def _judge_watchdog(config: PipelineConfig, s: float, found: list[str], warned: list[str]) -> None:
    """A full batch's pass ``s`` against the watchdog (``queue.forward_timeout_s``), room for 4:
    one pass also bisects a failing batch and splits one out of memory, several in one."""
    if (timeout_s := config.queue.forward_timeout_s) < 4 * s:
        (found if s >= timeout_s else warned).append(
            f"queue.forward_timeout_s {timeout_s:g} is within 4x of a full batch's predicted "
            f"service {s:.4g}s: a slow pass (a bisected poison item, an out-of-memory split) "
            f"would be stopped as hung; raise it to at least {4 * s:.4g}"
        )


def _window(config: PipelineConfig) -> float:
    """Seconds an item may wait for its batch to fill: ``max_wait_s``, none under the adaptive
    rule (``batching.policy.adaptive``), which releases at once to a free model."""
    return 0.0 if config.batching.adaptive else config.batching.max_wait_s


def _waits(config: PipelineConfig) -> float:
    """Seconds an item may wait on purpose: for its batch to fill, then for its group commit."""
    return _window(config) + config.output.commit_interval_s


def _judge_latency(
    config: PipelineConfig,
    profile: ServiceProfile,
    worst: WorstBatch,
    service_s: float,
    found: list[str],
    warned: list[str],
) -> None:
    wait_s, slo_s = _window(config), config.latency_slo_s
    commit_s = config.output.commit_interval_s
    shape = f"{worst.n_items} items x {worst.length} length"
    if _waits(config) + service_s > slo_s:
        window = (
            "adaptive, no wait window" if config.batching.adaptive else f"max_wait_s {wait_s:g}"
        )
        linger = f" + commit_interval_s {commit_s:g}" if commit_s else ""
        levers = ["max_batch_size", "max_batch_cost"]
        levers += [] if config.batching.adaptive else ["max_wait_s"]
        levers += ["commit_interval_s"] if commit_s else []
        found.append(
            f"worst-case latency {_waits(config) + service_s:.4g}s ({window} + "
            f"service {service_s:.4g}s for a full batch of {shape} on {profile.device}{linger}) "
            f"exceeds latency_slo_s {slo_s:g}; lower {' / '.join(levers)}"
        )
    elif max(wait_s, service_s) + service_s + commit_s > slo_s:
        warned.append(
            f"under sustained full load an item can wait for the batch ahead: "
            f"{max(wait_s, service_s) + service_s + commit_s:.4g}s > latency_slo_s {slo_s:g}"
        )
    due_s = config.queue.default_deadline_s
    if due_s is not None and _waits(config) + service_s > due_s:
        warned.append(
            f"queue.default_deadline_s {due_s:g} is below the worst case "
            f"{_waits(config) + service_s:.4g}s: items without a deadline can expire as late "
            f"even at low load; raise it (to latency_slo_s {slo_s:g}) or lower the batch"
        )
    if not profile.covers(worst.n_items, worst.length):
        warned.append(
            f"service time of {shape} is extrapolated beyond the profile (batch sizes up to "
            f"{profile.batch_sizes[-1]}, lengths up to {profile.lengths[-1]}); profile larger sizes"
        )


def _estimate_memory(
    profile: ServiceProfile | None, shapes: tuple[WorstBatch, ...], bytes_per_item: int | None
) -> int | None:
    if profile is not None:
        measured = [profile.predict_memory(s.n_items, s.length) for s in shapes]
        known = [m for m in measured if m is not None]
        if known:
            return max(known)
    if bytes_per_item is not None:
        return bytes_per_item * max(s.units for s in shapes)
    return None


def _check_memory(
    memory: int | None,
    device_bytes: int | None,
    fraction: float,
    found: list[str],
    warned: list[str],
) -> None:
    if device_bytes is None:
        return
    if memory is None:
        warned.append(
            "memory not checked: the profile has no peak memory and no bytes_per_item was given"
        )
        return
    budget = int(device_bytes * fraction)
    if memory > budget:
        found.append(
            f"a full batch needs about {memory / 2**20:.1f} MiB but {fraction:.0%} of the "
            f"device's {device_bytes / 2**20:.1f} MiB is {budget / 2**20:.1f} MiB; lower "
            "max_batch_size or max_batch_cost"
        )
