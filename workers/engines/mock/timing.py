"""How long a simulated engine step and a simulated KV transfer take (pure).

Contract:

- A :class:`TimingModel` answers ``step_ms(prefill_tokens, decode_seqs, kv_usage)``: the
  unscaled milliseconds of one engine step that computes ``prefill_tokens`` uncached
  prompt tokens (summed over the batch's prefill chunks) and one token for each of
  ``decode_seqs`` decoding requests, while ``kv_usage`` (used / total KV blocks, in [0, 1])
  of the cache is active. An empty step (0 and 0) takes 0 ms.
- :class:`PolynomialTiming` (default) is Dynamo's mocker model (ARCHITECTURE.md §3):
  prefill ms = 4.21e-7·T² + 1.518e-2·T + 16.5 for T = prefill tokens in the step;
  decode ms = max(1, −25.74u² + 54.01u + 5.74) with u = kv_usage. A step with both
  prefill and decode work takes the **sum** (the mixed batch runs the prefill chunk and the
  decode tokens in one forward pass whose cost we approximate as additive).
- :class:`TableTiming` interpolates measured points: ``prefill`` maps prefill tokens per
  step → ms and ``decode`` maps decoding requests per step (batch size) → ms, linearly
  between points and along the last segment beyond them; mixed steps take the sum. Load
  it with :meth:`TableTiming.from_json` from ``{"prefill": [[tokens, ms], ...],
  "decode": [[seqs, ms], ...]}``; ``tables/example_cpu.json`` is a small example.
- :class:`ZeroTiming`: every step takes 0 ms (router-overhead benchmarks).
- :func:`make_timing(spec)`: ``"poly"``/``"dynamo"``, ``"zero"``, or ``"table:PATH"``
  (``"table"`` alone: the shipped example).
- :func:`transfer_ms(num_bytes, bandwidth)`: simulated P→D KV transfer, bytes / bandwidth
  (bytes per second), in ms; 0 bytes or an infinite bandwidth take 0 ms.
- Scaling by a ``speedup_ratio`` (divide) is the caller's job (the scheduler).
"""

from __future__ import annotations

import bisect
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

EXAMPLE_TABLE = Path(__file__).with_name("tables") / "example_cpu.json"


class TimingModel(Protocol):
    """Unscaled step time; see the module docstring."""

    @property
    def name(self) -> str: ...

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float: ...


@dataclass(frozen=True)
class PolynomialTiming:
    """Dynamo mocker's polynomials (ARCHITECTURE.md §3); mixed steps add up."""

    name: str = "poly"
    prefill_a: float = 4.21e-7
    prefill_b: float = 1.518e-2
    prefill_c: float = 16.5
    decode_a: float = -25.74
    decode_b: float = 54.01
    decode_c: float = 5.74
    decode_min_ms: float = 1.0

    def prefill_ms(self, tokens: int) -> float:
        if tokens <= 0:
            return 0.0
        return self.prefill_a * tokens * tokens + self.prefill_b * tokens + self.prefill_c

    def decode_ms(self, kv_usage: float) -> float:
        u = min(max(kv_usage, 0.0), 1.0)
        return max(self.decode_min_ms, self.decode_a * u * u + self.decode_b * u + self.decode_c)

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float:
        ms = self.prefill_ms(prefill_tokens)
        if decode_seqs > 0:
            ms += self.decode_ms(kv_usage)
        return ms


@dataclass(frozen=True)
class ZeroTiming:
    """Instant steps."""

    name: str = "zero"

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float:
        return 0.0


def _interp(points: tuple[tuple[float, float], ...], x: float) -> float:
    """Piecewise-linear through ``points`` (sorted by x), extended along the end segments;
    never negative."""
    xs = [p[0] for p in points]
    if len(points) == 1:
        return max(0.0, points[0][1])
    i = bisect.bisect_right(xs, x)
    i = min(max(i, 1), len(points) - 1)
    (x0, y0), (x1, y1) = points[i - 1], points[i]
    y = y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return max(0.0, y)


@dataclass(frozen=True)
class TableTiming:
    """Interpolated measured points; see the module docstring."""

    prefill: tuple[tuple[float, float], ...]
    decode: tuple[tuple[float, float], ...]
    name: str = "table"

    def __post_init__(self) -> None:
        for label, pts in (("prefill", self.prefill), ("decode", self.decode)):
            if not pts:
                raise ValueError(f"timing table needs at least one {label} point")
            xs = [p[0] for p in pts]
            if xs != sorted(xs) or len(set(xs)) != len(xs):
                raise ValueError(f"{label} points must have strictly increasing x")
            if any(not math.isfinite(p[1]) or p[1] < 0 for p in pts):
                raise ValueError(f"{label} times must be finite and >= 0")

    @classmethod
    def from_dict(cls, data: dict[str, object], name: str = "table") -> TableTiming:
        def points(key: str) -> tuple[tuple[float, float], ...]:
            raw = data.get(key)
            if not isinstance(raw, list):
                raise ValueError(f"timing table: {key!r} must be a list of [x, ms] pairs")
            return tuple(sorted((float(x), float(y)) for x, y in raw))

        return cls(points("prefill"), points("decode"), name)

    @classmethod
    def from_json(cls, path: str | Path) -> TableTiming:
        return cls.from_dict(json.loads(Path(path).read_text()), name=f"table:{path}")

    def step_ms(self, prefill_tokens: int, decode_seqs: int, kv_usage: float) -> float:
        ms = _interp(self.prefill, prefill_tokens) if prefill_tokens > 0 else 0.0
        if decode_seqs > 0:
            ms += _interp(self.decode, decode_seqs)
        return ms


def make_timing(spec: str) -> TimingModel:
    """``poly`` | ``dynamo`` | ``zero`` | ``table`` | ``table:PATH``."""
    if spec in ("poly", "dynamo", ""):
        return PolynomialTiming()
    if spec == "zero":
        return ZeroTiming()
    if spec == "table":
        return TableTiming.from_json(EXAMPLE_TABLE)
    if spec.startswith("table:"):
        return TableTiming.from_json(spec.partition(":")[2])
    raise ValueError(f"unknown timing model {spec!r} (poly, zero, table, table:PATH)")


def transfer_ms(num_bytes: int, bandwidth: float) -> float:
    """Simulated transfer time of ``num_bytes`` at ``bandwidth`` bytes/s, in ms."""
    if num_bytes <= 0 or math.isinf(bandwidth):
        return 0.0
    if bandwidth <= 0:
        raise ValueError("bandwidth must be > 0")
    return num_bytes / bandwidth * 1000.0
