"""A model's measured service time per (batch size, length), saved as JSON; standard library only.

``length`` is the padded length of every item in the batch (tokens for token models; always 1 for
dense models, whose predictions ignore length). Times are forward wall seconds on one device, as
measured by ``batching.model.runner.measure_profile`` (median of repeats).

``predict`` is monotone (never smaller for more items or longer items) and conservative:

- measurements are first made monotone: a point's time is raised to the slowest time measured at
  a batch size and length no larger than it;
- between measured batch sizes and lengths it interpolates linearly;
- below the smallest measured size or length it uses the smallest measurement (fixed overheads
  do not vanish for tiny batches);
- past the largest batch size it extends the last point with the steeper of the last segment's
  slope and the proportional slope (time / batch size); past the longest length it scales
  proportionally to length. Growth that is super-linear beyond the measured range (attention is
  quadratic in length) can still be underestimated, so measure up to the sizes you configure;
  :meth:`ServiceProfile.covers` tells whether a query is inside the measured range.
"""

from __future__ import annotations

import bisect
import itertools
import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from batching import errors

FORMAT = "batching-service-profile"
FORMAT_VERSION = 1


@dataclass(frozen=True, slots=True)
class ProfilePoint:
    """One measurement: ``batch_size`` items of ``length`` each took ``seconds`` (median)."""

    batch_size: int
    length: int
    seconds: float
    peak_memory_bytes: int | None = None


@dataclass(frozen=True, slots=True)
class ServiceProfile:
    """Measured forward seconds of one model on one device, with where and when it was measured."""

    points: tuple[ProfilePoint, ...]
    model_name: str
    model_version: str
    device: str
    input_kind: str = "dense"
    torch_version: str = ""
    created_at: str = ""
    device_memory_bytes: int | None = None
    _curves: dict[int, _Curve] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        _validate_points(self.points)
        object.__setattr__(self, "_curves", _build_curves(self.points, self.is_dense))

    @property
    def is_dense(self) -> bool:
        """True when length does not matter (fixed-size inputs)."""
        return self.input_kind == "dense"

    @property
    def batch_sizes(self) -> tuple[int, ...]:
        """Measured batch sizes, ascending."""
        return tuple(sorted({p.batch_size for p in self.points}))

    @property
    def lengths(self) -> tuple[int, ...]:
        """Measured lengths, ascending (``(1,)`` for dense models)."""
        return tuple(sorted(self._curves))

    def covers(self, n_items: int, length: int = 1) -> bool:
        """True when ``(n_items, length)`` lies inside the measured range (no extrapolation)."""
        fits_length = self.is_dense or length <= self.lengths[-1]
        return n_items <= self.batch_sizes[-1] and fits_length

    def predict(self, n_items: int, length: int = 1) -> float:
        """Predicted forward seconds for ``n_items`` items padded to ``length`` (see module doc).

        Returns 0.0 for ``n_items <= 0``; the result is non-decreasing in both arguments.
        """
        if n_items <= 0:
            return 0.0
        lengths = self.lengths
        if self.is_dense or length <= lengths[0]:
            return self._curves[lengths[0]].at(n_items)
        if length >= lengths[-1]:
            return self._curves[lengths[-1]].at(n_items) * length / lengths[-1]
        hi = bisect.bisect_left(lengths, length)
        l0, l1 = lengths[hi - 1], lengths[hi]
        t0, t1 = self._curves[l0].at(n_items), self._curves[l1].at(n_items)
        return t0 + (t1 - t0) * (length - l0) / (l1 - l0)

    def predict_memory(self, n_items: int, length: int = 1) -> int | None:
        """Estimated peak device bytes for a batch, or None when no peak memory was measured.

        Linear in padded units (items x length; items for dense models) through the smallest
        measurement, with the steepest per-unit slope seen among the measurements.
        """
        measured = [
            (self._units(p.batch_size, p.length), p.peak_memory_bytes)
            for p in self.points
            if p.peak_memory_bytes is not None
        ]
        if not measured:
            return None
        base_units, base_bytes = min(measured)
        slopes = [(b - base_bytes) / (u - base_units) for u, b in measured if u > base_units]
        per_unit = max([0.0, *slopes])
        units = self._units(n_items, length)
        return math.ceil(base_bytes + per_unit * max(0, units - base_units))

    def _units(self, n_items: int, length: int) -> int:
        return n_items if self.is_dense else n_items * length

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready mapping (the file format)."""
        return {
            "format": FORMAT,
            "version": FORMAT_VERSION,
            "model": {"name": self.model_name, "version": self.model_version},
            "input_kind": self.input_kind,
            "device": self.device,
            "device_memory_bytes": self.device_memory_bytes,
            "torch_version": self.torch_version,
            "created_at": self.created_at,
            "points": [asdict(p) for p in self.points],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], *, source: str = "profile") -> ServiceProfile:
        """Build a profile from :meth:`to_dict` output; raises ``ConfigError`` naming the problem."""
        if data.get("format") != FORMAT or data.get("version") != FORMAT_VERSION:
            raise errors.ConfigError(
                f"{source}: not a version {FORMAT_VERSION} service profile; "
                "re-run `batching profile`"
            )
        memory = data.get("device_memory_bytes")
        if memory is not None and not _count(memory):
            raise errors.ConfigError(
                f"{source}: device_memory_bytes must be a whole number of bytes or null, got "
                f"{str(memory)[:40]!r}; re-run `batching profile`"
            )
        points = data.get("points")
        if not isinstance(points, list):
            raise errors.ConfigError(
                f"{source}: points must be a list of measurements; re-run `batching profile`"
            )
        try:
            parsed = tuple(_point(p, n) for n, p in enumerate(points))
            model = data.get("model")
            if not isinstance(model, dict) or not {"name", "version"} <= set(model):
                raise ValueError("model must be an object with name and version")
            return cls(
                points=parsed,
                model_name=str(model["name"]),
                model_version=str(model["version"]),
                device=str(data["device"]),
                input_kind=str(data.get("input_kind", "dense")),
                torch_version=str(data.get("torch_version", "")),
                created_at=str(data.get("created_at", "")),
                device_memory_bytes=data.get("device_memory_bytes"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise errors.ConfigError(
                f"{source}: invalid service profile ({exc}); re-run `batching profile`"
            ) from None

    def save(self, path: str | Path) -> Path:
        """Write the profile as indented JSON; returns the path."""
        p = Path(path)
        p.write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")
        return p

    @classmethod
    def load(cls, path: str | Path) -> ServiceProfile:
        """Read a profile written by :meth:`save`; raises ``ConfigError`` if missing or invalid."""
        p = Path(path)
        try:
            data = json.loads(p.read_text(encoding="utf-8"))
        except OSError as exc:
            raise errors.ConfigError(
                f"{p}: cannot read service profile ({exc.strerror}); run `batching profile`"
            ) from None
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise errors.ConfigError(
                f"{p}: service profile is not valid JSON in UTF-8; re-run `batching profile`"
            ) from None
        if not isinstance(data, dict):
            raise errors.ConfigError(f"{p}: service profile must be a JSON object")
        return cls.from_dict(data, source=str(p))


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _point(data: Any, n: int) -> ProfilePoint:
    """``points[n]`` of a profile file, its fields' types checked (``ValueError`` naming it)."""
    fields = {"batch_size", "length", "seconds", "peak_memory_bytes"}
    if not isinstance(data, dict) or not {"batch_size", "length", "seconds"} <= set(data):
        raise ValueError(f"points[{n}] must be an object of batch_size, length and seconds")
    if set(data) - fields:
        raise ValueError(
            f"points[{n}] has unknown field(s) {', '.join(sorted(set(data) - fields))}"
        )
    size, length, seconds = data["batch_size"], data["length"], data["seconds"]
    memory = data.get("peak_memory_bytes")
    if not (_count(size) and _count(length)):
        raise ValueError(f"points[{n}]: batch_size and length must be whole numbers")
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise ValueError(f"points[{n}]: seconds must be a number")
    if memory is not None and not _count(memory):
        raise ValueError(f"points[{n}]: peak_memory_bytes must be a whole number or null")
    return ProfilePoint(size, length, float(seconds), memory)


def _validate_points(points: Iterable[ProfilePoint]) -> None:
    seen: set[tuple[int, int]] = set()
    for p in points:
        if p.batch_size < 1 or p.length < 1:
            raise ValueError(f"batch_size and length must be >= 1, got {p}")
        if not (math.isfinite(p.seconds) and p.seconds >= 0):
            raise ValueError(f"seconds must be finite and >= 0, got {p.seconds!r}")
        if (p.batch_size, p.length) in seen:
            raise ValueError(f"duplicate point batch_size={p.batch_size} length={p.length}")
        seen.add((p.batch_size, p.length))
    if not seen:
        raise ValueError("a service profile needs at least one point")


@dataclass(frozen=True, slots=True)
class _Curve:
    """Monotone piecewise-linear seconds vs batch size at one length, linear past the last size."""

    sizes: tuple[int, ...]
    seconds: tuple[float, ...]
    tail_slope: float

    def at(self, n: int) -> float:
        sizes, secs = self.sizes, self.seconds
        if n <= sizes[0]:
            return secs[0]
        if n >= sizes[-1]:
            return secs[-1] + self.tail_slope * (n - sizes[-1])
        hi = bisect.bisect_left(sizes, n)
        s0, s1, t0, t1 = sizes[hi - 1], sizes[hi], secs[hi - 1], secs[hi]
        return t0 + (t1 - t0) * (n - s0) / (s1 - s0)


def _build_curves(points: tuple[ProfilePoint, ...], dense: bool) -> dict[int, _Curve]:
    """One monotone curve per measured length, each raised to dominate every shorter length."""
    by_length: dict[int, dict[int, float]] = {}
    for p in points:
        row = by_length.setdefault(1 if dense else p.length, {})
        row[p.batch_size] = max(row.get(p.batch_size, 0.0), p.seconds)
    curves: dict[int, _Curve] = {}
    previous: _Curve | None = None
    for length in sorted(by_length):
        previous = curves[length] = _dominating_curve(by_length[length], previous)
    return curves


def _dominating_curve(row: dict[int, float], previous: _Curve | None) -> _Curve:
    """Curve through ``row`` (size -> seconds), made non-decreasing and >= ``previous``."""
    own_sizes = tuple(sorted(row))
    own_secs = tuple(row[s] for s in own_sizes)
    slope = own_secs[-1] / own_sizes[-1]
    if len(own_sizes) > 1:
        slope = max(slope, (own_secs[-1] - own_secs[-2]) / (own_sizes[-1] - own_sizes[-2]))
    own = _Curve(own_sizes, own_secs, slope)
    if previous is None:
        sizes = list(own_sizes)
        raw = list(own_secs)
    else:
        sizes = sorted(set(own_sizes) | set(previous.sizes))
        raw = [max(own.at(s), previous.at(s)) for s in sizes]
        slope = max(slope, previous.tail_slope)
    secs = tuple(itertools.accumulate(raw, max))
    return _Curve(tuple(sizes), secs, slope)
