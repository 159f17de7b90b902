"""Store master domain types: replica states and their transitions, pins, objects, errors.

Replica states (Mooncake's names; what each means here):

- ``INITIALIZED``: the replica's record exists and a segment was chosen, but its byte range
  is not reserved yet. It lives only inside ``put_start``; a replica that cannot get its
  range goes to ``FAILED`` and is dropped before ``put_start`` returns.
- ``PROCESSING``: the range is reserved and handed to the writer, who is moving the bytes
  (between ``put_start`` and ``put_end``). Never served to readers.
- ``COMPLETE``: the writer confirmed the bytes (``put_end``). Only COMPLETE replicas are
  ever returned by ``get_replica_list``; an object is readable once all its live replicas
  are COMPLETE.
- ``REMOVED`` (terminal): the master released the range on purpose (``remove``,
  ``remove_all``, eviction, ``put_revoke``, zombie reclaim).
- ``FAILED`` (terminal): the replica was lost, not released: its allocation failed, or its
  segment was unmounted or its client stopped pinging (the bytes are gone with it).

Allowed transitions (:data:`TRANSITIONS`; anything else is a bug and raises
:class:`IllegalTransition`)::

    INITIALIZED → PROCESSING | FAILED
    PROCESSING  → COMPLETE | REMOVED | FAILED
    COMPLETE    → REMOVED | FAILED

A replica in a terminal state is dropped from its object at once; an object with no replica
left is deleted.

Errors: every refusal the master gives is a :class:`StoreError` subclass whose ``kind`` is
an :class:`ErrorKind` (what went wrong in the store's terms); the core knows no transport.
The gRPC service maps each kind to a status code in one table (``service.py``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class ReplicaState(enum.Enum):
    INITIALIZED = "initialized"
    PROCESSING = "processing"
    COMPLETE = "complete"
    REMOVED = "removed"
    FAILED = "failed"


TRANSITIONS: dict[ReplicaState, frozenset[ReplicaState]] = {
    ReplicaState.INITIALIZED: frozenset({ReplicaState.PROCESSING, ReplicaState.FAILED}),
    ReplicaState.PROCESSING: frozenset(
        {ReplicaState.COMPLETE, ReplicaState.REMOVED, ReplicaState.FAILED}),
    ReplicaState.COMPLETE: frozenset({ReplicaState.REMOVED, ReplicaState.FAILED}),
    ReplicaState.REMOVED: frozenset(),
    ReplicaState.FAILED: frozenset(),
}
TERMINAL = frozenset({ReplicaState.REMOVED, ReplicaState.FAILED})


class Pin(enum.Enum):
    """Eviction protection. Pins never block an explicit ``remove``.

    - ``NONE``: evictable (when complete and not leased).
    - ``SOFT``: evicted only when evicting every eligible unpinned object did not free
      enough; lapses to NONE after the soft-pin TTL, which reads refresh.
    - ``HARD``: never evicted.
    """

    NONE = "none"
    SOFT = "soft"
    HARD = "hard"


class ErrorKind(enum.Enum):
    """Why the master refused; one per :class:`StoreError` subclass."""

    INTERNAL = "internal"  # a StoreError without a more specific kind
    INVALID = "invalid"  # malformed input (empty key, bad size, replica count, geometry)
    NOT_FOUND = "not_found"  # unknown key, or a segment not mounted by that client
    EXISTS = "exists"  # the key or segment exists already
    LEASED = "leased"  # a read lease blocks the removal
    NOT_READY = "not_ready"  # the object is not complete yet
    WRONG_STATE = "wrong_state"  # the operation does not apply to the object's state
    NO_SPACE = "no_space"  # no segment can hold the object
    FORBIDDEN = "forbidden"  # the segment belongs to another principal


class StoreError(Exception):
    """A refusal; ``kind`` says which (the service maps it to a status code)."""

    kind = ErrorKind.INTERNAL


class InvalidInput(StoreError):
    kind = ErrorKind.INVALID


class NotFound(StoreError):
    kind = ErrorKind.NOT_FOUND


class AlreadyExists(StoreError):
    kind = ErrorKind.EXISTS


class Leased(StoreError):
    """The object holds a read lease: it cannot be removed until the lease expires."""

    kind = ErrorKind.LEASED


class NotReady(StoreError):
    """The object is not COMPLETE (a put is in progress)."""

    kind = ErrorKind.NOT_READY


class WrongState(StoreError):
    """The operation does not apply to the object's state (e.g. revoking a complete put)."""

    kind = ErrorKind.WRONG_STATE


class Forbidden(StoreError):
    """The segment was mounted by another principal (certificate identity)."""

    kind = ErrorKind.FORBIDDEN


class NoSpace(StoreError):
    """No mounted segment can hold even one replica (after trying eviction)."""

    kind = ErrorKind.NO_SPACE


class IllegalTransition(AssertionError):
    """A replica state change outside :data:`TRANSITIONS` (a bug in the master)."""


@dataclass
class Replica:
    """One copy of an object: ``size`` bytes at ``offset`` in segment ``segment_id``."""

    segment_id: str
    offset: int
    size: int
    state: ReplicaState = ReplicaState.INITIALIZED

    def move(self, new: ReplicaState) -> None:
        """Changes state along :data:`TRANSITIONS`; raises IllegalTransition otherwise."""
        if new not in TRANSITIONS[self.state]:
            raise IllegalTransition(f"replica {self.state.name} → {new.name}")
        self.state = new


@dataclass(frozen=True)
class ReplicaDescriptor:
    """What a reader or writer needs to move the bytes of one replica."""

    segment_id: str
    client_id: str
    endpoint: str
    offset: int  # within the segment
    address: int  # segment base + offset
    size: int
    state: ReplicaState


@dataclass
class ObjectMeta:
    """One key's metadata. Times are the master clock's seconds."""

    key: str
    size: int
    replicas: list[Replica]
    put_started_at: float
    last_access: float
    completed_at: float | None = None
    lease_until: float = 0.0
    pin: Pin = Pin.NONE
    soft_pin_until: float = 0.0
    replicas_wanted: int = 1

    @property
    def complete(self) -> bool:
        """Readable: ``put_end`` happened (all live replicas are COMPLETE)."""
        return self.completed_at is not None

    def leased(self, now: float) -> bool:
        return now < self.lease_until

    def bytes_held(self) -> int:
        return sum(r.size for r in self.replicas)
