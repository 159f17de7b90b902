"""Router policies for the offline replay: the registry's, plus a TTFT-aware policy.

Contract:

- :func:`make_policy(name, sim, rng)` returns a policy instance for the simulation:
  ``approx`` is built with the virtual clock, page size = the engine block size and a
  tree cap = the engine's block count; :data:`EXTRA` names (``ttft``, ``ttft_kv``) come
  from this module; anything else comes from ``default_registry(cfg.profiles_file)``
  (built-in policies and YAML profiles such as ``kv``, ``kv_sampled``, ``prefix_load``).
- :func:`chunked_prefill_ms(timing, tokens, budget, kv_usage)` estimates how long an
  engine needs to prefill ``tokens`` uncached tokens in chunks of at most ``budget``
  tokens, each step also carrying decodes (so the decode time at ``kv_usage`` is added
  per chunk). 0 tokens take 0 ms.
- :class:`TtftPolicy` (``ttft``): picks the candidate with the lowest predicted time to
  first token, ``chunked_prefill_ms(pending + own)`` where ``pending`` is the worker's
  queued and in-progress uncached prompt tokens (a load-report number: the live worker
  knows it) and ``own = prompt − predicted overlap``; ties (within ``tie_ms``) go to
  the larger overlap, then the lower KV usage, then at random (seeded).
  ``ttft_kv`` adds Dynamo's decode-block term: ``+ decode_weight · active blocks`` ms
  per block, steering away from workers whose decode batch is large. ``ttft_hit`` adds
  ``own_weight · chunked_prefill_ms(own)``: the uncached work a placement adds also
  slows the decodes sharing its steps (ITL), so cache hits count for more than their
  TTFT effect.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from typing import Any

from services.router.policies.approx import ApproxPolicy
from services.router.policies.base import Decision, Policy, RouteContext, WorkerState
from services.router.policies.plugins import decode_blocks
from services.router.policies.registry import default_registry
from workers.engines.mock.timing import TimingModel


def chunked_prefill_ms(timing: TimingModel, tokens: int, budget: int,
                       kv_usage: float) -> float:
    """See the module docstring."""
    if tokens <= 0:
        return 0.0
    full, rest = divmod(tokens, budget)
    ms = full * timing.step_ms(budget, 1, kv_usage)
    if rest:
        ms += timing.step_ms(rest, 1, kv_usage)
    return ms


class TtftPolicy:
    """Lowest predicted TTFT (see the module docstring)."""

    name = "ttft"

    def __init__(self, sim: Any, rng: random.Random, decode_weight: float = 0.0,
                 own_weight: float = 0.0, tie_ms: float = 1e-6) -> None:
        self.own_weight = own_weight
        self.sim = sim
        self.rng = rng
        self.decode_weight = decode_weight
        self.tie_ms = tie_ms
        self.timing = sim.cfg.timing()
        self.budget = sim.cfg.max_num_batched_tokens
        self.last_costs: dict[str, float] = {}

    def cost(self, ctx: RouteContext, w: WorkerState) -> float:
        """Predicted TTFT in ms (plus the decode term of ``ttft_kv``)."""
        own = max(len(ctx.token_ids) - w.overlap_blocks * w.block_size, 1)
        pending = self.sim.workers[w.instance_id].pending_prefill_tokens()
        ms = chunked_prefill_ms(self.timing, pending + own, self.budget, w.kv_usage)
        if self.decode_weight:
            ms += self.decode_weight * decode_blocks(w)
        if self.own_weight:
            ms += self.own_weight * chunked_prefill_ms(self.timing, own, self.budget,
                                                       w.kv_usage)
        return ms

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """The candidate with the lowest cost; see the module docstring."""
        costs = {w.instance_id: self.cost(ctx, w) for w in candidates}
        self.last_costs = costs
        best = min(costs.values())
        tied = [w for w in candidates if costs[w.instance_id] <= best + self.tie_ms]
        if len(tied) > 1:
            top = max(w.overlap_blocks for w in tied)
            tied = [w for w in tied if w.overlap_blocks == top]
            low = min(w.kv_usage for w in tied)
            tied = [w for w in tied if math.isclose(w.kv_usage, low)]
        w = tied[0] if len(tied) == 1 else self.rng.choice(tied)
        c = costs[w.instance_id]
        return Decision(w.instance_id, f"lowest predicted TTFT {c:.0f} ms", cost=c)


EXTRA = ("ttft", "ttft_kv", "ttft_hit")


def make_policy(name: str, sim: Any, rng: random.Random) -> Policy:
    """A policy instance for ``sim`` (see the module docstring)."""
    cfg = sim.cfg
    if name == "approx":
        return ApproxPolicy(page_size=cfg.block_size, max_pages_per_worker=cfg.num_blocks,
                            clock=lambda: sim.now)
    if name == "ttft":
        return TtftPolicy(sim, rng)
    if name == "ttft_kv":
        p = TtftPolicy(sim, rng, decode_weight=0.05)
        p.name = "ttft_kv"
        return p
    if name == "ttft_hit":
        p = TtftPolicy(sim, rng, own_weight=1.0)
        p.name = "ttft_hit"
        return p
    return default_registry(cfg.profiles_file).create(name, rng)
