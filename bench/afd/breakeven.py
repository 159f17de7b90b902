"""The AFD break-even model and the interval arithmetic behind the bench's overlap ratio.

Pure (numpy only): no processes, no torch. Used by :mod:`bench.afd.run`; the math is
checked by ``tests/unit/test_afd_breakeven.py``.

Shapes (:func:`llama_shape`): a Llama-style layer of hidden size ``H`` in SmolLM2's
proportions — head_dim 64, ``H / 64`` query heads, KV heads the largest divisor of the
query heads that is at most a third of them (GQA 3:1 for SmolLM2), MLP width ``8/3 H``
rounded up to a multiple of 64 (1536 for 576).

Per decode step, one layer, ``B`` tokens at context length ``c`` (float32):

- attention FLOPs ``2 B H (q + 2 kv) + 2 B q H + 4 B c q`` (q/k/v and o projections,
  scores and weighted sum); weight bytes ``4 (H (q + 2 kv) + q H)``;
- FFN FLOPs ``6 B H I``; weight bytes ``12 H I``.

Compute model (:func:`fit_compute`): ``t = c0 + c_seq B + c_byte bytes + c_flop flops``,
each constant >= 0, fit by relative least squares over measured ``(B, H, c, t)`` points
(every subset of the terms is fit; the best one with no negative constant wins). ``c0`` is
the per-call overhead (Python, op dispatch), ``c_seq`` a per-sequence cost (this engine runs
attention request by request; 0 for the FFN), ``c_byte`` the weight-streaming cost (decode
is memory-bound at small batch: the time barely grows with ``B``), ``c_flop`` the
arithmetic. Transfer model (:func:`fit_linear`): one layer message's round trip (attention
-> FFN -> attention, both sends and deliveries, no compute) ``R = r0 + r1 bytes`` with
``bytes = 4 B H``.

Predicted time per layer of one step (:func:`predict`), each role on its own core:

- unsplit ``U = A(B) + F(B)``;
- split, one microbatch ``S1 = A(B) + F(B) + R(B)``: always slower than unsplit by ``R``;
- split, two microbatches of ``b1 = ceil(B/2)`` and ``b2 = floor(B/2)`` (ping-pong):
  ``S2 = max(A(b1) + F(b1) + R(b1), A(b1) + A(b2), F(b1) + F(b2))`` — one microbatch's
  cycle, or either role's busy time, whichever is longest; ``S2 = S1`` for ``B = 1``.

AFD with overlap beats unsplit where ``S2 < U``; :func:`break_even_hidden` finds the
smallest such ``H`` of a grid for a batch. The model is optimistic for the split (perfect
pipelining, no scheduler noise) and ignores what unsplit could do with the second core.

Overlap ratio (:func:`covered_time`): the part of each message's transfer intervals that
falls inside its attention worker's compute intervals was *hidden* behind compute; the
rest (while that worker sent, waited for the FFN, or was not scheduled) was *exposed*.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

HEAD_DIM = 64
TERMS = ("c0", "c_seq", "c_byte", "c_flop")


@dataclass(frozen=True)
class LayerShape:
    hidden: int
    q: int  # query width (heads * head_dim)
    kv: int  # key (= value) width
    intermediate: int


def llama_shape(hidden: int) -> LayerShape:
    """SmolLM2-proportioned layer of ``hidden`` (module docstring); ValueError if ``hidden``
    is not a positive multiple of 64."""
    if hidden < HEAD_DIM or hidden % HEAD_DIM:
        raise ValueError(f"hidden must be a positive multiple of {HEAD_DIM}, got {hidden}")
    heads = hidden // HEAD_DIM
    kv_heads = max(d for d in range(1, heads + 1) if heads % d == 0 and 3 * d <= max(heads, 3))
    inter = math.ceil(8 * hidden / 3 / 64) * 64
    return LayerShape(hidden, heads * HEAD_DIM, kv_heads * HEAD_DIM, inter)


def attn_flops(s: LayerShape, batch: float, ctx: float) -> float:
    return 2 * batch * s.hidden * (s.q + 2 * s.kv) + 2 * batch * s.q * s.hidden \
        + 4 * batch * ctx * s.q


def attn_bytes(s: LayerShape) -> float:
    return 4.0 * (s.hidden * (s.q + 2 * s.kv) + s.q * s.hidden)


def ffn_flops(s: LayerShape, batch: float) -> float:
    return 6.0 * batch * s.hidden * s.intermediate


def ffn_bytes(s: LayerShape) -> float:
    return 12.0 * s.hidden * s.intermediate


def features(kind: str, s: LayerShape, batch: float, ctx: float) -> np.ndarray:
    """The model's regressors ``[1, B, bytes, flops]`` for ``kind`` "attn" or "ffn"
    (the FFN has no per-sequence term: its ``B`` column is 0)."""
    if kind == "attn":
        return np.array([1.0, batch, attn_bytes(s), attn_flops(s, batch, ctx)])
    if kind == "ffn":
        return np.array([1.0, 0.0, ffn_bytes(s), ffn_flops(s, batch)])
    raise ValueError(f"kind must be 'attn' or 'ffn', not {kind!r}")


def _nonneg_lstsq(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of ``x @ c ~ y`` with ``c >= 0``: every subset of the non-zero columns,
    the lowest residual among the non-negative fits."""
    cols = [j for j in range(x.shape[1]) if np.any(x[:, j])]
    best, best_res = np.zeros(x.shape[1]), math.inf
    for k in range(1, len(cols) + 1):
        for sub in itertools.combinations(cols, k):
            c, *_ = np.linalg.lstsq(x[:, sub], y, rcond=None)
            if np.any(c < 0):
                continue
            res = float(np.sum((x[:, sub] @ c - y) ** 2))
            if res < best_res - 1e-18:
                best_res = res
                best = np.zeros(x.shape[1])
                best[list(sub)] = c
    return best


def fit_compute(kind: str, points: Sequence[tuple[float, int, float, float]]) -> dict[str, float]:
    """Fit the compute model to ``(batch, hidden, ctx, seconds)`` points (relative least
    squares, constants >= 0); returns ``{c0, c_seq, c_byte, c_flop}`` in seconds (per call,
    per sequence, per byte, per FLOP). ValueError for no points."""
    if not points:
        raise ValueError("fit_compute needs at least one point")
    x = np.array([features(kind, llama_shape(h), b, c) for b, h, c, _ in points])
    y = np.array([t for *_, t in points], dtype=np.float64)
    w = 1.0 / np.maximum(y, 1e-12)
    coef = _nonneg_lstsq(x * w[:, None], y * w)
    return dict(zip(TERMS, (float(v) for v in coef), strict=True))


def compute_time(kind: str, consts: dict[str, float], batch: float, hidden: int,
                 ctx: float) -> float:
    """Seconds per layer call predicted by :func:`fit_compute`'s constants."""
    f = features(kind, llama_shape(hidden), batch, ctx)
    return float(sum(consts[t] * v for t, v in zip(TERMS, f, strict=True)))


def fit_linear(xs: Sequence[float], ys: Sequence[float]) -> dict[str, float]:
    """``y = a + b x`` by least squares with ``a, b >= 0`` (a single x: ``b = 0``);
    returns ``{"fixed": a, "per_unit": b}``. ValueError for no points."""
    if not xs or len(xs) != len(ys):
        raise ValueError("fit_linear needs as many ys as xs, at least one")
    x = np.column_stack([np.ones(len(xs)), np.asarray(xs, dtype=np.float64)])
    if len(set(xs)) < 2:
        x[:, 1] = 0.0
    c = _nonneg_lstsq(x, np.asarray(ys, dtype=np.float64))
    return {"fixed": float(c[0]), "per_unit": float(c[1])}


@dataclass(frozen=True)
class Model:
    """Fitted constants: compute per role (:func:`fit_compute`) and the round trip per
    message (:func:`fit_linear` over bytes, seconds)."""

    attn: dict[str, float]
    ffn: dict[str, float]
    transfer: dict[str, float]
    ctx: float = 16.0  # context length the table assumes

    def round_trip(self, batch: float, hidden: int) -> float:
        return self.transfer["fixed"] + self.transfer["per_unit"] * 4.0 * batch * hidden


def predict(m: Model, batch: int, hidden: int) -> dict[str, float]:
    """Seconds per layer of one decode step: ``unsplit``, ``split_1mb``, ``split_2mb``
    (module docstring), and ``speedup_2mb = unsplit / split_2mb``."""
    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")

    def a(b: int) -> float:
        return compute_time("attn", m.attn, b, hidden, m.ctx) if b else 0.0

    def f(b: int) -> float:
        return compute_time("ffn", m.ffn, b, hidden, m.ctx) if b else 0.0

    unsplit = a(batch) + f(batch)
    split1 = unsplit + m.round_trip(batch, hidden)
    if batch == 1:
        split2 = split1
    else:
        b1, b2 = (batch + 1) // 2, batch // 2
        split2 = max(a(b1) + f(b1) + m.round_trip(b1, hidden), a(b1) + a(b2), f(b1) + f(b2))
    return {"unsplit": unsplit, "split_1mb": split1, "split_2mb": split2,
            "speedup_2mb": unsplit / split2}


def break_even_hidden(m: Model, batch: int, hiddens: Sequence[int]) -> int | None:
    """The smallest hidden size of ``hiddens`` (ascending) where two-microbatch AFD is
    faster than unsplit at ``batch``; None if none is."""
    for h in sorted(hiddens):
        if predict(m, batch, h)["speedup_2mb"] > 1.0:
            return h
    return None


def table(m: Model, batches: Sequence[int], hiddens: Sequence[int],
          grid: Sequence[int]) -> dict[str, Any]:
    """JSON-ready predictions for every ``(hidden, batch)`` (microseconds per layer) and the
    break-even hidden size per batch over ``grid``."""
    rows = []
    for h in hiddens:
        for b in batches:
            p = predict(m, b, h)
            rows.append({"hidden": h, "batch": b,
                         **{f"{k}_us": v * 1e6 for k, v in p.items() if k != "speedup_2mb"},
                         "speedup_2mb": p["speedup_2mb"]})
    return {"rows": rows,
            "break_even_hidden": {str(b): break_even_hidden(m, b, grid) for b in batches},
            "grid": [min(grid), max(grid)]}


# ------------------------------------------------------------------ intervals

def merge(intervals: Sequence[tuple[float, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Sorted disjoint ``(starts, ends)`` covering the union of ``intervals`` (empty or
    reversed ones dropped)."""
    iv = sorted((a, b) for a, b in intervals if b > a)
    starts: list[float] = []
    ends: list[float] = []
    for a, b in iv:
        if starts and a <= ends[-1]:
            ends[-1] = max(ends[-1], b)
        else:
            starts.append(a)
            ends.append(b)
    return np.asarray(starts, dtype=np.float64), np.asarray(ends, dtype=np.float64)


class Cover:
    """The union of some intervals, answering "how much of ``[a, b]`` does it cover"."""

    def __init__(self, intervals: Sequence[tuple[float, float]]) -> None:
        self.starts, self.ends = merge(intervals)
        self._cum = np.concatenate([[0.0], np.cumsum(self.ends - self.starts)])

    def _upto(self, t: float) -> float:
        i = int(np.searchsorted(self.starts, t, side="right")) - 1
        if i < 0:
            return 0.0
        return float(self._cum[i] + min(t, self.ends[i]) - self.starts[i])

    def covered(self, a: float, b: float) -> float:
        """Length of ``[a, b] ∩ union``; 0 for ``b <= a``."""
        return max(0.0, self._upto(b) - self._upto(a)) if b > a else 0.0

    @property
    def total(self) -> float:
        return float(self._cum[-1])


def covered_time(intervals: Sequence[tuple[float, float]], cover: Cover) -> float:
    """Sum over ``intervals`` of the part ``cover`` covers (overlaps counted per interval)."""
    return sum(cover.covered(a, b) for a, b in intervals)
