"""MockEngine (asyncio): streaming, validation, abort, handoff, events, timing, load."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Callable
from typing import Any

import pytest

from tests.virtual_time import VirtualTimeLoop, run_virtual
from tests.waiting import wait_for
from workers.engines import create_engine, engine_kinds
from workers.engines.base import EngineError, EngineOutput, EngineRequest, Sampling
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.engines.mock.timing import PolynomialTiming


def request(rid: str, prompt: list[int], max_tokens: int = 4,
            params: dict[str, Any] | None = None, **kw: Any) -> EngineRequest:
    return EngineRequest(rid, prompt, Sampling(max_tokens=max_tokens, **kw), params)


async def engine(clock: Callable[[], float] | None = None, **kw: Any) -> MockEngine:
    base: dict[str, Any] = {"timing": "zero", "num_blocks": 128, "block_size": 4,
                            "max_model_len": 256}
    base.update(kw)
    e = MockEngine(MockEngineConfig(**base), clock=clock or asyncio.get_running_loop().time)
    await e.start()
    return e


async def collect(e: MockEngine, r: EngineRequest) -> list[EngineOutput]:
    return [o async for o in e.generate(r)]


async def test_registered_and_created_from_keywords(tmp_path: Any) -> None:
    assert "mock" in engine_kinds()
    (tmp_path / "config.json").write_text('{"vocab_size": 77}')
    e = create_engine("mock", model_path=str(tmp_path), model_name="m", timing="zero")
    assert isinstance(e, MockEngine)
    await e.start()
    try:
        assert e.info.engine == "mock" and e.info.model == "m"
        assert e.info.model_path == str(tmp_path) and e.info.handoff == {}
        assert e.core.config.vocab_size == 77  # from the model folder's config.json
        outs = await collect(e, request("r", [1, 2, 3], max_tokens=6))
        assert all(0 <= t < 77 for o in outs for t in o.token_ids)
    finally:
        await e.shutdown()


async def test_streams_one_delta_per_token_then_caches_the_prefix() -> None:
    e = await engine()
    try:
        prompt = list(range(10))
        outs = await collect(e, request("a", prompt, max_tokens=5))
        assert [len(o.token_ids) for o in outs] == [1] * 5
        assert [o.completion_tokens for o in outs] == [1, 2, 3, 4, 5]
        assert outs[-1].finished and outs[-1].finish_reason == "length"
        assert not any(o.finished for o in outs[:-1])
        assert outs[0].text == f" w{outs[0].token_ids[0]}"
        assert outs[0].queue_s is not None and outs[0].prefill_s is not None
        again = await collect(e, request("b", prompt, max_tokens=5))
        assert again[-1].cached_tokens == 8
        assert [o.token_ids for o in again] == [o.token_ids for o in outs]  # deterministic
        assert e.load().num_running == 0 and e.load().kv_usage == 0.0
        assert e.counters()["generated_tokens"] == 10
    finally:
        await e.shutdown()


async def test_invalid_requests_raise_engine_error() -> None:
    e = await engine(num_blocks=8)
    try:
        for bad in (request("x", []), request("x", [1], max_tokens=0),
                    request("x", [1] * 250, max_tokens=10),
                    request("x", [1] * 30, max_tokens=10)):  # 10 blocks > 8
            with pytest.raises(EngineError):
                await collect(e, bad)
    finally:
        await e.shutdown()


async def test_abort_and_early_close_free_the_blocks() -> None:
    e = await engine(timing="poly", speedup_ratio=50.0)
    try:
        gen = e.generate(request("a", list(range(40)), max_tokens=200)).__aiter__()
        await gen.__anext__()
        assert e.load().num_running == 1 and e.load().kv_usage > 0
        assert await e.abort("a")
        rest = [o async for o in gen]
        assert rest[-1].finish_reason == "abort"
        assert not await e.abort("a")
        gen2 = e.generate(request("b", list(range(40)), max_tokens=200)).__aiter__()
        await gen2.__anext__()
        await gen2.aclose()  # the consumer goes away
        assert e.load().num_running == 0 and e.load().kv_usage == 0.0
        assert e.counters()["aborted_requests"] == 2
    finally:
        await e.shutdown()


async def test_events_reach_the_sink_and_reset_clears() -> None:
    events: list[dict[str, Any]] = []
    e = await engine()
    e.set_event_sink(events.extend)
    try:
        await collect(e, request("a", list(range(9)), max_tokens=1))
        assert [ev["type"] for ev in events] == ["BlockStored"]
        assert await e.reset_prefix_cache()
        assert events[-1] == {"type": "AllBlocksCleared"}
    finally:
        await e.shutdown()


def test_prefill_then_decode_handoff_between_two_engines() -> None:
    async def scenario(loop: VirtualTimeLoop) -> None:
        link = {"kv_bytes_per_block": 1_000_000, "transfer_bandwidth": 1e8}
        p = await engine(loop.time, handoff="mock", engine_id="p-1", **link)
        d = await engine(loop.time, handoff="mock", **link)
        try:
            assert p.info.handoff["mode"] == "mock" and p.info.kv_layout == d.info.kv_layout
            prompt = list(range(20))  # 5 blocks -> 50 ms simulated transfer
            pouts = await collect(p, request("x", prompt, max_tokens=1, ignore_eos=True,
                                             params={"do_remote_decode": True}))
            params = pouts[-1].kv_transfer_params
            assert params is not None and params["remote_engine_id"] == "p-1"
            assert p.load().kv_usage == 0.0  # P does not hold blocks for D (simulation)
            t0 = loop.time()
            douts = await collect(d, request("x", prompt, max_tokens=3,
                                             params={**params, "do_remote_decode": False}))
            # timing "zero": the modelled 50 ms transfer is all the time D's request takes
            assert loop.time() - t0 == pytest.approx(0.05)
            assert douts[0].token_ids == pouts[0].token_ids
            assert douts[-1].cached_tokens == 19 and douts[-1].completion_tokens == 3
            assert d.counters()["kv_transfer_bytes"] == 5_000_000
        finally:
            await p.shutdown()
            await d.shutdown()

    run_virtual(scenario)


def test_poly_timing_paces_the_stream() -> None:
    """Each token arrives when the timing model says its step ends (on virtual time)."""
    async def scenario(loop: VirtualTimeLoop) -> None:
        e = await engine(loop.time, timing="poly", speedup_ratio=1.0)
        try:
            t0 = loop.time()
            at = []
            async for _ in e.generate(request("a", list(range(100)), max_tokens=5)):
                at.append(loop.time() - t0)
            timing = PolynomialTiming()
            prefill = timing.prefill_ms(100) / 1000  # ≈ 18.0 ms
            assert at[0] == pytest.approx(prefill)
            # 4 decode steps with 26 of 128 blocks in use (101 tokens of 4): ≈ 15.6 ms each
            step = timing.decode_ms(26 / 128) / 1000
            assert [b - a for a, b in itertools.pairwise(at)] == pytest.approx([step] * 4)
            assert e.modelled_tpot() == [("a", pytest.approx(step))]
        finally:
            await e.shutdown()

    run_virtual(scenario)


def test_output_interval_wakes_the_consumer_every_n_tokens() -> None:
    """EngineRequest.output_interval: a consumer that keeps up gets the first token at
    once, then outputs of N tokens (woken when the N-th token's step ends), then the
    finished rest: the same tokens, texts and counts as one output per token."""
    async def scenario(loop: VirtualTimeLoop) -> None:
        e = await engine(loop.time, timing="poly", speedup_ratio=1.0)
        try:
            prompt = list(range(100))
            each: list[tuple[float, EngineOutput]] = []
            async for o in e.generate(request("a", prompt, max_tokens=9)):
                each.append((loop.time(), o))
            held: list[tuple[float, EngineOutput]] = []
            req = dataclasses.replace(request("b", prompt, max_tokens=9), output_interval=3)
            async for o in e.generate(req):
                held.append((loop.time(), o))
            assert [len(o.token_ids) for _, o in each] == [1] * 9
            assert [len(o.token_ids) for _, o in held] == [1, 3, 3, 2]
            assert [t for _, o in held for t in o.token_ids] == [
                t for _, o in each for t in o.token_ids]
            assert "".join(o.text for _, o in held) == "".join(o.text for _, o in each)
            assert [o.completion_tokens for _, o in held] == [1, 4, 7, 9]
            assert held[-1][1].finished and held[-1][1].finish_reason == "length"
            assert not any(o.finished for _, o in held[:-1])
            assert held[0][1].queue_s is not None and held[1][1].queue_s is None
            # each output comes when the step of its last token ends (times from each start)
            t_each = [t - each[0][0] for t, _ in each]
            t_held = [t - held[0][0] for t, _ in held]
            assert t_held == pytest.approx([t_each[i] for i in (0, 3, 6, 8)])
        finally:
            await e.shutdown()

    run_virtual(scenario)


async def test_concurrent_requests_batch_together_and_shutdown_aborts() -> None:
    e = await engine(timing="poly", speedup_ratio=20.0)
    try:
        results = await asyncio.gather(*(collect(e, request(f"r{i}", [i] * 12, max_tokens=8))
                                         for i in range(6)))
        assert all(r[-1].finish_reason == "length" for r in results)
        assert e.counters()["steps"] < 6 * 9  # batched, not one request at a time
        gen = e.generate(request("z", [1, 2, 3], max_tokens=100)).__aiter__()
        await gen.__anext__()
    finally:
        await e.shutdown()
    rest = [o async for o in gen]
    assert rest[-1].finish_reason == "abort"


async def test_a_consumer_cancelled_while_waiting_aborts_its_request() -> None:
    e = await engine(timing="poly", speedup_ratio=10.0)
    try:
        got: list[EngineOutput] = []

        async def consume() -> None:
            async for o in e.generate(request("a", list(range(40)), max_tokens=200)):
                got.append(o)

        task = asyncio.create_task(consume())
        await wait_for(lambda: len(got) >= 2, 10, "two outputs")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert e.load().num_running == 0 and e.load().kv_usage == 0.0
        assert e.counters()["aborted_requests"] == 1
        outs = await collect(e, request("a", list(range(40)), max_tokens=3))  # id is free
        assert [o.completion_tokens for o in outs] == [1, 2, 3]
    finally:
        await e.shutdown()


async def test_a_consumer_that_lags_gets_the_waiting_outputs_merged() -> None:
    """Outputs already waiting when the consumer asks are merged (as vLLM's output
    collector merges them for a slow consumer); nothing is lost or reordered."""
    e = await engine()
    try:
        prompt = list(range(10))
        ref = await collect(e, request("a", prompt, max_tokens=6))
        gen = e.generate(request("b", prompt, max_tokens=6)).__aiter__()
        first = await gen.__anext__()
        assert len(first.token_ids) == 1 and first.queue_s is not None
        await wait_for(lambda: e.load().num_running == 0, 10, "the rest to be generated")
        rest = [o async for o in gen]
        assert len(rest) == 1  # five outputs were waiting: one merged output
        last = rest[0]
        assert first.token_ids + last.token_ids == [t for o in ref for t in o.token_ids]
        assert last.text == "".join(f" w{t}" for t in last.token_ids)
        assert last.finished and last.finish_reason == "length"
        assert last.completion_tokens == 6 and last.cached_tokens == 8  # a prefix hit
        assert last.queue_s is None  # only the first token's output carries it
    finally:
        await e.shutdown()
