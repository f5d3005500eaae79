"""Unit tests for the plan-time policy check: fake profiles, no torch, no I/O."""

from __future__ import annotations

from typing import Any

import pytest

from batching import config, errors
from batching.plan import check as policy
from batching.plan.profile import ProfilePoint, ServiceProfile

SHA = "a" * 64


def pipeline(slo_s: float = 1.0, **batching: Any) -> config.PipelineConfig:
    # items no longer than the profile below measures (longer ones: their own test)
    return config.parse_config(
        {
            "model": {"name": "w2-text", "version": "v1", "sha256": SHA, "max_item_tokens": 128},
            "batching": {"max_wait_s": 0.05, **batching},
            "latency_slo_s": slo_s,
        }
    )


def tokens_profile(
    seconds_per_unit: float = 1e-4, *, peak_per_unit: int | None = None, **kw: Any
) -> ServiceProfile:
    """Service time 0.001 s + ``seconds_per_unit`` per padded token, measured up to 256 x 128."""
    points = tuple(
        ProfilePoint(
            b,
            n,
            0.001 + seconds_per_unit * b * n,
            None if peak_per_unit is None else 10_000 + peak_per_unit * b * n,
        )
        for b in (1, 16, 64, 256)
        for n in (16, 64, 128)
    )
    fields = {"model_name": "w2-text", "model_version": "v1", "device": "fake-gpu"} | kw
    return ServiceProfile(points, input_kind="tokens", **fields)


def test_passes_when_worst_case_fits_the_slo() -> None:
    report = policy.check_policy(
        pipeline(max_batch_size=32, length_buckets=(32, 64, 128)), tokens_profile(1e-5)
    )
    assert report.ok, report.errors
    assert report.worst_batch == policy.WorstBatch(32, 128)
    assert report.predicted_service_s == pytest.approx(0.001 + 1e-5 * 32 * 128)
    assert report.worst_case_latency_s == pytest.approx(0.05 + 0.001 + 1e-5 * 32 * 128)
    report.raise_for_errors()


def test_refuses_when_wait_plus_full_batch_exceeds_the_slo() -> None:
    report = policy.check_policy(
        pipeline(slo_s=0.5, max_batch_size=64, length_buckets=(128,)), tokens_profile()
    )
    assert not report.ok
    (message,) = report.errors
    assert "0.05" in message
    assert "64 items x 128 length" in message
    assert "latency_slo_s 0.5" in message
    assert "\n" not in message
    with pytest.raises(errors.PolicyError, match="worst-case latency"):
        report.raise_for_errors()


def test_the_adaptive_rule_has_no_wait_window_in_the_worst_case() -> None:
    """Under ``adaptive`` a batch goes at once to a free model: ``max_wait_s`` is no trigger, so
    the plan-time worst case is the full batch's service time alone, and a refusal names only
    the levers that count."""
    service_s = 0.001 + 1e-5 * 32 * 128
    fixed = pipeline(slo_s=0.3, max_wait_s=0.28, max_batch_size=32, length_buckets=(128,))
    assert not policy.check_policy(fixed, tokens_profile(1e-5)).ok
    adaptive = pipeline(
        slo_s=0.3, max_wait_s=0.28, max_batch_size=32, length_buckets=(128,), adaptive=True
    )
    report = policy.check_policy(adaptive, tokens_profile(1e-5))
    assert report.ok, report.errors
    assert report.worst_case_latency_s == pytest.approx(service_s)
    big = pipeline(slo_s=0.3, max_batch_size=256, length_buckets=(128,), adaptive=True)
    (message,) = policy.check_policy(big, tokens_profile(1e-5)).errors
    assert "(adaptive, no wait window + service" in message, message
    assert message.endswith("lower max_batch_size / max_batch_cost"), message


def test_a_commit_interval_counts_toward_the_worst_case() -> None:
    shape: dict[str, Any] = {"max_batch_size": 32, "length_buckets": (32, 64, 128)}
    base = pipeline(**shape)
    service = 0.001 + 1e-5 * 32 * 128
    lingering = base.model_copy(
        update={"output": base.output.model_copy(update={"commit_interval_s": 0.95})}
    )
    assert policy.check_policy(base, tokens_profile(1e-5)).ok
    report = policy.check_policy(lingering, tokens_profile(1e-5))
    assert report.worst_case_latency_s == pytest.approx(0.05 + service + 0.95)
    (message,) = report.errors
    assert "+ commit_interval_s 0.95)" in message
    assert message.endswith("max_wait_s / commit_interval_s")


def test_cost_cap_shrinks_the_worst_batch() -> None:
    capped = pipeline(0.8, max_batch_size=64, max_batch_cost=512, length_buckets=(8, 128))
    # bucket [1, 8]: 64 one-token items padded to 8; bucket (8, 128]: 512 // 9 = 56 items
    assert policy.worst_batches(capped, 128, dense=False) == (
        policy.WorstBatch(64, 8),
        policy.WorstBatch(56, 128),
    )
    report = policy.check_policy(capped, tokens_profile())
    assert report.worst_batch == policy.WorstBatch(56, 128)
    assert report.ok, report.errors
    uncapped = policy.check_policy(
        pipeline(0.8, max_batch_size=64, length_buckets=(8, 128)), tokens_profile()
    )
    assert not uncapped.ok


def test_without_buckets_short_items_can_be_padded_to_the_longest() -> None:
    cfg = pipeline(max_batch_size=64, max_batch_cost=2048)
    shapes = policy.worst_batches(cfg, 128, dense=False)
    assert shapes == (policy.WorstBatch(64, 128),)  # 64 one-token items + one of 128
    report = policy.check_policy(cfg, tokens_profile(1e-6))
    assert report.worst_batch == policy.WorstBatch(64, 128)
    assert any("no length_buckets" in w for w in report.warnings)


def test_max_length_overrides_the_last_bucket_edge() -> None:
    cfg = pipeline(max_batch_size=8, length_buckets=(32, 64))
    report = policy.check_policy(cfg, tokens_profile(1e-6), max_length=512)
    assert report.worst_batch == policy.WorstBatch(8, 512)
    assert any("extrapolated" in w for w in report.warnings)


def test_the_overflow_bucket_counts_the_profiles_longest_length_not_the_last_edge() -> None:
    report = policy.check_policy(
        pipeline(max_batch_size=8, length_buckets=(32, 64)), tokens_profile(1e-6)
    )
    assert report.worst_batch == policy.WorstBatch(8, 128)  # the profile measured up to 128
    assert any("above the last length bucket edge (64)" in w for w in report.warnings)
    at_edge = policy.check_policy(
        pipeline(max_batch_size=8, length_buckets=(32, 128)), tokens_profile(1e-6)
    )
    assert at_edge.worst_batch == policy.WorstBatch(8, 128)
    assert not any("above the last" in w for w in at_edge.warnings)


def test_without_a_profile_the_check_is_not_ok_and_says_how_to_fix() -> None:
    report = policy.check_policy(pipeline(), None)
    assert not report.ok
    assert "batching profile" in report.errors[0]
    assert report.predicted_service_s is None


def test_profile_for_another_model_version_is_refused() -> None:
    report = policy.check_policy(pipeline(), tokens_profile(model_version="v0"))
    assert not report.ok
    assert "v0" in report.errors[0]


def test_dense_profile_uses_rows_and_ignores_length() -> None:
    points = (ProfilePoint(1, 1, 0.001), ProfilePoint(512, 1, 0.002))
    dense = ServiceProfile(points, "w2-text", "v1", "cpu", input_kind="dense")
    report = policy.check_policy(pipeline(max_batch_size=512, length_buckets=(64,)), dense)
    assert report.worst_batch == policy.WorstBatch(512, 1)
    assert report.ok


def test_memory_from_profile_must_fit_the_device() -> None:
    prof = tokens_profile(1e-6, peak_per_unit=1000, device_memory_bytes=4_000_000)
    report = policy.check_policy(pipeline(max_batch_size=64, length_buckets=(128,)), prof)
    assert report.estimated_memory_bytes == 10_000 + 1000 * 64 * 128
    assert not report.ok
    assert "MiB" in report.errors[0]
    assert "max_batch_size" in report.errors[0]
    bigger = policy.check_policy(
        pipeline(max_batch_size=64, length_buckets=(128,)), prof, device_memory_bytes=2**34
    )
    assert bigger.ok, bigger.errors


def test_memory_from_bytes_per_item_when_profile_has_none() -> None:
    cfg = pipeline(max_batch_size=16, length_buckets=(128,))
    report = policy.check_policy(
        cfg, tokens_profile(1e-6), device_memory_bytes=1_000_000, bytes_per_item=1000
    )
    assert report.estimated_memory_bytes == 1000 * 16 * 128
    assert not report.ok
    unknown = policy.check_policy(cfg, tokens_profile(1e-6), device_memory_bytes=1_000_000)
    assert unknown.ok
    assert any("memory not checked" in w for w in unknown.warnings)


def test_warns_when_the_batch_ahead_can_push_past_the_slo() -> None:
    # service 0.4 s, wait 0.05 s: one batch fits (0.45 s) but waiting for the one ahead does not
    report = policy.check_policy(
        pipeline(slo_s=0.5, max_batch_size=1, length_buckets=(128,)), tokens_profile(0.4 / 128)
    )
    assert report.ok
    assert any("batch ahead" in w for w in report.warnings)


def test_memory_fraction_is_validated() -> None:
    with pytest.raises(ValueError, match="memory_fraction"):
        policy.check_policy(pipeline(), None, memory_fraction=0.0)


def test_a_claim_smaller_than_a_batch_is_a_warning_with_the_transaction_count() -> None:
    small = policy.check_policy(
        pipeline(max_batch_size=32, claim_size=5, length_buckets=(128,)), tokens_profile(1e-5)
    )
    assert small.ok, small.errors
    assert any("claim_size 5 is below max_batch_size 32" in w for w in small.warnings)
    assert any("7 claim transactions" in w for w in small.warnings)
    default = policy.check_policy(
        pipeline(max_batch_size=32, length_buckets=(128,)), tokens_profile(1e-5)
    )
    assert not any("claim_size" in w for w in default.warnings)


def test_a_default_deadline_below_the_worst_case_is_a_warning() -> None:
    """An item without a deadline due before even an idle pipeline can commit it would expire
    at low load; at the objective the check is quiet."""
    cfg = pipeline(max_batch_size=32, length_buckets=(32, 64, 128))
    tight = cfg.model_copy(
        update={"queue": config.QueueConfig(late_policy="expire", default_deadline_s=0.05)}
    )
    report = policy.check_policy(tight, tokens_profile(1e-5))
    assert report.ok
    assert any(
        "queue.default_deadline_s 0.05 is below the worst case 0.09" in w for w in report.warnings
    ), report.warnings
    at_slo = cfg.model_copy(
        update={"queue": config.QueueConfig(late_policy="expire", default_deadline_s=1.0)}
    )
    quiet = policy.check_policy(at_slo, tokens_profile(1e-5))
    assert not any("default_deadline_s" in w for w in quiet.warnings)


def test_expire_without_the_adaptive_rule_is_warned() -> None:
    """``late_policy: expire`` on the fixed rule judges by a batch's own service time only,
    and commits some items past their deadline (found by a review): the check says so."""

    def with_queue(adaptive: bool) -> config.PipelineConfig:
        return config.parse_config(
            {
                "model": {"name": "w2-text", "version": "v1", "sha256": SHA},
                "batching": {"max_wait_s": 0.05, "adaptive": adaptive},
                "queue": {"late_policy": "expire"},
            }
        )

    fixed = policy.check_policy(with_queue(False), tokens_profile(1e-5))
    assert any("set batching.adaptive: true" in w for w in fixed.warnings)
    adaptive = policy.check_policy(with_queue(True), tokens_profile(1e-5))
    assert not any("late_policy" in w for w in adaptive.warnings)


def test_an_item_that_misses_the_objective_alone_fails_the_check() -> None:
    """``max_item_tokens`` let in items the profile never measured: the check said ok for a
    config whose 3,000-token items took ~2 s alone against a 1 s objective (a review)."""

    def with_limit(tokens: int, slo_s: float) -> config.PipelineConfig:
        model = {"name": "w2-text", "version": "v1", "sha256": SHA, "max_item_tokens": tokens}
        return config.parse_config(
            {
                "model": model,
                "batching": {"max_wait_s": 0.05, "length_buckets": [32, 64, 128]},
                "latency_slo_s": slo_s,
            }
        )

    profile = tokens_profile(1e-5)  # measured up to 128 tokens
    long = policy.check_policy(with_limit(16384, 1.0), profile)
    assert not long.ok
    (error,) = [e for e in long.errors if "max_item_tokens" in e]
    assert "set model.max_item_tokens to about" in error
    bulk = policy.check_policy(with_limit(16384, 600.0), profile)
    assert bulk.ok, bulk.errors
    assert any("past the profile's longest measured length 128" in w for w in bulk.warnings)
    measured = policy.check_policy(with_limit(128, 1.0), profile)
    assert measured.ok, measured.errors
    assert not any("max_item_tokens" in w for w in measured.warnings)


def test_a_profile_of_another_device_is_warned() -> None:
    """A GPU's profile (fifty times faster) passed the check of a config that runs on the
    CPU (a review): the check says whose times they are."""
    cpu = config.parse_config(
        {
            "model": {"name": "w2-text", "version": "v1", "sha256": SHA, "device": "cpu"},
            "batching": {"max_wait_s": 0.05},
        }
    )
    on_gpu = policy.check_policy(cpu, tokens_profile(1e-5, device="cuda:0 (NVIDIA H100)"))
    assert any("measured on cuda:0 (NVIDIA H100)" in w for w in on_gpu.warnings)
    on_cpu = policy.check_policy(cpu, tokens_profile(1e-5, device="cpu (2 threads)"))
    assert not any("measured on" in w for w in on_cpu.warnings)


@pytest.mark.parametrize(("timeout_s", "fails"), [(0.2, True), (1.0, False), (2.0, None)])
def test_a_forward_timeout_near_a_full_pass_is_refused_or_warned(
    timeout_s: float, fails: bool | None
) -> None:
    # a full batch of 64 x 128 is predicted at 0.3287 s (interpolated from the profile)
    cfg = pipeline(slo_s=60.0, max_batch_size=64, length_buckets=(128,))
    cfg = cfg.model_copy(
        update={"queue": cfg.queue.model_copy(update={"forward_timeout_s": timeout_s})}
    )
    report = policy.check_policy(cfg, tokens_profile(4e-5))
    said = [m for m in (*report.errors, *report.warnings) if "forward_timeout_s" in m]
    if fails is None:  # 2 s holds more than 4 passes
        assert said == []
        return
    (message,) = said
    assert (message in report.errors) is fails
    assert message.startswith(f"queue.forward_timeout_s {timeout_s:g} is within 4x of a full ")
    assert message.endswith("raise it to at least 1.315")
