"""Router policies for the offline replay: exactly the live router's registry.

Contract:

- :func:`sim_registry(sim)` returns ``default_registry(cfg.profiles_file, context)``, the
  live router's registry (built-in policies and YAML profiles such as ``kv``,
  ``kv_sampled``, ``prefix_load``, ``ttft``, ``ttft_kv``, ``ttft_hit``), built once per
  simulation (it reads the profiles and check-builds each), whose ``create(name, rng)``
  makes the simulation's policies. Its context is the simulated engines' facts, which
  policies take when they accept them: ``clock`` (the virtual clock), ``page_size`` (the
  engine block size) and ``max_pages_per_worker`` (the engine's block count) for
  ``approx``; ``perf_model`` (a :class:`TimingPerfModel` of the engines' timing model, KV
  capacity and speedup) and ``chunk_budget`` (``max_num_batched_tokens``) for the TTFT
  policies.
- :class:`TimingPerfModel` is the mock engine's :class:`TimingModel` as a
  :class:`services.common.perf_model.PerfModel`: ``prefill_ms(t)`` = a prefill-only
  step of ``t`` tokens, ``decode_step_ms(k)`` = a decode-only step at KV usage
  ``k / capacity``, both divided by ``speedup``.
"""

from __future__ import annotations

from typing import Any

from services.router.policies.registry import PolicyRegistry
from services.router.policy_setup import default_registry
from workers.engines.mock.timing import TimingModel


class TimingPerfModel:
    """See the module docstring."""

    def __init__(self, timing: TimingModel, capacity_tokens: int, speedup: float = 1.0
                 ) -> None:
        if capacity_tokens < 1 or not speedup > 0:
            raise ValueError("capacity_tokens must be >= 1 and speedup > 0")
        self.timing = timing
        self.capacity = capacity_tokens
        self.speedup = speedup

    @property
    def kv_capacity_tokens(self) -> int:
        return self.capacity

    def prefill_ms(self, tokens: float) -> float:
        return self.timing.step_ms(int(tokens), 0, 0.0) / self.speedup

    def decode_step_ms(self, active_kv_tokens: float) -> float:
        u = min(max(active_kv_tokens / self.capacity, 0.0), 1.0)
        return self.timing.step_ms(0, 1, u) / self.speedup


def sim_registry(sim: Any) -> PolicyRegistry:
    """The policy registry of ``sim`` (see the module docstring)."""
    cfg = sim.cfg
    context = {
        "clock": lambda: sim.now,
        "page_size": cfg.block_size,
        "max_pages_per_worker": cfg.num_blocks,
        "perf_model": TimingPerfModel(cfg.timing(), cfg.num_blocks * cfg.block_size,
                                      cfg.engine_speedup),
        "chunk_budget": cfg.max_num_batched_tokens,
    }
    return default_registry(cfg.profiles_file, context)
