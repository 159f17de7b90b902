"""The frontend releases every routing entry exactly once, whatever ends the request.

A real pipeline against a real RouterServicer (RouterCore, policies) and real Worker
servicers over mock engines, on in-process loopback gRPC servers (no etcd: the router is
given the worker records). After 100 consumers that close early, and after cancellations
at every point of a request (routing, prefill, mid-stream, also anyio's level-triggered
cancellation as Starlette applies it), the router's in-flight count is back to 0 and the
workers run nothing. Also row 9 of issue 12: two clients with the same ``request_id`` do
not collide, a prefill worker's INVALID_ARGUMENT is a 400 naming P, an abandoned request
counts ``outcome="cancelled"``. And blame: a handoff failure D reports is P's (P is
excluded and reported, D serves the retry), a worker that answered INTERNAL is not
reported (a poison request marks nothing unroutable), and a Route whose answer was lost
after the router committed it is released.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import grpc
import pytest

from protos import discovery_pb2, router_pb2_grpc, worker_pb2_grpc
from services.frontend.jobs import Chunk
from services.frontend.models import ModelCatalog
from services.frontend.openai_schema import ApiError, ParsedRequest, SamplingSpec
from services.frontend.pipeline import Pipeline
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.embedded import InProcessRouterStub
from services.router.policy_setup import default_registry
from services.router.service import RouterServicer
from tests.waiting import wait_for
from workers.engines.base import EngineOutput, EngineRequest, KvHandoffError
from workers.engines.mock import MockEngine, MockEngineConfig
from workers.request_plane import RequestPlane
from workers.service import WorkerServicer

MODEL = "m"
PROMPT = tuple(range(10, 74))  # 64 tokens


@dataclass
class Node:
    engine: MockEngine
    server: grpc.aio.Server
    record: discovery_pb2.InstanceRecord
    plane: RequestPlane | None = None

    async def stop(self) -> None:
        """The worker goes away: its request plane's connections drop, its gRPC calls
        end."""
        if self.plane is not None:
            self.plane.abort_connections()  # as when its process dies
            await self.plane.close()
        await self.server.stop(0)


async def serve(add: Callable[[Any, grpc.aio.Server], None], servicer: Any) -> tuple[
        grpc.aio.Server, str]:
    server = grpc.aio.server()
    add(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    return server, f"127.0.0.1:{port}"


POISON = 7  # a prompt starting with it hits FaultyEngine's bug


class FaultyEngine(MockEngine):
    """A mock engine with one fault the mock cannot produce itself: ``handoff``: a remote
    prefill's KV never comes (P silent; vLLM with policy fail raises KvHandoffError);
    ``poison``: a deterministic engine bug on prompts starting with :data:`POISON`."""

    fault = ""

    async def generate(self, request: EngineRequest) -> AsyncIterator[EngineOutput]:
        if self.fault == "handoff" and (request.kv_transfer_params or {}).get(
                "do_remote_prefill"):
            raise KvHandoffError(f"KV handoff failed: remote prefill of {request.request_id}")
        if self.fault == "poison" and request.prompt_token_ids[0] == POISON:
            raise RuntimeError("engine bug")
        async for out in super().generate(request):
            yield out


async def node(wid: str, role: int, model: str, num_blocks: int = 1024,
               fault: str = "") -> Node:
    engine = FaultyEngine(MockEngineConfig(
        model_name=model, block_size=16, num_blocks=num_blocks, max_model_len=4096,
        timing="poly", handoff="" if role == discovery_pb2.WORKER_ROLE_AGG else "mock"))
    engine.fault = fault
    await engine.start()
    servicer = WorkerServicer(engine, wid)
    server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, servicer)
    plane = RequestPlane(servicer.streams, "127.0.0.1", 0, "127.0.0.1")
    info = engine.info
    rec = discovery_pb2.InstanceRecord(
        instance_id=wid, component="worker", address=address, role=role, model=model,
        block_size=info.block_size, max_model_len=info.max_model_len, engine="mock",
        kv_layout=info.kv_layout, request_plane_address=await plane.start())
    if info.handoff:
        rec.handoff.CopyFrom(discovery_pb2.KvHandoff(mode="mock",
                                                     engine_id=info.handoff["engine_id"]))
    return Node(engine, server, rec, plane)


@dataclass
class Setup:
    core: RouterCore
    pipeline: Pipeline
    nodes: list[Node]
    embedded: bool = False  # the pipeline calls the router in-process

    def in_flight(self) -> int:
        return sum(self.core.in_flight().values())

    def busy(self) -> list[tuple[str, int, int]]:
        out = []
        for n in self.nodes:
            load = n.engine.load()
            if load.num_running or load.num_waiting:
                out.append((n.record.instance_id, load.num_running, load.num_waiting))
        return out

    async def settled(self) -> None:
        """Until no request is in flight in the router and no worker runs anything."""
        await wait_for(lambda: self.in_flight() == 0 and not self.busy(), 20,
                       lambda: f"nothing in flight (router: {dict(self.core.in_flight())}, "
                               f"workers: {self.busy()})")


class LostAnswerRouter(RouterServicer):
    """Routes (the router commits the entry), then the answer is lost with ``code``, as
    a deadline or a broken connection loses it on the caller's side."""

    code = grpc.StatusCode.UNAVAILABLE

    async def Route(self, request: Any, context: grpc.aio.ServicerContext) -> Any:  # noqa: N802
        await super().Route(request, context)
        await context.abort(self.code, "the answer was lost after the commit")


@contextlib.asynccontextmanager
async def mesh(nodes: Sequence[Node],
               servicer_cls: type[RouterServicer] = RouterServicer,
               streams: bool = False, planes: bool = False,
               embedded: bool = False) -> AsyncIterator[Setup]:
    """A router over ``nodes`` and a pipeline using it (its worker calls on
    GenerateStreams with ``streams``, on the workers' request planes with ``planes``; the
    router called in-process with ``embedded``, as ``--router embedded`` does, else over
    gRPC); stopped with the nodes after."""
    registry = default_registry()
    core = RouterCore(policy=registry.create("kv", random.Random(0)),
                      prefill_policy=registry.create("kv", random.Random(1)),
                      disagg=DisaggConfig(conditional=False),
                      clock=asyncio.get_running_loop().time)
    servicer = servicer_cls(core, {})
    records = {n.record.instance_id: n.record for n in nodes}
    servicer.set_records(records)
    router, router_address = await serve(router_pb2_grpc.add_RouterServicer_to_server,
                                         servicer)
    catalog = ModelCatalog()
    catalog.on_workers(records)
    pipeline = Pipeline(catalog, lambda: router_address, worker_streams=streams,
                        request_planes=planes,
                        router_stub=InProcessRouterStub(servicer) if embedded else None)
    try:
        yield Setup(core, pipeline, list(nodes), embedded)
    finally:
        await pipeline.close()
        await router.stop(0)
        for n in nodes:
            await n.stop()
            await n.engine.shutdown()


@pytest.fixture(scope="module", params=["call", "stream", "tcp"])
def transport(request: pytest.FixtureRequest) -> str:
    """The pipeline's worker transport (--worker-transport): every test runs with each."""
    return str(request.param)


@pytest.fixture(scope="module", params=["grpc", "embedded"])
def router_kind(request: pytest.FixtureRequest) -> str:
    """How the pipeline calls the router: every test on ``setup`` runs with each."""
    return str(request.param)


@pytest.fixture(scope="module")
async def setup(transport: str, router_kind: str) -> AsyncIterator[Setup]:
    async with mesh([
            await node("a1", discovery_pb2.WORKER_ROLE_AGG, MODEL),
            await node("a2", discovery_pb2.WORKER_ROLE_AGG, MODEL),
            # P/D: P's KV cache is smaller than D's, so P refuses what D accepts
            await node("p1", discovery_pb2.WORKER_ROLE_PREFILL, "pd", num_blocks=16),
            await node("d1", discovery_pb2.WORKER_ROLE_DECODE, "pd")],
            streams=transport == "stream", planes=transport == "tcp",
            embedded=router_kind == "embedded") as s:
        yield s


def request(max_tokens: int = 200, model: str = MODEL, request_id: str | None = None,
            prompt: tuple[int, ...] = PROMPT) -> ParsedRequest:
    return ParsedRequest("completion", model, SamplingSpec(max_tokens=max_tokens,
                                                           ignore_eos=True),
                         stream=True, prompt_token_ids=prompt, request_id=request_id)


def counter(p: Pipeline, name: str, **labels: str) -> float:
    total = 0.0
    for metric in p.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def outcomes(p: Pipeline, outcome: str) -> float:
    return counter(p, "kvmesh_requests_total", outcome=outcome)


async def test_100_consumers_closing_after_the_first_chunk_leak_nothing(setup: Setup) -> None:
    names = ("cancelled", "length", "stop", "error")
    before = {n: outcomes(setup.pipeline, n) for n in names}
    finished_first: list[str] = []  # a first chunk that already finished is no cancel

    async def one(i: int) -> None:
        _, chunks = await setup.pipeline.run(request(prompt=(i, *PROMPT)))
        first = await chunks.__anext__()
        assert first.token_ids
        if first.finish_reason:
            finished_first.append(first.finish_reason)
        await chunks.aclose()  # type: ignore[attr-defined]

    for batch in range(10):
        await asyncio.gather(*(one(batch * 10 + i) for i in range(10)))
    await setup.settled()
    delta = {n: outcomes(setup.pipeline, n) - before[n] for n in names}
    assert delta["cancelled"] == 100 - len(finished_first), (delta, finished_first)
    assert delta["error"] == 0, delta


async def consume(p: Pipeline, req: ParsedRequest, into: list[Chunk],
                  reached: asyncio.Event | None = None, n: int = 0) -> None:
    """Streams ``req`` into ``into``; sets ``reached`` once ``n`` chunks arrived."""
    _, chunks = await p.run(req)
    async for c in chunks:
        into.append(c)
        if reached is not None and len(into) >= n:
            reached.set()


@pytest.mark.parametrize("model", [MODEL, "pd"])
async def test_cancelled_at_every_point_releases_exactly_once(setup: Setup, model: str) -> None:
    """The consumer's task is cancelled after 0, 1, 2, ... loop iterations (in routing,
    in the worker calls: P, the handoff, D), and after its 1st, 2nd, 5th chunk."""
    for k in range(40):
        got: list[Chunk] = []
        task = asyncio.create_task(consume(setup.pipeline, request(20, model), got))
        for _ in range(k):
            await asyncio.sleep(0)  # one loop iteration: a deterministic cancel point
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        await setup.settled()
    for n in (1, 2, 5):
        got = []
        reached = asyncio.Event()
        task = asyncio.create_task(consume(setup.pipeline, request(150, model), got,
                                           reached, n))
        await asyncio.wait([task, asyncio.ensure_future(reached.wait())], timeout=20,
                           return_when=asyncio.FIRST_COMPLETED)
        assert reached.is_set() and not task.done(), (task, got)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert len(got) >= n  # it may have taken one more before the cancel landed
        await setup.settled()


async def test_level_triggered_cancellation_as_starlette_does(setup: Setup) -> None:
    """Inside an anyio cancel scope every await after the cancel is cancelled again: a
    Release awaited in a ``finally`` never ran (issue 12 row 2)."""
    for k in (0, 5, 40):
        got: list[Chunk] = []
        with anyio.CancelScope() as scope:
            asyncio.get_running_loop().call_later(0.001 * k, scope.cancel)
            await consume(setup.pipeline, request(400), got)
        assert scope.cancelled_caught
        await setup.settled()


async def test_finished_and_failed_requests_are_released(setup: Setup) -> None:
    _, chunks = await setup.pipeline.run(request(5))
    out = [c async for c in chunks]
    assert out[-1].finish_reason == "length" and out[-1].completion_tokens == 5
    # the stream ended without waiting for its Release (a task that close() waits for,
    # which runs after the answer has gone): nothing ran on the loop since, so the entry
    # is still there, then it goes
    assert setup.in_flight() == 1
    await setup.settled()
    # a consumer closing the stream at its finishing chunk, before the stream's end
    _, chunks = await setup.pipeline.run(request(1))
    last = await chunks.__anext__()
    assert last.finish_reason == "length"
    await chunks.aclose()  # type: ignore[attr-defined]
    await setup.settled()
    _, chunks = await setup.pipeline.run(request(5, "pd"))  # P/D: the same
    out = [c async for c in chunks]
    assert out[-1].finish_reason == "length" and setup.in_flight() == 1
    await setup.settled()
    # P refuses a 300-token prompt (its KV cache holds 256 tokens; D's 16k; the router
    # knows neither).
    _, chunks = await setup.pipeline.run(request(60, "pd", prompt=tuple(range(300))))
    with pytest.raises(ApiError) as err:
        async for _ in chunks:
            pass
    assert err.value.status == 400 and "prefill worker p1" in err.value.message
    assert "KV blocks" in err.value.message, err.value.message
    assert counter(setup.pipeline, "kvmesh_frontend_migrations_total") == 0  # its own fault
    await setup.settled()


async def test_clients_choosing_the_same_request_id_do_not_collide(setup: Setup) -> None:
    async def one() -> tuple[str, list[Chunk]]:
        job, chunks = await setup.pipeline.run(request(8, request_id="same"))
        return job.request_id, [c async for c in chunks]

    results = await asyncio.gather(*(one() for _ in range(4)))
    for rid, chunks in results:
        assert rid == "same" and chunks[-1].finish_reason == "length"
        assert sum(len(c.token_ids) for c in chunks) == 8
    await setup.settled()


async def test_an_invalidated_channel_reaches_a_worker_restarted_on_its_port() -> None:
    """Issue 12 row 7: after UNAVAILABLE the pool dials afresh instead of waiting out the
    old channel's reconnect backoff."""
    from protos import worker_pb2
    from services.common.grpc_client import ChannelPool

    engine = MockEngine(MockEngineConfig(timing="zero"))
    await engine.start()
    pool = ChannelPool()
    try:
        servicer = WorkerServicer(engine, "w")
        server, address = await serve(worker_pb2_grpc.add_WorkerServicer_to_server, servicer)
        stub = worker_pb2_grpc.WorkerStub(pool.get(address))
        await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        old = pool.get(address)
        await server.stop(0)
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        assert server.add_insecure_port(address) == int(address.rsplit(":", 1)[1])
        await server.start()
        assert pool.invalidate(address) and not pool.invalidate("127.0.0.1:1")
        assert pool.get(address) is not old
        fresh = worker_pb2_grpc.WorkerStub(pool.get(address))
        await fresh.GetLoad(worker_pb2.GetLoadRequest(), timeout=5)  # no wait_for_ready
        await server.stop(0)
    finally:
        await pool.close()
        await engine.shutdown()


async def test_a_worker_stopped_mid_stream_is_migrated_seamlessly(transport: str) -> None:
    async with mesh([await node("m1", discovery_pb2.WORKER_ROLE_AGG, "mig"),
                     await node("m2", discovery_pb2.WORKER_ROLE_AGG, "mig")],
                    streams=transport == "stream", planes=transport == "tcp") as s:
        _, chunks = await s.pipeline.run(request(40, "mig"))
        reference = [t for c in [c async for c in chunks] for t in c.token_ids]
        got: list[Chunk] = []
        _, chunks = await s.pipeline.run(request(40, "mig"))
        async for c in chunks:
            got.append(c)
            if len(got) == 5:
                busy = [n for n in s.nodes if n.engine.load().num_running]
                assert len(busy) == 1
                await busy[0].stop()  # its calls end; the client must not notice
        assert [t for c in got for t in c.token_ids] == reference
        last = got[-1]
        assert (last.finish_reason, last.prompt_tokens, last.completion_tokens) == (
            "length", len(PROMPT), 40)
        assert counter(s.pipeline, "kvmesh_frontend_migrations_total", stage="agg") == 1
        await s.settled()


async def test_a_handoff_failure_d_reports_is_blamed_on_p(transport: str) -> None:
    """D's KvHandoffError (P's KV never came) excludes and reports P, not D: the retry
    runs on D alone (it prefills itself) and no D is marked unroutable."""
    async with mesh([await node("hp", discovery_pb2.WORKER_ROLE_PREFILL, "hpd"),
                     await node("hd1", discovery_pb2.WORKER_ROLE_DECODE, "hpd", fault="handoff"),
                     await node("hd2", discovery_pb2.WORKER_ROLE_DECODE, "hpd",
                                fault="handoff")],
                    streams=transport == "stream", planes=transport == "tcp") as s:
        _, chunks = await s.pipeline.run(request(12, "hpd"))
        out = [c async for c in chunks]
        assert (out[-1].finish_reason, out[-1].completion_tokens) == ("length", 12)
        assert counter(s.pipeline, "kvmesh_frontend_migrations_total", stage="prefill") == 1
        assert counter(s.pipeline, "kvmesh_frontend_migrations_total") == 1
        await wait_for(lambda: set(s.core.unroutable()) == {"hp"}, 10,
                       lambda: f"only P reported (marked: {s.core.unroutable()})")
        await s.settled()


async def test_a_poison_request_marks_no_worker_unroutable(transport: str) -> None:
    """INTERNAL from a live worker's engine bug migrates, but reports nobody."""
    async with mesh([await node("x1", discovery_pb2.WORKER_ROLE_AGG, "px", fault="poison"),
                     await node("x2", discovery_pb2.WORKER_ROLE_AGG, "px",
                                fault="poison")],
                    streams=transport == "stream", planes=transport == "tcp") as s:
        _, chunks = await s.pipeline.run(request(8, "px", prompt=(POISON, *PROMPT)))
        with pytest.raises(ApiError):
            async for _ in chunks:
                pass
        assert counter(s.pipeline, "kvmesh_frontend_migrations_total", stage="agg") == 2
        await s.settled()
        await s.pipeline.close()  # every fire-and-forget call has run
        assert s.core.unroutable() == {}


@pytest.mark.parametrize("code", [grpc.StatusCode.DEADLINE_EXCEEDED,
                                  grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED,
                                  grpc.StatusCode.UNKNOWN])
async def test_a_route_lost_after_the_commit_is_released(code: grpc.StatusCode,
                                                         monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    monkeypatch.setattr(LostAnswerRouter, "code", code)
    async with mesh([await node("l1", discovery_pb2.WORKER_ROLE_AGG, "lost")],
                    LostAnswerRouter) as s:
        _, chunks = await s.pipeline.run(request(4, "lost"))
        with pytest.raises(ApiError):
            async for _ in chunks:
                pass
        await s.settled()  # the router's entry is gone (its TTL is far away)
