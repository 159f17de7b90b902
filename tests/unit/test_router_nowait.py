"""The embedded router stub's calls done in the caller's call. ``route_now``: Route's
answer and Route's errors (code, details), without a task, when the overlap source
answers without waiting (the prompt in the request, or given as a list); None when it
must wait. The fire-and-forget ``release_nowait``
and ``prefill_done_nowait``: the same effect on the router's state as the Release and
PrefillDone calls; a bad id or a failing router is logged (and counted), never raised
into the request that made the call; a failing PrefillDone over a channel is logged
too."""

from __future__ import annotations

import logging
import random

import grpc
import pytest

from protos import discovery_pb2, router_pb2, router_pb2_grpc
from services.common.procs import free_port
from services.frontend.models import ModelCatalog
from services.frontend.pipeline import Pipeline
from services.router.core import RouterCore
from services.router.embedded import InProcessRouterStub
from services.router.overlaps import RemoteSource
from services.router.policy_setup import default_registry
from services.router.service import RouterServicer


def servicer() -> RouterServicer:
    core = RouterCore(policy=default_registry().create("round_robin", random.Random(0)),
                      clock=lambda: 0.0)
    s = RouterServicer(core, {})
    s.set_records({"w1": discovery_pb2.InstanceRecord(
        instance_id="w1", component="worker", address="a-w1", model="m",
        role=discovery_pb2.WORKER_ROLE_AGG, block_size=4, max_model_len=4096)})
    return s


async def route(stub: InProcessRouterStub, rid: str) -> None:
    await stub.Route(router_pb2.RouteRequest(request_id=rid, model="m",
                                             token_ids=list(range(40)), max_tokens=8),
                     timeout=5)


async def test_they_change_what_the_calls_change() -> None:
    s = servicer()
    stub = InProcessRouterStub(s)
    for rid in ("a", "b"):
        await route(stub, rid)
    assert s.core.in_flight() == {"w1": 2}
    assert s.core.pending_prefill()["w1"] > 0
    stub.prefill_done_nowait("a")
    await stub.PrefillDone(router_pb2.PrefillDoneRequest(request_id="b"), timeout=5)
    assert not s.core.pending_prefill().get("w1")
    stub.release_nowait("a")
    assert s.core.in_flight() == {"w1": 1}
    stub.release_nowait("a")  # again: nothing held, nothing raised (found=false)
    await stub.Release(router_pb2.ReleaseRequest(request_id="b"), timeout=5)
    assert s.core.in_flight() == {}


async def test_a_bad_id_or_a_failing_router_is_logged_not_raised(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    s = servicer()
    stub = InProcessRouterStub(s)
    with caplog.at_level(logging.WARNING, "services.router.embedded"):
        stub.release_nowait("")
        stub.prefill_done_nowait("x" * 10_000)
    refused = [r.getMessage() for r in caplog.records]
    assert "router Release() refused: INVALID_ARGUMENT: request_id is required" in refused
    assert any(m.startswith("router PrefillDone(") and "INVALID_ARGUMENT" in m
               for m in refused)

    def broken(request_id: str) -> bool:
        raise RuntimeError("the core broke")

    monkeypatch.setattr(s.core, "release", broken)
    caplog.clear()
    with caplog.at_level(logging.ERROR, "services.router.embedded"):
        stub.release_nowait("a")
    assert [r.getMessage() for r in caplog.records] == ["router Release failed"]
    assert s.metrics.registry.get_sample_value(
        "kvmesh_router_errors_total", {"method": "Release"}) == 1


async def test_route_now_answers_and_refuses_as_route_does(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    a, b = servicer(), servicer()  # the same state: the same answers
    now, call = InProcessRouterStub(a), InProcessRouterStub(b)
    req = router_pb2.RouteRequest(request_id="r1", model="m", token_ids=list(range(40)),
                                  max_tokens=8)
    got = now.route_now(req)
    assert got is not None
    assert got == await call.Route(req, timeout=5)
    assert a.core.in_flight() == b.core.in_flight() == {"w1": 1}
    bad = [router_pb2.RouteRequest(model="m", token_ids=[1]),  # no request_id
           router_pb2.RouteRequest(request_id="r2", model="nope", token_ids=[1]),
           router_pb2.RouteRequest(request_id="r1", model="m", token_ids=[1])]  # in flight
    for r in bad:
        with pytest.raises(grpc.aio.AioRpcError) as inline:
            now.route_now(r)
        with pytest.raises(grpc.aio.AioRpcError) as called:
            await call.Route(r, timeout=5)
        assert inline.value.code() == called.value.code() != grpc.StatusCode.OK
        assert inline.value.details() == called.value.details()
    with pytest.raises(grpc.aio.AioRpcError) as big:  # only an in-process list holds one
        now.route_now(router_pb2.RouteRequest(request_id="r3", model="m"), [1, 1 << 32])
    assert big.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert big.value.details() == f"token_ids[1] = {1 << 32} is not a token id"
    assert a.core.in_flight() == {"w1": 1}  # r1 alone: nothing refused was routed

    def broken(*_: object, **__: object) -> None:
        raise RuntimeError("the core broke")

    monkeypatch.setattr(a.core, "route", broken)
    with caplog.at_level(logging.ERROR, "services.router.service"), \
            pytest.raises(grpc.aio.AioRpcError) as err:
        now.route_now(router_pb2.RouteRequest(request_id="r9", model="m",
                                              token_ids=[1, 2], max_tokens=1))
    assert err.value.code() == grpc.StatusCode.INTERNAL
    assert err.value.details() == "router Route failed: RuntimeError: the core broke"
    assert [r.getMessage() for r in caplog.records] == ["router Route failed"]
    assert a.metrics.registry.get_sample_value(
        "kvmesh_router_errors_total", {"method": "Route"}) == 1


async def test_route_now_takes_the_prompt_as_a_list_with_the_same_answers() -> None:
    """``token_ids`` given: the request's own ids are not read (left empty here), and
    the answers and refusals (a negative id, an image range past the prompt) are those
    of the same prompt in the message."""
    a, b = servicer(), servicer()
    now, call = InProcessRouterStub(a), InProcessRouterStub(b)
    tokens = list(range(40))
    got = now.route_now(router_pb2.RouteRequest(request_id="r1", model="m", max_tokens=8),
                        tokens)
    want = await call.Route(router_pb2.RouteRequest(
        request_id="r1", model="m", token_ids=tokens, max_tokens=8), timeout=5)
    assert got == want and got is not None and got.prompt_blocks == 10
    assert tokens == list(range(40))  # not changed
    for ids, item in (([3, -1, 4], None),
                      ([1] * 8, router_pb2.MmItem(mm_hash="h", offset=4, length=8))):
        bare = router_pb2.RouteRequest(request_id="r2", model="m",
                                       mm_items=[item] if item else [])
        full = router_pb2.RouteRequest(request_id="r2", model="m", token_ids=ids,
                                       mm_items=[item] if item else [])
        with pytest.raises(grpc.aio.AioRpcError) as inline:
            now.route_now(bare, ids)
        with pytest.raises(grpc.aio.AioRpcError) as called:
            await call.Route(full, timeout=5)
        assert inline.value.code() == called.value.code() == \
            grpc.StatusCode.INVALID_ARGUMENT
        assert inline.value.details() == called.value.details()


async def test_route_now_leaves_a_waiting_source_to_route() -> None:
    """A source that must wait (the remote indexer) has no ``find_now``: None, nothing
    routed; the caller calls Route."""
    core = RouterCore(policy=default_registry().create("round_robin", random.Random(0)),
                      clock=lambda: 0.0)
    s = RouterServicer(core, {}, RemoteSource(lambda: {}))
    assert InProcessRouterStub(s).route_now(router_pb2.RouteRequest(
        request_id="r", model="m", token_ids=[1])) is None
    assert core.in_flight() == {}


async def test_a_remote_prefill_done_that_fails_is_logged(
        caplog: pytest.LogCaptureFixture) -> None:
    """Over a channel (a router of its own) too: PrefillDone to a router that is not
    there is one warning naming the request and the status, never silent."""
    pipeline = Pipeline(ModelCatalog(), lambda: None)
    with caplog.at_level(logging.WARNING, "services.frontend.router_calls"):
        async with grpc.aio.insecure_channel(f"127.0.0.1:{free_port()}") as ch:
            pipeline.routing.prefill_done(router_pb2_grpc.RouterStub(ch), "pd-1")
            await pipeline.close()  # after the pending PrefillDone calls
    assert [r.getMessage() for r in caplog.records
            if r.name == "services.frontend.router_calls"] == [
        "router PrefillDone(pd-1) failed: UNAVAILABLE"]
