"""Shared pieces of the engine-level P/D handoff tests (test_pd_engines*.py).

- ``aggregated``: a session-scoped reference VllmEngine without a KV connector (import it
  into a test module to use it there; started once per session).
- ``start_pd(mode)``: a P (kv_producer) and a D (kv_consumer) VllmEngine with vLLM's NIXL
  connector, each with a fresh engine id and its own free side-channel port.
- ``run`` / ``token_ids`` / ``idle`` / ``holding``: drive an engine and read its load
  (wait with :func:`tests.waiting.wait_for`).
"""

from __future__ import annotations

import math
import random
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest_asyncio

from services.common.procs import free_port
from workers.engines.base import EngineOutput, EngineRequest, Sampling
from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig
from workers.kv import nixl
from workers.model.tiny import MODEL_SHAPE, ensure_tiny_model

MAX_MODEL_LEN = 512
BLOCK = 32
KV_GIB = 0.25
MAX_TOKENS = 12
# Bytes of one KV block of the tiny model (float32): K and V, all layers and KV heads.
BLOCK_BYTES = (
    2 * MODEL_SHAPE["num_hidden_layers"] * MODEL_SHAPE["num_key_value_heads"]
    * MODEL_SHAPE["head_dim"] * BLOCK * 4
)
_ids = iter(range(1_000_000))


def rid(tag: str) -> str:
    """A request id unique in this session."""
    return f"{tag}-{next(_ids)}"


def prompt(seed: int, n: int) -> list[int]:
    """``n`` random token ids of the tiny model (ids 0..2 are special)."""
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]


def blocks(n_tokens: int) -> int:
    return math.ceil(n_tokens / BLOCK)


def engine_config(
    mode: nixl.Mode | None = None,
    role: nixl.Role = "kv_both",
    tag: str = "e",
    **extra: Any,
) -> VllmEngineConfig:
    """The tiny model; with ``mode``, NIXL (fresh engine id, own side-channel port)."""
    ktc = env = None
    if mode is not None:
        ktc = nixl.nixl_kv_transfer_config(mode, nixl.new_engine_id(tag), role, **extra)
        env = nixl.nixl_env(free_port())
    return VllmEngineConfig(
        model_path=str(ensure_tiny_model()),
        max_model_len=MAX_MODEL_LEN,
        block_size=BLOCK,
        kv_cache_space_gib=KV_GIB,
        seed=0,
        kv_transfer_config=ktc,
        env=env or {},
    )


async def start_pd(mode: nixl.Mode, **extra: Any) -> tuple[VllmEngine, VllmEngine]:
    """Start P then D (one at a time: each EngineCore inherits its env at spawn)."""
    p = VllmEngine(engine_config(mode, "kv_producer", "p", **extra))
    await p.start()
    d = VllmEngine(engine_config(mode, "kv_consumer", "d", **extra))
    try:
        await d.start()
    except BaseException:
        await p.shutdown()
        raise
    return p, d


@pytest_asyncio.fixture(scope="session", loop_scope="session")
async def aggregated() -> AsyncIterator[VllmEngine]:
    """The reference: the same model and cache settings, no KV connector."""
    eng = VllmEngine(engine_config())
    await eng.start()
    yield eng
    await eng.shutdown()


def greedy(max_tokens: int) -> Sampling:
    return Sampling(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)


async def run(
    engine: VllmEngine,
    request_id: str,
    tokens: list[int],
    max_tokens: int = MAX_TOKENS,
    params: dict[str, Any] | None = None,
) -> list[EngineOutput]:
    """All outputs of one greedy request."""
    request = EngineRequest(request_id, tokens, greedy(max_tokens), params)
    return [o async for o in engine.generate(request)]


def token_ids(outs: list[EngineOutput]) -> list[int]:
    return [t for o in outs for t in o.token_ids]


def idle(engine: VllmEngine) -> Callable[[], bool]:
    """True once ``engine`` runs nothing and holds no KV blocks (cached ones are free)."""

    def check() -> bool:
        load = engine.load()
        return (load.num_running, load.num_waiting, load.kv_usage) == (0, 0, 0.0)

    return check


def holding(engine: VllmEngine) -> Callable[[], bool]:
    """True while ``engine`` holds KV blocks."""
    return lambda: engine.load().kv_usage > 0.0


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    """Counter increments (only the keys that moved)."""
    return {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
