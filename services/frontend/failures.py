"""Failed calls as the frontend reports and handles them: a router's admission rejection
and a worker's gRPC status as :class:`~services.frontend.openai_schema.ApiError` (4xx/5xx), and
a failed worker call of :func:`~services.frontend.handoff.run_plan` as a
:class:`WorkerFailure` whose ``migratable`` / ``worker_down`` drive the pipeline's
migration (:mod:`services.frontend.pipeline`).
"""

from __future__ import annotations

from dataclasses import dataclass

import grpc

from protos import router_pb2
from services.frontend.handoff import HandoffError
from services.frontend.openai_schema import ApiError

RETRY_AFTER_KEY = "retry-after"
REASON_KEY = "kvmesh-admission-reason"
# A worker's trailing metadata naming the role whose fault its failure is
# (workers/service.py: "prefill" when P's KV never came).
FAILED_ROLE_KEY = "kvmesh-failed-role"


def _trailer(exc: grpc.aio.AioRpcError, key: str) -> str | None:
    for k, v in exc.trailing_metadata() or ():
        if k == key:
            return v.decode() if isinstance(v, bytes) else str(v)
    return None


def rejection_error(exc: grpc.aio.AioRpcError) -> ApiError:
    """A router RESOURCE_EXHAUSTED (admission rejection) as an overloaded ApiError 503."""
    reason = _trailer(exc, REASON_KEY) or "overloaded"
    try:
        retry = float(_trailer(exc, RETRY_AFTER_KEY) or 1.0)
    except ValueError:
        retry = 1.0
    return ApiError(503, exc.details() or "the mesh is overloaded", type="overloaded_error",
                    code=reason, retry_after_s=max(retry, 0.0))


def status_error(code: grpc.StatusCode, detail: str, what: str) -> ApiError:
    """A gRPC status from ``what`` (router, worker, prefill worker) as an ApiError."""
    detail = detail or code.name
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return ApiError(400, detail if what == "router" else f"{what} refused the request: "
                                                             f"{detail}")
    if code == grpc.StatusCode.NOT_FOUND:
        return ApiError(404, detail, code="model_not_found", param="model")
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return ApiError(503, f"{what} refused the request: {detail}",
                        type="service_unavailable", code="no_compatible_workers")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.RESOURCE_EXHAUSTED):
        return ApiError(503, f"{what} unavailable: {detail}", type="service_unavailable")
    return ApiError(502, f"{what} failed: {detail}", type="upstream_error")


# Worker failures a migration may retry elsewhere (the worker or the link broke); any other
# code (INVALID_ARGUMENT, NOT_FOUND, RESOURCE_EXHAUSTED, ...) is the request's own fault or
# an admission answer, and goes to the client.
MIGRATABLE = frozenset({
    grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED, grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED,
})
@dataclass(frozen=True)
class WorkerFailure:
    """One attempt's failed worker call: which worker, at which stage, with what."""

    stage: str  # agg | prefill | decode | timeout
    instance_id: str
    address: str
    code: grpc.StatusCode | None  # None: no status (broken stream, handoff fault, timeout)
    detail: str

    @property
    def migratable(self) -> bool:
        return self.code is None or self.code in MIGRATABLE

    @property
    def worker_down(self) -> bool:
        """The worker may be dead or unreachable (UNAVAILABLE, or no status at all); one
        that answered any other status is alive."""
        return self.code is None or self.code == grpc.StatusCode.UNAVAILABLE

    def error(self) -> ApiError:
        """What the client gets when this failure is not migrated."""
        what = f"{'prefill worker' if self.stage == 'prefill' else 'worker'} {self.instance_id}"
        if self.code is None:
            return ApiError(502, self.detail, type="upstream_error")
        return status_error(self.code, self.detail, what)


def worker_failure(exc: HandoffError, route: router_pb2.RouteResponse) -> WorkerFailure:
    """``exc`` from :func:`run_plan` as a WorkerFailure: its stage, worker and code, the
    detail of its gRPC cause. The failure is P's (P's id and address; stage "prefill", or
    "timeout" as it was) when D says so (trailing ``kvmesh-failed-role: prefill``: P's KV
    never came) or the push timer fired."""
    rpc = exc.__cause__ if isinstance(exc.__cause__, grpc.aio.AioRpcError) else None
    stage, instance_id, address = exc.stage, exc.instance_id, exc.address
    p_fault = stage == "timeout" or (rpc is not None and stage == "decode"
                                     and _trailer(rpc, FAILED_ROLE_KEY) == "prefill")
    if p_fault and route.HasField("prefill"):
        stage = "timeout" if stage == "timeout" else "prefill"
        instance_id, address = route.prefill.instance_id, route.prefill.address
    detail = (rpc.details() or str(exc)) if rpc is not None else str(exc)
    return WorkerFailure(stage, instance_id, address, exc.code, detail)
