"""The simulated ("mock") engine: a vLLM-like engine without a model.

- :mod:`.blocks`: paged KV blocks with prefix caching, ref counts, LRU eviction and
  vLLM-shaped KV events (pure).
- :mod:`.scheduler`: continuous batching, chunked prefill under a token budget,
  preemption, simulated P→D KV reception (pure; the clock is passed in).
- :mod:`.timing`: step-time models (Dynamo's polynomial, measured tables, zero) and
  transfer time (pure).
- :mod:`.engine`: :class:`MockEngine`, the asyncio engine behind
  :class:`workers.engines.base.Engine`; registered as ``"mock"``.

The pure modules import nothing from asyncio, grpc or the network, so an offline
replay can drive the same core on a virtual clock.
"""

from workers.engines.mock.engine import MockEngine, MockEngineConfig

__all__ = ["MockEngine", "MockEngineConfig"]
