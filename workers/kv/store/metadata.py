"""What crosses vLLM's scheduler ↔ worker boundary for the store connector.

- :class:`StoreMeta` (scheduler → worker, one per step): the :class:`StepPlan`'s loads,
  saves and prefetch keys as vLLM's ``KVConnectorMetadata``.
- :class:`StoreWorkerMeta` (worker → scheduler, per step): ``done`` = ``(req_id, first,
  n)`` for each job whose first ``n`` blocks are now in the store (saved, already there,
  or loaded from it); ``aggregate`` concatenates the reports of several workers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)

from workers.kv.store.planner import StepPlan


@dataclass
class StoreMeta(StepPlan, KVConnectorMetadata):
    """What the worker side does in one step (crosses the scheduler → worker boundary)."""


@dataclass
class StoreWorkerMeta(KVConnectorWorkerMetadata):
    """Worker → scheduler, per step: ``(req_id, first, n)`` for each job whose first ``n``
    blocks are now in the store (saved, already there, or loaded from it)."""

    done: list[tuple[str, int, int]] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        if isinstance(other, StoreWorkerMeta):
            return StoreWorkerMeta(self.done + other.done)
        return self
