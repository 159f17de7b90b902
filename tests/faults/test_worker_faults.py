"""Worker and client faults on a P/D mesh of mock workers: kill -9 of P after its
prefill and of D mid-stream (migration), SIGSTOP of D past its lease, many client
disconnects, bad HTTP and gRPC input, one client request id used concurrently. Each
asserts what the client saw, that routing reacted, that no survivor holds a request,
that the index matches every worker, and that later requests succeed."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable

import grpc
import httpx
import pytest

from protos import (
    common_pb2,
    kv_events_pb2,
    router_pb2,
    router_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)
from tests.faults.mesh import MODEL, FaultMesh, monotonic
from tests.faults.table import FaultTable
from tests.waiting import wait_for

pytestmark = [pytest.mark.slow]
# Long enough (about 600 tokens) that conditional disaggregation sends it to a P.
LONG = " ".join(f"word{i}" for i in range(200)) + " "


def fresh_long(tag: str) -> str:
    """A long prompt no worker has cached (a cached LONG prefix is prefilled on D)."""
    return " ".join(f"{tag}w{i}" for i in range(200))


@pytest.fixture(scope="module")
async def mesh(tmp_path_factory: pytest.TempPathFactory, tiny_model: str,
               ) -> AsyncIterator[FaultMesh]:
    # decode-1's long lease lets a restart land inside it (a fresh process takes longer
    # than 2 s to register): test_a_worker_restarted_inside_its_lease.
    m = FaultMesh(tmp_path_factory.mktemp("faults-workers"), tiny_model,
                  extra={"decode-1": ["--lease-ttl", "30"]})
    await asyncio.to_thread(m.start)
    try:
        yield m
    finally:
        await asyncio.to_thread(m.stop)


async def settled(mesh: FaultMesh, names: list[str]) -> None:
    """The router holds no request in flight, every worker in ``names`` holds nothing,
    and the index matches each of them (a failure names what differs)."""
    last: dict[str, object] = {}

    async def check(what: str, probe: Callable[[], Awaitable[object]]) -> None:
        async def holds() -> bool:
            last[what] = await probe()
            return not last[what]
        await wait_for(holds, 30, lambda: f"{what} (last: {last[what]})")

    await check("no request in flight on the router",
                lambda: mesh.router_metric("kvmesh_router_inflight_requests"))
    await check("no request held on any worker", lambda: mesh.idle(names))
    await check("the index to match every worker", lambda: mesh.index_mismatch(names))


async def tokens_of(mesh: FaultMesh, prompt: str, n: int) -> tuple[list[str], str | None]:
    """(texts, error message) of one streamed completion."""
    texts: list[str] = []
    async for ev in mesh.stream(prompt, n):
        if "error" in ev:
            return texts, str(ev["error"])
        for c in ev.get("choices", []):
            texts.append(c.get("text", ""))
    return texts, None


async def test_a_mesh_serves_and_settles(mesh: FaultMesh) -> None:
    resp = await mesh.completion("hello there", 4)
    assert resp.status_code == 200, resp.text
    await settled(mesh, mesh.workers())


async def test_sigstop_of_d_past_its_lease(mesh: FaultMesh, fault_table: FaultTable) -> None:
    victim = "decode-0"
    mesh.pause(victim)
    paused_at = monotonic()
    try:
        await wait_for(lambda: _gone(mesh, victim), 30, f"{victim} to leave routing")
        left = monotonic() - paused_at
        ok = [(await mesh.completion(f"while {victim} sleeps {i}", 4)).status_code
              for i in range(10)]
    finally:
        mesh.resume(victim)
    await wait_for(lambda: _back(mesh, victim), 30, f"{victim} to rejoin routing")
    observed = f"{ok.count(200)}/10 requests served while D was stopped; D rejoined"
    held = fault_table.record("SIGSTOP of D past its lease (2 s)",
                              "10/10 requests served while D was stopped; D rejoined",
                              observed, count=1, seconds_to_leave_routing=left)
    assert held, observed
    await settled(mesh, mesh.workers())


async def _gone(mesh: FaultMesh, name: str) -> bool:
    return name not in await mesh.routable()


async def _back(mesh: FaultMesh, name: str) -> bool:
    return name in await mesh.routable()


async def test_many_client_disconnects_leak_nothing(mesh: FaultMesh,
                                                    fault_table: FaultTable) -> None:
    n = 100

    async def close_early(i: int) -> None:
        async for _ in mesh.stream(f"disconnect {i} " * 8, 200):
            return  # the client goes away after its first event

    await asyncio.gather(*(close_early(i) for i in range(n)))
    await settled(mesh, mesh.workers())
    resp = await mesh.completion("after the disconnects", 4)
    observed = f"workers idle, index in sync, next request {resp.status_code}"
    assert fault_table.record(f"{n} client disconnects mid-stream",
                              "workers idle, index in sync, next request 200", observed,
                              count=n), observed


async def finished_requests(mesh: FaultMesh, names: list[str]) -> dict[str, int]:
    return {n: (await mesh.load(n)).counters["finished_requests"] for n in names}


async def test_kill_p_after_its_prefill(mesh: FaultMesh, fault_table: FaultTable) -> None:
    prefills = [n for n in mesh.workers() if n.startswith("prefill")]
    before = await finished_requests(mesh, prefills)
    texts: list[str] = []
    error = None
    victim = ""
    async for ev in mesh.stream(LONG + "kill the prefill worker", 64):
        if "error" in ev:
            error = str(ev["error"])
            break
        texts.extend(c.get("text", "") for c in ev.get("choices", []))
        if not victim and texts:  # P is done once D streams: kill the P that prefilled
            after = await finished_requests(mesh, prefills)
            used = [n for n in prefills if after[n] > before[n]]
            assert len(used) == 1, f"expected one P to prefill, counters {before} → {after}"
            victim = used[0]
            mesh.kill(victim)
            killed_at = monotonic()
    assert victim, "no token arrived"
    await wait_for(lambda: _gone(mesh, victim), 30, f"{victim} to leave routing")
    left = monotonic() - killed_at
    later = [(await mesh.completion(f"after P died {i}", 4)).status_code for i in range(10)]
    survivors = [n for n in mesh.workers() if n != victim]
    await settled(mesh, survivors)
    mesh.restart(victim)
    await asyncio.to_thread(mesh.wait_serving, 60)
    observed = (f"stream {'error: ' + error if error else 'complete'}, "
                f"{later.count(200)}/10 later requests served")
    assert fault_table.record("kill -9 of P after its prefill",
                              "stream complete, 10/10 later requests served", observed,
                              seconds_to_leave_routing=left), observed


async def running_on(mesh: FaultMesh, names: list[str]) -> list[str]:
    return [n for n in names if (await mesh.load(n)).num_running]


async def test_kill_d_mid_stream_migrates(mesh: FaultMesh, fault_table: FaultTable) -> None:
    prompt = LONG + "migrate me"
    n = 1000  # long enough that D is still decoding when the client has read 8 tokens
    unbroken, error = await tokens_of(mesh, prompt, n)
    assert error is None and len(unbroken) > 1, error
    decodes = [n for n in mesh.workers() if n.startswith("decode")]
    texts: list[str] = []
    victim = ""
    async for ev in mesh.stream(prompt, n):
        if "error" in ev:
            error = str(ev["error"])
            break
        texts.extend(c.get("text", "") for c in ev.get("choices", []) if c.get("text"))
        if not victim and len(texts) >= 8:
            busy = await running_on(mesh, decodes)
            assert len(busy) == 1, f"expected one D streaming, got {busy}"
            victim = busy[0]
            mesh.kill(victim)
    assert victim, "the stream ended before 8 tokens"
    survivors = [n for n in mesh.workers() if n != victim]
    await settled(mesh, survivors)
    mesh.restart(victim)
    await asyncio.to_thread(mesh.wait_serving, 60)
    same = "".join(texts) == "".join(t for t in unbroken if t)
    observed = (f"{'error: ' + error if error else '0 errors'}, "
                f"tokens {'identical to' if same else 'differ from'} an unbroken run")
    assert fault_table.record("kill -9 of D mid-stream (migration)",
                              "0 errors, tokens identical to an unbroken run", observed,
                              count=1), observed


async def test_bad_input_set_on_one_connection(mesh: FaultMesh,
                                               fault_table: FaultTable) -> None:
    from tests.unit.test_http_bad_input import CASES

    cases = [(path, raw) for path, raw, _ in CASES]
    cases += [("/v1/completions", b"{" * 10), ("/v1/completions", b"not json"),
              ("/v1/completions", json.dumps({"model": "tiny", "prompt": "x",
                                              "max_tokens": 10**6}).encode()),
              ("/v1/completions", json.dumps({"model": "nope", "prompt": "x"}).encode()),
              ("/v1/completions", b"x" * (64 << 20))]
    codes: list[int] = []
    async with httpx.AsyncClient(base_url=mesh.url, timeout=60) as client:
        for path, raw in cases:  # one keep-alive connection: it must stay usable
            resp = await client.post(path, content=raw,
                                     headers={"Content-Type": "application/json"})
            codes.append(resp.status_code)
        good = await client.post("/v1/completions", json={"model": "tiny", "prompt": "ok",
                                                          "max_tokens": 2})
    refused = sum(400 <= c < 500 for c in codes)
    observed = f"{refused}/{len(codes)} refused with a 4xx; next request {good.status_code}"
    assert fault_table.record("bad HTTP input (one keep-alive connection)",
                              f"{len(codes)}/{len(codes)} refused with a 4xx; next request "
                              "200", observed, count=len(codes)), (observed, codes)


def _route(**fields: object) -> router_pb2.RouteRequest:
    req = router_pb2.RouteRequest(request_id="bad", model=MODEL, token_ids=[1, 2, 3])
    for name, value in fields.items():
        if isinstance(value, list):
            req.ClearField(name)  # type: ignore[arg-type]
            getattr(req, name).extend(value)
        else:
            setattr(req, name, value)
    return req


def _generate(**kv: object) -> worker_pb2.GenerateRequest:
    req = worker_pb2.GenerateRequest(request_id="bad-gen", token_ids=[1, 2, 3], model=MODEL,
                                     sampling=common_pb2.SamplingParams(max_tokens=2))
    for name, value in kv.items():
        if name == "temperature":
            req.sampling.temperature = value  # type: ignore[assignment]
        else:
            setattr(req.kv_transfer, name, value)
    return req


async def test_bad_grpc_input(mesh: FaultMesh, fault_table: FaultTable) -> None:
    routes = [_route(token_ids=[]), _route(token_ids=[1] * 2_000_000), _route(token_ids=[-1]),
              _route(max_tokens=-1), _route(request_id=""), _route(request_id="x" * 10_000)]
    # (the row-1 request is refused by a vLLM worker: tests/integration/
    # test_engine_death.py; a mock D needs no P coordinates, so out-of-range ones here)
    gens = [_generate(do_remote_prefill=True, remote_request_id="r", remote_port=70000),
            _generate(do_remote_prefill=True, remote_request_id="r", tp_size=-1),
            _generate(do_remote_prefill=True, do_remote_decode=True),
            _generate(temperature=float("nan"))]
    codes: list[str] = []
    async with grpc.aio.insecure_channel(mesh.address("router"),
                                         options=[("grpc.max_send_message_length",
                                                   64 << 20)]) as ch:
        for req in routes:
            try:
                await router_pb2_grpc.RouterStub(ch).Route(req, timeout=30)
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
    async with grpc.aio.insecure_channel(mesh.address("decode-0")) as ch:
        for g in gens:
            try:
                [r async for r in worker_pb2_grpc.WorkerStub(ch).Generate(g, timeout=30)]
                codes.append("OK")
            except grpc.aio.AioRpcError as exc:
                codes.append(exc.code().name)
    good = await mesh.completion("after bad grpc", 2)
    n = len(codes)
    observed = (f"{codes.count('INVALID_ARGUMENT')}/{n} INVALID_ARGUMENT; next request "
                f"{good.status_code}")
    assert fault_table.record("bad gRPC input (Router.Route, Worker.Generate)",
                              f"{n}/{n} INVALID_ARGUMENT; next request 200", observed,
                              count=n), (observed, codes)
    await settled(mesh, mesh.workers())


async def test_a_client_request_id_used_twice_at_once(mesh: FaultMesh,
                                                      fault_table: FaultTable) -> None:
    async def one(i: int) -> int:
        resp = await mesh.completion(f"same id {i} " * 30, 32, request_id="shared-id")
        return resp.status_code

    codes = await asyncio.gather(*(one(i) for i in range(4)))
    observed = f"{codes.count(200)}/4 served"
    assert fault_table.record("4 concurrent requests with the same client request_id",
                              "4/4 served", observed, count=4), (observed, codes)


async def frontend_metric(mesh: FaultMesh, sample: str) -> float:
    """One sample (name with labels, as exposed) of the frontend's /metrics; 0 if absent."""
    async with httpx.AsyncClient(timeout=10) as client:
        text = (await client.get(mesh.url + "/metrics")).text
    for line in text.splitlines():
        if line.startswith(sample + " "):
            return float(line.split()[1])
    return 0.0


PREFILL_MIGRATIONS = 'kvmesh_frontend_migrations_total{stage="prefill"}'
DECODE_MIGRATIONS = 'kvmesh_frontend_migrations_total{stage="decode"}'


async def test_every_p_killed_inside_its_lease(mesh: FaultMesh,
                                               fault_table: FaultTable) -> None:
    """Both P die; until their leases end the router still picks them: each request's
    P call fails, the frontend migrates, and with every P excluded D prefills locally."""
    prefills = [n for n in mesh.workers() if n.startswith("prefill")]
    done = await finished_requests(mesh, prefills)
    assert (await tokens_of(mesh, fresh_long("warm"), 4))[1] is None
    assert await finished_requests(mesh, prefills) != done, "the warm-up did not use a P"
    before = await frontend_metric(mesh, PREFILL_MIGRATIONS)
    for name in prefills:
        mesh.kill(name)
    assert set(prefills) <= await mesh.routable()  # still inside their leases
    results = await asyncio.gather(*(tokens_of(mesh, fresh_long(f"np{i}"), 8)
                                     for i in range(10)))
    migrated = await frontend_metric(mesh, PREFILL_MIGRATIONS) - before
    errors = [e for _, e in results if e is not None]
    for name in prefills:
        mesh.restart(name)
    await asyncio.to_thread(mesh.wait_serving, 60)
    await wait_for(lambda: _all_back(mesh, prefills), 30, "both P routable again")
    observed = f"{len(errors)} errors of 10; P migrations {'> 0' if migrated else '0'}"
    assert fault_table.record("kill -9 of every P, requests inside their leases",
                              "0 errors of 10; P migrations > 0", observed, count=10,
                              prefill_migrations=migrated), (observed, errors)
    await settled(mesh, mesh.workers())


async def _all_back(mesh: FaultMesh, names: list[str]) -> bool:
    return set(names) <= await mesh.routable()


async def test_kill_d_under_many_streams_and_new_requests(mesh: FaultMesh,
                                                          fault_table: FaultTable) -> None:
    """kill -9 of a D with 40 streams on the mesh, and 20 new requests sent at once
    after it, inside its lease; then the D comes back on its port and serves at once."""
    decodes = [n for n in mesh.workers() if n.startswith("decode")]
    before = await frontend_metric(mesh, DECODE_MIGRATIONS)
    started = asyncio.Event()
    seen = 0

    async def one(i: int) -> str | None:
        nonlocal seen
        texts: list[str] = []
        async for ev in mesh.stream(LONG + f"crowd {i}", 400):
            if "error" in ev:
                return str(ev["error"])
            texts.extend(c.get("text", "") for c in ev.get("choices", []) if c.get("text"))
            if len(texts) == 4:
                seen += 1
                if seen == 40:
                    started.set()
            if ev.get("usage"):
                return None if ev["usage"]["completion_tokens"] == 400 else f"usage {ev}"
        return "stream ended without usage"

    streams = [asyncio.ensure_future(one(i)) for i in range(40)]
    await wait_for(started.is_set, 60, "40 streams under way")
    busy = await running_on(mesh, decodes)
    victim = busy[0]
    mesh.kill(victim)
    fresh = await asyncio.gather(*(mesh.completion(f"right after {i} " * 30, 4)
                                   for i in range(20)))
    errors = [e for e in await asyncio.gather(*streams) if e is not None]
    fresh_bad = [r.status_code for r in fresh if r.status_code != 200]
    migrated = await frontend_metric(mesh, DECODE_MIGRATIONS) - before
    mesh.restart(victim)
    await wait_for(lambda: _all_back(mesh, [victim]), 60, f"{victim} routable again")
    await settled(mesh, mesh.workers())
    observed = (f"{len(errors)} stream errors of 40, {len(fresh_bad)} failed new requests "
                f"of 20")
    assert fault_table.record("kill -9 of D under 40 streams, 20 new requests at once",
                              "0 stream errors of 40, 0 failed new requests of 20",
                              observed, count=60, decode_migrations=migrated), (
        observed, errors[:3], fresh_bad)


async def test_a_worker_restarted_inside_its_lease(mesh: FaultMesh,
                                                   fault_table: FaultTable) -> None:
    """The new process registers under the same id before the old lease ends and numbers
    its KV events from 0 again: the index must follow it, not keep the old blocks."""
    victim = "decode-1"
    async with grpc.aio.insecure_channel(mesh.address(victim)) as ch:  # blocks on it
        stub = worker_pb2_grpc.WorkerStub(ch)
        req = worker_pb2.GenerateRequest(request_id="before-restart", model=MODEL,
                                         token_ids=list(range(1, 200)),
                                         sampling=common_pb2.SamplingParams(max_tokens=2))
        [r async for r in stub.Generate(req, timeout=30)]
        held = await stub.GetKvState(kv_events_pb2.KvStateRequest(), timeout=10)
    assert any(t.block_hashes for t in held.tiers)
    async def indexed() -> bool:
        return not await mesh.index_mismatch([victim])
    await wait_for(indexed, 30, f"the index to hold {victim}'s blocks")
    mesh.kill(victim)
    mesh.restart(victim)  # at once: well inside its 30 s lease
    await wait_for(lambda: _all_back(mesh, [victim]), 60, f"{victim} routable again")
    served = [(await tokens_of(mesh, fresh_long(f"after restart {i}"), 4))[1] is None
              for i in range(6)]
    await settled(mesh, mesh.workers())  # incl. the index equal to every worker's state
    observed = f"{sum(served)}/6 served; index matches the new process"
    assert fault_table.record("a worker killed and restarted inside its lease",
                              "6/6 served; index matches the new process", observed), observed
