"""The KV event bus on Redis Streams: stream naming and the entry format.

Contract:

- One stream per namespace, :func:`stream_name` (``kvmesh:<namespace>:kv-events``).
- Each entry has the fields ``w`` (worker id), ``k`` (kind) and ``d`` (a serialized
  protobuf): kind ``b`` = a :class:`~protos.kv_events_pb2.KvEventBatch` (consecutive
  events of one worker, ids without holes), kind ``s`` = a
  :class:`~protos.kv_events_pb2.KvState` (a full-state resync a worker published
  itself because its engine's events could not be replayed). A signed entry (a mesh with
  certificates) also has ``m``, the sender's MAC: HMAC-SHA256(the worker's event key,
  :func:`mac_input`), where ``mac_input(w, k, d)`` = ``b"kvmesh-ev1"`` + len(w) as 4
  bytes big-endian + w + k + d. The worker's key is
  :func:`services.common.tls.derive_event_key` (events secret, worker id).
- :func:`encode_batch` / :func:`encode_state` build the field maps for ``XADD``. With a
  ``key`` they add ``m``. :func:`decode_entry` parses one entry's fields back into the
  message. It raises :class:`BadEntry` for anything malformed (the consumer skips it and
  counts it). Given ``keys`` (worker id → that worker's event key, None for an unknown
  sender), it accepts only entries whose ``m`` verifies under the key of ``w`` and whose
  message names that same worker. Otherwise it raises :class:`BadSignature` (a BadEntry)
  with ``reason`` :data:`UNSIGNED` (no ``m``) or :data:`FORGED` (wrong MAC, an unknown
  sender, or a message for another worker than ``w``). Without ``keys`` (a mesh without
  certificates) ``m`` is ignored and unsigned entries are accepted, as before.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Callable, Mapping

from google.protobuf.message import DecodeError

from protos import kv_events_pb2

BATCH = b"b"
STATE = b"s"
MAC_CONTEXT = b"kvmesh-ev1"
UNSIGNED = "unsigned"
FORGED = "forged"
KeyLookup = Callable[[str], bytes | None]


class BadEntry(ValueError):
    """A stream entry that is not a kvmesh KV event entry."""


class BadSignature(BadEntry):
    """An entry whose sender is not proven: ``reason`` is UNSIGNED or FORGED; ``worker_id``
    is the sender the entry claims (its ``w`` field)."""

    def __init__(self, reason: str, worker_id: str, detail: str) -> None:
        super().__init__(f"{reason} entry for worker {worker_id!r}: {detail}")
        self.reason = reason
        self.worker_id = worker_id


def stream_name(namespace: str) -> str:
    """The namespace's KV event stream key."""
    return f"kvmesh:{namespace}:kv-events"


def mac_input(worker: bytes, kind: bytes, data: bytes) -> bytes:
    """The bytes an entry's MAC covers (module docstring)."""
    return MAC_CONTEXT + len(worker).to_bytes(4, "big") + worker + kind + data


def _mac(key: bytes, worker: bytes, kind: bytes, data: bytes) -> bytes:
    return hmac.new(key, mac_input(worker, kind, data), hashlib.sha256).digest()


def _fields(worker_id: str, kind: bytes, data: bytes, key: bytes | None) -> dict[bytes, bytes]:
    w = worker_id.encode()
    fields = {b"w": w, b"k": kind, b"d": data}
    if key is not None:
        fields[b"m"] = _mac(key, w, kind, data)
    return fields


def encode_batch(batch: kv_events_pb2.KvEventBatch,
                 key: bytes | None = None) -> dict[bytes, bytes]:
    """XADD fields for an event batch, signed with ``key`` if given."""
    return _fields(batch.worker_id, BATCH, batch.SerializeToString(), key)


def encode_state(state: kv_events_pb2.KvState,
                 key: bytes | None = None) -> dict[bytes, bytes]:
    """XADD fields for a full-state resync, signed with ``key`` if given."""
    return _fields(state.worker_id, STATE, state.SerializeToString(), key)


def _verify(fields: Mapping[bytes, bytes], kind: bytes, data: bytes, keys: KeyLookup) -> str:
    """The sender ``w`` once its MAC verifies; BadSignature otherwise."""
    w = fields.get(b"w", b"")
    try:
        sender = w.decode()
    except UnicodeDecodeError:
        raise BadEntry(f"worker id {w[:64]!r} is not UTF-8") from None
    if not sender:
        raise BadEntry("entry without worker id")
    mac = fields.get(b"m")
    if mac is None:
        raise BadSignature(UNSIGNED, sender, "no MAC (field m)")
    key = keys(sender)
    if key is None:
        raise BadSignature(FORGED, sender, "no event key for this sender")
    if not hmac.compare_digest(mac, _mac(key, w, kind, data)):
        raise BadSignature(FORGED, sender, "MAC does not verify")
    return sender


def decode_entry(
    fields: Mapping[bytes, bytes], keys: KeyLookup | None = None,
) -> kv_events_pb2.KvEventBatch | kv_events_pb2.KvState:
    """The message in one stream entry; with ``keys`` only a signed one (module
    docstring)."""
    kind, data = fields.get(b"k"), fields.get(b"d")
    if data is None or kind not in (BATCH, STATE):
        raise BadEntry(f"not a KV event entry (fields {sorted(fields)})")
    sender = _verify(fields, kind, data, keys) if keys is not None else None
    msg: kv_events_pb2.KvEventBatch | kv_events_pb2.KvState
    msg = kv_events_pb2.KvEventBatch() if kind == BATCH else kv_events_pb2.KvState()
    try:
        msg.ParseFromString(data)
    except DecodeError as exc:
        raise BadEntry(f"undecodable {kind!r} entry: {exc}") from None
    if not msg.worker_id:
        raise BadEntry("entry without worker id")
    if sender is not None and msg.worker_id != sender:
        raise BadSignature(FORGED, sender, f"it carries events of {msg.worker_id!r}")
    return msg
