"""Load predictors: the next interval's value of a series (request rate, ISL, OSL).

Pure: numpy only, no I/O. Contract of :class:`Predictor` (a ``typing.Protocol``):

- ``add(value)``: appends one observation (one throughput interval's value).
- ``predict()``: the expected value of the *next* observation; ``None`` before the first
  ``add``. Never negative (rates and lengths are non-negative).

Implementations, as in Dynamo's planner (``constant``, ``arima``, ``kalman``) plus a moving
average:

- :class:`ConstantPredictor`: the last value.
- :class:`MovingAveragePredictor`: the mean of the last ``window`` values.
- :class:`KalmanPredictor`: a 1-D Kalman filter; ``model="velocity"`` (constant-velocity:
  state = level and slope, so it follows ramps without lag) or ``"random_walk"``
  (state = level only: a smoother of noisy flat series).
- :class:`ArPredictor`: an ARIMA-like AR(p) model with intercept, refitted by least squares
  over the last ``window`` values on every ``add`` (``d=1`` differences first, the "I" of
  ARIMA). Falls back to the last value until it has enough points.

:func:`make_predictor` is the registry (``constant``, ``moving_average``, ``kalman``,
``arima``); unknown names raise ValueError.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

import numpy as np


class Predictor(Protocol):
    """Predicts the next value of a series from its history."""

    def add(self, value: float) -> None:
        """Records one observation."""
        ...

    def predict(self) -> float | None:
        """The expected next observation (>= 0), or None with no history."""
        ...


class ConstantPredictor:
    """Next = last."""

    def __init__(self) -> None:
        self._last: float | None = None

    def add(self, value: float) -> None:
        self._last = float(value)

    def predict(self) -> float | None:
        return None if self._last is None else max(self._last, 0.0)


class MovingAveragePredictor:
    """Next = mean of the last ``window`` values."""

    def __init__(self, window: int = 5) -> None:
        if window < 1:
            raise ValueError("window must be >= 1")
        self._values: deque[float] = deque(maxlen=window)

    def add(self, value: float) -> None:
        self._values.append(float(value))

    def predict(self) -> float | None:
        if not self._values:
            return None
        return max(sum(self._values) / len(self._values), 0.0)


class KalmanPredictor:
    """1-D Kalman filter; see the module docstring for the two models.

    ``q`` is the process noise (how fast the level/slope may wander) and ``r`` the
    measurement noise, both relative to the series' scale (variances are multiplied by the
    square of the first observation's magnitude, so the filter is scale-free).
    """

    def __init__(self, model: str = "velocity", q: float = 0.01, r: float = 0.1) -> None:
        if model not in ("velocity", "random_walk"):
            raise ValueError(f"unknown Kalman model {model!r}")
        self._velocity = model == "velocity"
        self._q = q
        self._r = r
        n = 2 if self._velocity else 1
        self._f = np.array([[1.0, 1.0], [0.0, 1.0]]) if self._velocity else np.eye(1)
        self._h = np.zeros((1, n))
        self._h[0, 0] = 1.0
        self._x: np.ndarray | None = None
        self._p = np.eye(n)
        self._scale = 1.0

    def add(self, value: float) -> None:
        z = float(value)
        n = self._f.shape[0]
        if self._x is None:
            self._scale = max(abs(z), 1.0) ** 2
            self._x = np.zeros(n)
            self._x[0] = z
            self._p = np.eye(n) * self._scale
            return
        q = np.eye(n) * self._q * self._scale
        r = self._r * self._scale
        # predict
        x = self._f @ self._x
        p = self._f @ self._p @ self._f.T + q
        # update
        y = z - float((self._h @ x)[0])
        s = float((self._h @ p @ self._h.T)[0, 0]) + r
        k = (p @ self._h.T)[:, 0] / s
        self._x = x + k * y
        self._p = (np.eye(n) - np.outer(k, self._h[0])) @ p

    def predict(self) -> float | None:
        if self._x is None:
            return None
        nxt = self._f @ self._x
        return max(float(nxt[0]), 0.0)


class ArPredictor:
    """AR(p) with intercept on the (optionally differenced) series, least squares."""

    def __init__(self, p: int = 3, window: int = 64, d: int = 0) -> None:
        if p < 1 or window < 2 or d not in (0, 1):
            raise ValueError("need p >= 1, window >= 2, d in (0, 1)")
        self._p = p
        self._d = d
        self._values: deque[float] = deque(maxlen=window)
        self._coef: np.ndarray | None = None

    def _series(self) -> np.ndarray:
        arr = np.asarray(self._values, dtype=float)
        return np.diff(arr) if self._d else arr

    def add(self, value: float) -> None:
        self._values.append(float(value))
        s = self._series()
        rows = len(s) - self._p
        if rows < self._p + 1:  # fewer equations than unknowns: no fit yet
            self._coef = None
            return
        x = np.column_stack([s[self._p - i - 1: len(s) - i - 1] for i in range(self._p)])
        x = np.column_stack([np.ones(rows), x])
        y = s[self._p:]
        self._coef, *_ = np.linalg.lstsq(x, y, rcond=None)

    def predict(self) -> float | None:
        if not self._values:
            return None
        last = self._values[-1]
        if self._coef is None:
            return max(last, 0.0)
        s = self._series()
        lags = s[::-1][: self._p]  # most recent first
        nxt = float(self._coef[0] + self._coef[1:] @ lags)
        if self._d:
            nxt = last + nxt
        return max(nxt, 0.0)


_REGISTRY: dict[str, Callable[..., Predictor]] = {
    "constant": ConstantPredictor,
    "moving_average": MovingAveragePredictor,
    "kalman": KalmanPredictor,
    "arima": ArPredictor,
}
_TAKES_WINDOW = ("moving_average", "arima")

PREDICTORS = tuple(_REGISTRY)


def make_predictor(name: str, window: int | None = None, **kwargs: Any) -> Predictor:
    """A new predictor by registry name. ``window`` goes to the predictors that keep a
    window (moving_average, arima) and is ignored by the others; ``kwargs`` go to the
    constructor."""
    try:
        factory = _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown predictor {name!r}; known: {', '.join(PREDICTORS)}") from None
    if window is not None and name in _TAKES_WINDOW:
        kwargs.setdefault("window", window)
    return factory(**kwargs)
