"""Unit tests for ServiceProfile: interpolation, conservative extrapolation, monotonicity, JSON."""

from __future__ import annotations

import itertools
import json
import math
from pathlib import Path

import pytest

from batching import errors
from batching.plan.profile import ProfilePoint, ServiceProfile


def profile(
    table: dict[tuple[int, int], float], *, kind: str = "tokens", **kwargs: object
) -> ServiceProfile:
    points = tuple(ProfilePoint(b, n, s) for (b, n), s in table.items())
    fields: dict[str, object] = {
        "model_name": "w2-text",
        "model_version": "v1",
        "device": "fake",
        "input_kind": kind,
        **kwargs,
    }
    return ServiceProfile(points, **fields)  # type: ignore[arg-type]


LINEAR = profile({(b, n): 0.001 + 1e-5 * b * n for b in (1, 8, 32) for n in (16, 64, 128)})
DENSE = profile({(1, 1): 0.001, (64, 1): 0.002, (512, 1): 0.008}, kind="dense")


@pytest.mark.parametrize(
    ("n_items", "length", "expected"),
    [
        (8, 64, 0.001 + 1e-5 * 8 * 64),  # measured point
        (20, 64, 0.001 + 1e-5 * 20 * 64),  # between batch sizes (exact for linear data)
        (8, 96, 0.001 + 1e-5 * 8 * 96),  # between lengths
        (1, 4, 0.001 + 1e-5 * 16),  # below the smallest length: clamp up to it
        (0, 64, 0.0),
    ],
)
def test_predict_interpolates(n_items: int, length: int, expected: float) -> None:
    assert LINEAR.predict(n_items, length) == pytest.approx(expected)


def test_predict_extrapolates_at_least_proportionally() -> None:
    at_max = LINEAR.predict(32, 128)
    assert LINEAR.predict(64, 128) >= 2 * at_max - 1e-12
    assert LINEAR.predict(32, 256) == pytest.approx(2 * at_max)
    assert not LINEAR.covers(64, 128)
    assert LINEAR.covers(32, 128)


def test_predict_below_smallest_batch_keeps_fixed_overhead() -> None:
    assert DENSE.predict(1) == DENSE.predict(0.5) == 0.001  # type: ignore[arg-type]


def test_dense_profile_ignores_length() -> None:
    assert DENSE.predict(64, 1) == DENSE.predict(64, 500) == pytest.approx(0.002)
    assert DENSE.lengths == (1,)
    assert DENSE.covers(512, 10_000)


def test_extrapolation_uses_the_steeper_last_segment() -> None:
    steep = profile({(1, 1): 0.001, (10, 1): 0.001, (20, 1): 0.011}, kind="dense")
    assert steep.predict(30) == pytest.approx(0.021)  # slope 0.001/item beats 0.011/20


NOISY = profile(
    {
        (1, 16): 0.004,
        (8, 16): 0.003,  # noisy: faster than batch 1
        (32, 16): 0.02,
        (1, 64): 0.002,  # noisy: faster than the shorter length
        (4, 64): 0.05,
        (64, 128): 0.2,
    }
)


@pytest.mark.parametrize("prof", [LINEAR, DENSE, NOISY], ids=["linear", "dense", "noisy"])
def test_predict_is_monotone_in_items_and_length(prof: ServiceProfile) -> None:
    sizes = [1, 2, 3, 4, 7, 8, 9, 20, 32, 33, 64, 100, 600]
    lengths = [1, 8, 16, 17, 40, 64, 65, 100, 128, 129, 300]
    grid = {(n, ln): prof.predict(n, ln) for n, ln in itertools.product(sizes, lengths)}
    for (n, ln), t in grid.items():
        assert math.isfinite(t)
        for n2, ln2 in itertools.product(sizes, lengths):
            if n2 >= n and ln2 >= ln:
                assert grid[n2, ln2] >= t - 1e-12, ((n, ln), (n2, ln2))


def test_noisy_measurements_are_raised_never_lowered() -> None:
    assert NOISY.predict(8, 16) == pytest.approx(0.004)
    assert NOISY.predict(1, 64) == pytest.approx(0.004)
    assert NOISY.predict(32, 64) >= 0.05


def test_predict_memory_is_linear_in_padded_units() -> None:
    points = (ProfilePoint(1, 16, 0.01, 1000), ProfilePoint(4, 16, 0.02, 1600))
    prof = ServiceProfile(points, "m", "v", "fake", input_kind="tokens")
    assert prof.predict_memory(4, 16) == 1600
    assert prof.predict_memory(8, 16) == 2400  # 10 bytes per padded token past the base
    assert LINEAR.predict_memory(8, 16) is None


@pytest.mark.parametrize(
    "points",
    [
        (),
        (ProfilePoint(0, 1, 0.1),),
        (ProfilePoint(1, 1, -0.1),),
        (ProfilePoint(1, 1, float("nan")),),
        (ProfilePoint(1, 1, 0.1), ProfilePoint(1, 1, 0.2)),
    ],
)
def test_invalid_points_are_rejected(points: tuple[ProfilePoint, ...]) -> None:
    with pytest.raises(ValueError, match=r"point|seconds|>= 1"):
        ServiceProfile(points, "m", "v", "fake")


def test_save_and_load_round_trip(tmp_path: Path) -> None:
    prof = profile(
        {(1, 16): 0.01, (8, 16): 0.02},
        torch_version="2.13.0",
        created_at="2026-01-01T00:00:00+00:00",
        device_memory_bytes=80 * 2**30,
    )
    path = prof.save(tmp_path / "p.json")
    data = json.loads(path.read_text())
    assert data["format"] == "batching-service-profile"
    assert data["model"] == {"name": "w2-text", "version": "v1"}
    loaded = ServiceProfile.load(path)
    assert loaded == prof
    assert loaded.predict(4, 16) == prof.predict(4, 16)


@pytest.mark.parametrize(
    ("content", "match"),
    [
        (None, "cannot read"),
        ("{", "not valid JSON"),
        ("[]", "JSON object"),
        ('{"format": "other", "version": 1}', "not a version 1"),
        ('{"format": "batching-service-profile", "version": 1, "points": []}', "invalid"),
        (
            '{"format": "batching-service-profile", "version": 1, "points": [], '
            '"device_memory_bytes": "lots"}',
            "device_memory_bytes must be a whole number of bytes or null, got 'lots'",
        ),
        ('{"format": "batching-service-profile", "version": 1, "points": 3}', "must be a list"),
        (
            '{"format": "batching-service-profile", "version": 1, "points": [[1, 16, 0.1]]}',
            r"points\[0\] must be an object of batch_size, length and seconds",
        ),
        (
            '{"format": "batching-service-profile", "version": 1, "points": '
            '[{"batch_size": 1, "length": "16", "seconds": 0.1}]}',
            "batch_size and length must be whole numbers",
        ),
    ],
)
def test_load_errors_say_how_to_fix(tmp_path: Path, content: str | None, match: str) -> None:
    path = tmp_path / "p.json"
    if content is not None:
        path.write_text(content)
    with pytest.raises(errors.ConfigError, match=match) as info:
        ServiceProfile.load(path)
    assert "batching profile" in str(info.value) or match == "JSON object"
