"""TTFT-aware router policies (ttft, ttft_kv, ttft_hit) on hand-made worker states, the
chunked perf model they use, policy profiles in YAML, and RouterCore's pending-prefill
accounting (add on route, remove on prefill done and on release, never negative)."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from protos import common_pb2, router_pb2, worker_pb2
from services.common.perf_model import (
    ChunkedPerfModel,
    PolynomialPerfModel,
    chunked_prefill_ms,
)
from services.router.core import RouterCore
from services.router.disagg import DisaggConfig
from services.router.plan import WorkerRecord
from services.router.policies.base import RouteContext, WorkerOverlap, WorkerState, uncached_tokens
from services.router.policies.profile import ProfileError
from services.router.policies.ttft import TtftPolicy
from services.router.policy_setup import default_registry, ttft_args

BS = 16
POLY = PolynomialPerfModel()


def state(i: str, **kw: object) -> WorkerState:
    return WorkerState(i, f"addr-{i}", BS, **kw)  # type: ignore[arg-type]


def ctx(n: int, rid: str = "r") -> RouteContext:
    return RouteContext(rid, "m", tuple(range(n)))


# --- the perf model ---------------------------------------------------------------------

def test_chunked_prefill_is_chunks_plus_a_decode_term_each() -> None:
    decode = POLY.decode_step_ms(0.5 * POLY.kv_capacity_tokens)
    want = 2 * (POLY.prefill_ms(8192) + decode) + POLY.prefill_ms(100) + decode
    assert chunked_prefill_ms(POLY, 2 * 8192 + 100, 8192, 0.5) == pytest.approx(want)
    assert chunked_prefill_ms(POLY, 0, 8192, 0.5) == 0.0
    chunked = ChunkedPerfModel(POLY, 8192)
    assert chunked.prefill_ms(100) == pytest.approx(POLY.prefill_ms(100)
                                                    + POLY.decode_step_ms(0))
    assert chunked.decode_step_ms(5000) == POLY.decode_step_ms(5000)
    assert chunked.kv_capacity_tokens == POLY.kv_capacity_tokens
    with pytest.raises(ValueError):
        ChunkedPerfModel(POLY, 0)


def test_uncached_tokens() -> None:
    assert uncached_tokens(100, 2, 16) == 68
    assert uncached_tokens(64, 4, 16) == 1  # fully cached: the last token is computed
    assert uncached_tokens(0, 0, 16) == 0


# --- the policies -----------------------------------------------------------------------

def test_prefers_the_worker_with_less_pending_prefill() -> None:
    p = TtftPolicy(POLY, rng=random.Random(0))
    a = state("a", pending_prefill_tokens=20000)
    b = state("b", pending_prefill_tokens=3000)
    d = p.select(ctx(1000), [a, b])
    assert d.worker_id == "b"
    assert d.cost == pytest.approx(p.prefill_ms(4000, 0.0))
    assert p.last_costs["a"] == pytest.approx(p.prefill_ms(21000, 0.0))


def test_overlap_reduces_own_cost() -> None:
    p = TtftPolicy(POLY, rng=random.Random(0))
    cold = state("a", prompt_blocks=62, overlap_blocks=0)
    warm = state("b", prompt_blocks=62, overlap_blocks=60)
    assert p.select(ctx(1000), [cold, warm]).worker_id == "b"
    assert p.last_costs["b"] == pytest.approx(p.prefill_ms(1000 - 60 * BS, 0.0))
    assert p.last_costs["a"] == pytest.approx(p.prefill_ms(1000, 0.0))
    # ... but not past a much longer queue
    busy_warm = state("b", prompt_blocks=62, overlap_blocks=60, pending_prefill_tokens=30000)
    assert p.select(ctx(1000), [cold, busy_warm]).worker_id == "a"


def test_ttft_hit_counts_own_uncached_prefill_again() -> None:
    # a: cold and idle; b: cached but with a queue. Predicted TTFT favours a slightly;
    # ttft_hit charges a's own 8000 uncached tokens twice and goes to the cache hit.
    a = state("a", prompt_blocks=500, overlap_blocks=0)
    b = state("b", prompt_blocks=500, overlap_blocks=400, pending_prefill_tokens=6500)
    plain = TtftPolicy(POLY, rng=random.Random(0))
    hit = TtftPolicy(POLY, own_weight=1.0, rng=random.Random(0))
    assert plain.select(ctx(8000), [a, b]).worker_id == "a"
    assert hit.select(ctx(8000), [a, b]).worker_id == "b"
    own_b = 8000 - 400 * BS
    assert hit.last_costs["b"] == pytest.approx(hit.prefill_ms(6500 + own_b, 0.0)
                                                + hit.prefill_ms(own_b, 0.0))


def test_ttft_kv_adds_decode_blocks_and_ties_break_by_overlap_then_usage() -> None:
    p = TtftPolicy(POLY, decode_weight=0.05, rng=random.Random(0))
    a = state("a", active_blocks=1000)
    b = state("b", active_blocks=0)
    assert p.select(ctx(100), [a, b]).worker_id == "b"
    assert p.last_costs["a"] - p.last_costs["b"] == pytest.approx(50.0)
    # equal costs (x's cached 160 tokens equal its queue): the larger overlap wins
    x = state("x", prompt_blocks=62, overlap_blocks=10, pending_prefill_tokens=10 * BS)
    y = state("y", prompt_blocks=62)
    assert {TtftPolicy(POLY, rng=random.Random(s)).select(ctx(1000), [x, y]).worker_id
            for s in range(20)} == {"x"}
    x = state("x", prompt_blocks=4, overlap_blocks=4)
    y = state("y", prompt_blocks=4, overlap_blocks=4)
    z = state("z", prompt_blocks=4, overlap_blocks=4)
    picks = {TtftPolicy(POLY, rng=random.Random(s)).select(ctx(64), [x, y, z]).worker_id
             for s in range(20)}
    assert picks == {"x", "y", "z"}  # all tie: seeded random choice


def test_bad_arguments_are_rejected() -> None:
    for kw in ({"chunk_budget": 0}, {"own_weight": -1.0}):
        with pytest.raises(ValueError):
            TtftPolicy(POLY, rng=random.Random(0), **kw)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loaded PerfModel"):
        TtftPolicy("mocker", rng=random.Random(0))  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="speedup"):
        ttft_args({"speedup": 0.0})
    with pytest.raises(TypeError):
        TtftPolicy(POLY)  # type: ignore[call-arg]  # the RNG is required


def test_ttft_args_load_the_named_perf_model() -> None:
    got = ttft_args({"perf_model": "mocker", "speedup": 2.0, "kv_capacity_tokens": 1000,
                     "chunk_budget": 64})
    assert set(got) == {"perf_model", "chunk_budget"} and got["chunk_budget"] == 64
    model = got["perf_model"]
    assert isinstance(model, PolynomialPerfModel) and model.kv_capacity_tokens == 1000
    assert model.prefill_ms(100) == pytest.approx(PolynomialPerfModel(1000).prefill_ms(100) / 2)
    assert ttft_args({"perf_model": POLY, "speedup": 3.0}) == {"perf_model": POLY}
    with pytest.raises(OSError):
        ttft_args({"perf_model": "/nonexistent/table.json"})


def test_registered_policies_and_yaml_policy_profiles() -> None:
    reg = default_registry()
    assert {"ttft", "ttft_kv", "ttft_hit"} <= set(reg.names())
    hit = reg.create("ttft_hit", random.Random(0))
    assert isinstance(hit, TtftPolicy) and hit.name == "ttft_hit" and hit.own_weight == 1.0
    kv = reg.create("ttft_kv", random.Random(0))
    assert isinstance(kv, TtftPolicy) and kv.decode_weight == 0.05
    # context (the simulator's engine facts) overrides the YAML args; unknown keys ignored
    fast = default_registry(context={"chunk_budget": 2048, "page_size": 3}).create(
        "ttft_hit", random.Random(0))
    assert isinstance(fast, TtftPolicy) and fast.budget == 2048
    reg.load_profiles("""
profiles:
  ttft_fast:
    policy: {name: ttft, args: {speedup: 2.0, chunk_budget: 4096}}
""")
    f = reg.create("ttft_fast", random.Random(0))
    assert isinstance(f, TtftPolicy) and f.name == "ttft_fast" and f.budget == 4096
    assert f.prefill_ms(100, 0.0) == pytest.approx(
        TtftPolicy(POLY, rng=random.Random(0)).prefill_ms(100, 0.0) / 2)
    plain = reg.create("ttft", random.Random(0))  # the bare policy: mocker, speedup 1
    assert isinstance(plain, TtftPolicy) and isinstance(plain.model, PolynomialPerfModel)
    assert plain.prefill_ms(100, 0.0) == pytest.approx(f.prefill_ms(100, 0.0) * 2)
    with pytest.raises(ProfileError, match="bad args.*speedup"):
        reg.load_profiles("profiles:\n  bad:\n    policy: {name: ttft, args: {speedup: 0}}\n")
    with pytest.raises(ProfileError, match="bad args"):
        reg.load_profiles("profiles:\n  bad:\n    policy: {name: ttft, args: "
                          "{perf_model: /nonexistent/table.json}}\n")
    with pytest.raises(ProfileError, match="bad args"):
        reg.load_profiles("profiles:\n  bad:\n    policy: {name: ttft, args: {chunk_budget: 0}}\n")
    with pytest.raises(ProfileError, match="unknown policy"):
        reg.load_profiles("profiles:\n  bad:\n    policy: nope\n")
    with pytest.raises(ProfileError, match="takes no"):
        reg.load_profiles("profiles:\n  bad:\n    policy: ttft\n    picker: max_score\n")


# --- RouterCore's pending-prefill accounting ---------------------------------------------

def rec(i: str, role: str = "agg") -> WorkerRecord:
    return WorkerRecord(i, f"addr-{i}", "m", role, BS, 1 << 20, handoff_mode="push",
                        kv_layout="x")


def clock() -> float:
    return 0.0


def overlaps(**blocks: int) -> dict[str, WorkerOverlap]:
    return {w: WorkerOverlap(w, n, {"device": n}) for w, n in blocks.items()}


def test_core_adds_on_route_and_removes_on_prefill_done_and_release() -> None:
    c = RouterCore(policy=default_registry().create("ttft", random.Random(0)), clock=clock)
    c.set_workers([rec("a"), rec("b")])
    p1 = c.route(RouteContext("r1", "m", tuple(range(1000)), overlaps=overlaps(a=10)))
    assert p1.worker.instance_id == "a"  # the hit: 840 uncached tokens vs 1000
    assert c.pending_prefill() == {"a": 1000 - 10 * BS}
    # the next request sees a's pending tokens and goes to the idle worker
    p2 = c.route(RouteContext("r2", "m", tuple(range(500)), overlaps=overlaps()))
    assert p2.worker.instance_id == "b"
    assert c.pending_prefill() == {"a": 840, "b": 500}
    assert c.release_prefill("r1") and not c.release_prefill("r1")
    assert c.pending_prefill() == {"b": 500}
    assert c.in_flight() == {"a": 1, "b": 1}  # still in flight: only the prefill is over
    assert c.release("r2")
    assert c.pending_prefill() == {}
    assert c.release("r1") and not c.release_prefill("r2")
    assert c.pending_prefill() == {}


def test_core_pending_goes_to_the_prefill_worker_and_never_negative() -> None:
    c = RouterCore(policy=default_registry().create("least_loaded", random.Random(0)),
                   disagg=DisaggConfig(conditional=False), clock=clock)
    c.set_workers([rec("p1", "prefill"), rec("d1", "decode")])
    plan = c.route(RouteContext("r1", "m", tuple(range(3000)), overlaps=overlaps(p1=2)))
    assert plan.prefill is not None and plan.prefill.instance_id == "p1"
    assert c.pending_prefill() == {"p1": 3000 - 2 * BS}
    c.set_workers([rec("d1", "decode")])  # P vanished: its entries go with it
    assert c.pending_prefill() == {}
    c.set_workers([rec("p1", "prefill"), rec("d1", "decode")])
    assert not c.release_prefill("r1") and c.release("r1")
    assert c.pending_prefill() == {}
    # D prefilling locally (no prefill worker) takes the tokens itself
    c.set_workers([rec("d1", "decode")])
    c.route(RouteContext("r2", "m", tuple(range(5000, 5100))))  # not in the history
    assert c.pending_prefill() == {"d1": 100}


def test_states_carry_pending_prefill_to_policies() -> None:
    seen: list[dict[str, int]] = []

    class Spy:
        name = "spy"

        def select(self, ctx: RouteContext, cands: list[WorkerState]) -> object:
            from services.router.policies.base import Decision
            seen.append({w.instance_id: w.pending_prefill_tokens for w in cands})
            return Decision(cands[0].instance_id, "first")

    c = RouterCore(policy=Spy(), clock=clock)  # type: ignore[arg-type]
    c.set_workers([rec("a"), rec("b")])
    c.route(RouteContext("r1", "m", tuple(range(40))))
    c.route(RouteContext("r2", "m", tuple(range(100, 140))))
    assert seen == [{"a": 0, "b": 0}, {"a": 40, "b": 0}]
    # the history predicts r3 shares r1's two full blocks on a: 40 − 32 uncached
    c.route(RouteContext("r3", "m", tuple(range(40))))
    assert c.pending_prefill() == {"a": 40 + 40 + 8}


# --- PrefillDone: the servicer and the frontend's first-token call -------------------------

async def test_servicer_prefill_done_releases_pending() -> None:
    from services.router.service import RouterServicer

    c = RouterCore(policy=default_registry().create("ttft", random.Random(0)), clock=clock)
    c.set_workers([rec("a")])
    c.route(RouteContext("r1", "m", tuple(range(100))))
    svc = RouterServicer(c, {})
    got = await svc.PrefillDone(router_pb2.PrefillDoneRequest(request_id="r1"), None)  # type: ignore[arg-type]
    assert got.found and c.pending_prefill() == {}
    again = await svc.PrefillDone(router_pb2.PrefillDoneRequest(request_id="r1"), None)  # type: ignore[arg-type]
    assert not again.found


class _Router:
    """The router stub a pipeline calls: Route picks worker ``w``; PrefillDone and Release
    are recorded in ``calls`` (``prefill_done:<id>``, ``release``)."""

    def __init__(self, calls: list[str]) -> None:
        self.calls = calls

    async def Route(self, req: Any, **kw: Any) -> Any:  # noqa: N802
        return router_pb2.RouteResponse(
            worker=router_pb2.WorkerChoice(instance_id="w", address="x"))

    async def PrefillDone(self, req: Any, **kw: Any) -> Any:  # noqa: N802
        self.calls.append("prefill_done:" + req.request_id)
        return router_pb2.PrefillDoneResponse(found=True)

    async def Release(self, req: Any, **kw: Any) -> Any:  # noqa: N802
        self.calls.append("release")
        return router_pb2.ReleaseResponse(found=True)


def _pipeline(monkeypatch: pytest.MonkeyPatch, router: _Router, plan: Any,
              request_id: str) -> tuple[Any, Any]:
    """A pipeline whose router is ``router`` and whose worker calls are ``plan``, and a
    job of 10 prompt tokens and max_tokens 2 named ``request_id``."""
    from services.frontend import pipeline as pipeline_mod
    from services.frontend.jobs import Job
    from services.frontend.models import ModelCatalog, ModelInfo
    from services.frontend.openai_schema import ParsedRequest, SamplingSpec

    monkeypatch.setattr(pipeline_mod.router_pb2_grpc, "RouterStub", lambda ch: router)
    monkeypatch.setattr(pipeline_mod, "run_plan", plan)
    job = Job(request_id, ParsedRequest("completion", "m", SamplingSpec(max_tokens=2)),
              ModelInfo("m", "/m", 4096, 16, 1, 0), list(range(10)), 0)
    return pipeline_mod.Pipeline(ModelCatalog(), lambda: "router:1"), job


@pytest.mark.parametrize("fails", [False, True])
async def test_frontend_tells_prefill_done_at_the_first_token_without_waiting(
        monkeypatch: pytest.MonkeyPatch, fails: bool) -> None:
    calls: list[str] = []
    gate = asyncio.Event()
    told = asyncio.Event()  # PrefillDone was called

    class SlowRouter(_Router):
        async def PrefillDone(self, req: Any, **kw: Any) -> Any:  # noqa: N802
            got = await super().PrefillDone(req, **kw)
            told.set()
            await gate.wait()  # a slow router must not hold the stream
            if fails:
                raise RuntimeError("router gone")
            return got

    async def plan(pool: Any, req: Any, route: Any, metrics: Any,
                   streams: Any = None) -> AsyncIterator[Any]:
        yield worker_pb2.GenerateResponse(text="a", token_ids=[1])
        # the worker's next chunk comes once PrefillDone went out: sent at the first
        # token (else this waits forever), and not awaited by the stream (else the stream
        # would wait for the gate, which opens only after it ended)
        await told.wait()
        calls.append("second chunk")
        yield worker_pb2.GenerateResponse(text="b", token_ids=[2],
                                          finish_reason=common_pb2.FINISH_REASON_STOP)

    p, job = _pipeline(monkeypatch, SlowRouter(calls), plan, "r9")

    async def consume() -> list[Any]:
        return [c async for c in p.stream(job)]

    chunks = await asyncio.wait_for(consume(), 60)  # an awaited PrefillDone would hang
    assert [c.text for c in chunks] == ["a", "b"]
    assert calls == ["prefill_done:r9", "second chunk", "release"]  # not awaited
    gate.set()
    await p.close()  # waits for the background call; its failure is swallowed


@pytest.mark.parametrize("chunks", [1, 2])
async def test_a_first_chunk_that_finishes_needs_no_prefill_done(
        monkeypatch: pytest.MonkeyPatch, chunks: int) -> None:
    """An answer whose first chunk finishes it (one token, or a stop at the first): the
    attempt's Release frees what PrefillDone would, so the router gets only that; an
    answer in two chunks gets PrefillDone at the first."""
    calls: list[str] = []

    async def plan(pool: Any, req: Any, route: Any, metrics: Any,
                   streams: Any = None) -> AsyncIterator[Any]:
        if chunks == 2:
            yield worker_pb2.GenerateResponse(text="a", token_ids=[1])
        yield worker_pb2.GenerateResponse(text="b", token_ids=[2],
                                          finish_reason=common_pb2.FINISH_REASON_STOP)

    p, job = _pipeline(monkeypatch, _Router(calls), plan, "r1")
    got = [c.text async for c in p.stream(job)]
    await p.close()  # the background calls (Release, PrefillDone) are done
    assert got == ["a", "b"][2 - chunks:]
    assert calls == (["release"] if chunks == 1 else ["prefill_done:r1", "release"])
