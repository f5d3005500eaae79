"""``batching check`` says how long an item the device can take, and warns when the model's
``max_item_tokens`` lets in longer ones (they would go dead at scoring)."""

from __future__ import annotations

from batching import config
from batching.plan import check as policy
from tests.unit.test_policy import SHA, tokens_profile


def pipeline(**model: object) -> config.PipelineConfig:
    return config.parse_config(
        {
            "model": {"name": "w2-text", "version": "v1", "sha256": SHA, **model},
            "batching": {"max_wait_s": 0.05, "length_buckets": [128]},
        }
    )


def test_the_largest_item_is_what_fits_the_memory_budget() -> None:
    # 10,000 bytes + 1,000 a token: 1 MiB holds 1,038 tokens.
    report = policy.check_policy(
        pipeline(max_item_tokens=4096),
        tokens_profile(peak_per_unit=1000),
        device_memory_bytes=2**20,
        memory_fraction=1.0,
    )
    assert report.largest_item == "1038 tokens (memory budget 1.0 MiB; model.max_item_tokens 4096)"
    assert any("lower max_item_tokens to 1038" in w for w in report.warnings)


def test_max_item_tokens_within_the_budget_is_the_largest_item_without_a_warning() -> None:
    report = policy.check_policy(
        pipeline(max_item_tokens=500, memory_budget_bytes=2**20),
        tokens_profile(peak_per_unit=1000),
    )
    assert report.largest_item == "500 tokens (memory budget 1.0 MiB; model.max_item_tokens 500)"
    assert not any("lower max_item_tokens" in w for w in report.warnings)


def test_without_measured_memory_the_limit_is_all_it_can_say() -> None:
    report = policy.check_policy(pipeline(), tokens_profile(), device_memory_bytes=2**30)
    assert report.largest_item is not None
    assert report.largest_item.startswith("up to model.max_item_tokens 16384 tokens accepted")


def test_the_runners_memory_curve_is_quadratic_in_length_and_never_below_its_probes() -> None:
    from batching.model.runner import ItemMemory

    # 16 bytes per length^2 (4 heads x float32 scores) + 1,000 per token + 5,000 fixed.
    lengths = (32, 64, 128)
    peaks = [5000 + 1000 * n + 16 * n * n for n in lengths]
    memory = ItemMemory.fit(lengths, peaks, budget=6_400_000_000, source="test", max_length=60000)
    for n, peak in zip(lengths, peaks, strict=True):
        assert memory.batch(1, n) >= peak
    assert memory.batch(1, 20000) >= 6_400_000_000  # the 20k-token item of the issue
    assert memory.batch(2, 128) > memory.batch(1, 128)
    assert 19000 < memory.longest() < 20000


def test_a_fixed_part_counts_once_per_batch_not_once_per_row() -> None:
    """A GPU's workspace (here 50 MB) is in every single-item probe; spread over the rows of
    a batch it would split every large batch for nothing."""
    from batching.model.runner import ItemMemory

    lengths = (32, 64, 128)
    peaks = [50_000_000 + 1000 * n + 16 * n * n for n in lengths]
    memory = ItemMemory.fit(lengths, peaks, budget=10**12, source="test", max_length=60000)
    true = 50_000_000 + 2048 * (1000 * 128 + 16 * 128 * 128)
    assert true <= memory.batch(2048, 128) < 1.01 * true
