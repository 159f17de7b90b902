"""Engine performance models: how long a prefill and a decode step take on one replica.

Pure, no I/O except :meth:`TablePerfModel.from_json`. Contract of :class:`PerfModel`
(a ``typing.Protocol``; the planner and the admission core use only these):

- ``kv_capacity_tokens``: KV cache capacity of one replica, in tokens.
- ``prefill_ms(tokens)``: milliseconds to prefill ``tokens`` uncached prompt tokens in one
  batch on an otherwise idle replica.
- ``decode_step_ms(active_kv_tokens)``: milliseconds of one decode step (= ITL) when the
  running batch holds ``active_kv_tokens`` tokens of KV in total.

Implementations:

- :class:`PolynomialPerfModel`: Dynamo's mocker polynomials (ARCHITECTURE.md §3):
  prefill ms = 4.21e-7·T² + 1.518e-2·T + 16.5; decode step ms = −25.74u² + 54.01u + 5.74
  with u = active KV / capacity (at least 1 ms), both divided by ``speedup``.
- :class:`ChunkedPerfModel`: wraps any model for an engine that prefills in chunks of
  at most ``budget`` tokens per step, each step also running the decodes (continuous
  batching with chunked prefill, as vLLM and the mock engine do):
  :func:`chunked_prefill_ms` ``(model, tokens, budget, kv_usage)`` = ``full`` chunks of
  ``budget`` plus one of the rest, each costing ``prefill_ms(chunk) +
  decode_step_ms(kv_usage · capacity)``; 0 tokens take 0 ms. Its ``prefill_ms(tokens)``
  is that estimate at KV usage 0; ``decode_step_ms`` and the capacity are the base's.
- :class:`TablePerfModel`: piecewise-linear interpolation (linear extrapolation past the
  ends) through measured points, e.g. profiled from the mock or the vLLM engine. The JSON /
  dict form is ``{"kv_capacity_tokens": N, "prefill": [[tokens, ms], ...],
  "decode": [[active_kv_tokens, ms], ...]}`` (points may also be ``{"tokens": t, "ms": m}``
  / ``{"kv_tokens": k, "ms": m}`` objects).

Derived quantities used by the planner (Dynamo's throughput mode), for any model:

- :func:`prefill_throughput`: prompt tokens/s of one replica at a given ISL.
- :func:`decode_throughput`: output tokens/s of one replica at context length ``c`` (Dynamo
  uses ``isl + osl/2``) under an ITL SLO: the batch size b that maximises b/step(b·c) with
  step(b·c) <= SLO and b·c <= capacity.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol


class PerfModel(Protocol):
    """Timing of one engine replica; see the module docstring."""

    @property
    def kv_capacity_tokens(self) -> int:
        """KV capacity of one replica in tokens."""
        ...

    def prefill_ms(self, tokens: float) -> float:
        """Milliseconds to prefill ``tokens`` uncached tokens."""
        ...

    def decode_step_ms(self, active_kv_tokens: float) -> float:
        """Milliseconds of one decode step with ``active_kv_tokens`` in the batch."""
        ...


@dataclass(frozen=True)
class PolynomialPerfModel:
    """Dynamo mocker timing, divided by ``speedup`` (> 1 = a faster engine)."""

    capacity: int = 16384 * 16
    speedup: float = 1.0

    def __post_init__(self) -> None:
        if self.capacity < 1 or self.speedup <= 0:
            raise ValueError("capacity must be >= 1 and speedup > 0")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.capacity

    def prefill_ms(self, tokens: float) -> float:
        t = max(float(tokens), 0.0)
        return (4.21e-7 * t * t + 1.518e-2 * t + 16.5) / self.speedup

    def decode_step_ms(self, active_kv_tokens: float) -> float:
        u = min(max(float(active_kv_tokens), 0.0) / self.capacity, 1.0)
        return max(-25.74 * u * u + 54.01 * u + 5.74, 1.0) / self.speedup


def chunked_prefill_ms(model: PerfModel, tokens: float, budget: int,
                       kv_usage: float = 0.0) -> float:
    """Milliseconds to prefill ``tokens`` in chunks of at most ``budget`` tokens, each
    step also carrying decodes at ``kv_usage`` (see the module docstring)."""
    n = int(tokens)
    if n <= 0:
        return 0.0
    if budget < 1:
        raise ValueError("budget must be >= 1")
    decode = model.decode_step_ms(kv_usage * model.kv_capacity_tokens)
    full, rest = divmod(n, budget)
    ms = full * (model.prefill_ms(budget) + decode)
    if rest:
        ms += model.prefill_ms(rest) + decode
    return ms


@dataclass(frozen=True)
class ChunkedPerfModel:
    """``base`` on an engine with a per-step token ``budget`` (chunked prefill)."""

    base: PerfModel
    budget: int = 8192

    def __post_init__(self) -> None:
        if self.budget < 1:
            raise ValueError("budget must be >= 1")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.base.kv_capacity_tokens

    def prefill_ms(self, tokens: float) -> float:
        return chunked_prefill_ms(self.base, tokens, self.budget, 0.0)

    def decode_step_ms(self, active_kv_tokens: float) -> float:
        return self.base.decode_step_ms(active_kv_tokens)


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear through (xs, ys), extrapolating the end segments linearly."""
    if len(xs) == 1:
        return ys[0]
    if x <= xs[0]:
        i = 0
    elif x >= xs[-1]:
        i = len(xs) - 2
    else:
        i = next(k for k in range(len(xs) - 1) if xs[k] <= x <= xs[k + 1])
    x0, x1, y0, y1 = xs[i], xs[i + 1], ys[i], ys[i + 1]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def _points(raw: Any, keys: tuple[str, ...]) -> tuple[list[float], list[float]]:
    pts: list[tuple[float, float]] = []
    for p in raw:
        if isinstance(p, Mapping):
            xk = next((k for k in keys if k in p), None)
            if xk is None or "ms" not in p:
                raise ValueError(f"point {p!r} needs one of {keys} and 'ms'")
            pts.append((float(p[xk]), float(p["ms"])))
        else:
            x, y = p
            pts.append((float(x), float(y)))
    if not pts:
        raise ValueError("a table needs at least one point")
    pts.sort()
    xs = [x for x, _ in pts]
    if len(set(xs)) != len(xs):
        raise ValueError("duplicate x values in a table")
    if any(y <= 0 for _, y in pts):
        raise ValueError("table times must be > 0 ms")
    return xs, [y for _, y in pts]


class TablePerfModel:
    """Measured points, interpolated; see the module docstring for the format."""

    MIN_MS = 0.01

    def __init__(self, kv_capacity_tokens: int, prefill: Sequence[Any],
                 decode: Sequence[Any]) -> None:
        if kv_capacity_tokens < 1:
            raise ValueError("kv_capacity_tokens must be >= 1")
        self._capacity = int(kv_capacity_tokens)
        self._px, self._py = _points(prefill, ("tokens", "t"))
        self._dx, self._dy = _points(decode, ("kv_tokens", "active_kv_tokens", "tokens"))

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TablePerfModel:
        """From ``{"kv_capacity_tokens", "prefill", "decode"}``."""
        try:
            return cls(int(data["kv_capacity_tokens"]), data["prefill"], data["decode"])
        except KeyError as exc:
            raise ValueError(f"perf table misses {exc.args[0]!r}") from None

    @classmethod
    def from_json(cls, path: str | Path) -> TablePerfModel:
        """Reads the JSON form from ``path``."""
        return cls.from_dict(json.loads(Path(path).read_text()))

    @property
    def kv_capacity_tokens(self) -> int:
        return self._capacity

    def prefill_ms(self, tokens: float) -> float:
        return max(_interp(self._px, self._py, max(float(tokens), 0.0)), self.MIN_MS)

    def decode_step_ms(self, active_kv_tokens: float) -> float:
        return max(_interp(self._dx, self._dy, max(float(active_kv_tokens), 0.0)), self.MIN_MS)


def prefill_throughput(model: PerfModel, isl: float) -> float:
    """Prompt tokens per second one replica prefills at prompt length ``isl``."""
    isl = max(isl, 1.0)
    return isl * 1000.0 / model.prefill_ms(isl)


@dataclass(frozen=True)
class DecodeCapacity:
    """Best decode operating point of one replica at one context length."""

    tokens_per_s: float
    batch: int
    step_ms: float
    meets_slo: bool  # False: even batch 1 exceeds the ITL SLO (tokens_per_s is batch 1's)


def decode_throughput(model: PerfModel, context: float, itl_slo_ms: float,
                      max_batch: int = 1024) -> DecodeCapacity:
    """Output tokens/s of one replica at context ``context`` under ``itl_slo_ms``."""
    context = max(context, 1.0)
    limit = max(1, min(max_batch, math.floor(model.kv_capacity_tokens / context)))
    best: DecodeCapacity | None = None
    for b in range(1, limit + 1):
        step = model.decode_step_ms(b * context)
        if step > itl_slo_ms:
            continue
        tps = b * 1000.0 / step
        if best is None or tps > best.tokens_per_s:
            best = DecodeCapacity(tps, b, step, True)
    if best is None:
        step = model.decode_step_ms(context)
        best = DecodeCapacity(1000.0 / step, 1, step, False)
    return best


def expected_itl_ms(model: PerfModel, batch: float, context: float) -> float:
    """The model's ITL for ``batch`` running requests of ``context`` tokens each."""
    return model.decode_step_ms(max(batch, 1.0) * max(context, 1.0))


def load_perf_model(spec: str, speedup: float = 1.0,
                    kv_capacity_tokens: int = 16384 * 16) -> PerfModel:
    """``"mocker"`` → :class:`PolynomialPerfModel`; otherwise a JSON table path."""
    if spec in ("", "mocker", "polynomial"):
        return PolynomialPerfModel(kv_capacity_tokens, speedup)
    return TablePerfModel.from_json(spec)
