"""The router servicer's overlap sources (embedded index, remote with fallback) and what it
returns and traces; no network (the remote stub is a fake)."""

import dataclasses
import random
from typing import Any

import grpc
import pytest

from protos import discovery_pb2, indexer_pb2, router_pb2
from services.common.block_hash import block_hashes
from services.indexer.core import KvEvent, KvIndex
from services.router.core import RouterCore
from services.router.overlaps import EmbeddedSource, HistorySource, RemoteSource
from services.router.policies.base import RouteContext, WorkerOverlap
from services.router.policy_setup import default_registry
from services.router.service import RouterServicer, _set_plan_attributes


def worker(i: str, bs: int) -> discovery_pb2.InstanceRecord:
    return discovery_pb2.InstanceRecord(instance_id=i, component="worker", address=f"a-{i}",
                                        model="m", role=discovery_pb2.WORKER_ROLE_AGG,
                                        block_size=bs, max_model_len=4096)


class Aborted(Exception):
    pass


class FakeContext:
    async def abort(self, code: grpc.StatusCode, details: str) -> None:
        raise Aborted(code, details)


PROMPT = list(range(64))


def kv_core() -> RouterCore:
    return RouterCore(policy=default_registry().create("kv", random.Random(0)),
                      clock=lambda: 0.0)


def servicer(source: Any) -> RouterServicer:
    core = kv_core()
    s = RouterServicer(core, {}, source)
    s.set_records({"w1": worker("w1", 16), "w2": worker("w2", 32)})
    return s


async def test_embedded_index_counts_each_worker_at_its_block_size() -> None:
    index = KvIndex()
    index.apply(KvEvent("w1", 0, "stored", tuple(block_hashes(PROMPT, 16)[:3]), "host"))
    # w2 stored the 16-token hashes, which mean nothing at its block size of 32.
    index.apply(KvEvent("w2", 0, "stored", tuple(block_hashes(PROMPT, 16)), "device"))
    s = servicer(EmbeddedSource(index))
    resp = await s.Route(router_pb2.RouteRequest(request_id="r", model="m", token_ids=PROMPT),
                         FakeContext())  # type: ignore[arg-type]
    assert resp.worker.instance_id == "w1" and resp.overlap_source == "indexer"
    assert resp.predicted_overlap_blocks == 3 and resp.block_size == 16
    assert dict(resp.predicted_overlap_by_tier) == {"host": 3} and resp.prompt_blocks == 4
    with pytest.raises(TypeError):
        EmbeddedSource(object())


class FakeStub:
    def __init__(self, fail: bool) -> None:
        self.fail = fail
        self.requests: list[indexer_pb2.FindMatchesRequest] = []

    async def FindMatches(self, req: indexer_pb2.FindMatchesRequest,  # noqa: N802
                          **kw: Any) -> indexer_pb2.FindMatchesResponse:
        self.requests.append(req)
        if self.fail:
            raise grpc.aio.AioRpcError(grpc.StatusCode.DEADLINE_EXCEEDED, grpc.aio.Metadata(),
                                       grpc.aio.Metadata(), "too slow")
        return indexer_pb2.FindMatchesResponse(overlaps=[
            indexer_pb2.WorkerOverlap(worker_id="w2", blocks=2, by_tier={"device": 2}),
            indexer_pb2.WorkerOverlap(worker_id="w1", blocks=1, by_tier={"device": 1}),
        ])


async def test_remote_source_queries_per_block_size_and_falls_back() -> None:
    stub = FakeStub(fail=False)
    live = {"idx-1": discovery_pb2.InstanceRecord(instance_id="idx-1", address="x")}
    src = RemoteSource(lambda: live, stub_factory=lambda addr: stub)
    s = servicer(src)
    resp = await s.Route(router_pb2.RouteRequest(request_id="r", model="m", token_ids=PROMPT),
                         FakeContext())  # type: ignore[arg-type]
    # Two block sizes → two queries with precomputed hashes; each answer kept only for
    # the workers of that size.
    assert sorted(len(r.block_hashes) for r in stub.requests) == [2, 4]
    assert resp.overlap_source == "indexer" and resp.worker.instance_id == "w2"
    assert resp.predicted_overlap_blocks == 2 and src.fallbacks == 0
    stub.fail = True
    await s.Release(router_pb2.ReleaseRequest(request_id="r"), FakeContext())  # type: ignore[arg-type]
    resp = await s.Route(router_pb2.RouteRequest(request_id="r2", model="m", token_ids=PROMPT),
                         FakeContext())  # type: ignore[arg-type]
    assert resp.overlap_source == "history" and src.fallbacks == 1
    assert src.fallback_reasons == {"deadline_exceeded": 1}
    # The history remembers the first decision.
    assert resp.worker.instance_id == "w2" and resp.predicted_overlap_blocks == 2
    live.clear()
    assert await src.find({16: [1]}, s._core.workers("m")) is None
    assert src.fallback_reasons["no_instance"] == 1


async def test_history_source_and_unknown_model() -> None:
    s = servicer(HistorySource())
    with pytest.raises(Aborted) as err:
        await s.Route(router_pb2.RouteRequest(request_id="r", model="x", token_ids=PROMPT),
                      FakeContext())  # type: ignore[arg-type]
    assert err.value.args[0] == grpc.StatusCode.NOT_FOUND
    resp = await s.Route(router_pb2.RouteRequest(request_id="r", model="m", token_ids=PROMPT),
                         FakeContext())  # type: ignore[arg-type]
    assert resp.overlap_source == "history"


def test_span_attributes_of_a_plan() -> None:
    core = kv_core()
    s = RouterServicer(core, {})
    s.set_records({"w1": worker("w1", 16)})
    from services.router.policies.base import RouteContext, WorkerOverlap

    plan = core.route(RouteContext("r", "m", tuple(PROMPT), overlaps={
        "w1": WorkerOverlap("w1", 3, {"device": 1, "store": 3})}))

    class Span:
        def __init__(self, recording: bool = True) -> None:
            self.attrs: dict[str, Any] = {}
            self.recording = recording

        def is_recording(self) -> bool:
            return self.recording

        def set_attribute(self, k: str, v: Any) -> None:
            self.attrs[k] = v

    unrecorded = Span(recording=False)
    _set_plan_attributes(unrecorded, plan)
    assert unrecorded.attrs == {}  # nothing computed for a span that records nothing
    span = Span()
    _set_plan_attributes(span, plan)
    assert span.attrs["kvmesh.predicted_overlap_blocks"] == 3
    assert span.attrs["kvmesh.predicted_overlap_blocks.store"] == 3
    assert span.attrs["kvmesh.overlap_source"] == "indexer"
    # 4 blocks − (1 + 2·0.25) = 2.5
    assert span.attrs["kvmesh.worker_cost"] == pytest.approx(2.5)
    assert span.attrs["kvmesh.worker_score"] == 1.0


async def test_config_flags_and_embedded_hook(tmp_path: Any) -> None:
    from services.common.config import ConfigError, load_config
    from services.router.main import RouterConfig, start_router

    f = tmp_path / "p.yaml"
    f.write_text("profiles:\n  mine:\n    scorers: [prefix_cache, queue]\n")
    cfg = load_config(RouterConfig, ["--policy", "mine", "--prefill-policy", "kv",
                                     "--profiles", str(f), "--indexer", "embedded",
                                     "--redis-url", "redis://127.0.0.1:1"], {})
    assert cfg.indexer == "embedded" and "mine" in cfg.registry(lambda: 0.0).names()
    with pytest.raises(ConfigError, match="embedded needs --redis-url"):
        load_config(RouterConfig, ["--indexer", "embedded"], {})
    with pytest.raises(ConfigError, match="indexer must be one of"):
        load_config(RouterConfig, ["--indexer", "sideways"], {})
    with pytest.raises(ConfigError, match="unknown policy 'mine'"):
        load_config(RouterConfig, ["--policy", "mine"], {})
    f.write_text("profiles:\n  bad:\n    scorers: [nope]\n")
    with pytest.raises(ConfigError, match="unknown scorer 'nope'"):
        load_config(RouterConfig, ["--profiles", str(f)], {})
    # The embedded index must come with --indexer embedded, and only then.
    with pytest.raises(ValueError, match="embedded index is required"):
        await start_router(cfg)
    with pytest.raises(ValueError, match="embedded index is required"):
        await start_router(load_config(RouterConfig, [], {}), embedded_index=KvIndex())


def test_a_response_names_each_worker_as_its_latest_record_does() -> None:
    """The worker a response names carries its discovery record's request plane and
    handoff, as re-registered (the servicer keeps one built choice per record), and a
    caller changing its response changes no later one."""
    s = servicer(HistorySource())

    def plane_of(rid: str) -> router_pb2.RouteResponse:
        resp = s.route_now(router_pb2.RouteRequest(request_id=rid, model="m", max_tokens=1),
                           PROMPT)
        assert resp is not None
        return resp

    first = plane_of("a")
    assert first.worker.request_plane_address == ""
    first.worker.request_plane_address = "changed by the caller"
    assert plane_of("b").worker.request_plane_address == ""
    moved = {k: discovery_pb2.InstanceRecord() for k in ("w1", "w2")}
    for k, rec in moved.items():
        rec.CopyFrom(worker(k, 16))
        rec.request_plane_address = f"plane-{k}"
        rec.handoff.mode = "pull"
    s.set_records(moved)
    resp = plane_of("c")
    assert resp.worker.request_plane_address == f"plane-{resp.worker.instance_id}"
    assert resp.worker.handoff.mode == "pull"


def test_the_policies_context_is_the_request_s_with_the_core_s_fields() -> None:
    """``RouteContext.for_policies`` is ``dataclasses.replace`` of the three fields the
    core fills in, every other field kept (each set to a value of its own here)."""
    values: dict[str, Any] = {f.name: f"v-{f.name}" for f in dataclasses.fields(RouteContext)}
    ctx = RouteContext(**values)
    got = ctx.for_policies({"w": WorkerOverlap("w", 2)}, 7, "indexer")
    assert got == dataclasses.replace(ctx, overlaps={"w": WorkerOverlap("w", 2)},
                                      prompt_blocks=7, overlap_source="indexer")
