"""Planner service on real etcd against a live mesh: a mock fleet (1 P + 1 D, the mock
engine), a router and the real frontend. Requests go through the frontend; the planner
discovers the workers and the frontend, reads GetLoad and the frontend's /metrics,
decides, and publishes its desired counts (dry-run actuator).

The planner runs on a clock the test moves: ``N`` requests finish between two throughput
ticks ``INTERVAL`` apart in planner time, so the rate it derives is exactly
``N / INTERVAL``, however long the requests took on the host.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass

import httpx
import pytest

from services.common.config import load_config
from services.common.discovery import InstanceWatcher
from services.common.procs import Child
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.planner.main import PlannerApp, PlannerConfig, PlannerLoop, start_planner
from services.planner.observe import MeshObserver, traffic_from_metrics
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args
from tests.manual_clock import Clock
from tests.waiting import wait_for
from workers.fleet import Fleet, FleetConfig, start_fleet

NS = "planner-it"
ISL, OSL = 1000, 20
# The mock engines run SPEEDUP times faster than Dynamo's polynomial and the planner models
# them so (--perf-speedup, SLOs divided by SPEEDUP). N requests per INTERVAL of planner
# time are, at speed 1, 512 req/s: more than one P and one D can serve. Planner times are
# exact in binary.
SPEEDUP = 8.0
INTERVAL = 2.0 ** -8  # planner seconds between throughput ticks
N = 16  # requests in one interval


@dataclass
class LiveMesh:
    fleet: Fleet
    router: RouterApp
    frontend: FrontendApp


@pytest.fixture
async def live(etcd: Child, tiny_model: str) -> AsyncIterator[LiveMesh]:
    args = base_args(etcd.address, NS)
    fleet = await start_fleet(load_config(FleetConfig, [
        *args, "--workers", "0", "--prefill-workers", "1", "--decode-workers", "1",
        "--block-size", "16", "--max-num-seqs", "256", "--max-model-len", "4096",
        "--timing", "poly", "--speedup-ratio", str(SPEEDUP), "--worker-id", "plan-",
        "--model-path", tiny_model, "--model-name", "mock"], {}))
    router = await start_router(load_config(RouterConfig, [
        *args, "--conditional-disagg", "false"], {}))
    frontend = await start_frontend(load_config(FrontendConfig, [
        *args, "--http-port", "0", "--router-address", router.server.address], {}))
    try:
        yield LiveMesh(fleet, router, frontend)
    finally:
        await frontend.server.stop()
        await router.server.stop()
        await fleet.stop()


async def two_more_steps(loop: PlannerLoop) -> None:
    """Until two more planner steps have finished: every step that ends later began its
    observation after this call (the step in flight now may have observed before it)."""
    target = loop.periodic.calls + 2
    await wait_for(lambda: loop.periodic.calls >= target, 10, "two more planner steps")


async def complete(client: httpx.AsyncClient, url: str, i: int) -> None:
    prompt = [3 + (i * 7919 + j) % 600 for j in range(ISL)]
    resp = await client.post(f"{url}/v1/completions", json={
        "model": "mock", "prompt": prompt, "max_tokens": OSL, "ignore_eos": True})
    assert resp.status_code == 200, resp.text
    usage = resp.json()["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"]) == (ISL, OSL)


async def test_planner_scales_from_live_metrics(etcd: Child, live: LiveMesh) -> None:
    clock = Clock(0.0)  # the planner's time: moves only when the test moves it
    cfg = load_config(PlannerConfig, [
        *base_args(etcd.address, NS), "--throughput-interval-s", str(INTERVAL),
        "--load-interval-s", "0", "--tick-s", "0.05", "--perf-speedup", str(SPEEDUP),
        "--itl-slo-ms", str(20 / SPEEDUP), "--ttft-slo-ms", str(1000 / SPEEDUP),
        "--max-decode", "30", "--max-prefill", "30"], {})
    app: PlannerApp = await start_planner(cfg, clock=clock)
    observer = app.loop.observer
    assert isinstance(observer, MeshObserver)
    planners = InstanceWatcher(etcd.address, NS, "planner")
    await planners.start()
    try:
        # t=0: the first tick; the planner finds both workers and the frontend.
        await wait_for(lambda: app.loop.last is not None and observer.metrics_urls()
                       and app.loop.last.ready == {"prefill": 1, "decode": 1}, 30,
                       lambda: f"the planner to see P, D and the frontend ({app.loop.last})")
        await two_more_steps(app.loop)
        clock.advance(INTERVAL)  # the throughput tick that takes the counters' base (no traffic)
        await two_more_steps(app.loop)
        url = live.frontend.base_url
        async with httpx.AsyncClient(timeout=120) as client:
            await asyncio.gather(*(complete(client, url, i) for i in range(N)))

            async def counted() -> bool:
                seen = traffic_from_metrics((await client.get(f"{url}/metrics")).text)
                assert seen.requests <= N, seen
                return seen.finished == N

            await wait_for(counted, 10, f"the frontend's /metrics to count {N} finished")
        await two_more_steps(app.loop)  # from now on every step scrapes all N requests
        clock.advance(INTERVAL)  # t = 2 · INTERVAL
        await two_more_steps(app.loop)

        def desired() -> dict[str, int]:
            recs = list(planners.instances().values())
            return dict(recs[0].desired_replicas) if recs else {}

        def raised() -> dict[str, int]:
            d = desired()
            return d if d.get("decode", 1) > 1 else {}

        published = await wait_for(raised, 10, lambda: f"the planner to raise the decode "
                                                       f"count (published: {desired()})")
        pred = app.core.last_prediction
        assert pred is not None and pred.rate == N / INTERVAL  # exact: planner time
        assert (pred.isl, pred.osl) == (ISL, OSL)
        assert published["prefill"] >= 2
        snap = await observer.collect()  # the planner's own GetLoad calls are answered
        assert sorted(w.role for w in snap.observations.workers if w.reported) == [
            "decode", "prefill"]
        last = app.loop.last
        assert last is not None and last.ready == {"prefill": 1, "decode": 1}
    finally:
        await planners.close()
        await app.server.stop()
