"""The Router gRPC servicer, plus the glue that feeds discovery and load into the core.

Contract:

- ``Route``: INVALID_ARGUMENT without a model, NOT_FOUND for a model no worker ever served,
  UNAVAILABLE when it has no live worker now; otherwise the chosen worker with the policy
  name and reason. Records a ``router.route`` span (policy, worker id, reason).
- ``Release``: ends the request's load accounting.
- ``ListWorkers``: the live worker records from etcd.
- :class:`LoadPoller` asks every live worker for ``GetLoad`` every ``period_s`` and feeds
  the core; a worker that does not answer keeps its last report until discovery drops it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

import grpc

from protos import discovery_pb2, router_pb2, router_pb2_grpc, worker_pb2, worker_pb2_grpc
from services.common.grpc_client import ChannelPool
from services.common.telemetry import tracer
from services.router.core import NoWorkers, RouterCore, RoutingError, UnknownModel, WorkerRecord
from services.router.policies.base import RouteContext

log = logging.getLogger(__name__)

ROLE_NAMES = {
    discovery_pb2.WORKER_ROLE_AGG: "agg",
    discovery_pb2.WORKER_ROLE_PREFILL: "prefill",
    discovery_pb2.WORKER_ROLE_DECODE: "decode",
}
ROLE_ENUM = {v: k for k, v in ROLE_NAMES.items()}


def record_from_proto(rec: discovery_pb2.InstanceRecord) -> WorkerRecord:
    """Discovery record → the core's WorkerRecord."""
    return WorkerRecord(
        instance_id=rec.instance_id, address=rec.address, model=rec.model,
        role=ROLE_NAMES.get(rec.role, "agg"), block_size=rec.block_size,
        max_model_len=rec.max_model_len, handoff_mode=rec.handoff.mode,
        kv_layout=rec.kv_layout,
    )


class RouterServicer(router_pb2_grpc.RouterServicer):
    """Serves routing decisions from a RouterCore."""

    def __init__(self, core: RouterCore, records: dict[str, discovery_pb2.InstanceRecord]):
        self._core = core
        self._records = records
        self._tracer = tracer("router")

    def set_records(self, records: dict[str, discovery_pb2.InstanceRecord]) -> None:
        """Applies a discovery snapshot."""
        self._records = records
        self._core.set_workers(record_from_proto(r) for r in records.values())

    async def Route(  # noqa: N802
        self, request: router_pb2.RouteRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.RouteResponse:
        if not request.model:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "model is required")
        if not request.request_id:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "request_id is required")
        ctx = RouteContext(request.request_id, request.model, tuple(request.token_ids))
        with self._tracer.start_as_current_span("router.route") as span:
            span.set_attribute("kvmesh.request_id", request.request_id)
            span.set_attribute("kvmesh.policy", self._core.policy.name)
            try:
                plan = self._core.route(ctx)
            except UnknownModel as exc:
                await context.abort(grpc.StatusCode.NOT_FOUND, str(exc))
            except NoWorkers as exc:
                await context.abort(grpc.StatusCode.UNAVAILABLE, str(exc))
            except RoutingError as exc:  # incl. Incompatible P/D layouts
                await context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            span.set_attribute("kvmesh.worker_id", plan.worker.instance_id)
            span.set_attribute("kvmesh.route_reason", plan.reason)
            span.set_attribute("kvmesh.disaggregated", plan.disaggregated)
            span.set_attribute("kvmesh.predicted_overlap_blocks", plan.overlap_blocks)
            if plan.prefill is not None:
                span.set_attribute("kvmesh.prefill_worker_id", plan.prefill.instance_id)
        resp = router_pb2.RouteResponse(
            worker=self._choice(plan.worker), policy=plan.policy, reason=plan.reason,
            disaggregated=plan.disaggregated, predicted_overlap_blocks=plan.overlap_blocks,
            predicted_prefill_overlap_blocks=plan.prefill_overlap_blocks,
        )
        if plan.prefill is not None:
            resp.prefill.CopyFrom(self._choice(plan.prefill))
        return resp

    def _choice(self, worker: WorkerRecord) -> router_pb2.WorkerChoice:
        choice = router_pb2.WorkerChoice(
            instance_id=worker.instance_id, address=worker.address,
            role=ROLE_ENUM.get(worker.role, discovery_pb2.WORKER_ROLE_AGG),
        )
        rec = self._records.get(worker.instance_id)
        if rec is not None and rec.HasField("handoff"):
            choice.handoff.CopyFrom(rec.handoff)
        return choice

    async def Release(  # noqa: N802
        self, request: router_pb2.ReleaseRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ReleaseResponse:
        return router_pb2.ReleaseResponse(found=self._core.release(request.request_id))

    async def ListWorkers(  # noqa: N802
        self, request: router_pb2.ListWorkersRequest, context: grpc.aio.ServicerContext
    ) -> router_pb2.ListWorkersResponse:
        recs = [r for _, r in sorted(self._records.items())
                if not request.model or r.model == request.model]
        return router_pb2.ListWorkersResponse(workers=recs)


class LoadPoller:
    """Polls GetLoad on every live worker and feeds the core."""

    def __init__(self, core: RouterCore, period_s: float) -> None:
        self._core = core
        self._period = period_s
        self._pool = ChannelPool()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Starts the polling task."""
        self._task = asyncio.create_task(self._run(), name="load-poller")

    async def _poll_one(self, worker: WorkerRecord) -> None:
        stub = worker_pb2_grpc.WorkerStub(self._pool.get(worker.address))
        try:
            rep = await stub.GetLoad(worker_pb2.GetLoadRequest(), timeout=self._period)
        except grpc.RpcError:
            return
        self._core.update_load(worker.instance_id, rep.num_running, rep.num_waiting,
                               rep.kv_usage)

    async def _run(self) -> None:
        while True:
            workers = self._core.workers()
            await asyncio.gather(*(self._poll_one(w) for w in workers))
            await self._pool.keep_only({w.address for w in workers})
            await asyncio.sleep(self._period)

    async def close(self) -> None:
        """Stops polling and closes channels."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self._pool.close()
