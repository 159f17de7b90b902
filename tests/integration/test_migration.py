"""Request migration through a live mesh: kill -9 the worker streaming a request.

Real etcd and Redis (fixtures), an in-process router and frontends, and mock workers in
their own processes (``python -m workers --engine mock``, so they can be killed; a
400-token stream takes seconds, so it is mid-way when the kill lands). The mock engine's
token n is a hash of everything before it, as greedy decoding is, so prompt + the tokens
so far, re-sent to another worker, continue the very same sequence.

- aggregated (HTTP SSE): the client sees no error, the unbroken run's tokens, finish
  "length" and usage for the original prompt and all 400 tokens; one migration counted;
- disaggregated (gRPC API), kill D: the same, through P → another D;
- ``--migration-limit 0``: the client gets the error event, nothing migrated;
- a client that goes away mid-stream counts ``outcome="cancelled"`` and logs no traceback.

A killed worker is restarted on the same port after its test (the next tests may route
to it through a fresh channel).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import sys
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx
import pytest

from protos import common_pb2, frontend_pb2, frontend_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.procs import Child, free_port, spawn
from services.frontend.main import FrontendApp, FrontendConfig, start_frontend
from services.router.main import RouterApp, RouterConfig, start_router
from tests.integration.conftest import base_args
from tests.waiting import wait_for

pytestmark = pytest.mark.slow
NS = "migration"
AGG, PD = "mig-agg", "mig-pd"
# The mock's modelled decode step is ~6 ms: 400 tokens leave seconds for the kill to land
# mid-stream even on a loaded host.
MAX_TOKENS = 400
KILL_AFTER = 8
PROMPT = list(range(100, 164))


@dataclass
class Worker:
    name: str
    role: str
    model: str
    port: int
    child: Child | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"


@dataclass
class MigMesh:
    etcd: str
    redis: str
    tiny_model: str
    log_dir: Path
    router: RouterApp
    frontend: FrontendApp
    no_migration: FrontendApp
    workers: dict[str, Worker] = field(default_factory=dict)

    def start(self, w: Worker) -> None:
        w.child = spawn(w.name, [
            sys.executable, "-m", "workers", "--engine", "mock", *base_args(self.etcd, NS),
            "--redis-url", f"redis://{self.redis}", "--role", w.role, "--port", str(w.port),
            "--worker-id", w.name, "--model-path", self.tiny_model, "--model-name", w.model,
            "--block-size", "16"], self.log_dir, append=True,
            # no preexec_fn: forking this gRPC-threaded process to run Python in the
            # child crashed it (SIGSEGV); Child.stop() in the fixture ends it instead
            die_with_parent=False)

    def routed(self) -> set[tuple[str, int]]:
        """(address, pid) of the workers the router knows."""
        return {(r.address, r.pid) for r in self.router.watcher.instances().values()}

    async def ready(self) -> None:
        """Until every worker is alive and known to the router and both frontends."""
        def check() -> bool:
            for w in self.workers.values():
                assert w.child is not None and w.child.alive(), (
                    w.child.log_tail() if w.child else w.name)
            return (self.routed() >= {(w.address, w.child.pid)  # type: ignore[union-attr]
                                      for w in self.workers.values()}
                    and all(f.pipeline.catalog.get(m) is not None
                            for f in (self.frontend, self.no_migration) for m in (AGG, PD)))

        await wait_for(check, 120, lambda: f"workers routable (router has {self.routed()})")

    async def running(self, candidates: list[str]) -> Worker:
        """The one worker of ``candidates`` that is running a request."""
        async def busy() -> list[Worker]:
            out = []
            for name in candidates:
                w = self.workers[name]
                async with grpc.aio.insecure_channel(w.address) as ch:
                    rep = await worker_pb2_grpc.WorkerStub(ch).GetLoad(
                        worker_pb2.GetLoadRequest(), timeout=5)
                if rep.num_running:
                    out.append(w)
            return out

        found = await wait_for(busy, 10, f"one of {candidates} running the request")
        assert len(found) == 1, [w.name for w in found]
        return found[0]

    def kill(self, w: Worker) -> None:
        """kill -9 (the ``restart`` fixture starts it again after the test)."""
        assert w.child is not None
        w.child.kill()


@pytest.fixture(scope="module")
async def mig(etcd: Child, redis_server: Child, tiny_model: str,
              log_dir: Path) -> AsyncIterator[MigMesh]:
    args = base_args(etcd.address, NS)
    router = await start_router(load_config(RouterConfig, [
        *args, "--load-poll-s", "0.2", "--conditional-disagg", "false"], {}))
    fronts = [await start_frontend(load_config(FrontendConfig, [
        *args, "--http-port", "0", "--router-address", router.server.address,
        "--migration-limit", limit], {})) for limit in ("3", "0")]
    m = MigMesh(etcd.address, redis_server.address, tiny_model, log_dir, router, *fronts)
    for name, role, model in (("a1", "agg", AGG), ("a2", "agg", AGG), ("p1", "prefill", PD),
                              ("d1", "decode", PD), ("d2", "decode", PD)):
        m.workers[name] = Worker(name, role, model, free_port())
        m.start(m.workers[name])
    try:
        await m.ready()
        yield m
    finally:
        for w in m.workers.values():
            if w.child is not None:
                w.child.stop()
        for f in fronts:
            await f.server.stop()
        await router.server.stop()


@pytest.fixture
async def restart(mig: MigMesh) -> AsyncIterator[list[Worker]]:
    """Workers a test killed; restarted on their ports (and awaited) after it."""
    killed: list[Worker] = []
    yield killed
    for w in killed:
        mig.start(w)
    await mig.ready()


def counter(app: FrontendApp, name: str, **labels: str) -> float:
    total = 0.0
    for metric in app.pipeline.metrics.registry.collect():
        for s in metric.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def body(model: str, **extra: object) -> dict[str, object]:
    return {"model": model, "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0,
            "ignore_eos": True, **extra}


def mock_ids(text: str) -> list[int]:
    """The mock engine's text is `` w<id>`` per token."""
    return [int(w[1:]) for w in text.split()]


@pytest.fixture(scope="module")
async def reference(mig: MigMesh) -> list[int]:
    """The unbroken greedy run of the request."""
    async with httpx.AsyncClient(base_url=mig.frontend.base_url, timeout=60) as client:
        resp = await client.post("/v1/completions", json=body(AGG))
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    ids = mock_ids(out["choices"][0]["text"])
    assert len(ids) == MAX_TOKENS
    return ids


async def sse_with_kill(mig: MigMesh, app: FrontendApp, model: str,
                        candidates: list[str], killed: list[Worker]) -> list[dict[str, object]]:
    """Streams the request over HTTP, kill -9 its worker after KILL_AFTER tokens; the
    events (the [DONE] marker as {"done": True})."""
    events: list[dict[str, object]] = []
    tokens = 0
    async with httpx.AsyncClient(base_url=app.base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions", json=body(
                model, stream=True, stream_options={"include_usage": True})) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                if line == "data: [DONE]":
                    events.append({"done": True})
                    continue
                ev = json.loads(line[6:])
                events.append(ev)
                for c in ev.get("choices", []):
                    tokens += len(mock_ids(c.get("text", "")))
                if tokens >= KILL_AFTER and not killed:
                    w = await mig.running(candidates)
                    mig.kill(w)
                    killed.append(w)
    return events


async def test_agg_worker_killed_mid_stream_migrates_without_a_client_error(
        mig: MigMesh, reference: list[int], restart: list[Worker]) -> None:
    before = counter(mig.frontend, "kvmesh_frontend_migrations_total", stage="agg")
    events = await sse_with_kill(mig, mig.frontend, AGG, ["a1", "a2"], restart)
    assert len(restart) == 1
    assert not [e for e in events if "error" in e], events
    assert events[-1] == {"done": True}
    text = "".join(str(c["text"]) for e in events for c in e.get("choices", []))  # type: ignore[attr-defined]
    assert mock_ids(text) == reference  # no token repeated, none missing
    finish = [c["finish_reason"] for e in events for c in e.get("choices", [])  # type: ignore[attr-defined]
              if c["finish_reason"]]
    assert finish == ["length"]
    usage = events[-2]["usage"]
    assert usage == {"prompt_tokens": len(PROMPT), "completion_tokens": MAX_TOKENS,  # type: ignore[comparison-overlap]
                     "total_tokens": len(PROMPT) + MAX_TOKENS,
                     "prompt_tokens_details": usage["prompt_tokens_details"]}  # type: ignore[index]
    assert counter(mig.frontend, "kvmesh_frontend_migrations_total", stage="agg") == before + 1


async def test_decode_worker_killed_mid_stream_migrates_through_p_to_another_d(
        mig: MigMesh, reference: list[int], restart: list[Worker]) -> None:
    before = counter(mig.frontend, "kvmesh_frontend_migrations_total", stage="decode")
    chunks: list[frontend_pb2.CompletionChunk] = []
    async with grpc.aio.insecure_channel(mig.frontend.server.address) as ch:
        stub = frontend_pb2_grpc.FrontendStub(ch)
        async for c in stub.Generate(frontend_pb2.CompletionRequest(
                model=PD, prompt=" ".join(f"w{t}" for t in PROMPT),
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True))):
            chunks.append(c)
            if sum(len(x.token_ids) for x in chunks) >= KILL_AFTER and not restart:
                w = await mig.running(["d1", "d2"])
                mig.kill(w)
                restart.append(w)
    assert len(restart) == 1
    got = [t for c in chunks for t in c.token_ids]
    assert len(got) == MAX_TOKENS
    # The text prompt tokenizes differently from PROMPT: compare with its own unbroken run.
    async with grpc.aio.insecure_channel(mig.frontend.server.address) as ch:
        again = [c async for c in frontend_pb2_grpc.FrontendStub(ch).Generate(
            frontend_pb2.CompletionRequest(
                model=AGG, prompt=" ".join(f"w{t}" for t in PROMPT),
                sampling=common_pb2.SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0,
                                                   ignore_eos=True)))]
    assert got == [t for c in again for t in c.token_ids]
    last = chunks[-1]
    assert last.finish_reason == common_pb2.FINISH_REASON_LENGTH
    assert last.usage.completion_tokens == MAX_TOKENS
    assert last.usage.prompt_tokens == again[-1].usage.prompt_tokens
    assert counter(mig.frontend, "kvmesh_frontend_migrations_total",
                   stage="decode") == before + 1


async def test_a_whole_answer_whose_worker_dies_migrates_with_what_it_was_sent(
        mig: MigMesh, reference: list[int], restart: list[Worker],
        caplog: pytest.LogCaptureFixture) -> None:
    """A non-streamed request (GenerateRequest.whole: after its first message the worker
    holds every token for its last one) whose worker is killed KILL_AFTER engine steps
    in: the held tokens die with it, the migration carries the first message's, the next
    worker makes the rest, and the answer is the unbroken run's."""
    caplog.set_level(logging.INFO, logger="services.frontend.pipeline")
    before = counter(mig.frontend, "kvmesh_frontend_migrations_total", stage="agg")
    async with httpx.AsyncClient(base_url=mig.frontend.base_url, timeout=60) as client:
        answer = asyncio.ensure_future(client.post("/v1/completions", json=body(AGG)))
        w = await mig.running(["a1", "a2"])
        start = await engine_steps(w)

        async def stepped() -> bool:
            return await engine_steps(w) >= start + KILL_AFTER
        await wait_for(stepped, 30, f"{KILL_AFTER} engine steps on {w.name}")
        mig.kill(w)
        restart.append(w)
        resp = await answer
    assert resp.status_code == 200, resp.text
    out = resp.json()
    assert mock_ids(out["choices"][0]["text"]) == reference  # none repeated, none missing
    assert out["choices"][0]["finish_reason"] == "length"
    assert out["usage"]["completion_tokens"] == MAX_TOKENS
    assert counter(mig.frontend, "kvmesh_frontend_migrations_total", stage="agg") == before + 1
    carried = [r.args[-1] for r in caplog.records if "migrating with" in r.getMessage()]
    assert len(carried) == 1 and 1 <= carried[0] < MAX_TOKENS, carried  # type: ignore[operator]


async def engine_steps(w: Worker) -> int:
    """The mock engine's step count, from the worker's GetLoad counters."""
    async with grpc.aio.insecure_channel(w.address) as ch:
        rep = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=5)
    return rep.counters["steps"]


async def test_migration_limit_0_gives_the_client_the_error(
        mig: MigMesh, restart: list[Worker]) -> None:
    events = await sse_with_kill(mig, mig.no_migration, AGG, ["a1", "a2"], restart)
    assert len(restart) == 1
    errors = [e for e in events if "error" in e]
    assert len(errors) == 1 and errors[0]["error"]["message"], events  # type: ignore[index]
    assert events[-1] == {"done": True} and "error" in events[-2]  # as vLLM: [DONE] after it
    assert counter(mig.no_migration, "kvmesh_frontend_migrations_total") == 0
    assert counter(mig.no_migration, "kvmesh_requests_total", outcome="error") >= 1


@pytest.fixture
def frontend_logs(caplog: pytest.LogCaptureFixture) -> Iterator[pytest.LogCaptureFixture]:
    """Every log record, uvicorn's too (its loggers do not propagate to the root)."""
    caplog.set_level(logging.INFO)
    extra = [logging.getLogger(n) for n in ("uvicorn", "uvicorn.error", "uvicorn.asgi")]
    for lg in extra:
        lg.addHandler(caplog.handler)
    try:
        yield caplog
    finally:
        for lg in extra:
            lg.removeHandler(caplog.handler)


async def test_client_disconnect_counts_cancelled_and_logs_no_traceback(
        mig: MigMesh, frontend_logs: pytest.LogCaptureFixture) -> None:
    before = counter(mig.frontend, "kvmesh_requests_total", outcome="cancelled")
    async with httpx.AsyncClient(base_url=mig.frontend.base_url, timeout=60) as client:
        async with client.stream("POST", "/v1/completions",
                                 json=body(AGG, stream=True)) as resp:
            assert resp.status_code == 200
            async for line in resp.aiter_lines():
                if line.startswith("data: "):
                    break  # and close the connection mid-stream
    async with grpc.aio.insecure_channel(mig.frontend.server.address) as ch:
        call = frontend_pb2_grpc.FrontendStub(ch).Generate(frontend_pb2.CompletionRequest(
            model=AGG, prompt="w1 w2 w3", sampling=common_pb2.SamplingParams(
                max_tokens=MAX_TOKENS, ignore_eos=True)))
        async for _ in call:
            break
        call.cancel()
    await wait_for(lambda: counter(mig.frontend, "kvmesh_requests_total",
                                   outcome="cancelled") == before + 2, 20,
                   "both abandoned requests counted as cancelled")
    for name in ("a1", "a2"):  # the workers stop them
        await wait_for(lambda n=name: not_running(mig, n), 20, f"{name} idle")  # type: ignore[misc]
    tracebacks = [r for r in frontend_logs.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]


async def test_a_client_gone_mid_answer_cancels_a_non_streamed_request(
        mig: MigMesh, frontend_logs: pytest.LogCaptureFixture) -> None:
    """A non-streamed request whose client closes the connection while the worker
    generates: the worker stops it, the router releases it, it counts as cancelled, and
    the frontend logs no traceback and answers the next request."""
    before = counter(mig.frontend, "kvmesh_requests_total", outcome="cancelled")

    async def ask() -> None:
        async with httpx.AsyncClient(base_url=mig.frontend.base_url, timeout=60) as client:
            await client.post("/v1/completions", json=body(AGG))

    client = asyncio.create_task(ask())
    try:
        busy = await mig.running(["a1", "a2"])
    finally:
        client.cancel()  # closes the connection mid-answer (400 tokens take seconds)
        with contextlib.suppress(asyncio.CancelledError):
            await client
    await wait_for(lambda: counter(mig.frontend, "kvmesh_requests_total",
                                   outcome="cancelled") == before + 1, 20,
                   "the abandoned request counted as cancelled")
    await wait_for(lambda: not_running(mig, busy.name), 20, f"{busy.name} idle")
    await wait_for(lambda: not mig.router.servicer.core.in_flight(), 20,
                   lambda: f"router entries released: {mig.router.servicer.core.in_flight()}")
    tracebacks = [r for r in frontend_logs.records if r.exc_info or r.levelno >= logging.ERROR]
    assert not tracebacks, [r.getMessage() for r in tracebacks]
    async with httpx.AsyncClient(base_url=mig.frontend.base_url, timeout=60) as c:
        resp = await c.post("/v1/completions", json=body(AGG, max_tokens=4))
    assert resp.status_code == 200 and resp.json()["usage"]["completion_tokens"] == 4


async def not_running(mig: MigMesh, name: str) -> bool:
    async with grpc.aio.insecure_channel(mig.workers[name].address) as ch:
        rep = await worker_pb2_grpc.WorkerStub(ch).GetLoad(worker_pb2.GetLoadRequest(),
                                                            timeout=5)
    return rep.num_running == 0 and rep.num_waiting == 0
