"""Early rejection live: mock fleet (1 P + 1 D, Dynamo mocker timing) on real etcd, with an
in-process router and frontend, under a burst beyond D's capacity.

D holds 1024 blocks of 16 tokens (16k tokens); the ITL SLO (20 ms / speed-up) is met up to
~30 % KV usage, about 9 requests of 512 + 64 tokens. A burst of 32 such requests:

- ``--admission early`` (decode correction 1.1: a 10 % margin for the stack's overhead):
  some requests get HTTP 503 with ``Retry-After`` and an
  ``overloaded_error`` body; the admitted ones stay at the ITL SLO (median within 20 %,
  none beyond 30 %: host lag can add a request or two; bench/admission has exact SLO
  attainment);
- ``--admission none``: every request is admitted (and the batch blows the SLO).

The ITL asserted is D's *modelled* TPOT (the timing model's step times of each request's
decode steps, :meth:`MockEngine.modelled_tpot`), not the client's wall clock: on a loaded
CI host the wall clock measures the host, not the admission decision. The client-side TPOT
of the same experiment is what ``bench/admission`` reports.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import AsyncIterator

import httpx
import pytest

from bench.replay.client import send
from bench.replay.stats import Result
from services.common.procs import Child
from tests.integration.conftest import mock_pd_fleet, router_and_frontend
from tests.waiting import wait_for
from workers.engines.mock.engine import MockEngine
from workers.fleet import Fleet

SPEEDUP = 2.0
ITL_SLO_MS = 20.0 / SPEEDUP
BLOCK = 16
BLOCKS = 1024
BURST = 32
PROMPT, OUTPUT = 512, 64


@pytest.fixture(scope="module")
async def fleet(etcd: Child, tiny_model: str) -> AsyncIterator[tuple[str, Fleet]]:
    ns = "admission"
    async with mock_pd_fleet(etcd.address, ns, tiny_model, block_size=BLOCK,
                             num_blocks=BLOCKS, max_num_seqs=256, speedup=SPEEDUP,
                             worker_id="adm-") as f:
        yield ns, f


async def run_burst(etcd: str, ns: str, admission: str) -> tuple[list[Result],
                                                                  list[httpx.Response]]:
    async with router_and_frontend(etcd, ns, [
            "--policy", "least_loaded", "--load-poll-s", "0.1",
            "--conditional-disagg", "false",
            "--admission", admission, "--admission-itl-slo-ms", str(ITL_SLO_MS),
            "--admission-perf-speedup", str(SPEEDUP), "--admission-decode-correction", "1.1",
            "--admission-kv-capacity-tokens", str(BLOCK * BLOCKS)]) as (router, frontend):
        async def ready() -> bool:
            return (len(router.watcher.instances()) == 2
                    and await frontend_ready(frontend.base_url))

        await wait_for(ready, 30, "the router to see P and D and the frontend to be healthy")
        results = [Result(i, 0.0) for i in range(BURST)]
        async with httpx.AsyncClient(timeout=60) as client:
            first_rejection = asyncio.Event()

            async def one(i: int) -> None:
                prompt = [3 + (i * 7919 + j) % 600 for j in range(PROMPT)]
                if (await send(client, frontend.base_url, "mock", prompt, OUTPUT,
                               results[i])).status == "rejected":
                    first_rejection.set()

            burst = asyncio.gather(*(one(i) for i in range(BURST)))
            # once the burst is being rejected (so D is full and decoding), more requests
            # are seen raw, for their headers and body, one at a time until one is
            # rejected or the burst is over (admission may let one in as D drains)
            raw: list[httpx.Response] = []
            waiter = asyncio.ensure_future(first_rejection.wait())
            await asyncio.wait({burst, waiter}, return_when=asyncio.FIRST_COMPLETED)
            waiter.cancel()
            while not burst.done() and not any(r.status_code == 503 for r in raw):
                raw.append(await client.post(f"{frontend.base_url}/v1/completions", json={
                    "model": "mock", "prompt": [5 + len(raw)] * PROMPT,
                    "max_tokens": OUTPUT}))
            await burst
            metrics = (await client.get(f"{frontend.base_url}/metrics")).text
        assert ("kvmesh_admission_rejections_total{" in metrics) == any(
            r.status == "rejected" for r in results)
        return results, raw


async def frontend_ready(url: str) -> bool:
    try:
        async with httpx.AsyncClient(timeout=1) as client:
            return (await client.get(f"{url}/health")).status_code == 200
    except httpx.HTTPError:
        return False


def decoder(f: Fleet) -> MockEngine:
    (d,) = f.by_role("decode")
    return d.engine


def new_tpots_ms(engine: MockEngine, before: set[str]) -> list[float]:
    """Modelled TPOT (ms) of the requests D finished since ``before`` was taken."""
    return [t * 1000 for rid, t in engine.modelled_tpot() if rid not in before]


async def test_early_rejects_part_of_a_burst_and_the_admitted_meet_the_itl_slo(
        etcd: Child, fleet: tuple[str, Fleet]) -> None:
    ns, f = fleet
    before = {rid for rid, _ in decoder(f).modelled_tpot()}
    results, raw = await run_burst(etcd.address, ns, "early")
    ok = [r for r in results if r.status == "ok"]
    rejected = [r for r in results if r.status == "rejected"]
    assert not [r for r in results if r.status == "error"], results
    assert ok and len(rejected) >= BURST // 2, (len(ok), len(rejected))
    assert all(r.completion_tokens == OUTPUT for r in ok)
    tpots = new_tpots_ms(decoder(f), before)
    admitted_raw = [r for r in raw if r.status_code == 200]
    assert len(tpots) == len(ok) + len(admitted_raw)  # D decoded exactly the admitted ones
    # Admission predicts from modelled times; on a loaded host the real schedule lags the
    # model, so one to three extra requests may overlap (9 instead of 8 on D: 10.4 ms). The
    # admitted set stays at the SLO; without admission the median is ~1.7x the SLO.
    assert statistics.median(tpots) <= 1.2 * ITL_SLO_MS, sorted(tpots)
    assert max(tpots) <= 1.3 * ITL_SLO_MS, sorted(tpots)
    # sent while the admitted part of the burst was decoding: the last one was refused
    resp = raw[-1]
    assert resp.status_code == 503, [r.status_code for r in raw]
    assert int(resp.headers["retry-after"]) >= 1
    err = resp.json()["error"]
    assert err["type"] == "overloaded_error" and err["code"] in ("predicted_itl", "kv_full")


async def test_without_admission_everything_is_admitted(
        etcd: Child, fleet: tuple[str, Fleet]) -> None:
    ns, f = fleet
    before = {rid for rid, _ in decoder(f).modelled_tpot()}
    results, _ = await run_burst(etcd.address, ns, "none")
    assert [r.status for r in results] == ["ok"] * BURST, [r.error for r in results]
    # the whole burst on D at once: the worst request is past the bound the admitted set
    # keeps (1.3x the SLO, above), and many miss the SLO. A quiet host gives a median of
    # 1.4-1.6x and a max of 1.55-1.67x; a loaded one spreads the burst (real time lags the
    # model while P's prefills are serial), so the median alone was seen between 1.0x and
    # 1.3x there and is not asserted.
    tpots = new_tpots_ms(decoder(f), before)
    assert len(tpots) == BURST
    assert max(tpots) > 1.3 * ITL_SLO_MS, sorted(tpots)
    assert sum(t > ITL_SLO_MS for t in tpots) >= BURST // 4, sorted(tpots)
