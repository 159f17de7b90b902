"""The router's vocabulary, shared by its core, its servicer and its tools: what a worker
looks like to the router (:class:`WorkerRecord`, from discovery), what a routing decision
is (:class:`RoutePlan`), and how routing fails (:class:`RoutingError` and its kinds,
which the servicer maps to gRPC status codes). Pure data: no I/O, no clock."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from services.router.admission.core import AdmissionDecision
from services.router.disagg import PairInfo


class RoutingError(Exception):
    """Base of routing failures."""


class UnknownModel(RoutingError):
    """No worker serves this model name."""


class NoWorkers(RoutingError):
    """The model is known but no worker can take the request now."""


class Incompatible(RoutingError):
    """Prefill and decode workers exist, but no pair can hand KV over."""


class InvalidRequest(RoutingError):
    """The request cannot run on this model (e.g. longer than its context)."""


class AlreadyInFlight(RoutingError):
    """A request with this id is routed and not released."""


class Rejected(RoutingError):
    """Admission control refused the request (the plan it would have run on is kept)."""

    def __init__(self, decision: AdmissionDecision, plan: RoutePlan) -> None:
        super().__init__(decision.detail or decision.reason)
        self.decision = decision
        self.plan = plan


@dataclass(frozen=True)
class WorkerRecord:
    """What the router needs to know about a worker from discovery."""

    instance_id: str
    address: str
    model: str
    role: str
    block_size: int
    max_model_len: int
    handoff_mode: str = ""
    kv_layout: str = ""
    # The incarnation: a restarted worker registers with a new pid / start time, which
    # ends a failure mark (see the module docstring).
    pid: int = 0
    started_at_ms: int = 0
    # The worker can serve a request whole (prefill and decode) although its role is
    # "prefill" (a vLLM or mock P worker: its connector only adds the handoff); discovery's
    # ``decode_alone`` capability. See "P serves whole".
    can_decode_alone: bool = False

    def fits(self, tokens: int) -> bool:
        """Whether ``tokens`` (prompt + output) fit its context (0: unknown, no limit)."""
        return self.max_model_len <= 0 or tokens <= self.max_model_len

    def pair_info(self) -> PairInfo:
        return PairInfo(self.instance_id, self.handoff_mode, self.block_size, self.kv_layout)


@dataclass(frozen=True)
class RoutePlan:
    """The decision for one request.

    ``overlap_*`` is the predicted overlap on ``worker`` (D or the agg worker),
    ``prefill_overlap_*`` on ``prefill``; ``score``/``cost`` are those of ``worker``'s
    decision (``prefill_score``/``prefill_cost`` of P's) when the policy reports them.
    """

    worker: WorkerRecord
    prefill: WorkerRecord | None
    policy: str
    reason: str
    overlap_blocks: int = 0
    prefill_overlap_blocks: int = 0
    overlap_by_tier: Mapping[str, int] = field(default_factory=dict)
    prefill_overlap_by_tier: Mapping[str, int] = field(default_factory=dict)
    overlap_source: str = "history"
    prompt_blocks: int = 0
    score: float | None = None
    cost: float | None = None
    prefill_score: float | None = None
    prefill_cost: float | None = None
    admission: AdmissionDecision | None = None

    @property
    def disaggregated(self) -> bool:
        return self.prefill is not None

    @property
    def block_size(self) -> int:
        """Block size the overlaps are counted in (``worker``'s; P pairs only with equal)."""
        return self.worker.block_size
