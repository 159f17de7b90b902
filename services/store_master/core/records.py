"""Plain-data records of the master's durable state, for persistence (e.g. Redis hashes).

Contract:

- :func:`segment_record` / :func:`object_record` turn a mounted segment / an object into a
  JSON-ready dict; :func:`encode` / :func:`decode` turn records into bytes and back.
- :func:`object_from_record` parses an object record (raises ValueError when malformed).
- What is durable: segments (owner, principal, base, size, endpoint) and objects (size,
  replicas with their ranges and states, put start/completion times, pin and soft-pin
  deadline, wanted replica count, last access at the last write). What is not: read
  leases, client ping times and access times refreshed by reads; the master re-derives
  them conservatively on restore (see :meth:`StoreMaster.restore`).
- :class:`Changes`: records written (dict) or deleted (None) since the last drain, keyed by
  object key / segment id; applying every drain in order to a key-value store keeps it
  equal to :meth:`StoreMaster.snapshot`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from services.store_master.core.allocator import Segment
from services.store_master.core.states import ObjectMeta, Pin, Replica, ReplicaState

Record = dict[str, Any]


@dataclass
class Changes:
    objects: dict[str, Record | None] = field(default_factory=dict)
    segments: dict[str, Record | None] = field(default_factory=dict)

    def __bool__(self) -> bool:
        return bool(self.objects or self.segments)

    def merge(self, newer: Changes) -> None:
        """Folds ``newer`` (drained later) into this one; the newer record wins."""
        self.objects.update(newer.objects)
        self.segments.update(newer.segments)


def segment_record(seg: Segment) -> Record:
    return {"segment_id": seg.segment_id, "client_id": seg.client_id, "base": seg.base,
            "size": seg.size, "endpoint": seg.endpoint, "principal": seg.principal}


def object_record(obj: ObjectMeta) -> Record:
    return {
        "key": obj.key, "size": obj.size,
        "replicas": [[r.segment_id, r.offset, r.size, r.state.value] for r in obj.replicas],
        "put_started_at": obj.put_started_at, "completed_at": obj.completed_at,
        "last_access": obj.last_access, "pin": obj.pin.value,
        "soft_pin_until": obj.soft_pin_until, "replicas_wanted": obj.replicas_wanted,
    }


def object_from_record(rec: Record) -> ObjectMeta:
    try:
        replicas = [Replica(str(s), int(o), int(n), ReplicaState(st))
                    for s, o, n, st in rec["replicas"]]
        completed = rec["completed_at"]
        return ObjectMeta(
            key=str(rec["key"]), size=int(rec["size"]), replicas=replicas,
            put_started_at=float(rec["put_started_at"]),
            completed_at=None if completed is None else float(completed),
            last_access=float(rec["last_access"]), pin=Pin(rec["pin"]),
            soft_pin_until=float(rec["soft_pin_until"]),
            replicas_wanted=int(rec["replicas_wanted"]))
    except (KeyError, TypeError, ValueError) as exc:
        raise ValueError(f"malformed object record: {exc}") from exc


def encode(rec: Record) -> bytes:
    return json.dumps(rec, separators=(",", ":"), sort_keys=True).encode()


def decode(raw: bytes | str) -> Record:
    out = json.loads(raw)
    if not isinstance(out, dict):
        raise ValueError("record is not a JSON object")
    return out
