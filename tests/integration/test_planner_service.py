"""Planner service on real etcd: discovers workers and a frontend, reads GetLoad and
/metrics, decides, and publishes its desired counts (dry-run actuator)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from protos import discovery_pb2, worker_pb2, worker_pb2_grpc
from services.common.config import load_config
from services.common.discovery import InstanceWatcher, Registration
from services.common.procs import Child
from services.planner.main import PlannerConfig, start_planner


class FakeWorker(worker_pb2_grpc.WorkerServicer):
    def __init__(self) -> None:
        self.calls = 0

    async def GetLoad(self, request, context):  # type: ignore[no-untyped-def]  # noqa: N802
        self.calls += 1
        return worker_pb2.LoadReport(num_running=2, num_waiting=0, kv_usage=0.1)


async def test_planner_scales_from_live_metrics(etcd: Child) -> None:
    ns = "planner-it"
    fake = FakeWorker()
    server = grpc.aio.server()
    worker_pb2_grpc.add_WorkerServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()

    started = time.monotonic()

    async def metrics(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        n = int((time.monotonic() - started) * 100)  # 100 req/s, ISL 1000, OSL 200
        body = (f"kvmesh_requests_total{{path=\"agg\",outcome=\"stop\"}} {n}\n"
                f"kvmesh_prompt_tokens_total {n * 1000}\n"
                f"kvmesh_completion_tokens_total {n * 200}\n").encode()
        writer.write(b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: "
                     + str(len(body)).encode() + b"\r\nConnection: close\r\n\r\n" + body)
        await writer.drain()
        writer.close()

    http = await asyncio.start_server(metrics, "127.0.0.1", 0)
    http_port = http.sockets[0].getsockname()[1]
    regs = [Registration(etcd.address, ns, discovery_pb2.InstanceRecord(
        instance_id=f"w-{role}", component="worker", address=f"127.0.0.1:{port}",
        role=role), ttl=5)
        for role in (discovery_pb2.WORKER_ROLE_PREFILL, discovery_pb2.WORKER_ROLE_DECODE)]
    regs.append(Registration(etcd.address, ns, discovery_pb2.InstanceRecord(
        instance_id="fe", component="frontend", address="127.0.0.1:1",
        labels={"http": f"127.0.0.1:{http_port}"}), ttl=5))
    for r in regs:
        await r.start()
    cfg = load_config(PlannerConfig, [
        "--etcd-endpoint", etcd.address, "--namespace", ns, "--lease-ttl", "2",
        "--grace-s", "0.2", "--throughput-interval-s", "1", "--load-interval-s", "0",
        "--itl-slo-ms", "20", "--max-decode", "30", "--max-prefill", "30"], {})
    app = await start_planner(cfg)
    planners = InstanceWatcher(etcd.address, ns, "planner")
    await planners.start()
    try:
        deadline = time.monotonic() + 15
        desired: dict[str, str] = {}
        while time.monotonic() < deadline:
            recs = list(planners.instances().values())
            if recs and int(recs[0].labels.get("desired_decode", "1")) > 1:
                desired = dict(recs[0].labels)
                break
            await asyncio.sleep(0.2)
        assert desired, "planner never raised the decode count"
        pred = app.core.last_prediction
        assert pred is not None and pred.rate == pytest.approx(100, rel=0.3)
        assert pred.isl == pytest.approx(1000) and pred.osl == pytest.approx(200)
        assert int(desired["desired_prefill"]) >= 2
        assert fake.calls > 0
        last = app.loop.last
        assert last is not None and last.ready == {"prefill": 1, "decode": 1}
    finally:
        await planners.close()
        await app.server.stop()
        for r in regs:
            await r.close()
        http.close()
        await server.stop(0)
