"""The embedded router stub's fire-and-forget calls (``release_nowait``,
``prefill_done_nowait``): the same effect on the router's state as the Release and
PrefillDone calls, done in the caller's call; a bad id or a failing router is logged
(and counted), never raised into the request that made the call."""

from __future__ import annotations

import logging
import random

import pytest

from protos import discovery_pb2, router_pb2
from services.router.core import RouterCore
from services.router.embedded import InProcessRouterStub
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
