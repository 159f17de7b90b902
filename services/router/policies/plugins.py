"""Built-in filters, scorers and pickers (llm-d style) and Dynamo's KV cost.

Contract (see ``base.py`` for the protocols):

- :func:`credited_overlap(w, credits)` is the tier-credited overlap of a worker in blocks:
  ``Σ credit[tier] · blocks that tier adds`` walking tiers from the best credit down
  (a block in several tiers counts once, at its best tier; blocks of the any-tier run not
  covered by a per-tier leading run get the lowest credit). Without per-tier data all
  ``overlap_blocks`` count as device.
- :func:`kv_cost(w, overlap_weight, credits)` is Dynamo's cost
  ``overlap_weight · prefill_blocks + decode_blocks`` with ``prefill_blocks`` = prompt
  blocks − credited overlap and ``decode_blocks`` = the worker's active blocks (the larger
  of the router's count and ``kv_usage · kv_total_blocks`` when the report has a total and
  was taken after the router's latest release on that worker).
- Scorers (each returns one score in [0, 1] per candidate, higher is better):
  ``kv_cost`` (min-max normalised: cheapest → 1), ``prefix_cache`` (``match/total``),
  ``queue`` (min-max normalised queue: shortest → 1), ``kv_utilization`` (``1 − usage``).
  ``KvCostScorer.last_costs`` keeps the raw costs of its last call, for traces.
- Filters: ``queue_below`` (queue < ``max``), ``kv_usage_below`` (usage < ``max``).
- Pickers (each takes the injected ``rng``, required): ``max_score`` (ties within 1e-9 →
  smaller cached tree when known → seeded random), ``random`` (seeded), ``softmax``
  (min-max normalise the scores to u ∈ [0, 1] with the best at 0 and sample
  ``p ∝ exp(−u/T)``; ``T ≤ 0`` behaves as ``max_score``).
  With the ``kv_cost`` scorer alone this is exactly Dynamo's temperature sampling.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from services.router.policies.base import (
    TIERS,
    Decision,
    Rng,
    RouteContext,
    WorkerState,
    queue_of,
)

DEFAULT_TIER_CREDIT: Mapping[str, float] = {"device": 1.0, "host": 0.75, "store": 0.25}
TIE_EPS = 1e-9


def credited_overlap(w: WorkerState, credits: Mapping[str, float] = DEFAULT_TIER_CREDIT
                     ) -> float:
    """Overlap blocks weighted by the tier they are in (see the module docstring)."""
    return credited_blocks(w.overlap_blocks, w.overlap_by_tier, credits)


def credited_blocks(blocks: int, by_tier: Mapping[str, int],
                    credits: Mapping[str, float] = DEFAULT_TIER_CREDIT) -> float:
    """:func:`credited_overlap` of an overlap of ``blocks`` in any tier, ``by_tier`` per
    tier."""
    if not by_tier:
        return float(blocks) * credits.get("device", 1.0)
    total, counted = 0.0, 0
    for tier in sorted(by_tier, key=lambda t: -credits.get(t, 0.0)):
        # Leading runs per tier: a longer run in a worse tier adds only its extra blocks.
        n = min(by_tier[tier], blocks or by_tier[tier])
        if n > counted:
            total += (n - counted) * credits.get(tier, 0.0)
            counted = n
    if blocks > counted:  # tiers alternate along the prompt: credit the worst
        total += (blocks - counted) * min(credits.get(t, 0.0) for t in TIERS)
    return total


def decode_blocks(w: WorkerState) -> float:
    """Active blocks: router-tracked, or from the load report when it knows the total."""
    fresh = w.kv_total_blocks > 0 and w.load_fresh
    reported = w.kv_usage * w.kv_total_blocks if fresh else 0.0
    return max(float(w.active_blocks), reported)


def kv_cost(w: WorkerState, overlap_weight: float = 1.0,
            credits: Mapping[str, float] = DEFAULT_TIER_CREDIT) -> float:
    """Dynamo's cost of sending the prompt to ``w`` (lower is better). The router's
    compact decision (:func:`services.router.plain.route_plain`) computes the same from
    the same numbers: change both."""
    prefill = max(w.prompt_blocks - credited_overlap(w, credits), 0.0)
    return overlap_weight * prefill + decode_blocks(w)


def minmax_low_is_best(values: Mapping[str, float]) -> dict[str, float]:
    """Maps the smallest value to 1 and the largest to 0 (all 1 when equal)."""
    lo, hi = min(values.values()), max(values.values())
    if hi - lo <= TIE_EPS:
        return {k: 1.0 for k in values}
    return {k: (hi - v) / (hi - lo) for k, v in values.items()}


class KvCostScorer:
    """Dynamo's KV cost, min-max normalised to a score."""

    name = "kv_cost"

    def __init__(self, overlap_weight: float = 1.0,
                 tier_credit: Mapping[str, float] | None = None) -> None:
        if overlap_weight < 0:
            raise ValueError("overlap_weight must be >= 0")
        credits = dict(DEFAULT_TIER_CREDIT)
        for tier, credit in (tier_credit or {}).items():
            if tier not in TIERS:
                raise ValueError(f"unknown tier {tier!r}; tiers: {list(TIERS)}")
            credits[tier] = float(credit)
        self.overlap_weight = float(overlap_weight)
        self.credits = credits
        self.last_costs: dict[str, float] = {}

    def score(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> dict[str, float]:
        """1 for the cheapest candidate, 0 for the dearest."""
        self.last_costs = {w.instance_id: kv_cost(w, self.overlap_weight, self.credits)
                           for w in candidates}
        return minmax_low_is_best(self.last_costs)


class PrefixCacheScorer:
    """llm-d's prefix-cache scorer: matched blocks / prompt blocks."""

    name = "prefix_cache"

    def score(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> dict[str, float]:
        """``overlap_blocks / prompt_blocks`` (0 for a prompt without a full block)."""
        return {w.instance_id: (min(w.overlap_blocks / w.prompt_blocks, 1.0)
                                if w.prompt_blocks else 0.0) for w in candidates}


class QueueScorer:
    """llm-d's queue scorer: shortest queue → 1, longest → 0."""

    name = "queue"

    def score(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> dict[str, float]:
        """Min-max normalised queue length, inverted."""
        return minmax_low_is_best({w.instance_id: float(queue_of(w)) for w in candidates})


class KvUtilizationScorer:
    """llm-d's kv-utilization scorer: ``1 − kv_usage``."""

    name = "kv_utilization"

    def score(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> dict[str, float]:
        """Free KV fraction, clamped to [0, 1]."""
        return {w.instance_id: min(max(1.0 - w.kv_usage, 0.0), 1.0) for w in candidates}


class QueueBelow:
    """Keeps workers whose queue is below ``max``."""

    name = "queue_below"

    def __init__(self, max: int = 16) -> None:  # noqa: A002 (YAML argument name)
        self.max = int(max)

    def filter(self, ctx: RouteContext,
               candidates: Sequence[WorkerState]) -> list[WorkerState]:
        """Candidates with ``queue < max``."""
        return [w for w in candidates if queue_of(w) < self.max]


class KvUsageBelow:
    """Keeps workers whose KV usage is below ``max``."""

    name = "kv_usage_below"

    def __init__(self, max: float = 0.95) -> None:  # noqa: A002
        self.max = float(max)

    def filter(self, ctx: RouteContext,
               candidates: Sequence[WorkerState]) -> list[WorkerState]:
        """Candidates with ``kv_usage < max``."""
        return [w for w in candidates if w.kv_usage < self.max]


def _best(candidates: Sequence[WorkerState], scores: Mapping[str, float],
          rng: Rng) -> tuple[WorkerState, str]:
    by_id = {w.instance_id: w for w in candidates}
    wid, why = best_id(list(by_id), scores, rng, lambda i: by_id[i].tree_blocks)
    return by_id[wid], why


def best_id(ids: Sequence[str], scores: Mapping[str, float], rng: Rng,
            tree_of: Callable[[str], int | None]) -> tuple[str, str]:
    """The highest-scoring of ``ids`` (non-empty, in candidate order) and the reason's
    tail: ties within :data:`TIE_EPS` go to the smaller cached tree (``tree_of``, asked
    only on a tie; when it knows every tied worker's), then to ``rng.choice``."""
    top = max([scores[i] for i in ids])
    tied = [i for i in ids if scores[i] >= top - TIE_EPS]
    if len(tied) == 1:
        return tied[0], ""
    trees = [tree_of(i) for i in tied]
    if all(t is not None for t in trees):
        small = min(t or 0 for t in trees)
        smaller = [i for i, t in zip(tied, trees, strict=True) if t == small]
        if len(smaller) < len(tied):
            tied = smaller
            if len(tied) == 1:
                return tied[0], "; tie broken by smaller tree"
    return rng.choice(tied), f"; tie of {len(tied)} broken at random"


class MaxScorePicker:
    """Highest score; ties → smaller tree → random (seeded)."""

    name = "max_score"

    def __init__(self, rng: Rng) -> None:
        self._rng = rng

    def pick(self, ctx: RouteContext, candidates: Sequence[WorkerState],
             scores: Mapping[str, float]) -> Decision:
        """The best-scoring candidate (see the class docstring)."""
        w, why = _best(candidates, scores, self._rng)
        return Decision(w.instance_id, f"max score{why}", score=scores[w.instance_id])


class RandomPicker:
    """Uniformly random, ignoring scores."""

    name = "random"

    def __init__(self, rng: Rng) -> None:
        self._rng = rng

    def pick(self, ctx: RouteContext, candidates: Sequence[WorkerState],
             scores: Mapping[str, float]) -> Decision:
        """A uniformly drawn candidate."""
        w = self._rng.choice(list(candidates))
        return Decision(w.instance_id, "random pick", score=scores[w.instance_id])


class SoftmaxPicker:
    """Samples ``p ∝ exp(−u/T)``, u = min-max normalised distance to the best score."""

    name = "softmax"

    def __init__(self, temperature: float = 0.0, *, rng: Rng) -> None:
        if temperature < 0:
            raise ValueError("temperature must be >= 0")
        self.temperature = float(temperature)
        self._rng = rng

    def probabilities(self, candidates: Sequence[WorkerState],
                      scores: Mapping[str, float]) -> dict[str, float]:
        """The sampling distribution (T > 0)."""
        vals = {w.instance_id: scores[w.instance_id] for w in candidates}
        hi, lo = max(vals.values()), min(vals.values())
        span = hi - lo
        weights = {k: (math.exp(-((hi - v) / span) / self.temperature) if span > TIE_EPS
                       else 1.0) for k, v in vals.items()}
        total = sum(weights.values())
        return {k: v / total for k, v in weights.items()}

    def pick(self, ctx: RouteContext, candidates: Sequence[WorkerState],
             scores: Mapping[str, float]) -> Decision:
        """A sampled candidate (``T = 0``: the best, as ``max_score``)."""
        if self.temperature <= 0:
            w, why = _best(candidates, scores, self._rng)
            return Decision(w.instance_id, f"max score{why}", score=scores[w.instance_id])
        probs = self.probabilities(candidates, scores)
        ids = [w.instance_id for w in candidates]
        chosen = self._rng.choices(ids, weights=[probs[i] for i in ids])[0]
        return Decision(chosen, f"sampled at T={self.temperature:g} "
                        f"(p={probs[chosen]:.2f})", score=scores[chosen])


PluginFactory = Callable[..., Any]

# Built-in plugins by name. Factories get the YAML ``args`` as keywords (and ``rng=`` when
# they accept it: the pickers require it).
FILTERS: dict[str, PluginFactory] = {"queue_below": QueueBelow, "kv_usage_below": KvUsageBelow}
SCORERS: dict[str, PluginFactory] = {
    "kv_cost": KvCostScorer, "prefix_cache": PrefixCacheScorer, "queue": QueueScorer,
    "kv_utilization": KvUtilizationScorer,
}
PICKERS: dict[str, PluginFactory] = {
    "max_score": MaxScorePicker, "random": RandomPicker, "softmax": SoftmaxPicker,
}
