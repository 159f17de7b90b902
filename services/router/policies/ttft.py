"""TTFT-aware routing: send each request where its first token is predicted soonest.

Pure (no I/O, no asyncio, no clock, no RNG of its own). The prediction uses a
chunked-prefill performance model (:func:`services.common.perf_model.chunked_prefill_ms`):
an engine prefills at most ``chunk_budget`` tokens per step and every step also runs the
decodes, whose step time depends on the worker's KV usage.

Contract:

- :func:`~services.router.policies.base.uncached_tokens` is the prompt tokens a worker
  must compute: ``prompt − overlap · block_size``, at least 1 (an engine always computes
  the last token), 0 for an empty prompt. The router's pending-prefill accounting and
  admission (``RouterCore``) and the policies use the same number.
- :class:`TtftPolicy` (registered as ``ttft``; the default profiles ``ttft_kv`` and
  ``ttft_hit`` in ``profiles.yaml`` are the same class with other weights) picks the
  candidate with the lowest cost, in ms::

      cost = chunked_prefill_ms(pending + own, kv_usage)
             + decode_weight · decode_blocks(w)
             + own_weight · chunked_prefill_ms(own, kv_usage)

  with ``pending`` = :attr:`WorkerState.pending_prefill_tokens` (uncached prompt tokens
  routed to the worker whose prefill is not over) and ``own`` = this request's
  uncached tokens on that worker. ``ttft`` has both weights 0 (pure predicted TTFT);
  ``ttft_kv`` adds Dynamo's decode-block term (steers away from large decode batches);
  ``ttft_hit`` sets ``own_weight = 1``: the uncached work a placement adds also slows
  the decodes sharing its steps (ITL), so cache hits count for more than their TTFT
  effect. Ties (costs within ``tie_ms`` of the best) go to the larger overlap, then the
  lower KV usage, then at random from the injected ``rng`` (reproducible when seeded).
  The decision carries ``cost``; ``last_costs`` keeps every candidate's cost of the last
  call, for traces and tests.
- P/D-aware decode pick (``decode_itl_weight`` > 0; the default profile ``ttft_pd``):
  a candidate whose :attr:`WorkerState.role` is ``"decode"`` is costed by what it does
  for the request, decoding, not by a prefill it will not run::

      after = max(kv_usage · capacity, active_blocks · block_size) + own
      cost  = chunked_prefill_ms(pending, kv_usage)           # D's local prefills stall its steps
              + own_weight · chunked_prefill_ms(own, kv_usage)  # D's cache: less to move or prefill
              + decode_itl_weight · decode_step_ms(after)      # its step time at the added batch
              + kv_penalty_ms · max(0, after − kv_headroom · capacity)
                               / ((1 − kv_headroom) · capacity)

  where ``own`` is the request's tokens not cached on D (the KV it adds there),
  ``capacity`` the worker's reported KV tokens (``kv_total_blocks · block_size``; the perf
  model's when unknown). The last term keeps D's KV headroom: past ``kv_headroom`` the
  engine preempts and recomputes. P (role ``prefill``) and aggregated candidates keep the
  cost above (their prefill queue); with ``decode_itl_weight`` 0 every role does.
- P/D local prefill (``local_duty`` > 0 and a ``clock`` given; ``ttft_pd``):
  :meth:`TtftPolicy.prefer_local_prefill(ctx, p, d, now)` is the router core's optional
  conditional-disaggregation hook, asked when Dynamo's rule chose a remote prefill on P.
  It answers ``(True, reason)`` (D prefills the prompt itself) when P is backed up (its
  predicted time to the first token, ``chunked_prefill_ms(P's pending + own on P)``, is
  at least ``local_min_ms``: D's decode time is not spent on small TTFT gains), D is
  predicted to give the first token sooner, ``chunked_prefill_ms(D's pending + own on
  D)`` below P's, and D's prefill budget allows it: each
  local prefill it grants books its predicted ms / ``local_duty`` of D's time (a token
  bucket per D, refilled by the clock, at most ``local_burst_ms`` ahead), so D spends at
  most about ``local_duty`` of its time prefilling and its decodes keep their ITL (a
  step that carries a prefill chunk is that much longer). Otherwise ``(False, reason)``;
  ``None`` when the hook is off. ``keep_only`` drops vanished workers' budgets.
- Arguments: ``perf_model`` (a loaded :class:`~services.common.perf_model.PerfModel`,
  required), ``chunk_budget`` (>= 1, the engines' ``max_num_batched_tokens``),
  ``own_weight``, ``decode_weight``, ``decode_itl_weight``, ``kv_penalty_ms``,
  ``local_burst_ms``, ``local_min_ms`` and ``tie_ms`` (>= 0), ``kv_headroom`` (in
  (0, 1)), ``local_duty`` (in [0, 1)), ``clock`` (the router's; without one the
  local-prefill hook is off), and the keyword-only ``rng`` (required). Invalid values
  raise ValueError. The YAML form of a policy profile names the model instead
  (``perf_model: mocker | JSON path``, ``speedup``, ``kv_capacity_tokens``);
  ``services/router/policy_setup.py`` loads it and passes the object in.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

from services.common.perf_model import PerfModel, chunked_prefill_ms
from services.router.policies.base import (
    Clock,
    Decision,
    Rng,
    RouteContext,
    WorkerState,
    uncached_tokens,
)
from services.router.policies.plugins import decode_blocks


class TtftPolicy:
    """Lowest predicted time to first token; see the module docstring."""

    name = "ttft"

    def __init__(self, perf_model: PerfModel, chunk_budget: int = 8192,
                 own_weight: float = 0.0, decode_weight: float = 0.0, tie_ms: float = 1e-6,
                 decode_itl_weight: float = 0.0, kv_headroom: float = 0.9,
                 kv_penalty_ms: float = 1000.0, local_duty: float = 0.0,
                 local_burst_ms: float = 2000.0, local_min_ms: float = 0.0,
                 clock: Clock | None = None, *,
                 rng: Rng) -> None:
        if int(chunk_budget) < 1:
            raise ValueError("chunk_budget must be >= 1")
        if min(own_weight, decode_weight, tie_ms, decode_itl_weight, kv_penalty_ms) < 0:
            raise ValueError("own_weight, decode_weight, decode_itl_weight, kv_penalty_ms "
                             "and tie_ms must be >= 0")
        if not 0.0 < kv_headroom < 1.0:
            raise ValueError("kv_headroom must be in (0, 1)")
        if not 0.0 <= local_duty < 1.0 or min(local_burst_ms, local_min_ms) < 0:
            raise ValueError("local_duty must be in [0, 1), local_burst_ms and "
                             "local_min_ms >= 0")
        if isinstance(perf_model, str) or not callable(getattr(perf_model, "prefill_ms", None)):
            raise ValueError(f"perf_model must be a loaded PerfModel, got {perf_model!r}")
        self.model: PerfModel = perf_model
        self.budget = int(chunk_budget)
        self.own_weight = float(own_weight)
        self.decode_weight = float(decode_weight)
        self.tie_ms = float(tie_ms)
        self.decode_itl_weight = float(decode_itl_weight)
        self.kv_headroom = float(kv_headroom)
        self.kv_penalty_ms = float(kv_penalty_ms)
        self.local_duty = float(local_duty)
        self.local_burst_ms = float(local_burst_ms)
        self.local_min_ms = float(local_min_ms)
        self.clock = clock
        self._local_until: dict[str, float] = {}  # D id -> its prefill budget's horizon (s)
        self.rng = rng
        self.last_costs: dict[str, float] = {}

    def prefill_ms(self, tokens: int, kv_usage: float) -> float:
        """Chunked prefill time of ``tokens`` on a worker at ``kv_usage``."""
        return chunked_prefill_ms(self.model, tokens, self.budget, kv_usage)

    def cost(self, ctx: RouteContext, w: WorkerState) -> float:
        """The predicted cost of ``w`` in ms (see the module docstring)."""
        own = max(uncached_tokens(len(ctx.token_ids), w.overlap_blocks, w.block_size), 1)
        if self.decode_itl_weight and w.role == "decode":
            return self.decode_cost(w, own)
        ms = self.prefill_ms(w.pending_prefill_tokens + own, w.kv_usage)
        if self.decode_weight:
            ms += self.decode_weight * decode_blocks(w)
        if self.own_weight:
            ms += self.own_weight * self.prefill_ms(own, w.kv_usage)
        return ms

    def decode_cost(self, w: WorkerState, own: int) -> float:
        """The P/D-aware cost of decode worker ``w`` adding ``own`` KV tokens, in ms (see
        the module docstring)."""
        cap = float(w.kv_total_blocks * w.block_size or self.model.kv_capacity_tokens)
        after = max(w.kv_usage * cap, float(w.active_blocks * w.block_size)) + own
        ms = self.prefill_ms(w.pending_prefill_tokens, w.kv_usage)
        if self.own_weight:
            ms += self.own_weight * self.prefill_ms(own, w.kv_usage)
        ms += self.decode_itl_weight * self.model.decode_step_ms(min(after, cap))
        over = after - self.kv_headroom * cap
        if over > 0:
            ms += self.kv_penalty_ms * over / ((1.0 - self.kv_headroom) * cap)
        return ms

    def prefer_local_prefill(self, ctx: RouteContext, p: WorkerState, d: WorkerState
                             ) -> tuple[bool, str] | None:
        """Whether decode worker ``d`` should prefill ``ctx`` itself rather than prefill
        worker ``p`` (see the module docstring); books D's budget when it says yes."""
        if not self.local_duty or self.clock is None:
            return None
        n = len(ctx.token_ids)
        own_p = max(uncached_tokens(n, p.overlap_blocks, p.block_size), 1)
        own_d = max(uncached_tokens(n, d.overlap_blocks, d.block_size), 1)
        remote = self.prefill_ms(p.pending_prefill_tokens + own_p, p.kv_usage)
        if remote < self.local_min_ms:
            return False, (f"remote prefill: P {remote:.0f} ms to the first token < "
                           f"{self.local_min_ms:.0f} ms")
        local = self.prefill_ms(d.pending_prefill_tokens + own_d, d.kv_usage)
        if local >= remote:
            return False, (f"remote prefill: P {remote:.0f} ms <= D {local:.0f} ms "
                           "predicted to the first token")
        now = self.clock()
        start = max(self._local_until.get(d.instance_id, now), now)
        if start - now > self.local_burst_ms / 1000.0:
            return False, (f"remote prefill: {d.instance_id}'s local prefill budget "
                           f"({self.local_duty:g} of its time) is spent")
        cost_s = self.prefill_ms(own_d, d.kv_usage) / 1000.0 / self.local_duty
        self._local_until[d.instance_id] = start + cost_s
        return True, (f"local prefill on D: {local:.0f} ms < P's {remote:.0f} ms "
                      "predicted to the first token, within D's prefill budget")

    def keep_only(self, worker_ids: Iterable[str]) -> None:
        """Drops the local-prefill budgets of workers no longer present."""
        keep = set(worker_ids)
        for wid in [w for w in self._local_until if w not in keep]:
            del self._local_until[wid]

    def select(self, ctx: RouteContext, candidates: Sequence[WorkerState]) -> Decision:
        """The candidate with the lowest cost; ties as in the module docstring."""
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
        return Decision(w.instance_id, f"{self.name}: lowest predicted TTFT {c:.0f} ms "
                        f"(pending {w.pending_prefill_tokens} tokens, overlap "
                        f"{w.overlap_blocks}/{w.prompt_blocks} blocks)", cost=c)
