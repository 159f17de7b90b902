"""``run_plan`` (the handoff driver) against mock workers over gRPC: agg, pull and push run
to the end; every failing call surfaces as HandoffError with its stage, worker and gRPC
code; closing the iterator or the push timer leaves no task running and the workers idle;
the frontend blames a push timeout on P.

Failures are real: a closed port (UNAVAILABLE), the worker's own validation
(INVALID_ARGUMENT), and a simulated P→D link too slow for the push timer. Prompt
logprobs on push (the mock computes none): a scripted P (:class:`ScriptedP`, a gRPC
worker that answers as P would, with or without them, or fails after its first chunk)
next to the fleet's real D; a P failure, or a P without the prompt logprobs asked for, is
a HandoffError at P's stage before any chunk goes out.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

import grpc
import pytest

from protos import common_pb2, discovery_pb2, router_pb2, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.grpc_client import ChannelPool
from services.common.procs import Child, free_port
from services.frontend import handoff
from services.frontend.failures import worker_failure
from services.frontend.handoff import HandoffError, Request, run_plan
from services.frontend.metrics import FrontendMetrics
from tests.integration.conftest import base_args
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "handoffdrv"
BLOCK = 16
PROMPT = [3 + (i * 31) % 900 for i in range(5 * BLOCK + 3)]


@pytest.fixture(scope="module")
async def fleet(etcd: Child) -> AsyncIterator[Fleet]:
    cfg = load_config(FleetConfig, [
        *base_args(etcd.address, NS), "--workers", "1", "--prefill-workers", "1",
        "--decode-workers", "1", "--block-size", str(BLOCK), "--num-blocks", "512",
        "--max-model-len", "1024", "--timing", "poly", "--worker-id", "hd-"], {})
    f = await start_fleet(cfg)
    try:
        yield f
    finally:
        await f.stop()


@pytest.fixture
async def pool() -> AsyncIterator[ChannelPool]:
    p = ChannelPool()
    try:
        yield p
    finally:
        await p.close()


def closed_port() -> str:
    return f"127.0.0.1:{free_port()}"  # outside the ephemeral range: nothing connects from it


def choice(instance_id: str, address: str, mode: str = "") -> router_pb2.WorkerChoice:
    return router_pb2.WorkerChoice(instance_id=instance_id, address=address,
                                   handoff=discovery_pb2.KvHandoff(
                                       mode=mode, engine_id="e", side_channel_host="127.0.0.1",
                                       side_channel_port=5600, tp_size=1))


def plan(f: Fleet, mode: str, *, p_addr: str | None = None,
         d_addr: str | None = None) -> router_pb2.RouteResponse:
    p, d = f.by_role("prefill")[0], f.by_role("decode")[0]
    if mode == "agg":
        a = f.by_role("agg")[0]
        return router_pb2.RouteResponse(worker=choice(a.worker_id, d_addr or a.address))
    return router_pb2.RouteResponse(
        disaggregated=True, worker=choice(d.worker_id, d_addr or d.address),
        prefill=choice(p.worker_id, p_addr or p.address, mode))


def request(rid: str, max_tokens: int = 6, prompt: list[int] | None = None) -> Request:
    return Request(rid, "mock", PROMPT if prompt is None else prompt,
                   common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True))


def tasks_of(rid: str) -> list[asyncio.Task[object]]:
    return [t for t in asyncio.all_tasks() if t.get_name().endswith(f":{rid}")]


async def wait_idle(address: str) -> None:
    async with grpc.aio.insecure_channel(address) as ch:
        stub = worker_pb2_grpc.WorkerStub(ch)

        async def idle() -> bool:
            rep = await stub.GetLoad(worker_pb2.GetLoadRequest())
            return (rep.num_running, rep.num_waiting) == (0, 0)

        await wait_for(idle, 10, f"worker {address} idle", interval_s=0.02)


async def collect(pool: ChannelPool, req: Request, route: router_pb2.RouteResponse) -> list[
        worker_pb2.GenerateResponse]:
    return [r async for r in run_plan(pool, req, route, FrontendMetrics())]


@pytest.mark.parametrize("mode", ["agg", "mock", "push"])
async def test_each_plan_streams_to_the_end(fleet: Fleet, pool: ChannelPool,
                                            mode: str) -> None:
    out = await collect(pool, request(f"ok-{mode}"), plan(fleet, mode))
    assert sum(len(r.token_ids) for r in out) == 6
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert not tasks_of(f"ok-{mode}")
    if mode != "agg":  # the same prompt again: the client sees P's prefix hits
        again = await collect(pool, request(f"ok2-{mode}"), plan(fleet, mode))
        assert again[-1].usage.cached_tokens == 5 * BLOCK


@pytest.mark.parametrize(("mode", "dead", "stage"), [
    ("agg", "d", "agg"), ("mock", "p", "prefill"), ("mock", "d", "decode"),
    ("push", "d", "decode")])
async def test_an_unreachable_worker_is_a_handoff_error(
        fleet: Fleet, pool: ChannelPool, mode: str, dead: str, stage: str) -> None:
    addr = closed_port()
    route = plan(fleet, mode, **{f"{dead}_addr": addr})
    rid = f"dead-{mode}-{dead}"
    with pytest.raises(HandoffError) as err:
        await collect(pool, request(rid), route)
    e = err.value
    target = route.prefill if dead == "p" else route.worker
    assert (e.stage, e.code, e.address) == (stage, grpc.StatusCode.UNAVAILABLE, addr)
    assert e.instance_id == target.instance_id and target.instance_id in str(e)
    assert isinstance(e.__cause__, grpc.aio.AioRpcError)
    assert not tasks_of(rid)
    for w in fleet.workers:
        await wait_idle(w.address)


async def test_the_workers_refusal_keeps_its_code(fleet: Fleet, pool: ChannelPool) -> None:
    with pytest.raises(HandoffError) as err:
        await collect(pool, request("bad", prompt=[]), plan(fleet, "mock"))
    assert (err.value.stage, err.value.code) == ("prefill", grpc.StatusCode.INVALID_ARGUMENT)


async def test_push_timeout_cancels_both_calls(etcd: Child, pool: ChannelPool,
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """D's KV never arrives in time (a P→D link of 1 byte/s): the timer ends the request
    and both calls are cancelled."""
    slow = await start_fleet(load_config(FleetConfig, [
        *base_args(etcd.address, NS), "--workers", "0", "--prefill-workers", "1",
        "--decode-workers", "1", "--block-size", str(BLOCK), "--max-model-len", "1024",
        "--timing", "poly", "--transfer-bandwidth", "1", "--worker-id", "hd-slow-"], {}))
    monkeypatch.setattr(handoff, "PUSH_TIMEOUT_S", 0.3)
    try:
        route = plan(slow, "push")
        with pytest.raises(HandoffError) as err:
            await collect(pool, request("slow"), route)
        e = err.value
        assert (e.stage, e.code, e.instance_id) == (
            "timeout", None, route.worker.instance_id), str(e)
        assert "within 0.3s" in str(e) and route.prefill.instance_id in str(e)
        # the frontend blames (excludes, reports) P, whose push never came, not D
        failure = worker_failure(e, route)
        assert (failure.stage, failure.instance_id, failure.address, failure.worker_down) == (
            "timeout", route.prefill.instance_id, route.prefill.address, True)
        assert not tasks_of("slow")
        for w in slow.workers:
            await wait_idle(w.address)
    finally:
        await slow.stop()


@pytest.mark.parametrize("mode", ["mock", "push"])
async def test_closing_the_iterator_cancels_every_call(fleet: Fleet, pool: ChannelPool,
                                                       mode: str) -> None:
    rid = f"close-{mode}"
    it = run_plan(pool, request(rid, max_tokens=400), plan(fleet, mode), FrontendMetrics())
    first = await it.__anext__()
    assert first.token_ids
    await it.aclose()  # type: ignore[attr-defined]
    assert not tasks_of(rid)
    for w in fleet.workers:
        await wait_idle(w.address)


class ScriptedP(worker_pb2_grpc.WorkerServicer):
    """A push P: its one token, then its finish (with ``prompt_logprobs`` entries, one per
    prompt token, when ``logprobs``); ``fail``: INTERNAL after the first chunk instead."""

    def __init__(self, *, logprobs: bool = True, fail: bool = False) -> None:
        self.logprobs, self.fail = logprobs, fail
        self.requests: list[worker_pb2.GenerateRequest] = []

    async def Generate(self, request: worker_pb2.GenerateRequest,  # noqa: N802
                       context: grpc.aio.ServicerContext) -> AsyncIterator[
                           worker_pb2.GenerateResponse]:
        self.requests.append(request)
        yield worker_pb2.GenerateResponse(token_ids=[7])
        if self.fail:
            await context.abort(grpc.StatusCode.INTERNAL, "P broke after its write")
        lps = [common_pb2.PositionLogprobs(token=common_pb2.TokenLogprob(token_id=t))
               for t in request.token_ids] if self.logprobs else []
        yield worker_pb2.GenerateResponse(
            finish_reason=common_pb2.FINISH_REASON_LENGTH, prompt_logprobs=lps,
            usage=common_pb2.Usage(prompt_tokens=len(request.token_ids), completion_tokens=1))


@pytest.fixture
async def scripted() -> AsyncIterator[tuple[ScriptedP, str]]:
    p = ScriptedP()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(p, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        yield p, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


def with_prompt_logprobs(rid: str) -> Request:
    req = request(rid)
    req.sampling.prompt_logprobs = 1
    return req


async def test_push_sends_ps_prompt_logprobs_on_the_first_chunk(
        fleet: Fleet, pool: ChannelPool, scripted: tuple[ScriptedP, str]) -> None:
    p, addr = scripted
    out = await collect(pool, with_prompt_logprobs("plp-ok"), plan(fleet, "push", p_addr=addr))
    assert [len(r.prompt_logprobs) for r in out] == [len(PROMPT)] + [0] * (len(out) - 1)
    assert p.requests[0].sampling.prompt_logprobs == 1  # P computes them, D does not
    assert sum(len(r.token_ids) for r in out) == 6


@pytest.mark.parametrize("fault", ["no_logprobs", "fails"])
async def test_a_push_p_without_its_prompt_logprobs_fails_at_ps_stage(
        fleet: Fleet, pool: ChannelPool, scripted: tuple[ScriptedP, str], fault: str) -> None:
    """P failing after its WRITE, or finishing without the prompt logprobs: D's first
    chunk never goes out without them; the request fails at P's stage, which the
    pipeline migrates (excluding and reporting P) like any P failure."""
    p, addr = scripted
    p.logprobs, p.fail = fault != "no_logprobs", fault == "fails"
    route = plan(fleet, "push", p_addr=addr)
    rid = f"plp-{fault}"
    got: list[worker_pb2.GenerateResponse] = []
    with pytest.raises(HandoffError) as err:
        async for resp in run_plan(pool, with_prompt_logprobs(rid), route, FrontendMetrics()):
            got.append(resp)
    e = err.value
    assert got == []  # nothing without the prompt logprobs
    code = grpc.StatusCode.INTERNAL if fault == "fails" else None
    assert (e.stage, e.code, e.address) == ("prefill", code, addr), str(e)
    failure = worker_failure(e, route)
    assert (failure.stage, failure.instance_id, failure.migratable) == (
        "prefill", route.prefill.instance_id, True)
    assert not tasks_of(rid)
    await wait_idle(route.worker.address)


async def test_cancelling_during_prefill_cancels_p(fleet: Fleet, pool: ChannelPool) -> None:
    it = run_plan(pool, request("cancel-p", max_tokens=4), plan(fleet, "mock"),
                  FrontendMetrics())
    step = asyncio.ensure_future(it.__anext__())
    await wait_for(lambda: tasks_of("cancel-p"), 5, "the prefill call to start",
                   interval_s=0.001)
    step.cancel()
    with pytest.raises(asyncio.CancelledError):
        await step
    assert not tasks_of("cancel-p")
    await wait_idle(fleet.by_role("prefill")[0].address)


def first_request(rid: str, max_tokens: int = 6, **sampling: object) -> Request:
    """A pull request whose P token may go out first (the mock's EOS ids: none)."""
    s = common_pb2.SamplingParams(max_tokens=max_tokens, **sampling)  # type: ignore[arg-type]
    return Request(rid, "mock", PROMPT, s, first_token_stops=frozenset())


def sent_first(metrics: FrontendMetrics, source: str) -> float:
    return metrics.registry.get_sample_value("kvmesh_pd_first_token_total",
                                             {"source": source}) or 0.0


async def test_ps_token_goes_out_first_and_d_continues_after_it(
        fleet: Fleet, pool: ChannelPool) -> None:
    p, d = fleet.by_role("prefill")[0], fleet.by_role("decode")[0]
    recomputed = await collect(pool, request("ft-d"), plan(fleet, "mock"))
    metrics = FrontendMetrics()
    out = [r async for r in run_plan(pool, first_request("ft-p"), plan(fleet, "mock"),
                                     metrics)]
    assert out[0].worker_id == p.worker_id and len(out[0].token_ids) == 1
    assert {r.worker_id for r in out[1:]} == {d.worker_id}
    # the same tokens and text as when D generates every token
    assert [t for r in out for t in r.token_ids] == [t for r in recomputed for t in r.token_ids]
    assert "".join(r.text for r in out) == "".join(r.text for r in recomputed)
    last = out[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert (last.usage.prompt_tokens, last.usage.completion_tokens) == (len(PROMPT), 6)
    assert (sent_first(metrics, "prefill"), sent_first(metrics, "decode")) == (1.0, 0.0)
    assert not tasks_of("ft-p")
    await wait_idle(p.address)
    await wait_idle(d.address)


async def test_a_stop_token_from_p_is_left_to_d(fleet: Fleet, pool: ChannelPool) -> None:
    """P's token is a stop token of the request: D recomputes it and stops on it (P never
    sees the stop token ids: it must end length-capped to hand its KV over)."""
    first = (await collect(pool, first_request("ft-probe", max_tokens=2),
                           plan(fleet, "mock")))[0].token_ids[0]
    metrics = FrontendMetrics()
    out = [r async for r in run_plan(pool, first_request("ft-stop", stop_token_ids=[first]),
                                     plan(fleet, "mock"), metrics)]
    assert [t for r in out for t in r.token_ids] == [first]
    assert out[-1].finish_reason == common_pb2.FINISH_REASON_STOP
    assert out[0].worker_id == fleet.by_role("decode")[0].worker_id
    assert (sent_first(metrics, "prefill"), sent_first(metrics, "decode")) == (0.0, 1.0)
    assert (out[-1].usage.prompt_tokens, out[-1].usage.completion_tokens) == (len(PROMPT), 1)


async def test_a_d_failure_after_ps_token_is_a_decode_handoff_error(
        fleet: Fleet, pool: ChannelPool) -> None:
    p = fleet.by_role("prefill")[0]
    out: list[worker_pb2.GenerateResponse] = []
    with pytest.raises(HandoffError) as err:
        async for r in run_plan(pool, first_request("ft-dead-d"),
                                plan(fleet, "mock", d_addr=closed_port()), FrontendMetrics()):
            out.append(r)
    assert err.value.stage == "decode"
    assert [r.worker_id for r in out] == [p.worker_id]  # P's token went out, then D failed
    assert not tasks_of("ft-dead-d")
