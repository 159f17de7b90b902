""""P serves whole" live: mock fleet (1 P + 1 D, 256 blocks of 16 tokens each) on real
etcd, with an in-process router (``--prefill-whole``) and frontend.

A long request A goes P → D and decodes on D, holding ~3000 of D's 4096 tokens of KV.
Request B (800 prompt tokens) would take D past 90 % while P, whose blocks A freed, stays
under 80 %: the router gives B to P whole (no prefill worker in the plan), the frontend
runs it as an aggregated request there, and P generates every token. Discovery carries
the capability (``decode_alone``) from the worker's record to the router.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from services.common.procs import Child
from tests.integration.conftest import mock_pd_fleet, router_and_frontend
from tests.waiting import wait_for
from workers.fleet import Fleet

BLOCK, BLOCKS = 16, 256
A_PROMPT, A_OUTPUT = 3000, 1000
B_PROMPT, B_OUTPUT = 800, 8


@pytest.fixture(scope="module")
async def fleet(etcd: Child, tiny_model: str) -> AsyncIterator[tuple[str, Fleet]]:
    ns = "whole"
    async with mock_pd_fleet(etcd.address, ns, tiny_model, block_size=BLOCK,
                             num_blocks=BLOCKS, max_num_seqs=16, speedup=1,
                             worker_id="whole-") as f:
        yield ns, f


async def test_a_full_d_sends_the_request_whole_to_p(
        etcd: Child, fleet: tuple[str, Fleet]) -> None:
    ns, f = fleet
    (p,), (d,) = f.by_role("prefill"), f.by_role("decode")
    async with router_and_frontend(etcd.address, ns, [
            "--policy", "least_loaded", "--load-poll-s", "0.05",
            "--conditional-disagg", "false", "--prefill-whole", "true"]) as (router, frontend):
        core = router.servicer.core
        def seen() -> bool:
            workers = {w.role: w for w in core.workers()}
            return set(workers) == {"prefill", "decode"}

        await wait_for(seen, 30, "the router to see P and D")
        roles = {w.role: w.can_decode_alone for w in core.workers()}
        assert roles == {"prefill": True, "decode": False}  # from discovery's decode_alone
        p_id = next(w.instance_id for w in core.workers() if w.role == "prefill")
        d_id = next(w.instance_id for w in core.workers() if w.role == "decode")
        p_before = len(p.engine.modelled_tpot())

        async with httpx.AsyncClient(timeout=120) as client:
            url = f"{frontend.base_url}/v1/completions"
            a_body = {"model": "mock", "prompt": [7] * A_PROMPT, "max_tokens": A_OUTPUT,
                      "ignore_eos": True, "stream": True}
            async with client.stream("POST", url, json=a_body) as a:
                assert a.status_code == 200, await a.aread()
                lines = a.aiter_lines()
                chunks = 0
                while chunks < 2:  # A decodes on D (P's token, then D's)
                    line = await anext(lines)
                    chunks += line.startswith("data: {")

                def placed() -> bool:
                    dk, pk = core.kv_usage_of(d_id), core.kv_usage_of(p_id)
                    return dk is not None and pk is not None and dk > 0.7 and pk < 0.1

                await wait_for(placed, 30, lambda: f"the router to see A on D and P free "
                               f"(D {core.kv_usage_of(d_id)}, P {core.kv_usage_of(p_id)})",
                               interval_s=0.02)
                b = await client.post(url, json={
                    "model": "mock", "prompt": [9] * B_PROMPT, "max_tokens": B_OUTPUT,
                    "ignore_eos": True})
                assert b.status_code == 200, b.text
                assert b.json()["usage"]["completion_tokens"] == B_OUTPUT
                # P decoded B: a request of more than one token finished there
                assert len(p.engine.modelled_tpot()) == p_before + 1
                assert d.engine.counters().get("finished_requests", 0) == 0  # A still runs
            # A's stream is closed early: the frontend cancels it on D
            metrics = (await client.get(f"{frontend.base_url}/metrics")).text
        assert 'kvmesh_requests_total{outcome="length",path="agg"} 1.0' in metrics, \
            [m for m in metrics.splitlines() if m.startswith("kvmesh_requests_total")]

        routes = {s.labels["plan"]: s.value for m in router.servicer.metrics.registry.collect()
                  if m.name == "kvmesh_router_routes" for s in m.samples
                  if s.name.endswith("_total")}
        assert routes == {"disagg": 1.0, "prefill_whole": 1.0}

        async def drained() -> bool:
            return core.in_flight_count() == 0
        await wait_for(drained, 30, "A and B released")
